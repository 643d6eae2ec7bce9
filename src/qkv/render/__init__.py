"""Renderers of a :class:`qkv.Trace` (and of an exercise), one module per format.

``text`` (terminal tables), ``markdown``, ``latex`` (a standalone document, or a math-only
display for Jupyter), ``json`` (the trace's own dict, see ``docs/trace-schema.md``) and
``html`` (a self-contained page with a heatmap of the weights). All but JSON draw the same
blocks from :mod:`qkv.render.blocks`. Importing this package registers every format in
:mod:`qkv.explanation.formats`, where :meth:`qkv.Trace.render` finds them (the first lookup
of a format imports it, through the loader ``import qkv`` gives the registry).

Examples
--------
>>> import qkv
>>> t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
>>> print(render(t, "text").splitlines()[0])
Scaled dot-product attention, step by step
"""

from __future__ import annotations

from functools import partial
from typing import Any

from ..errors import InputError
from ..explanation import formats
from . import as_html, as_json, as_latex, as_markdown, as_text
from .exercise import render_exercise

__all__ = ["DOCUMENT_FORMATS", "FORMATS", "render", "render_blocks"]

#: Format name -> the module in this package that renders it.
FORMATS = {
    "text": as_text,
    "markdown": as_markdown,
    "latex": as_latex,
    "json": as_json,
    "html": as_html,
}

#: Formats drawn from :mod:`qkv.render.blocks` (all but JSON).
DOCUMENT_FORMATS = ("text", "markdown", "latex", "html")

for _name, _module in FORMATS.items():
    formats.register(_name, _module.render)
    formats.register(_name, partial(render_exercise, format=_name), what="exercise")


def render_blocks(blocks: list[Any], format: str = "text") -> str:
    """Render a list of :mod:`~qkv.render.blocks` blocks as a document in ``format``."""
    if format not in DOCUMENT_FORMATS:
        raise InputError(f"format: expected one of {', '.join(DOCUMENT_FORMATS)}, got {format!r}")
    return FORMATS[format].render_blocks(blocks)


def render(trace: Any, format: str = "text", **options: Any) -> str:
    """Render ``trace`` in ``format`` (one of :data:`FORMATS`)."""
    return formats.renderer(format)(trace, **options)

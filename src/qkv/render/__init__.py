"""Renderers of a :class:`qkv.Trace`, one module per format.

``text`` (terminal tables), ``markdown``, ``latex`` (a standalone document, or a math-only
display for Jupyter), ``json`` (see ``docs/trace-schema.md``) and ``html`` (a self-contained
page with a heatmap of the weights). All but JSON draw the same blocks from
:mod:`qkv.render.blocks`.

Examples
--------
>>> import qkv
>>> t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
>>> print(render(t, "text").splitlines()[0])
Scaled dot-product attention, step by step
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ..errors import InputError

__all__ = ["DOCUMENT_FORMATS", "FORMATS", "render", "render_blocks"]

#: Format name -> module in this package exposing ``render(trace, **options) -> str``.
FORMATS = {
    "text": "as_text",
    "markdown": "as_markdown",
    "latex": "as_latex",
    "json": "as_json",
    "html": "as_html",
}


#: Formats drawn from :mod:`qkv.render.blocks` (all but JSON).
DOCUMENT_FORMATS = ("text", "markdown", "latex", "html")


def render_blocks(blocks: list[Any], format: str = "text") -> str:
    """Render a list of :mod:`~qkv.render.blocks` blocks as a document in ``format``."""
    if format not in DOCUMENT_FORMATS:
        raise InputError(f"format: expected one of {', '.join(DOCUMENT_FORMATS)}, got {format!r}")
    return import_module(f"{__name__}.{FORMATS[format]}").render_blocks(blocks)


def render(trace: Any, format: str = "text", **options: Any) -> str:
    """Render ``trace`` in ``format`` (one of :data:`FORMATS`)."""
    if format not in FORMATS:
        raise InputError(f"format: expected one of {', '.join(FORMATS)}, got {format!r}")
    return import_module(f"{__name__}.{FORMATS[format]}").render(trace, **options)

"""Where a trace (or an exercise) finds the renderer of a format, without importing one.

The explanation side only produces data; the render package registers one function per format
here when it is imported, and :meth:`Trace.render` looks the function up by name. So the
explanation never imports a renderer, and a new format is one :func:`register` call.
``import qkv`` does not import the renderers either: it hands this module a loader
(:func:`register_later`) that imports them before the first lookup.

Examples
--------
>>> import qkv
>>> known("trace")
('text', 'markdown', 'latex', 'json', 'html')
>>> renderer("pdf")
Traceback (most recent call last):
...
qkv.errors.InputError: format: expected one of text, markdown, latex, json, html, got 'pdf'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import InputError

__all__ = ["Renderable", "known", "register", "register_later", "renderer"]

#: What is rendered ("trace" or "exercise") -> format name -> function(obj, **options) -> str.
_RENDERERS: dict[str, dict[str, Callable[..., str]]] = {}

#: Loaders that register formats, each run once, before the first lookup.
_LATER: list[Callable[[], object]] = []


def register_later(load: Callable[[], object]) -> None:
    """Run ``load`` (which registers formats, typically by importing a module that calls
    :func:`register`) once, before the next lookup or registration."""
    _LATER.append(load)


def _load() -> None:
    while _LATER:
        _LATER.pop(0)()


def register(name: str, fn: Callable[..., str], *, what: str = "trace") -> None:
    """Make ``fn(obj, **options) -> str`` the renderer of format ``name`` for ``what``."""
    _load()  # the pending formats first, so that this one replaces a built-in of its name
    _RENDERERS.setdefault(what, {})[name] = fn


def known(what: str = "trace") -> tuple[str, ...]:
    """The formats registered for ``what``, in the order they were registered."""
    _load()
    return tuple(_RENDERERS.get(what, {}))


def renderer(name: str, what: str = "trace") -> Callable[..., str]:
    """The renderer of format ``name``; :class:`InputError` naming the known formats if none."""
    _load()
    table = _RENDERERS.get(what, {})
    if name not in table:
        raise InputError(f"format: expected one of {', '.join(table)}, got {name!r}")
    return table[name]


class Renderable:
    """``render(format)`` and its shorthands for a trace, through the registry."""

    def render(self, format: str = "text", **options: Any) -> str:
        """Render as ``"text"``, ``"markdown"``, ``"latex"``, ``"json"`` or ``"html"``."""
        return renderer(format)(self, **options)

    def to_text(self, **options: Any) -> str:
        return self.render("text", **options)

    def to_markdown(self, **options: Any) -> str:
        return self.render("markdown", **options)

    def to_latex(self, **options: Any) -> str:
        return self.render("latex", **options)

    def to_json(self, **options: Any) -> str:
        return self.render("json", **options)

    def to_html(self, **options: Any) -> str:
        return self.render("html", **options)

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        return self.render("html", fragment=True)

    def _repr_markdown_(self) -> str:
        return self.render("markdown")

    def _repr_latex_(self) -> str:
        return self.render("latex", standalone=False, math_only=True)

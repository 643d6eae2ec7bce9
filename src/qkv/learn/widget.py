"""A notebook widget with the live page's step view: :func:`widget` (``anywidget``; Jupyter,
JupyterLab, VS Code, marimo).

The widget's state is two dictionaries synchronised with the notebook front end: ``fields``
(what the learner typed: ``q``, ``k``, ``v``, ``d``, ``reading``, ``causal``, ``align``,
``mask``, ``window``, ``exact``, as on the page) and ``view`` (every step, computed in Python
by :func:`qkv.learn.api.explain_fields` — the page's own function — whenever ``fields``
changes). Input the library refuses leaves ``view`` as it was and sets ``error`` to
``{"field": ..., "message": ...}`` with the library's message; the front end then shows that
view dimmed, as not the fields' own. The front end only draws.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from ..explanation.display import fmt
from ..extras import require
from ..keywords import near_keywords
from .api import FieldError, explain_fields
from .page import CSS, DRAW_JS, SEED

__all__ = ["widget"]

ESM = (
    DRAW_JS
    + r"""
const FIELDS = ["q", "k", "v", "d", "mask", "window"];
function render({ model, el: host }) {
  const p = "qkvw" + Math.random().toString(36).slice(2) + "-";
  const root = document.createElement("div");
  root.className = "qkv-live";
  const form = document.createElement("div");
  form.className = "inputs";
  const inputs = {};
  for (const f of FIELDS) {
    const label = el("label", {}, f === "k" ? "K" : f === "v" ? "V" : f);
    const input = el("input", { type: "text", "data-field": f });
    input.value = model.get("fields")[f] || "";
    input.addEventListener("change", () => send({ [f]: input.value }));
    const err = el("span", { class: "err", id: p + "err-" + f });
    form.append(label, input, err);
    inputs[f] = input;
  }
  const toggles = el("div", { class: "toggle" });
  for (const [key, text] of [["divide", "÷ √d"], ["multiply", "× √d"], ["none", "no scale"]]) {
    const b = el("button", { type: "button", "data-reading": key }, text);
    b.addEventListener("click", () => send({ reading: key }));
    toggles.appendChild(b);
  }
  const causal = el("input", { type: "checkbox", "data-field": "causal" });
  causal.addEventListener("change", () => send({ causal: causal.checked }));
  form.append(toggles, causal, el("span", {}, " causal"));
  const view = el("div", { class: "view" });
  for (const id of ["scale", "note", "heat", "steps"]) view.appendChild(el("div", { id: p + id }));
  root.append(form, view);
  host.appendChild(root);

  function send(change) {
    model.set("fields", { ...model.get("fields"), ...change });
    model.save_changes();
  }
  function show() {
    const fields = model.get("fields");
    toggles.querySelectorAll("button").forEach((b) =>
      b.setAttribute("aria-pressed", String(b.dataset.reading === fields.reading)));
    causal.checked = !!fields.causal;
    for (const f of FIELDS) root.querySelector("#" + p + "err-" + f).textContent = "";
    const error = model.get("error");
    if (error && error.field) {
      const target = root.querySelector("#" + p + "err-" + error.field) ||
                     root.querySelector("#" + p + "err-q");
      target.textContent = error.message;
    }
    const b = model.get("view");
    if (b && b.shown) draw(b, p, root);
    stale(!!(error && error.field), p, root);  // the view drawn is not for these fields
  }
  model.on("change:view", show);
  model.on("change:error", show);
  model.on("change:fields", show);
  show();
}
export default { render };
"""
)


def _text(a: Any) -> str:
    """An array as the fields write it: rows split by ``;``, entries by commas."""
    if a is None:
        return ""
    if isinstance(a, str):
        return a
    m = np.atleast_2d(np.asarray(a, dtype=float))
    return "; ".join(", ".join(fmt(x) for x in row) for row in m)


@lru_cache(maxsize=1)
def _widget_class() -> type:
    anywidget = require("anywidget", "qkv.widget")
    traitlets = require("traitlets", "qkv.widget")

    class LiveWidget(anywidget.AnyWidget):  # type: ignore[name-defined]
        """Every step of attention for ``fields``, recomputed by qkv on each change."""

        _esm = ESM
        _css = CSS
        fields = traitlets.Dict().tag(sync=True)
        view = traitlets.Dict().tag(sync=True)
        error = traitlets.Dict().tag(sync=True)

        @traitlets.observe("fields")
        def _recompute(self, change: Any) -> None:
            try:
                self.view = explain_fields(dict(change["new"]))
                self.error = {}
            except FieldError as exc:
                self.error = {"field": exc.field, "message": str(exc)}

    return LiveWidget


@near_keywords()
def widget(
    q: Any,
    k: Any,
    v: Any = None,
    *,
    d: int | None = None,
    reading: str = "divide",
    causal: bool = False,
    align: str = "bottom-right",
    mask: Any = None,
    window: tuple[int | None, int | None] | None = None,
    exact: bool = False,
) -> Any:
    """A notebook widget showing every step of attention, recomputed as its inputs are edited.

    Needs the ``widget`` extra (``anywidget``). The widget draws the same step view as
    ``qkv learn``; every number comes from :func:`qkv.explain` (run in Python on each edit).

    Parameters
    ----------
    q, k, v : array_like or str
        Queries ``(L, d)`` or ``(d,)``, keys ``(S, d)``, values ``(S, dv)`` (optional), as
        arrays or as the page writes them (``"1, 0; 3, 2"``).
    d : int, optional
        The ``d`` of ``1/√d`` (default: ``len(q)``).
    reading : {"divide", "multiply", "none"}
        The scale: divide by √d (standard), multiply by √d (a common slip), or no scale.
    causal : bool
        Causal attention, aligned ``"bottom-right"`` (qkv's) or ``"top-left"`` (``align``).
    align : {"bottom-right", "top-left"}
    mask : array_like of bool, optional
        ``True`` (1) where a key may be attended: one row, or one per query.
    window : (int or None, int or None), optional
        A sliding window ``(left, right)``.
    exact : bool
        Exact values too (SymPy, the ``exact`` extra).

    Returns
    -------
    LiveWidget
        An ``anywidget.AnyWidget``: display it in a notebook. Its ``fields``, ``view`` and
        ``error`` traits hold the inputs, every step and the last refusal.

    Raises
    ------
    qkv.InputError
        When the first inputs are refused (the library's message, naming the field); also
        without the ``widget`` extra.

    Examples
    --------
    >>> import qkv
    >>> w = qkv.widget([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)  # doctest: +SKIP
    >>> w.view["shown"]["weights"]  # doctest: +SKIP
    [['0.04743', '0.95257']]
    """
    fields = {
        **SEED,
        "q": _text(q),
        "k": _text(k),
        "v": _text(v),
        "d": "" if d is None else str(d),
        "reading": reading,
        "causal": bool(causal),
        "align": align,
        "mask": "" if mask is None else _text(np.asarray(mask, dtype=bool).astype(int)),
        "window": "" if window is None else ",".join("" if x is None else str(x) for x in window),
        "exact": bool(exact),
    }
    view = explain_fields(fields)  # refused input raises here, before any widget is made
    return _widget_class()(fields=fields, view=view, error={})

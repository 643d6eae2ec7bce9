"""The real-model pane: a sentence, a layer, a head and a token of a local model -> that head's
step view for the token, under the page's scale reading.

:func:`qkv.integrations.explain_model.explain_model` runs the text through the model (default:
the small all-MiniLM-L6-v2 of the ``model`` extra, read from disk, nothing downloaded) and
explains the head; this module re-explains the chosen token's row with :func:`qkv.explain` under
the reading asked for ("what if this head forgot its scale"), and returns the same step view as
typed-in numbers (:func:`qkv.learn.api.step_view`). The loaded model and the last explanations
are kept, so toggling the reading does not run the model again.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

import numpy as np

from ..checks import parse_int
from ..errors import InputError
from ..explanation.readings import READINGS
from ..explanation.trace import explain
from .api import FieldError, step_view

__all__ = ["MODEL_FIELDS", "model_fields"]

#: The fields of the model pane.
MODEL_FIELDS = ("text", "layer", "head", "query", "reading")

_LOCK = threading.Lock()
_LOADED: list[Any] = []


def _loaded() -> Any:
    """The packaged model, loaded once (tokenizer, model, folder)."""
    from ..integrations.explain_model import load

    with _LOCK:
        if not _LOADED:
            _LOADED.append(load(None))
        return _LOADED[0]


@lru_cache(maxsize=32)
def _explained(text: str, layer: int, head: int, query: int | str | None) -> Any:
    from ..integrations.explain_model import check_length, explain_model

    loaded = _loaded()
    check_length(loaded[0], text)
    with _LOCK:  # one forward pass at a time through the shared model
        return explain_model(text, layer=layer, head=head, query=query, loaded=loaded)


def _int(fields: dict[str, Any], name: str) -> int:
    value = str(fields.get(name, "0")).strip() or "0"
    try:
        return parse_int(value, name, minimum=0)
    except InputError as exc:
        raise FieldError(name, str(exc)) from None


def model_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The step view of one head of the packaged model for one token of ``text``.

    ``query`` is a token's text or index (empty: the last word); ``reading`` one of the scale
    readings. The answer adds ``tokens`` (the labels), ``query`` (the row explained),
    ``layers`` and ``heads`` (how many the model has) to the step view.

    Raises
    ------
    FieldError
        Naming the field (``text``, ``layer``, ``head``, ``query``): the library's message,
        also for a missing model or extra.
    """
    unknown = sorted(set(fields) - set(MODEL_FIELDS))
    if unknown:
        raise FieldError(unknown[0], f"{unknown[0]}: not a field of the model pane")
    text = fields.get("text")
    if not isinstance(text, str) or not text.strip():
        raise FieldError("text", "text: type a sentence")
    layer, head = _int(fields, "layer"), _int(fields, "head")
    q_text = str(fields.get("query") or "").strip()
    query: int | str | None = None
    if q_text:
        query = int(q_text) if q_text.lstrip("-").isdigit() else q_text
    scales = {key: expr for key, _, expr in READINGS}
    reading = fields.get("reading") or "divide"
    if reading not in scales:
        raise FieldError("reading", f"reading: expected one of {', '.join(scales)}")
    try:
        m = _explained(text, layer, head, query)
    except InputError as exc:
        msg = str(exc).removeprefix("--")  # the command's option names, as the pane's fields
        name = msg.split(":", 1)[0]
        raise FieldError(name if name in MODEL_FIELDS else "text", msg) from None
    t, i = m.trace, m.query
    d = t.scale.d if t.scale.d is not None else t.d
    kw: dict[str, Any] = {"scale": scales[reading]}
    if "d" in scales[reading]:
        kw["d"] = d
    assert t.excluded is not None  # the model's trace runs to the output
    # the row alone, with the keys the whole trace excludes for it (causal, window, padding)
    # given as its mask: the row keeps its own position's exclusions
    mask: Any = None
    if t.bias is not None:
        mask = np.where(t.excluded[i : i + 1], -np.inf, t.bias[i : i + 1])
    elif t.excluded[i].any():
        mask = ~t.excluded[i : i + 1]
    row = explain(
        t.q[i : i + 1],
        t.k,
        t.v,
        mask=mask,
        key_labels=m.labels,
        query_labels=[m.labels[i]],
        **kw,
    )
    view = step_view(row)
    view.update(
        tokens=m.labels,
        query=i,
        layers=int(getattr(_loaded()[1].config, "num_hidden_layers", 0) or 0),
        heads=int(m.heads.shape[0]),
        title=m.title(),
    )
    return view

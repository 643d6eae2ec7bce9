"""Record what a Hugging Face model's attention layers hand to the ``"qkv"`` backend.

:func:`capture` is a context manager: inside it, every call of the ``"qkv"`` attention backend
(:func:`qkv.integrations.transformers.attention_forward`) for the layers asked for is copied —
the per-head ``q``, ``k``, ``v`` after the model's positional encoding (rotary embeddings are
applied before the backend is called), the scale the model uses, and the mask (causal flag,
sliding window, boolean or additive mask) exactly as :func:`qkv.attention` receives them. The
copies are taken after qkv has computed the output, from the same tensors, so the model's
outputs are unchanged.

Each call becomes a :class:`Record`; :meth:`Record.attention` runs those inputs through
:func:`qkv.attention` again and :meth:`Record.explain` gives one head's step-by-step
:class:`qkv.Trace`.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from ..front import attention
from ..keywords import near_keywords

__all__ = ["Capture", "Record", "capture"]


@dataclass(eq=False)
class Record:
    """One attention call of one layer, for the heads asked for.

    Attributes
    ----------
    layer : int
        The layer's index (its ``layer_idx``, else the order of its first call).
    heads : tuple of int
        The query heads kept, in the order of the head axis of the arrays below.
    q : ndarray, ``(batch, len(heads), L, d)``
    k, v : ndarray, ``(batch, len(heads), S, d)`` and ``(..., S, dv)``
        The kv head each query head reads (grouped-query attention resolved).
    mask : ndarray or None
        Boolean (``True`` = may attend) or additive float mask, broadcastable to
        ``(batch, len(heads), L, S)``.
    scale : float
    causal : bool
    window : tuple or None
        As :func:`qkv.attention` takes them.
    out : ndarray, ``(batch, len(heads), L, dv)``
        What the backend computed for these heads.
    """

    layer: int
    heads: tuple[int, ...]
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None
    scale: float
    causal: bool
    window: tuple[int | None, int | None] | None
    out: np.ndarray

    def options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`qkv.attention` that the backend used."""
        return {
            "scale": self.scale,
            "causal": self.causal,
            "mask": self.mask,
            "window": self.window,
        }

    def attention(self) -> np.ndarray:
        """:func:`qkv.attention` on the recorded inputs, ``(batch, len(heads), L, dv)``."""
        return attention(self.q, self.k, self.v, **self.options())

    def _slot(self, head: int) -> int:
        if head not in self.heads:
            raise InputError(f"head: {head} was not captured (captured: {list(self.heads)})")
        return self.heads.index(head)

    def head_mask(self, head: int, batch: int = 0) -> np.ndarray | None:
        """The mask of one head and batch element, ``(L, S)`` (``None`` when there is none)."""
        if self.mask is None:
            return None
        m = self.mask
        b = batch if m.shape[0] > 1 else 0
        h = self._slot(head) if m.shape[1] > 1 else 0
        return np.broadcast_to(m[b, h], (self.q.shape[-2], self.k.shape[-2]))

    def explain(self, head: int, batch: int = 0, **options: Any) -> Any:
        """One head's :class:`qkv.Trace` (``options`` go to :func:`qkv.explain`, e.g. labels)."""
        from ..explanation.trace import explain

        h = self._slot(head)
        d = self.q.shape[-1]
        standard = self.scale == d**-0.5  # shown as 1/√d with d = head size
        return explain(
            self.q[batch, h],
            self.k[batch, h],
            self.v[batch, h],
            d=d if standard else None,
            scale=None if standard else self.scale,
            causal=self.causal,
            window=self.window,
            mask=self.head_mask(head, batch),
            **options,
        )


@dataclass(eq=False)
class Capture:
    """The records of a :func:`capture` block, in call order."""

    records: list[Record] = field(default_factory=list)

    def layer(self, index: int) -> Record:
        """The first record of layer ``index`` (a prefill, when the model generated)."""
        for r in self.records:
            if r.layer == index:
                return r
        seen = sorted({r.layer for r in self.records})
        raise InputError(f"layer: {index} was not captured (captured: {seen})")


def _numpy(t: Any) -> np.ndarray:
    return t.detach().to("cpu").clone().numpy()


@near_keywords()
@contextmanager
def capture(
    model: Any, layers: Iterable[int] | None = None, heads: Iterable[int] | None = None
) -> Iterator[Capture]:
    """Record the attention inputs of ``model``'s layers while the block runs.

    The model runs through the ``"qkv"`` backend inside the block (it is switched to it, and
    switched back on exit, if it used another one); with a model already on ``"qkv"`` its
    outputs are bit for bit those without the capture.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    layers : iterable of int, optional
        Layer indices to record (default: all).
    heads : iterable of int, optional
        Query heads to record in each of them (default: all).

    Yields
    ------
    Capture
        Filled as the model runs.

    Examples
    --------
    >>> import torch, transformers, qkv
    >>> from qkv.integrations.capture import capture
    >>> cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
    ...                               num_attention_heads=2, intermediate_size=32)
    >>> model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    >>> with capture(model, layers=[1], heads=[0]) as cap, torch.no_grad():
    ...     _ = model(torch.tensor([[1, 5, 7, 2]]))
    >>> r = cap.layer(1)
    >>> r.q.shape, r.scale == 8 ** -0.5, bool(abs(r.attention() - r.out).max() < 1e-6)
    ((1, 1, 4, 8), True, True)
    """
    from . import transformers as backend

    want_layers = None if layers is None else {int(x) for x in layers}
    want_heads = None if heads is None else [int(x) for x in heads]
    result = Capture()
    order: dict[int, int] = {}

    def record(module: Any, query: Any, key: Any, value: Any, options: dict, out: Any) -> None:
        index = getattr(module, "layer_idx", None)
        if index is None:
            index = order.setdefault(id(module), len(order))
        index = int(index)
        if want_layers is not None and index not in want_layers:
            return
        hq, hkv = query.shape[1], key.shape[1]
        keep = list(range(hq)) if want_heads is None else want_heads
        bad = [h for h in keep if not 0 <= h < hq]
        if bad:
            raise InputError(f"heads: {bad} out of range for a layer with {hq} query heads")
        kv = [h // (hq // hkv) for h in keep]
        mask, scale = options["mask"], options["scale"]
        if mask is not None:
            mask = _numpy(mask)
            while mask.ndim < 4:
                mask = mask[None]
            if mask.shape[1] > 1:
                mask = mask[:, keep]
        result.records.append(
            Record(
                layer=index,
                heads=tuple(keep),
                q=_numpy(query[:, keep]),
                k=_numpy(key[:, kv]),
                v=_numpy(value[:, kv]),
                mask=mask,
                scale=float(query.shape[-1]) ** -0.5 if scale is None else float(scale),
                causal=bool(options["causal"]),
                window=options["window"],
                out=_numpy(out[:, keep]),
            )
        )

    previous = getattr(model.config, "_attn_implementation", None)
    name = backend.register()
    if previous != name:
        model.set_attn_implementation(name)
    backend.OBSERVERS.append(record)
    try:
        yield result
    finally:
        backend.OBSERVERS.remove(record)
        if previous != name and previous is not None:
            model.set_attn_implementation(previous)

"""A kernel under test: the function, its calling convention, and how to call it on a case.

The kit's cases are float64 NumPy arrays in the ``(batch, heads, L, d)`` layout with the
keywords of :func:`qkv.attention`. A :class:`Kernel` says how the function wants them: the
layout (``"bhld"`` or ``"blhd"``), the array type (NumPy, PyTorch or JAX arrays), the dtype,
which features it supports and how it aligns ``causal``. Masks keep the ``(..., L, S)`` shape
in every layout, and a log-sum-exp the ``(batch, heads, L)`` one.

What a function supports is read from its signature unless declared: each keyword it names
claims its feature, and the kit asks it nothing it did not name. Two kinds of features are
*probed* rather than assumed (:mod:`qkv.testing.probe`): grouped heads and empty inputs, which
every undeclared kernel is asked for but may refuse (an error then reads as "not supported"),
and, for a function taking ``**kwargs``, each keyword feature it does not name, which it
supports when the keyword changes its output.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from .tolerance import DTYPES, round_to

__all__ = [
    "ARRAYS",
    "FEATURES",
    "KEYWORDS",
    "LAYOUTS",
    "Kernel",
    "dtype_name",
    "infer_probes",
    "infer_supports",
]

LAYOUTS = ("bhld", "blhd")
ARRAYS = ("numpy", "torch", "jax")

#: Every feature the kit checks, in report order, with what it means.
FEATURES: dict[str, str] = {
    "plain": "softmax(q kᵀ/√d) v, default scale",
    "scale": "an explicit scale=",
    "causal": "causal=True in the declared alignment",
    "mask": "a boolean mask, True = may attend",
    "float_mask": "a float mask added to the scaled scores",
    "window": "a sliding window (left, right)",
    "gqa": "grouped heads: query head h reads kv head h // (Hq / Hkv)",
    "dv": "values of another width than the keys (dv ≠ d)",
    "empty": "L = 0 or S = 0",
    "single": "L = 1 or S = 1",
    "long": "long rows (S in the thousands)",
    "extreme": "extreme magnitudes (scores in the thousands, tiny or huge values)",
    "masked_rows": "rows that may attend no key",
    "decode": "a few queries against a longer cache of keys (causal where supported)",
    "softcap": "softcap=c: scores c·tanh(s/c)",
    "sinks": "sinks=: one logit per head in every softmax, with no value",
    "alibi": "alibi_slopes=: ALiBi position bias",
    "lse": "return_lse=True: each row's log-sum-exp (natural log) beside the output",
    "varlen": "packed sequences of different lengths (cu_seqlens), with a varlen= function",
    "grad": "gradients of q, k, v (PyTorch callables)",
}

#: The keyword each feature passes to the function (features not listed pass none).
KEYWORDS = {
    "scale": "scale",
    "causal": "causal",
    "mask": "mask",
    "float_mask": "mask",
    "window": "window",
    "softcap": "softcap",
    "sinks": "sinks",
    "alibi": "alibi_slopes",
    "lse": "return_lse",
}

# Features needing no keyword: every kernel is checked on them unless it says otherwise.
_SHAPES = ("plain", "gqa", "dv", "empty", "single", "long", "extreme", "decode")

# Shape features an undeclared kernel is asked for but may refuse: a simple kernel need not
# group heads or take empty inputs, and an error on them then means "not supported".
_REFUSABLE = ("gqa", "empty")


def _keywords(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    """The names ``fn`` takes by keyword, and whether it takes ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return set(), False
    P = inspect.Parameter
    named = {n for n, p in params.items() if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    return named, any(p.kind is P.VAR_KEYWORD for p in params.values())


def infer_supports(fn: Callable[..., Any]) -> set[str]:
    """The features checked for a function that declares none: the shape features, each
    feature whose keyword it takes by name (a positional-only parameter is not one), with
    ``**kwargs`` every keyword feature (those it does not name are probed:
    :func:`infer_probes`), and ``masked_rows`` with a mask, causal or window keyword."""
    named, var = _keywords(fn)
    out = set(_SHAPES) | {f for f, kw in KEYWORDS.items() if var or kw in named}
    if {"mask", "causal", "window"} & out:
        out.add("masked_rows")
    return out


def infer_probes(fn: Callable[..., Any]) -> set[str]:
    """The features of :func:`infer_supports` tried before they are checked: grouped heads
    and empty inputs, and the keyword features a ``**kwargs`` function does not name."""
    named, var = _keywords(fn)
    return set(_REFUSABLE) | {f for f, kw in KEYWORDS.items() if var and kw not in named}


def dtype_name(x: Any) -> str | None:
    """The name of an array's dtype (``"float32"``, ``"bfloat16"``) in NumPy, PyTorch or JAX;
    ``None`` for an object without one."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        return None
    name = getattr(dt, "name", None)
    return name if isinstance(name, str) else str(dt).removeprefix("torch.")


@dataclass
class Kernel:
    """An attention function and its conventions.

    Parameters
    ----------
    fn : callable
        Called as ``fn(q, k, v, **keywords)`` with only the keywords of the case's feature.
    name : str, optional
        For the report card (default: the function's qualified name).
    layout : {"bhld", "blhd"}
        ``(batch, heads, L, d)`` or ``(batch, L, heads, d)`` for ``q``, ``k``, ``v`` and the
        output.
    arrays : {"numpy", "torch", "jax"}
        The array type the function takes and returns.
    supports : iterable of str, optional
        Features it supports (keys of :data:`FEATURES`): exactly these are checked. Default
        from its signature (:func:`infer_supports`).
    causal_alignment : {"bottom-right", "top-left"}
        Where ``causal=True`` puts the queries when ``L != S``: bottom-right (qkv,
        FlashAttention, decoding with a cache) or top-left (PyTorch's ``is_causal``).
    masked_rows : {"zero", "nan", "any"}
        What a row that may attend no key gives: 0 (qkv), NaN, or not checked.
    notes : list of str
        Conventions worth printing on the card.
    device : str
        Where torch tensors are made (``"cpu"``, ``"cuda"``).
    varlen : callable, optional
        The kernel's packed variable-length entry, called as :func:`qkv.attention_varlen` is:
        ``varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=...)`` with ``(total, heads, d)``
        arrays (:mod:`qkv.testing.varlen`).
    probe : iterable of str, optional
        Features among ``supports`` that are tried first (:mod:`qkv.testing.probe`): one the
        function refuses (raises on) or ignores (a keyword with no effect) is reported as not
        supported instead of failing. Default: :func:`infer_probes` when ``supports`` is read
        from the signature, none when it is declared.
    """

    fn: Callable[..., Any]
    name: str = ""
    layout: str = "bhld"
    arrays: str = "numpy"
    supports: Iterable[str] | None = None
    causal_alignment: str = "bottom-right"
    masked_rows: str = "zero"
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"
    varlen: Callable[..., Any] | None = None
    probe: Iterable[str] | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise InputError(f"fn: expected a callable, got {type(self.fn).__name__}")
        for what, value, choices in (
            ("layout", self.layout, LAYOUTS),
            ("arrays", self.arrays, ARRAYS),
            ("causal_alignment", self.causal_alignment, ("bottom-right", "top-left")),
            ("masked_rows", self.masked_rows, ("zero", "nan", "any")),
        ):
            if value not in choices:
                raise InputError(f"{what}: expected one of {', '.join(choices)}, got {value!r}")
        if not self.name:
            mod = getattr(self.fn, "__module__", None) or ""
            qual = getattr(self.fn, "__qualname__", None) or type(self.fn).__name__
            self.name = f"{mod}.{qual}" if mod else qual
        inferred = self.supports is None
        sup = infer_supports(self.fn) if inferred else set(self.supports or ())
        if inferred and self.varlen is not None:
            sup.add("varlen")
        if self.probe is None:
            probe = infer_probes(self.fn) & sup if inferred else set()
        else:
            probe = set(self.probe)
        for what, names in (("supports", sup), ("probe", probe)):
            unknown = sorted(names - set(FEATURES))
            if unknown:
                raise InputError(
                    f"{what}: unknown feature(s) {', '.join(unknown)}; expected some of "
                    f"{', '.join(FEATURES)}"
                )
        self.supports = sup | probe
        self.probe = frozenset(probe)

    # ----- conversion to and from the function's arrays -----
    def to_arrays(self, x: np.ndarray, dtype: str, *, layout: bool = True) -> Any:
        """``x`` (float64, ``bhld``) as the function's arrays in ``dtype`` (and its layout)."""
        x = round_to(x, dtype)
        if layout and self.layout == "blhd":
            x = np.swapaxes(x, 1, 2)
        if self.arrays == "torch":
            import torch

            t = torch.from_numpy(
                np.ascontiguousarray(x, dtype=np.float32 if dtype == "bfloat16" else dtype)
            )
            return t.to(device=self.device, dtype=getattr(torch, dtype))
        if self.arrays == "jax":
            import jax.numpy as jnp

            return jnp.asarray(x.astype(np.float32), dtype=getattr(jnp, dtype))
        return np.ascontiguousarray(x.astype(_numpy_dtype(dtype)))

    def from_arrays(self, out: Any) -> np.ndarray:
        """The function's output as float64 NumPy in ``bhld``."""
        if self.arrays == "torch" or hasattr(out, "detach"):
            out = out.detach().cpu()
            # float64 holds every float dtype exactly (NumPy has no bfloat16; float32 would
            # round a float64 output)
            out = (out.double() if out.is_floating_point() else out).numpy()
        a = np.asarray(out, dtype=np.float64)
        if self.layout == "blhd" and a.ndim == 4:
            a = np.swapaxes(a, 1, 2)
        return a

    def mask_arrays(self, m: np.ndarray, dtype: str) -> Any:
        """A mask as the function's arrays (boolean kept boolean; float in ``dtype``)."""
        if m.dtype == bool:
            if self.arrays == "torch":
                import torch

                return torch.from_numpy(m.copy()).to(self.device)
            if self.arrays == "jax":
                import jax.numpy as jnp

                return jnp.asarray(m)
            return m
        return self.to_arrays(m, dtype, layout=False)

    def call(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, options: dict, dtype: str
    ) -> np.ndarray:
        """Run the function on a case (float64 arrays in bhld) and give its output as
        float64 in bhld."""
        return self.from_arrays(self.run(q, k, v, options, dtype))

    def run(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, options: dict, dtype: str) -> Any:
        """Run the function on a case (float64 arrays in bhld): its output as it gives it."""
        kw: dict[str, Any] = {}
        for name, value in options.items():
            if name == "mask":
                kw[name] = self.mask_arrays(value, dtype)
            elif name in ("sinks", "alibi_slopes"):
                kw[name] = self.to_arrays(
                    value, "float32" if dtype != "float64" else dtype, layout=False
                )
            else:
                kw[name] = value
        args = [self.to_arrays(x, dtype) for x in (q, k, v)]
        return self.fn(*args, **kw)


def _numpy_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise InputError(
                "dtypes: bfloat16 NumPy arrays need ml_dtypes (pip install ml_dtypes)"
            ) from None
        return ml_dtypes.bfloat16
    if dtype not in DTYPES:
        raise InputError(f"dtypes: expected some of {', '.join(DTYPES)}, got {dtype!r}")
    return np.dtype(dtype)

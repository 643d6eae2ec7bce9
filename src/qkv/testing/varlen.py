"""Packed variable-length attention (``cu_seqlens``) against the reference, sequence by sequence.

The kernel is called as :func:`qkv.attention_varlen` is: ``varlen(q, k, v, cu_seqlens_q,
cu_seqlens_k, **keywords)`` with ``q (total_q, heads, d)``, ``k (total_k, kv_heads, d)``,
``v (total_k, kv_heads, dv)`` and int64 offsets (and ``causal=True`` when it supports causal).
Each sequence's rows must equal :func:`qkv.reference.attention` on that sequence alone, within
the tolerance of :mod:`qkv.testing.tolerance`. A failure is shrunk, and its first wrong
sequence diagnosed like any other case; one more slip is tried on the whole batch: the
sequences attending across their boundaries (the offsets ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

from .. import reference
from .diagnose import diagnose
from .features import Case, top_left
from .kernel import Kernel
from .report import Failure, FeatureResult
from .search import Search
from .strategies import Shape, cu_seqlens, values
from .tolerance import allowed

__all__ = ["check_varlen"]


@dataclass
class Packed:
    """One packed batch: arrays ``(total, heads, d)``, offsets, keywords."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    options: dict[str, Any]
    alignment: str

    def seq(self, b: int) -> Case:
        """Sequence ``b`` as a one-batch :class:`Case` in the ``bhld`` layout."""
        qs, ks = slice(self.cu_q[b], self.cu_q[b + 1]), slice(self.cu_k[b], self.cu_k[b + 1])
        q, k, v = (np.swapaxes(x, 0, 1)[None] for x in (self.q[qs], self.k[ks], self.v[ks]))
        shape = Shape(1, q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
        ref = dict(self.options)
        if ref.get("causal") and self.alignment == "top-left":
            ref.pop("causal")
            ref["mask"] = top_left(shape.L, shape.S)
        return Case("varlen", shape, q, k, v, dict(self.options), ref)

    def expected(self) -> np.ndarray:
        out = np.zeros((self.q.shape[0], self.q.shape[1], self.v.shape[2]))
        for b in range(len(self.cu_q) - 1):
            out[self.cu_q[b] : self.cu_q[b + 1]] = np.swapaxes(self.seq(b).expected()[0], 0, 1)
        return out

    def describe(self) -> str:
        return (
            f"cu_seqlens_q={self.cu_q.tolist()} cu_seqlens_k={self.cu_k.tolist()} "
            f"Hq={self.q.shape[1]} Hkv={self.k.shape[1]} d={self.q.shape[2]} dv={self.v.shape[2]}"
        )


@st.composite
def packed(draw: Any, causal: bool, alignment: str, gqa: bool) -> Packed:
    """A packed batch of 1 to 3 sequences with lengths 0 to 5 (queries) and 1 to 6 (keys)."""
    cu_q = draw(cu_seqlens(batch=(1, 3), length=(0, 5)))
    n = len(cu_q) - 1
    cu_k = draw(cu_seqlens(batch=(n, n), length=(1, 6)))
    hkv = draw(st.integers(1, 2))
    hq = hkv * (draw(st.integers(1, 2)) if gqa else 1)
    d, dv = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = values(rng, (int(cu_q[-1]), hq, d))
    k = values(rng, (int(cu_k[-1]), hkv, d))
    v = values(rng, (int(cu_k[-1]), hkv, dv))
    return Packed(q, k, v, cu_q, cu_k, {"causal": True} if causal else {}, alignment)


def _call(kernel: Kernel, p: Packed, dtype: str) -> np.ndarray:
    assert kernel.varlen is not None
    args = [kernel.to_arrays(x, dtype, layout=False) for x in (p.q, p.k, p.v)]
    cu = [_offsets(kernel, c) for c in (p.cu_q, p.cu_k)]
    out = kernel.varlen(*args, *cu, **p.options)
    return kernel.from_arrays(out)  # packed: (total, heads, dv) in every layout


def _offsets(kernel: Kernel, cu: np.ndarray) -> Any:
    if kernel.arrays == "torch":
        import torch

        return torch.from_numpy(cu.astype(np.int32)).to(kernel.device)
    return cu


def _judge(kernel: Kernel, p: Packed, dtype: str) -> tuple[bool, float, float, Any, str]:
    expected = p.expected()
    tol = max(
        [allowed(c.q, c.k, c.v, c.ref_options, dtype) for c in map(p.seq, range(len(p.cu_q) - 1))]
    )
    try:
        with np.errstate(all="ignore"):
            got = np.asarray(_call(kernel, p, dtype))
    except Exception as exc:  # the kernel's error is the failure reported
        return False, np.inf, tol, None, f"raised {type(exc).__name__}: {exc}"
    if got.shape != expected.shape:
        return False, np.inf, tol, got, f"output shape {got.shape}, expected {expected.shape}"
    with np.errstate(invalid="ignore"):
        diff = np.abs(got - expected)
    err = float(diff.max()) if diff.size else 0.0
    if not np.all(np.isfinite(diff)):
        err = np.inf
    return err <= tol, err, tol, got, ""


def _leak(p: Packed) -> np.ndarray:
    """The offsets ignored: every query attends the whole packed batch (bottom-right)."""
    q, k, v = (np.swapaxes(x, 0, 1) for x in (p.q, p.k, p.v))
    return np.swapaxes(np.asarray(reference.attention(q, k, v, **p.options)), 0, 1)


def check_varlen(kernel: Kernel, dtype: str, examples: int, seed: int) -> FeatureResult:
    """The ``varlen`` row of the report card."""
    if kernel.varlen is None:
        return FeatureResult("varlen", dtype, "unsupported", note="no varlen= function given")
    sup = set(kernel.supports or ())
    strategy = packed("causal" in sup, kernel.causal_alignment, "gqa" in sup)
    search = Search(examples, f"{seed}:varlen:{dtype}")

    def judged(p: Packed) -> tuple[bool, float, float]:
        ok, err, tol, _, _ = _judge(kernel, p, dtype)
        return ok, err, tol

    p = search.smallest_failure(strategy, judged)
    if p is None:
        return FeatureResult("varlen", dtype, "pass", examples, search.worst, search.allowed)
    _, err, tol, got, msg = _judge(kernel, p, dtype)
    slip = None
    if got is not None and got.shape == p.q.shape[:2] + p.v.shape[2:]:
        leak = _leak(p)
        if not np.allclose(leak, p.expected(), atol=tol) and np.allclose(got, leak, atol=tol):
            slip = ("sequences leak into each other", "the offsets are ignored: queries attend "
                    "keys of other sequences; each sequence attends only its own keys")  # fmt: skip
        for b in range(len(p.cu_q) - 1):
            if slip:
                break
            rows = slice(p.cu_q[b], p.cu_q[b + 1])
            case = p.seq(b)
            mine = np.swapaxes(got[rows], 0, 1)[None]
            if mine.size and not np.allclose(mine, case.expected(), atol=tol):
                slip = diagnose(case, mine, tol)
    inputs = {"q": p.q, "k": p.k, "v": p.v, "cu_seqlens_q": p.cu_q, "cu_seqlens_k": p.cu_k}
    failure = Failure(
        p.describe(),
        {**inputs, **p.options},
        p.expected(),
        got,
        err,
        tol,
        msg,
        slip[0] if slip else None,
        slip[1] if slip else None,
    )
    return FeatureResult("varlen", dtype, "fail", search.first, failure=failure)

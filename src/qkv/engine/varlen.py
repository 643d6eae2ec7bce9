"""Packed variable-length attention: a batch of sequences of different lengths, no padding.

The layout of FlashAttention's ``flash_attn_varlen_func``: the queries of every sequence are
stacked along one axis, ``q (total_q, heads, d)``, and ``cu_seqlens_q`` holds the cumulative
offsets (sequence ``b`` is rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``); the same for the
keys and values. Each sequence equals :func:`qkv.attention` on it alone.

How it runs fast: sequences of one query (a server's decoding steps, alone or beside prompts)
run where the native kernels are active on their decode step, the packed keys one page that
each reads its run of (:func:`qkv.engine.kernels.native_decode.paged_step`). For the others,
where the optional native kernels are active
(:func:`qkv.engine.kernels.native.attend_packed`, float32/float64), every sequence runs in one
call of their packed walk: (sequence, query head, query block) tasks on native threads, read
straight from the packed arrays. Otherwise the sequences with some work run in one call of the
NumPy packed kernel
(:mod:`qkv.engine.kernels.packed`), which walks sequences × kv heads × tiles on the worker threads
straight from the packed arrays — no padding, no copies of the queries, no per-sequence plan —
with the query heads of a group stacked against their shared kv head. Sequences too short for
that (less than :data:`WALK_FLOPS` of work per kv head, where the walk's per-item Python cost
would dominate) are sorted by length and grouped into buckets of similar lengths; each bucket is
one batched call of the ordinary kernels. Inside a bucket a sequence is padded at the *front*
(right-aligned), which keeps bottom-right causal alignment and windows exact in the padded
coordinates (query row ``i'`` and key ``j'`` of the padded arrays are ``Lmax - L`` and ``Smax -
S`` places after the sequence's own, so ``j <= S - L + i`` is ``j' <= Smax - Lmax + i'``); the
padded keys are masked out and the padded query rows dropped. Causal buckets whose sequences all
have the same ``S - L`` (prompts, ``L == S``) are padded at the back instead: no real query then
sees a padded key, so no mask is needed and the kernel still skips the tiles above the diagonal.
A bucket grows while its padding costs less than the calls it saves (:data:`CALL_FLOPS` each)
plus :data:`PAD_FRACTION` of its work.

Scores that overflow the compute dtype on the way to a finite answer (huge ``scale`` or
entries) are redone per sequence by :func:`qkv.engine.kernels.dispatch.attend`, which knows how.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import numerics
from ..errors import InputError, InputTypeError
from ..keywords import near_keywords
from ..masks import Window
from ..validate import as_array, block_plan, check_scale, check_window, from_foreign
from .kernels import dispatch, native, native_decode, packed, router

__all__ = [
    "CALL_FLOPS",
    "PAD_FRACTION",
    "WALK_FLOPS",
    "attention_varlen",
    "causal_rows_steps",
    "check_offsets",
    "decode_steps",
]

CALL_FLOPS = 4e6  # a call's fixed cost (about 0.1 ms) in flops of attention work
PAD_FRACTION = 0.05  # padding allowed beyond that, as a fraction of a group's work
# Work per (sequence, kv head) from which the packed walk serves a sequence: its per-item
# Python cost (tens of microseconds) is then small beside the arithmetic.
WALK_FLOPS = 2e6


def check_offsets(cu: Any, name: str, total: int, total_name: str) -> np.ndarray:
    """Check cumulative offsets: 1-D ints, start 0, non-decreasing, end at ``total``."""
    cu = from_foreign(cu, name)
    try:
        a = np.asarray(cu)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{name}: cannot be read as a 1-D array of ints ({exc})") from None
    if a.dtype == object and a.size and all(type(x) is int for x in a.reshape(-1).tolist()):
        big = max(a.reshape(-1).tolist(), key=abs)  # Python ints NumPy could not hold
        raise InputError(
            f"{name}: offset {big} is out of the int64 range (|offset| < 2**63); offsets count "
            f"the rows of the packed array, {total_name} = {total}"
        )
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        if not (a.size == 0 and a.dtype == np.float64):  # an empty list reads as float64
            raise InputTypeError(
                f"{name}: expected integer offsets, got dtype {a.dtype} with shape {a.shape}"
            )
    if a.ndim != 1 or a.size < 1:
        raise InputError(f"{name}: expected a 1-D array of batch + 1 offsets, got shape {a.shape}")
    if a.dtype.kind == "u" and int(a.max()) > np.iinfo(np.int64).max:  # int64 would wrap
        raise InputError(
            f"{name}: offset {int(a.max())} is beyond {total_name} = {total} (the rows of the "
            f"packed array), got {a.tolist()}"
        )
    a = a.astype(np.int64)
    if a[0] != 0:
        raise InputError(f"{name}: must start at 0, got {a[0]}")
    if (a[1:] < a[:-1]).any():  # (np.diff's own checks cost a small call 3 µs)
        raise InputError(f"{name}: must be non-decreasing, got {a.tolist()}")
    if a[-1] != total:
        raise InputError(
            f"{name}: must end at {total_name} = {total} (the rows of the packed array), "
            f"got {a[-1]}"
        )
    return a


def _buckets(lq: np.ndarray, lk: np.ndarray, unit: int) -> list[np.ndarray]:
    """Sequences (indices) grouped into batched calls, sorted by length.

    A sequence joins the current group while the group's padding costs less than the calls it
    saves (:data:`CALL_FLOPS` each) plus :data:`PAD_FRACTION` of its work; ``unit`` is the
    flops of one score (heads times ``2·d + 2·dv``).
    """
    order = np.lexsort((lq, lk))
    groups: list[list[int]] = []
    work = qmax = kmax = 0.0  # the current group's work and longest lengths
    for i in order.tolist():
        a, b = float(lq[i]), float(lk[i])
        if groups:
            n, w = len(groups[-1]) + 1, work + a * b * unit
            padded = n * max(qmax, a) * max(kmax, b) * unit
            if padded - w <= (n - 1) * CALL_FLOPS + PAD_FRACTION * w:
                groups[-1].append(i)
                work, qmax, kmax = w, max(qmax, a), max(kmax, b)
                continue
        groups.append([i])
        work, qmax, kmax = a * b * unit, a, b
    return [np.asarray(g, dtype=np.int64) for g in groups]


@near_keywords()
def attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    scale: Any = None,
    causal: bool = False,
    window: Any = None,
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Attention over a packed batch of sequences of different lengths.

    Parameters
    ----------
    q : array_like, shape ``(total_q, heads, d)``
        The queries of every sequence, one after another.
    k : array_like, shape ``(total_k, kv_heads, d)``
        Keys, packed the same way; ``heads`` must be a multiple of ``kv_heads`` (query head
        ``h`` reads kv head ``h // (heads // kv_heads)``).
    v : array_like, shape ``(total_k, kv_heads, dv)``
        Values.
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape ``(batch + 1,)``
        Cumulative offsets: sequence ``b`` is ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` and
        ``k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]``. Start at 0, never decrease, end at the
        totals. Empty sequences are allowed.
    scale : float, optional
        Default ``1/sqrt(d)``.
    causal : bool, optional
        Bottom-right aligned within each sequence: with ``L`` queries and ``S`` keys, query
        ``i`` sees keys ``j <= S - L + i`` (as in FlashAttention).
    window : (int or None, int or None), optional
        ``(left, right)`` within each sequence, as in :func:`qkv.attention`.
    return_lse : bool, optional
        Also return the log-sum-exp, shape ``(total_q, heads)`` (``-inf`` where a row sees no
        key), in the accumulation dtype.

    Returns
    -------
    ndarray, shape ``(total_q, heads, dv)``
        Rows of sequence ``b`` equal ``qkv.attention`` on that sequence alone (heads moved to
        axis 0 and back); a query with no keys to see gives zeros.

    Examples
    --------
    Two sequences, of 2 and 3 tokens, packed:

    >>> import numpy as np
    >>> import qkv
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 5, 4, 8))    # 5 tokens, 4 heads, d = 8
    >>> cu = [0, 2, 5]
    >>> out = qkv.attention_varlen(q, k[:, :2], v[:, :2], cu, cu, causal=True)  # 2 kv heads
    >>> one = qkv.attention(
    ...     q[2:5].transpose(1, 0, 2), k[2:5, :2].transpose(1, 0, 2),
    ...     v[2:5, :2].transpose(1, 0, 2), causal=True)
    >>> bool(np.allclose(out[2:5], one.transpose(1, 0, 2)))
    True
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise InputTypeError(f"causal: expected True or False, got {causal!r}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise InputTypeError(f"return_lse: expected True or False, got {return_lse!r}")
    qa, ka, va = (as_array(x, name, narrow=True) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    for name, a, want in (
        ("q", qa, "(total_q, heads, d)"),
        ("k", ka, "(total_k, kv_heads, d)"),
        ("v", va, "(total_k, kv_heads, dv)"),
    ):
        if a.ndim != 3:
            raise InputError(f"{name}: expected shape {want}, got {a.shape}")
    if qa.shape[2] != ka.shape[2]:
        raise InputError(f"q, k: feature size d differs: q has shape {qa.shape}, k {ka.shape}")
    if qa.shape[2] == 0:
        raise InputError(f"q: feature size d must be at least 1, got shape {qa.shape}")
    if ka.shape[:2] != va.shape[:2]:
        raise InputError(f"k, v: (total_k, kv_heads) differ: k has shape {ka.shape}, v {va.shape}")
    heads, kv_heads = qa.shape[1], ka.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise InputError(
            f"q, k: {heads} query heads cannot share {kv_heads} kv heads: q has shape "
            f"{qa.shape}, k {ka.shape}"
        )
    cq = check_offsets(cu_seqlens_q, "cu_seqlens_q", qa.shape[0], "total_q")
    ck = check_offsets(cu_seqlens_k, "cu_seqlens_k", ka.shape[0], "total_k")
    if cq.size != ck.size:
        raise InputError(
            f"cu_seqlens_q, cu_seqlens_k: batch sizes differ: shapes {cq.shape} and {ck.shape}"
        )
    out_dt = np.result_type(qa, ka, va)
    acc_dt = numerics.acc_dtype(out_dt)  # float16, bfloat16: float32
    fscale = check_scale(scale, qa.shape[2])
    window = check_window(window)
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    walker = router.packed(qa, ka, va, acc_dt, (lq, lk))
    # the sequences the decode step served: (sequences, their query rows, out, lse) each
    decoded: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    if walker.name == "native decode step" and numerics.scale_in_range(fscale, acc_dt):
        one = np.flatnonzero((lq == 1) & (lk >= 1))
        done = decode_steps(qa, ka, va, cq[one], ck[one], ck[one + 1], fscale, window, acc_dt)
        if done is not None and one.size == lq.size:  # (a decoding batch: nothing else)
            o, lse = done
            out = o if o.dtype == out_dt else o.astype(out_dt)
            return (out, lse) if return_lse else out
        if done is not None:
            decoded.append((one, cq[one], *done))
        walker = router.packed(qa, ka, va, acc_dt)  # the others (or a result not finite)
    few = router.packed_causal_rows(qa, ka, va, acc_dt, (lq, lk), causal, window)
    if few.size and numerics.scale_in_range(fscale, acc_dt):  # draft tokens: causal rows
        decoded += causal_rows_steps(qa, ka, va, cq, ck, few, fscale, acc_dt)
    bf16 = walker.stored  # bfloat16 is read in place by that kernel only
    if not bf16:
        qa, ka, va = (_widened(x) for x in (qa, ka, va))

    unit = heads * 2 * (qa.shape[2] + va.shape[2])  # flops per score
    live = (lq > 0) & (lk > 0)  # the others give zeros and -inf
    for served, *_ in decoded:
        live[served] = False
    fused = walker.name != "packed walk"  # its work items cost microseconds: all go there
    walk = live if fused else live & (lq * lk * (unit // kv_heads) >= WALK_FLOPS)
    if not numerics.scale_in_range(fscale, acc_dt):
        walk = np.zeros_like(live)  # the scale needs float64 (dispatch.attend, per sequence)
    redo: set[int] = set()  # an overflow on the way, or NaN/inf inputs
    with np.errstate(over="ignore", invalid="ignore"):
        rule = dict(scale=fscale, causal=causal, window=window, dtype=acc_dt)
        seqs = np.flatnonzero(walk)
        if fused:
            o, lse = native.attend_packed(
                qa, ka, va, cq, ck, seqs=seqs, bad=redo, bf16=bf16, **rule
            )
        else:
            o, lse = packed.attend(qa, ka, va, cq, ck, seqs=seqs, bad=redo, **rule)
    out = o if o.dtype == out_dt else o.astype(out_dt)
    for _, rows, o_rows, lse_rows in decoded:
        out[rows], lse[rows] = o_rows, lse_rows
    batch = _Batch(qa, ka, va, cq, ck, out, lse, fscale, causal, window)
    for b in sorted(redo):
        _alone(batch, b)
    short = np.flatnonzero(live & ~walk)
    if short.size:
        for idx in _buckets(lq[short], lk[short], unit):
            _bucket(batch, short[idx], lq, lk)
    return (out, lse) if return_lse else out


def decode_steps(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    rows: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    scale: float,
    window: Window | None,
    dtype: np.dtype,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Packed sequences of one query each (the router's ``native decode step``: the caller
    asked :func:`qkv.engine.kernels.router.packed`) in one native decoding step: query row
    ``rows[i]`` of ``q`` against keys ``starts[i]`` (or, with a window, ``left`` keys before
    its last) to ``ends[i]`` of the packed ``k`` and ``v``, which are one page: the query sits
    at its last key, bottom-right, so causal hides nothing and a window's right side neither;
    ``softcap`` as in :func:`qkv.attention`. ``(out (len(rows), heads, dv), lse (len(rows),
    heads))`` in ``dtype``, or None where a result is not finite (or the step refuses the
    arrays)."""
    n = rows.size
    one = q if n == q.shape[0] else q[rows]  # (a decoding batch: every row, in order)
    queries = one.astype(dtype, copy=False)[:, :, None, :]  # (sequences, heads, 1, d)
    table = np.zeros((n, 1), np.int32)
    starts, ends = starts.astype(np.int64), ends.astype(np.int64)
    if window is not None and window[0] is not None:
        starts = np.maximum(starts, ends - 1 - window[0])
    found = native_decode.paged_step(
        queries, k[None], v[None], table, starts, ends, scale, softcap=softcap
    )
    if found is None:
        return None
    out, lse = found
    return out[:, :, 0], lse[:, :, 0]


def causal_rows_steps(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cq: np.ndarray,
    ck: np.ndarray,
    seqs: np.ndarray,
    scale: float,
    dtype: np.dtype,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Packed sequences ``seqs`` of a few causal query rows each (the router's
    :func:`~qkv.engine.kernels.router.packed_causal_rows`), those of one row count at a time,
    as causal rows (:mod:`qkv.engine.kernels.causal_rows`): one native step over the packed
    keys as one page, each sequence's rows causal on its keys.
    ``[(sequences, their query rows, out (rows, heads, dv), lse (rows, heads))]`` in
    ``dtype``, one entry per row count whose step served it (none where a result is not
    finite: the caller's walk takes those)."""
    found = []
    lq = cq[1:] - cq[:-1]
    for rows in np.unique(lq[seqs]):
        group = seqs[lq[seqs] == rows]
        at = cq[group][:, None] + np.arange(rows)  # (sequences, rows): their query rows
        queries = np.moveaxis(q[at], 2, 1).astype(dtype)  # (sequences, heads, rows, d)
        lo, hi = ck[group].astype(np.int64), ck[group + 1].astype(np.int64)
        table = np.zeros((group.size, 1), np.int32)
        step = native_decode.paged_step(queries, k[None], v[None], table, lo, hi, scale,
                                        causal=True)  # fmt: skip
        if step is None:  # (a result not finite)
            continue
        out, lse = step
        flat = at.reshape(-1)
        found.append((group, flat, np.moveaxis(out, 1, 2).reshape(flat.size, *out.shape[1::2]),
                      np.moveaxis(lse, 1, 2).reshape(flat.size, -1)))  # fmt: skip
    return found


@dataclass(frozen=True)
class _Batch:
    """A checked packed call: its arrays and offsets, its checked options, and the ``out`` and
    ``lse`` being filled (the sequences the packed walk did not serve are written in here)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cq: np.ndarray
    ck: np.ndarray
    out: np.ndarray
    lse: np.ndarray
    scale: float
    causal: bool
    window: Window | None

    def attend(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(out, lse)`` of heads-first blocks of this call by the ordinary kernels (with their
        retries for scores that overflow the compute dtype); nothing is checked again."""
        plan = block_plan(
            q,
            k,
            v,
            scale=self.scale,
            causal=self.causal,
            window=self.window,
            mask=mask,
            out_dtype=np.result_type(self.q, self.k, self.v),
        )
        return dispatch.attend(plan)


def _alone(batch: _Batch, b: int) -> None:
    """Sequence ``b`` by the ordinary kernels on views of the packed arrays."""
    sq, sk = slice(batch.cq[b], batch.cq[b + 1]), slice(batch.ck[b], batch.ck[b + 1])
    views = (batch.q[sq], batch.k[sk], batch.v[sk])
    o, s = batch.attend(*(_widened(x).transpose(1, 0, 2) for x in views))
    batch.out[sq], batch.lse[sq] = o.transpose(1, 0, 2), s.T


def _bucket(batch: _Batch, seqs: np.ndarray, lq: np.ndarray, lk: np.ndarray) -> None:
    """One batched call for the sequences ``seqs``, front-padded to their longest."""
    nq, nk = lq[seqs].tolist(), lk[seqs].tolist()
    Lm, Sm = max(nq), max(nk)
    # Causal with one offset S - L for every sequence (prompts: L == S): pad at the back, and
    # no real query sees a padded key, so no mask is needed and the kernel skips the tiles above
    # the diagonal. Otherwise pad at the front and mask the padded keys.
    back = batch.causal and all(b - a == Sm - Lm for a, b in zip(nq, nk, strict=True))
    starts_q, starts_k = batch.cq[seqs].tolist(), batch.ck[seqs].tolist()
    rows = [(int(i), n, 0 if back else Lm - n) for i, n in zip(starts_q, nq, strict=True)]
    keys = [(int(i), n, 0 if back else Sm - n) for i, n in zip(starts_k, nk, strict=True)]

    def padded(x: np.ndarray, where: list[tuple[int, int, int]], width: int) -> np.ndarray:
        # Heads first and contiguous, as the kernels read fastest; one strided copy each.
        p = np.zeros((len(where), x.shape[1], width, x.shape[2]), dtype=x.dtype)
        for j, (start, n, off) in enumerate(where):
            p[j, :, off : off + n] = x[start : start + n].transpose(1, 0, 2)
        return p

    mask = None
    if not back and min(nk) < Sm:
        mask = (np.arange(Sm)[None, :] >= Sm - np.asarray(nk)[:, None])[:, None, None, :]
    o, s = batch.attend(
        padded(batch.q, rows, Lm), padded(batch.k, keys, Sm), padded(batch.v, keys, Sm), mask
    )
    for j, (start, n, off) in enumerate(rows):
        batch.out[start : start + n] = o[j, :, off : off + n].transpose(1, 0, 2)
        batch.lse[start : start + n] = s[j, :, off : off + n].T


def _widened(a: np.ndarray) -> np.ndarray:
    """``a``, or its float32 values where it is bfloat16 (ml_dtypes')."""
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a

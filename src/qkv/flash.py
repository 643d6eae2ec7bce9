"""FlashAttention 2's interface on the CPU: ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache`` with flash-attn's names, defaults, layouts and semantics.

Code written for FlashAttention runs on qkv by changing its import::

    from qkv.flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

- :func:`flash_attn_func`: ``(batch, seqlen, heads, d)`` arrays, on :func:`qkv.attention`'s
  checked call (``layout="blhd"``), with its autograd for tensors that require grad;
- :func:`flash_attn_varlen_func`: packed ``(total, heads, d)`` with ``cu_seqlens``, on qkv's
  packed walk (:func:`qkv.attention_varlen`; sequences of one query, decoding steps, on its
  native decode step); per sequence on :func:`qkv.attention` where the walk lacks a feature
  (soft-capping, ALiBi, gradients); K/V in pages with ``block_table`` (a decoding batch in
  one paged step);
- :func:`flash_attn_with_kvcache`: a contiguous ``(batch, seqlen, kv_heads, d)`` or paged
  ``(num_blocks, page_size, kv_heads, d)`` K/V cache; new ``k``/``v`` are written into it in
  place, then the queries (one or several per sequence) attend to it.

The semantics are flash-attn 2's, which are qkv's (:func:`qkv.attention`): causal is aligned
bottom-right (query ``i`` of ``L`` against ``S`` keys sits at position ``S − L + i``);
``window_size=(left, right)`` with ``-1`` (any negative) unbounded, and ``right`` set to 0 by
``causal``; ``softcap=0`` off; ``alibi_slopes`` of shape ``(heads,)`` or ``(batch, heads)`` add
``−slope · |i + S − L − j|`` (to keys on both sides of the query where they are visible);
grouped heads (``heads`` a multiple of ``kv_heads``). float32, float64, bfloat16 and float16 CPU
tensors give tensors, NumPy arrays give arrays; products are accumulated in float32 (float64 for
float64), and the log-sum-exp comes in that dtype.

What the CPU road does not do as flash-attn does:

- ``dropout_p > 0`` is refused by name: flash-attn's dropout draws from the GPU's Philox stream,
  which no CPU computation can reproduce, and a dropout pattern that differs is a different
  result. Apply dropout to the inputs or outputs with your framework where you need it.
- ``deterministic`` is accepted and has nothing to do: the CPU road is deterministic (the same
  inputs give the same bits, backward included).
- ``num_splits`` is accepted and ignored (the split of the keys is qkv's own choice).
- a query row that may attend no key gives output 0 and log-sum-exp ``-inf`` (flash-attn 2
  reports ``+inf`` there).
- ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: the third value is the
  dropout pattern flash-attn returns for testing, which has no meaning without dropout.
- device tensors are refused by name: this module computes on the CPU.

Examples
--------
>>> import numpy as np
>>> from qkv.flash import flash_attn_func
>>> rng = np.random.default_rng(0)
>>> q = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)  # (batch, seqlen, heads, d)
>>> k = v = rng.standard_normal((2, 5, 2, 8)).astype(np.float32)  # 2 kv heads
>>> flash_attn_func(q, k, v, causal=True).shape
(2, 5, 4, 8)
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from . import numerics, torch_bridge
from .call import Call, build
from .checks import check_int, check_real
from .engine import run as core
from .engine.kernels import dispatch, router
from .engine.varlen import attention_varlen, check_offsets, decode_steps
from .errors import InputError, InputTypeError
from .keywords import near_keywords
from .options import Options
from .tensors import (
    give,
    give_pair,
    is_tensor,
    refuse_grad,
    swap_axes,
    swapped_result,
    want_of,
    wants_grad,
)
from .validate import as_array, block_plan, check_flag, check_scale, from_foreign

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

Window = tuple[int | None, int | None]


# ----- the options, read once -----


def _refuse_dropout(dropout_p: Any) -> None:
    """``dropout_p``: 0 only (see the module docstring)."""
    p = check_real(dropout_p, "dropout_p")
    if p != 0.0:
        raise InputError(
            f"dropout_p: {p} > 0 is not supported on the CPU: flash-attn's dropout follows the "
            "GPU's random stream, which a CPU road cannot reproduce; pass dropout_p=0.0 (as "
            "at inference) and apply dropout in your framework where training needs it"
        )


def _window(window_size: Any, causal: bool) -> Window | None:
    """flash-attn's ``window_size=(left, right)`` (negative: unbounded; ``causal`` sets
    ``right`` to 0) as qkv's ``(left, right)`` window with ``None`` unbounded."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise InputTypeError(
            f"window_size: expected (left, right) with -1 for unbounded, got {window_size!r}"
        )
    sides: list[int | None] = []
    for side, w in zip(("left", "right"), window_size, strict=True):
        n = check_int(w, f"window_size: {side} (-1: unbounded)")
        sides.append(None if n < 0 else n)
    if causal:
        sides[1] = 0
    if sides == [None, None] or (causal and sides[0] is None):  # (causal alone says (None, 0))
        return None
    return (sides[0], sides[1])


def _softcap(softcap: Any) -> float | None:
    """flash-attn's ``softcap``: 0 is off, else a positive finite float."""
    c = check_real(softcap, "softcap")
    if c < 0:
        raise InputError(f"softcap: expected 0 (off) or a positive number, got {c}")
    return None if c == 0 else c


def _slopes(alibi_slopes: Any, batch: int, heads: int) -> np.ndarray | None:
    """``alibi_slopes`` of shape ``(heads,)`` or ``(batch, heads)`` as a float64 ``(batch,
    heads)`` array (a view), checked; ``None`` when not given."""
    if alibi_slopes is None:
        return None
    if wants_grad(alibi_slopes):
        raise InputError(
            f"alibi_slopes: qkv gives no gradient for ALiBi slopes (shape "
            f"{tuple(alibi_slopes.shape)}); detach them"
        )
    a = as_array(alibi_slopes, "alibi_slopes").astype(np.float64, copy=False)
    if a.shape not in ((heads,), (batch, heads)):
        raise InputError(
            f"alibi_slopes: expected shape ({heads},) or ({batch}, {heads}) (heads, or batch and "
            f"heads), got {a.shape}"
        )
    if not np.all(np.isfinite(a)):
        raise InputError(f"alibi_slopes: must be finite, got NaN or infinity (shape {a.shape})")
    return np.broadcast_to(a, (batch, heads))


def _later_alibi(
    slopes: np.ndarray, L: int, S: int, window: Window | None, dtype: Any
) -> np.ndarray | None:
    """The part of flash-attn's ALiBi that qkv's ``alibi_slopes`` leaves out: ``−slope · (j −
    p)`` for keys ``j`` after the query's position ``p = S − L + i`` (qkv's ALiBi covers the keys
    at or before it). A bias of shape ``(*slopes.shape, L, S)``, or ``None`` where no later key
    is visible (causal, or a window whose right side is 0)."""
    if (window is not None and window[1] == 0) or L == 0 or S == 0:
        return None
    ahead = np.maximum(np.arange(S)[None, :] - (S - L + np.arange(L))[:, None], 0)
    if not ahead.any():
        return None
    return (-slopes[..., None, None] * ahead).astype(dtype)


def _options(
    scale: Any,
    causal: bool,
    window: Window | None,
    softcap: float | None,
    slopes: np.ndarray | None,
    L: int,
    S: int,
    acc: Any,
) -> Options:
    """qkv's options for flash-attn's (``slopes``: one row per batch entry, for ``(batch,
    heads, L, S)`` scores)."""
    bias = None if slopes is None else _later_alibi(slopes, L, S, window, acc)
    return Options(
        scale=scale, causal=causal, window=window, softcap=softcap, alibi_slopes=slopes, mask=bias
    )


def _acc(*xs: Any) -> Any:
    """The accumulation dtype for inputs ``xs`` (tensors read by their dtype's name)."""
    names = {str(getattr(x, "dtype", "float64")).replace("torch.", "") for x in xs}
    return np.float64 if names == {"float64"} else np.float32


def _shape(x: Any, name: str, want: str, ndim: int) -> tuple[int, ...]:
    """The shape of ``x`` (a tensor or anything NumPy reads) with ``ndim`` dimensions."""
    if not is_tensor(x):
        x = as_array(x, name, narrow=True)
    shape = tuple(x.shape)
    if len(shape) != ndim:
        raise InputError(f"{name}: expected shape {want}, got {shape}")
    return shape


def _run(call: Call) -> Any:
    """The back end for a checked call: the NumPy engine, or the torch bridge's autograd."""
    if call.route == "numpy":
        res = core.run(call.fn, call.plan, call.kernel, call.return_lse)
        return give_pair(res[0], res[1], call.want) if call.return_lse else give(res, call.want)
    if call.route == "autograd":
        return torch_bridge.run(call)
    name, t = next((n, t) for n, t in call.given.items() if is_tensor(t) and not t.is_cpu)
    raise InputError(
        f"{name}: a tensor on device {t.device} (shape {tuple(t.shape)}); qkv.flash computes on "
        "the CPU: move it with .cpu(), or use flash-attn itself on the GPU"
    )


# ----- flash_attn_func -----


@near_keywords()
def flash_attn_func(
    q: Any,
    k: Any,
    v: Any,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash-attn 2's ``flash_attn_func`` on the CPU.

    Parameters
    ----------
    q : array_like or Tensor, shape ``(batch, seqlen_q, heads, d)``
    k : array_like or Tensor, shape ``(batch, seqlen_k, kv_heads, d)``
        ``heads`` a multiple of ``kv_heads`` (query head ``h`` reads kv head
        ``h // (heads // kv_heads)``).
    v : array_like or Tensor, shape ``(batch, seqlen_k, kv_heads, dv)``
    dropout_p : float, optional
        0 only (refused otherwise: see :mod:`qkv.flash`).
    softmax_scale : float, optional
        Default ``1/sqrt(d)``.
    causal : bool, optional
        Bottom-right aligned: query ``i`` sees keys ``j <= seqlen_k - seqlen_q + i``.
    window_size : (int, int), optional
        ``(left, right)``: query at position ``p`` sees keys ``p - left <= j <= p + right``;
        ``-1`` is unbounded.
    softcap : float, optional
        ``softcap · tanh(s / softcap)`` on the scaled scores; 0 is off.
    alibi_slopes : array_like, shape ``(heads,)`` or ``(batch, heads)``, optional
        Adds ``-slope · |i + seqlen_k - seqlen_q - j|`` to the scores.
    deterministic : bool, optional
        Accepted; the CPU road is always deterministic.
    return_attn_probs : bool, optional
        Also return the log-sum-exp (and ``None`` for the dropout pattern).

    Returns
    -------
    out : shape ``(batch, seqlen_q, heads, dv)``
        The caller's type: a CPU tensor for tensors (in the autograd graph when an input
        requires grad), an array for arrays.
    softmax_lse : shape ``(batch, heads, seqlen_q)``
        Only with ``return_attn_probs``, in the accumulation dtype (float32; float64 for
        float64).
    None
        Only with ``return_attn_probs`` (flash-attn's dropout pattern).

    Examples
    --------
    >>> import numpy as np
    >>> import qkv
    >>> from qkv.flash import flash_attn_func
    >>> x = np.random.default_rng(1).standard_normal((1, 4, 2, 8))
    >>> out, lse, _ = flash_attn_func(x, x, x, causal=True, return_attn_probs=True)
    >>> out.shape, lse.shape
    ((1, 4, 2, 8), (1, 2, 4))
    >>> t = x.transpose(0, 2, 1, 3)                  # qkv's (batch, heads, seqlen, d)
    >>> bool(np.allclose(out, qkv.attention(t, t, t, causal=True).transpose(0, 2, 1, 3)))
    True
    """
    _refuse_dropout(dropout_p)
    check_flag(causal, "causal")
    check_flag(deterministic, "deterministic")
    check_flag(return_attn_probs, "return_attn_probs")
    B, L, H, _ = _shape(q, "q", "(batch, seqlen_q, heads, d)", 4)
    S = _shape(k, "k", "(batch, seqlen_k, kv_heads, d)", 4)[1]
    _shape(v, "v", "(batch, seqlen_k, kv_heads, dv)", 4)
    window = _window(window_size, causal)
    slopes = _slopes(alibi_slopes, B, H)
    opts = _options(softmax_scale, causal, window, _softcap(softcap), slopes, L, S, _acc(q, k, v))
    call = build("attention", q, k, v, opts, return_lse=return_attn_probs, layout="blhd")
    res = _run(call)  # (batch, heads, seqlen_q, dv): the lse is flash-attn's already
    if return_attn_probs:
        return swapped_result(res[0], 1, 2), res[1], None
    return swapped_result(res, 1, 2)


# ----- flash_attn_varlen_func -----


def _offsets(cu: Any, name: str, total: int | None, total_name: str) -> np.ndarray:
    """Checked cumulative offsets; ``total=None`` checks everything but the last value."""
    if total is None:  # keys in pages: the last offset counts the keys, no array does
        a = np.asarray(from_foreign(cu, name))
        ok = a.ndim == 1 and a.size and a.dtype.kind in "iu"
        total = int(a[-1]) if ok else 0
    return check_offsets(cu, name, total, total_name)


def _longest(n: Any, name: str, lengths: np.ndarray, what: str) -> None:
    """``max_seqlen_q``/``max_seqlen_k`` at least the longest sequence (flash-attn sizes its
    grid by it and would leave the rest of a longer sequence unwritten)."""
    if getattr(n, "ndim", None) == 0 and not isinstance(n, np.generic):  # a 0-d tensor/array
        n = n.item() if str(n.dtype).replace("torch.", "").startswith(("int", "uint")) else n
    m = check_int(n, name, minimum=0)
    longest = int(lengths.max(initial=0))
    if m < longest:
        raise InputError(
            f"{name}: {m} is less than the longest {what} sequence ({longest} rows, from the "
            "cumulative offsets)"
        )


@near_keywords()
def flash_attn_varlen_func(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Any = None,
) -> Any:
    """flash-attn 2's ``flash_attn_varlen_func`` on the CPU: packed sequences of different
    lengths, no padding.

    Parameters
    ----------
    q : array_like or Tensor, shape ``(total_q, heads, d)``
        The queries of every sequence, one after another.
    k, v : array_like or Tensor
        Keys ``(total_k, kv_heads, d)`` and values ``(total_k, kv_heads, dv)``, packed the
        same way as ``q``; or, with ``block_table``, pages ``(num_blocks,
        page_size, kv_heads, d)`` and ``(num_blocks, page_size, kv_heads, dv)``.
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape ``(batch + 1,)``
        Cumulative offsets: sequence ``b`` is ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``, and
        likewise its keys (with ``block_table``: its ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``
        keys are read from its pages). Start at 0, never decrease, end at the totals.
    max_seqlen_q, max_seqlen_k : int
        At least the longest sequence's length (checked).
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic
        As in :func:`flash_attn_func`, within each sequence.
    return_attn_probs : bool, optional
        Also return the log-sum-exp, shape ``(heads, total_q)``, and ``None``.
    block_table : array_like of int, shape ``(batch, max_blocks)``, optional
        The pages of each sequence's keys, in order (as in :func:`flash_attn_with_kvcache`);
        no gradient.

    Returns
    -------
    out : shape ``(total_q, heads, dv)``
        Rows of sequence ``b`` equal :func:`flash_attn_func` on that sequence alone.
    softmax_lse : shape ``(heads, total_q)``
        Only with ``return_attn_probs``.
    None
        Only with ``return_attn_probs``.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.flash import flash_attn_func, flash_attn_varlen_func
    >>> x = np.random.default_rng(2).standard_normal((7, 2, 8))  # sequences of 3 and 4 tokens
    >>> cu = np.array([0, 3, 7], dtype=np.int32)
    >>> out = flash_attn_varlen_func(x, x, x, cu, cu, 4, 4, causal=True)
    >>> one = flash_attn_func(x[None, 3:], x[None, 3:], x[None, 3:], causal=True)
    >>> bool(np.allclose(out[3:], one[0]))
    True
    """
    _refuse_dropout(dropout_p)
    check_flag(causal, "causal")
    check_flag(deterministic, "deterministic")
    check_flag(return_attn_probs, "return_attn_probs")
    paged = block_table is not None
    tq, H, d = _shape(q, "q", "(total_q, heads, d)", 3)
    if paged:
        kshape = _shape(k, "k", "(num_blocks, page_size, kv_heads, d) with block_table", 4)
        _shape(v, "v", "(num_blocks, page_size, kv_heads, dv) with block_table", 4)
    else:
        kshape = _shape(k, "k", "(total_k, kv_heads, d)", 3)
        _shape(v, "v", "(total_k, kv_heads, dv)", 3)
    cq = _offsets(cu_seqlens_q, "cu_seqlens_q", tq, "total_q")
    ck = _offsets(cu_seqlens_k, "cu_seqlens_k", None if paged else kshape[0], "total_k")
    if cq.size != ck.size:
        raise InputError(
            f"cu_seqlens_q, cu_seqlens_k: batch sizes differ: shapes {cq.shape} and {ck.shape}"
        )
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    _longest(max_seqlen_q, "max_seqlen_q", lq, "query")
    _longest(max_seqlen_k, "max_seqlen_k", lk, "key")
    B = lq.size
    window = _window(window_size, causal)
    cap = _softcap(softcap)
    slopes = _slopes(alibi_slopes, B, H)
    scale = check_scale(softmax_scale, d)
    if paged:
        refuse_grad("flash_attn_varlen_func with block_table", q=q, k=k, v=v)
        out, lse = _varlen_pages(q, k, v, block_table, cq, lk, scale, causal, window, cap, slopes)
    elif cq.size == 1 or (cap is None and slopes is None and not wants_grad(q, k, v)):
        # the packed walk: every sequence in one call, straight from the packed arrays
        o, s = attention_varlen(
            q, k, v, cq, ck, scale=scale, causal=causal, window=window, return_lse=True
        )
        out, lse = give_pair(o, np.ascontiguousarray(s.T), want_of(q, k, v))
    elif slopes is None and not wants_grad(q, k, v):  # soft-capping, which the walk lacks
        out, lse = _varlen_capped(q, k, v, cq, ck, scale, causal, window, cap)
    else:  # ALiBi, or gradients: qkv.attention's call, sequence by sequence
        out, lse = _varlen_each(q, k, v, cq, ck, scale, causal, window, cap, slopes)
    return (out, lse, None) if return_attn_probs else out


def _varlen_each(
    q: Any,
    k: Any,
    v: Any,
    cq: np.ndarray,
    ck: np.ndarray,
    scale: float,
    causal: bool,
    window: Window | None,
    cap: float | None,
    slopes: np.ndarray | None,
) -> tuple[Any, Any]:
    """Packed sequences one by one through :func:`qkv.attention`'s checked call (autograd for
    tensors that require grad), joined again: ``(out (total_q, heads, dv), lse (heads,
    total_q))``."""
    acc = _acc(q, k, v)
    outs, lses = [], []
    for b in range(cq.size - 1):
        sq, sk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        L, S = sq.stop - sq.start, sk.stop - sk.start
        per = None if slopes is None else slopes[b]
        opts = _options(scale, causal, window, cap, per, L, S, acc)
        call = build("attention", q[sq], k[sk], v[sk], opts, return_lse=True, layout="blhd")
        o, s = _run(call)  # (heads, L, dv), (heads, L)
        outs.append(swap_axes(o, 0, 1))
        lses.append(s)
    if is_tensor(outs[0]):
        import torch

        return torch.cat(outs, 0), torch.cat(lses, -1)
    return np.concatenate(outs, 0), np.concatenate(lses, -1)


def _varlen_capped(
    q: Any,
    k: Any,
    v: Any,
    cq: np.ndarray,
    ck: np.ndarray,
    scale: float,
    causal: bool,
    window: Window | None,
    cap: float | None,
) -> tuple[Any, Any]:
    """Packed soft-capped sequences, no gradient: those of one query (decoding steps) in one
    native decode step where the router gives them one (:func:`qkv.engine.varlen.decode_steps`),
    the others through :func:`qkv.attention`'s checked call one by one, as
    :func:`_varlen_each`: ``(out (total_q, heads, dv), lse (heads, total_q))``."""
    qa, ka, va = (as_array(x, n, narrow=True) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    out_dt = np.result_type(qa, ka, va)
    acc = numerics.acc_dtype(out_dt)
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    out = np.zeros((qa.shape[0], qa.shape[1], va.shape[2]), out_dt)
    lse = np.full((qa.shape[1], qa.shape[0]), -np.inf, acc)
    rest = np.arange(lq.size)
    walker = router.packed(qa, ka, va, acc, (lq, lk))
    if walker.name == "native decode step" and numerics.scale_in_range(scale, acc):
        steps = (lq == 1) & (lk >= 1)
        one = np.flatnonzero(steps)
        done = decode_steps(qa, ka, va, cq[one], ck[one], ck[one + 1], scale, window, acc, cap)
        if done is not None:
            out[cq[one]], lse[:, cq[one]] = done[0], done[1].T
            rest = np.flatnonzero(~steps)
    for b in rest.tolist():
        sq, sk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        opts = _options(
            scale, causal, window, cap, None, sq.stop - sq.start, sk.stop - sk.start, acc
        )
        call = build("attention", qa[sq], ka[sk], va[sk], opts, return_lse=True, layout="blhd")
        o, s = _run(call)  # (heads, L, dv), (heads, L)
        out[sq], lse[:, sq] = np.swapaxes(o, 0, 1), s
    return give_pair(out, lse, want_of(q, k, v))


def _varlen_pages(
    q: Any,
    k: Any,
    v: Any,
    block_table: Any,
    cq: np.ndarray,
    lk: np.ndarray,
    scale: float,
    causal: bool,
    window: Window | None,
    cap: float | None,
    slopes: np.ndarray | None,
) -> tuple[Any, Any]:
    """Packed queries against keys in pages (``flash_attn_varlen_func(block_table=...)``)."""
    qa = as_array(q, "q", narrow=True)
    kp, vp = _pages_pair(k, v, "k", "v")
    B, H = cq.size - 1, qa.shape[1]
    if qa.shape[2] != kp.shape[3]:
        raise InputError(f"q, k: feature size d differs: q has shape {qa.shape}, k {kp.shape}")
    _check_heads(qa.shape, kp.shape)
    bt = _block_table(block_table, B, kp.shape[0], kp.shape[1], lk, np.zeros(B, np.int64))
    if B and slopes is None and (np.diff(cq) == 1).all():  # a decoding step: one call for all
        o, s = _attend_pages(
            qa[:, :, None], kp, vp, bt, lk, scale=scale, causal=causal, window=window,
            softcap=cap, alibi_slopes=None, return_lse=True,
        )  # fmt: skip
        return give_pair(o[:, :, 0], np.ascontiguousarray(s[:, :, 0].T), want_of(q, k, v))
    out_dt = np.result_type(qa, kp, vp)
    out = np.zeros((qa.shape[0], H, vp.shape[3]), out_dt)
    lse = np.full((H, qa.shape[0]), -np.inf, numerics.acc_dtype(out_dt))
    for b in range(B):
        rows = slice(int(cq[b]), int(cq[b + 1]))
        if rows.stop == rows.start:
            continue
        qb = qa[rows].transpose(1, 0, 2)[None]  # (1, heads, L, d)
        o, s = _attend_pages(
            qb, kp, vp, bt[b : b + 1], lk[b : b + 1], scale=scale, causal=causal, window=window,
            softcap=cap, alibi_slopes=None if slopes is None else slopes[b : b + 1],
            return_lse=True,
        )  # fmt: skip
        out[rows] = o[0].transpose(1, 0, 2)
        lse[:, rows] = s[0]
    return give_pair(out, lse, want_of(q, k, v))


# ----- paged attention: the one place that reads pages through a block table -----


def _attend_pages(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_table: np.ndarray,
    seqlens: np.ndarray,
    *,
    scale: float | None,
    causal: bool,
    window: Window | None,
    softcap: float | None,
    alibi_slopes: np.ndarray | None,
    return_lse: bool,
) -> Any:
    """Attention of ``q`` to K/V read from pages through a block table; nothing is checked.

    Must equal :func:`qkv.reference.attention` on each sequence's keys gathered in order
    (with flash-attn's ALiBi). ``q (B, H, Lq, d)``; pages ``(num_blocks, page_size, kv_heads,
    d)`` and ``(..., dv)``; ``block_table (B, max_blocks)``: sequence ``b``'s keys ``j`` are row
    ``j % page_size`` of page ``block_table[b, j // page_size]``; ``seqlens (B,)``: its number
    of keys, the appended ones included. Query row ``i`` of sequence ``b`` sits at position
    ``seqlens[b] - Lq + i`` (bottom-right). ``scale`` (``None``: ``1/sqrt(d)``), ``causal``,
    ``window`` (``(left, right)``, ``None`` unbounded), ``softcap`` (``None``: off) as in
    :func:`qkv.attention`; ``alibi_slopes`` (``(H,)`` or ``(B, H)``) flash-attn's,
    ``-slope · |position - j|`` on both sides of the query. Returns ``out (B, H, Lq, dv)`` in
    ``result_type`` of the inputs, and ``lse (B, H, Lq)`` in the accumulation dtype with
    ``return_lse``.

    A decoding step (one query per sequence), a few rows with no window, and a chunk of
    more rows with no window on a table of several pages a sequence (no ALiBi) is
    :func:`qkv.engine.paged.attend_pages`, which reads the pages in place where its kernels
    can (the native decode step; for chunks, the prefill over each sequence's full pages). A
    contiguous cache's chunk takes the road below on views of its rows. Otherwise each sequence's
    pages are gathered into a contiguous copy for the ordinary kernels (the decode ones
    together, :func:`qkv.engine.kernels.dispatch.attend_many`).
    """
    if router.flash_pages(q.shape[2], window, alibi_slopes is not None, block_table.shape[1]):
        from .engine import paged

        found = paged.attend_pages(
            q, k_pages, v_pages, block_table, seqlens, scale=scale, causal=causal,
            window=window, softcap=softcap, return_lse=True,
        )  # fmt: skip
        out = found[0].astype(np.result_type(q, k_pages, v_pages), copy=False)
        return (out, found[1]) if return_lse else out
    B, H, Lq, d = q.shape
    P, Hkv, dv = k_pages.shape[1], k_pages.shape[2], v_pages.shape[3]
    out_dt = np.result_type(q, k_pages, v_pages)
    acc = numerics.acc_dtype(out_dt)
    fscale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    slopes = None if alibi_slopes is None else np.broadcast_to(alibi_slopes, (B, H))
    plans = []
    for b in range(B):
        S = int(seqlens[b])
        pages = block_table[b, : -(-S // P) if P else 0]
        if pages.size == 1:  # one page (a contiguous cache's row): a view, no copy
            kb, vb = k_pages[pages[0], :S], v_pages[pages[0], :S]
        else:
            kb = k_pages[pages].reshape(-1, Hkv, d)[:S]
            vb = v_pages[pages].reshape(-1, Hkv, dv)[:S]
        kb, vb = kb.transpose(1, 0, 2), vb.transpose(1, 0, 2)
        plan = block_plan(
            q[b], _wide(kb), _wide(vb), scale=fscale, causal=causal, window=window,
            out_dtype=out_dt,
        )  # fmt: skip
        if softcap is not None or slopes is not None:
            extra: dict[str, Any] = {"softcap": softcap}
            if slopes is not None:
                extra["alibi"] = slopes[b].astype(acc)
                extra["bias"] = _later_alibi(slopes[b], Lq, S, plan.window, acc)
            plan = replace(plan, **extra)
        plans.append(plan)
    out = np.empty((B, H, Lq, dv), out_dt)
    lse = np.empty((B, H, Lq), acc)
    for b, (o, s) in enumerate(dispatch.attend_many(plans)):
        out[b], lse[b] = o, s
    return (out, lse) if return_lse else out


def _pages_of(k_cache: np.ndarray, v_cache: np.ndarray) -> int:
    """The rows of pages that a contiguous cache ``(batch, seqlen_cache, kv_heads, ·)`` is,
    viewed without a copy (the largest of 256, 128, 64, 32, 16 dividing ``seqlen_cache``),
    so that a chunk of queries reads its sequences' full pages in place
    (:func:`qkv.engine.paged.attend_pages`); 0 where none fits or the rows are not
    contiguous."""
    cap = k_cache.shape[1]
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        return 0
    return next((p for p in (256, 128, 64, 32, 16) if cap % p == 0 and cap > p), 0)


def _wide(a: np.ndarray) -> np.ndarray:
    """``a``, or its float32 values where it is bfloat16 (ml_dtypes')."""
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a


# ----- flash_attn_with_kvcache -----


def _ints(x: Any, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    """An integer array of ``shape`` (``what`` says what it holds), as int64."""
    x = from_foreign(x, name)
    try:
        a = np.asarray(x)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{name}: cannot be read as an array of ints ({exc})") from None
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        raise InputTypeError(f"{name}: expected integers ({what}), got dtype {a.dtype}")
    if a.shape != shape:
        raise InputError(f"{name}: expected shape {shape} ({what}), got {a.shape}")
    return a.astype(np.int64)


def _pages_pair(k: Any, v: Any, kname: str, vname: str) -> tuple[np.ndarray, np.ndarray]:
    """Two 4-D caches (or pages) read as arrays in their own dtype, their first three sizes
    equal."""
    ka, va = as_array(k, kname, narrow=True), as_array(v, vname, narrow=True)
    for name, a in ((kname, ka), (vname, va)):
        if a.ndim != 4:
            raise InputError(
                f"{name}: expected (batch, seqlen, kv_heads, d) or (num_blocks, page_size, "
                f"kv_heads, d), got shape {a.shape}"
            )
    if ka.shape[:3] != va.shape[:3]:
        raise InputError(
            f"{kname}, {vname}: the first three sizes differ (blocks or batch, page size or "
            f"seqlen, kv heads): {kname} has shape {ka.shape}, {vname} {va.shape}"
        )
    if ka.shape[1] < 1:
        raise InputError(
            f"{kname}: the page size (or the cache's seqlen, axis 1) must be at least 1, got "
            f"shape {ka.shape}"
        )
    return ka, va


def _check_heads(qshape: tuple[int, ...], kshape: tuple[int, ...]) -> None:
    H, Hkv = qshape[-2], kshape[-2]
    if Hkv < 1 or H % Hkv:
        raise InputError(
            f"q, k_cache: {H} query heads cannot share {Hkv} kv heads: q has shape {qshape}, "
            f"the cache {kshape}"
        )


def _block_table(
    block_table: Any,
    B: int,
    num_blocks: int,
    P: int,
    need: np.ndarray,
    written: np.ndarray,
) -> np.ndarray:
    """The checked block table: ``(B, max_blocks)`` ints whose first ``ceil(need[b] / P)``
    entries name blocks of the pool, and no block written by this call (positions
    ``need[b] - written[b]`` on) read anywhere else."""
    bt = from_foreign(block_table, "block_table")
    a = np.asarray(bt)
    if a.ndim != 2 or a.shape[0] != B:
        raise InputError(f"block_table: expected shape ({B}, max_blocks), got {a.shape}")
    bt = _ints(a, "block_table", a.shape, "the pages of each sequence")
    blocks = -(-need // P)  # pages each sequence needs
    if blocks.size and int(blocks.max()) > bt.shape[1]:
        b = int(np.argmax(blocks))
        raise InputError(
            f"block_table: sequence {b} needs {int(blocks[b])} pages of {P} for its "
            f"{int(need[b])} keys, but the table has {bt.shape[1]} per sequence (shape "
            f"{bt.shape})"
        )
    seq = np.repeat(np.arange(B), blocks)
    slot = np.concatenate([np.arange(n) for n in blocks.tolist()]) if B else seq
    used = bt[seq, slot]
    bad = (used < 0) | (used >= num_blocks)
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(
            f"block_table: sequence {int(seq[i])}'s page {int(slot[i])} is block {int(used[i])}, "
            f"outside the pool of {num_blocks} blocks (k_cache's axis 0)"
        )
    if written.any():
        first = (need - written) // P  # the first page written in each sequence
        hit = slot >= first[seq]
        hit &= written[seq] > 0
        counts = np.bincount(used, minlength=num_blocks)
        clash = hit & (counts[used] > 1)
        if clash.any():
            i = int(np.argmax(clash))
            blk = int(used[i])
            others = [(int(s), int(p)) for s, p, u in zip(seq, slot, used, strict=True)
                      if u == blk and (s, p) != (seq[i], slot[i])]  # fmt: skip
            raise InputError(
                f"block_table: block {blk} is written by this call (sequence {int(seq[i])}, "
                f"page {int(slot[i])}, where the new keys go) and is also read as sequence "
                f"{others[0][0]}'s page {others[0][1]}: appending would overwrite it; give "
                "each sequence its own blocks for the pages it appends to"
            )
    return bt


def _rotary(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos: np.ndarray, interleaved: bool
) -> np.ndarray:
    """Rotary embedding of ``x (B, L, heads, d)`` at positions ``pos (B, L)``: its first
    ``2 · cos.shape[1]`` features rotated in pairs, interleaved ``(x0, x1), (x2, x3)...`` (GPT-J)
    or halves ``(x_i, x_{i + r/2})`` (GPT-NeoX); computed in float32 (float64 for float64) and
    rounded to ``x``'s dtype."""
    work = np.float64 if x.dtype == np.float64 else np.float32
    y = x.astype(work)
    r = 2 * cos.shape[1]
    c = cos[pos][:, :, None, :].astype(work)  # (B, L, 1, r/2)
    s = sin[pos][:, :, None, :].astype(work)
    if interleaved:
        x1, x2 = y[..., 0:r:2], y[..., 1:r:2]
        y[..., 0:r:2], y[..., 1:r:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = y[..., : r // 2], y[..., r // 2 : r]
        y[..., : r // 2], y[..., r // 2 : r] = x1 * c - x2 * s, x1 * s + x2 * c
    return y.astype(x.dtype)


def _write(cache: Any, rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> None:
    """``cache[rows[i], cols[i]] = values[i]`` in place (a tensor through torch, an array
    through NumPy), rounded to the cache's dtype."""
    if is_tensor(cache):
        import torch

        from .tensors import as_dtype

        idx = (torch.from_numpy(rows), torch.from_numpy(cols))
        cache[idx] = as_dtype(np.ascontiguousarray(values), cache)
        return
    cache[rows, cols] = values.astype(cache.dtype, copy=False)


def _writable(x: Any, name: str) -> None:
    """A cache this call writes into: a tensor that needs no gradient, or a writeable array."""
    if is_tensor(x):
        refuse_grad("flash_attn_with_kvcache (it writes the new keys into the caches)", **{name: x})
        return
    if not isinstance(x, np.ndarray) or not x.flags.writeable:
        raise InputError(
            f"{name}: flash_attn_with_kvcache writes the new k/v into the cache in place, so it "
            f"must be a writeable NumPy array or CPU tensor, got {type(x).__name__}"
            + ("" if not isinstance(x, np.ndarray) else " (read-only)")
        )


@near_keywords()
def flash_attn_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any = None,
    v: Any = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    cache_seqlens: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    block_table: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Any = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """flash-attn 2's ``flash_attn_with_kvcache`` on the CPU: append new keys and values to a
    K/V cache in place, then attend to it.

    Every argument is checked before anything is written: a refused call leaves the caches as
    they were.

    Parameters
    ----------
    q : array_like or Tensor, shape ``(batch, seqlen_q, heads, d)``
        One query per sequence (decoding) or several (a prefill chunk against the cache).
    k_cache, v_cache : ndarray or Tensor
        Contiguous ``(batch_cache, seqlen_cache, kv_heads, d)`` (``dv`` for ``v_cache``), or,
        with ``block_table``, pages ``(num_blocks, page_size, kv_heads, d)``. Written in place
        where ``k``/``v`` are given.
    k, v : array_like or Tensor, shape ``(batch, seqlen_new, kv_heads, d)``, optional
        New keys and values, written at positions ``cache_seqlens[b], ...`` of sequence ``b``
        (rotated first with ``rotary_cos``/``rotary_sin``) before the attention reads them.
    rotary_cos, rotary_sin : array_like, shape ``(seqlen_ro, rotary_dim / 2)``, optional
        Rotary embedding of ``q`` and the new ``k`` (only with ``k``): the new key ``j`` at
        position ``cache_seqlens[b] + j``; query ``i`` at ``cache_seqlens[b] + i`` when causal
        or windowed, else every query at ``cache_seqlens[b]``. The first ``rotary_dim``
        features rotate; see ``rotary_interleaved``.
    cache_seqlens : int or array_like of int, shape ``(batch,)``, optional
        Keys already in each sequence's cache; default: the whole cache (``seqlen_cache``, or
        ``max_blocks · page_size``). Required with ``k``/``v``.
    cache_batch_idx : array_like of int, shape ``(batch,)``, optional
        Which entry of a contiguous cache each sequence uses (default ``0 .. batch - 1``);
        distinct where ``k``/``v`` are written.
    cache_leftpad : array_like of int, shape ``(batch,)``, optional
        Where each sequence's keys start in a contiguous cache (left padding).
    block_table : array_like of int, shape ``(batch, max_blocks)``, optional
        Paged caches: sequence ``b``'s key ``j`` is row ``j % page_size`` of block
        ``block_table[b, j // page_size]``. Entries past a sequence's pages are not read.
    softmax_scale, causal, window_size, softcap, alibi_slopes
        As in :func:`flash_attn_func`, on each sequence's ``cache_seqlens[b] + seqlen_new``
        keys (minus its left padding), queries aligned bottom-right.
    rotary_interleaved : bool, optional
        ``True`` (flash-attn's default): rotate pairs ``(x0, x1), (x2, x3), ...`` (GPT-J);
        ``False``: pairs ``(x_i, x_{i + rotary_dim/2})`` (GPT-NeoX, Llama).
    num_splits : int, optional
        Accepted and ignored (qkv splits the keys its own way).
    return_softmax_lse : bool, optional
        Also return the log-sum-exp, shape ``(batch, heads, seqlen_q)``.

    Returns
    -------
    out : shape ``(batch, seqlen_q, heads, dv)``
    softmax_lse : shape ``(batch, heads, seqlen_q)``
        Only with ``return_softmax_lse``.

    Examples
    --------
    A paged cache of 4 blocks of 2 tokens; sequence 0 holds 3 keys in blocks 2 and 0, one new
    key is appended and one query attends to all 4:

    >>> import numpy as np
    >>> from qkv.flash import flash_attn_func, flash_attn_with_kvcache
    >>> rng = np.random.default_rng(3)
    >>> k_cache, v_cache = np.zeros((2, 4, 2, 1, 8), np.float32)
    >>> old_k, old_v, new_k, new_v, q = rng.standard_normal((5, 1, 3, 1, 8)).astype(np.float32)
    >>> k_cache[[2, 2, 0], [0, 1, 0]], v_cache[[2, 2, 0], [0, 1, 0]] = old_k[0], old_v[0]
    >>> out = flash_attn_with_kvcache(
    ...     q[:, :1], k_cache, v_cache, new_k[:, :1], new_v[:, :1], cache_seqlens=[3],
    ...     block_table=[[2, 0]], causal=True)
    >>> bool(np.array_equal(k_cache[0, 1], new_k[0, 0]))     # written in place
    True
    >>> keys = np.concatenate([old_k, new_k[:, :1]], 1)
    >>> vals = np.concatenate([old_v, new_v[:, :1]], 1)
    >>> bool(np.allclose(out, flash_attn_func(q[:, :1], keys, vals, causal=True), atol=1e-6))
    True
    """
    # ----- every check, before anything is written -----
    check_flag(causal, "causal")
    check_flag(rotary_interleaved, "rotary_interleaved")
    check_flag(return_softmax_lse, "return_softmax_lse")
    check_int(num_splits, "num_splits", minimum=0)
    refuse_grad("flash_attn_with_kvcache", q=q, k=k, v=v)
    qa = as_array(q, "q", narrow=True)
    if qa.ndim != 4:
        raise InputError(f"q: expected shape (batch, seqlen_q, heads, d), got {qa.shape}")
    B, Lq, H, d = qa.shape
    paged = block_table is not None
    kc, vc = _pages_pair(k_cache, v_cache, "k_cache", "v_cache")
    if kc.shape[3] != d:
        raise InputError(
            f"q, k_cache: feature size d differs: q has shape {qa.shape}, k_cache {kc.shape}"
        )
    _check_heads(qa.shape, kc.shape)
    Hkv, dv = kc.shape[2], vc.shape[3]
    if (k is None) != (v is None):
        raise InputError("k, v: give both new keys and new values, or neither")
    Lnew = 0
    if k is not None:
        ka, va = as_array(k, "k", narrow=True), as_array(v, "v", narrow=True)
        if ka.ndim != 4 or ka.shape[0] != B or ka.shape[2:] != (Hkv, d):
            raise InputError(
                f"k: expected shape ({B}, seqlen_new, {Hkv}, {d}) (batch, new keys, kv heads, "
                f"d), got {ka.shape}"
            )
        if va.shape != ka.shape[:3] + (dv,):
            raise InputError(
                f"v: expected shape {ka.shape[:3] + (dv,)} (k's with v_cache's dv), got {va.shape}"
            )
        Lnew = ka.shape[1]
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            _writable(cache, name)
        for name, a in (("k_cache", kc), ("v_cache", vc)):
            if not np.issubdtype(a.dtype, np.floating) and a.dtype.name != "bfloat16":
                raise InputTypeError(f"{name}: expected a floating cache, got dtype {a.dtype}")
    P = kc.shape[1]
    if paged:
        if cache_batch_idx is not None:
            raise InputError(
                "cache_batch_idx: not with block_table (a paged cache names its blocks there), "
                "as in flash-attn"
            )
        if cache_leftpad is not None:
            raise InputError("cache_leftpad: not with block_table (as in flash-attn)")
        capacity = None  # the block table's width decides it
    else:
        capacity = P
    if cache_seqlens is None:
        if k is not None:
            raise InputError(
                "cache_seqlens: required with k/v (the new keys go at positions "
                "cache_seqlens[b], ...)"
            )
        if paged:
            width = np.asarray(from_foreign(block_table, "block_table")).shape[-1:]
            seqlens = np.full(B, (width[0] if width else 0) * P, np.int64)
        else:
            seqlens = np.full(B, P, np.int64)
    elif isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        seqlens = np.full(B, int(cache_seqlens), np.int64)
    else:
        seqlens = _ints(cache_seqlens, "cache_seqlens", (B,), "keys in each sequence's cache")
    if (seqlens < 0).any():
        raise InputError(f"cache_seqlens: must be >= 0, got {seqlens.tolist()}")
    total = seqlens + Lnew  # keys per sequence once the new ones are in
    if capacity is not None and (total > capacity).any():
        b = int(np.argmax(total > capacity))
        raise InputError(
            f"cache_seqlens: sequence {b} holds {int(seqlens[b])} keys"
            + (f" and {Lnew} new ones are appended" if Lnew else "")
            + f", beyond the cache's {capacity} positions (k_cache has shape {kc.shape})"
        )
    if paged:
        bt = _block_table(block_table, B, kc.shape[0], P, total, np.full(B, Lnew))
        rows_of = None
    else:
        if cache_batch_idx is None:
            if kc.shape[0] != B:
                raise InputError(
                    f"k_cache: its batch ({kc.shape[0]}, axis 0) differs from q's ({B}); pass "
                    "cache_batch_idx to pick entries of a larger cache"
                )
            rows_of = np.arange(B)
        else:
            rows_of = _ints(cache_batch_idx, "cache_batch_idx", (B,), "the cache entry of each "
                            "sequence")  # fmt: skip
            if ((rows_of < 0) | (rows_of >= kc.shape[0])).any():
                raise InputError(
                    f"cache_batch_idx: entries must lie in 0 .. {kc.shape[0] - 1} (k_cache's "
                    f"batch), got {rows_of.tolist()}"
                )
            if Lnew and np.unique(rows_of).size != B:
                raise InputError(
                    f"cache_batch_idx: repeats an entry ({rows_of.tolist()}) while k/v are "
                    "appended: two sequences would write the same cache rows"
                )
    if cache_leftpad is None:
        leftpad = np.zeros(B, np.int64)
    else:
        leftpad = _ints(cache_leftpad, "cache_leftpad", (B,), "where each sequence starts")
        if ((leftpad < 0) | (leftpad > seqlens)).any():
            raise InputError(
                f"cache_leftpad: must lie in 0 .. cache_seqlens[b], got {leftpad.tolist()} "
                f"with cache_seqlens {seqlens.tolist()}"
            )
    window = _window(window_size, causal)
    cap = _softcap(softcap)
    slopes = _slopes(alibi_slopes, B, H)
    scale = check_scale(softmax_scale, d)
    rot = None
    if (rotary_cos is None) != (rotary_sin is None):
        raise InputError("rotary_cos, rotary_sin: give both, or neither")
    if rotary_cos is not None:
        if k is None:
            raise InputError(
                "rotary_cos: the rotary embedding applies with new k/v only (as in flash-attn)"
            )
        cos = as_array(rotary_cos, "rotary_cos")
        sin = as_array(rotary_sin, "rotary_sin")
        if cos.ndim != 2 or sin.shape != cos.shape or not 1 <= 2 * cos.shape[1] <= d:
            raise InputError(
                f"rotary_cos, rotary_sin: expected equal shapes (seqlen_ro, rotary_dim / 2) with "
                f"rotary_dim <= d = {d}, got {cos.shape} and {sin.shape}"
            )
        each = causal or window is not None
        qpos = seqlens[:, None] + (np.arange(Lq)[None, :] if each else 0 * np.arange(Lq))
        kpos = seqlens[:, None] + np.arange(Lnew)[None, :]
        last = max(int(qpos.max(initial=0)), int(kpos.max(initial=0)))
        if last >= cos.shape[0]:
            raise InputError(
                f"rotary_cos: {cos.shape[0]} positions, but position {last} is needed "
                "(cache_seqlens plus the new tokens)"
            )
        rot = (cos, sin, qpos, kpos)

    # ----- checked: rotate, write the new keys and values, attend -----
    if rot is not None:
        cos, sin, qpos, kpos = rot
        qa = _rotary(qa, cos, sin, qpos, rotary_interleaved)
        ka = _rotary(ka, cos, sin, kpos, rotary_interleaved)
    if Lnew:
        pos = (seqlens[:, None] + np.arange(Lnew)[None, :]).reshape(-1)
        seq = np.repeat(np.arange(B), Lnew)
        if paged:
            rows, cols = bt[seq, pos // P], pos % P
        else:
            assert rows_of is not None
            rows, cols = rows_of[seq], pos
        _write(k_cache, rows, cols, ka.reshape(B * Lnew, Hkv, d))
        _write(v_cache, rows, cols, va.reshape(B * Lnew, Hkv, dv))
        kc, vc = _pages_pair(k_cache, v_cache, "k_cache", "v_cache")  # as written
    qb = qa.transpose(0, 2, 1, 3)  # qkv's (batch, heads, seqlen_q, d)
    rule: dict[str, Any] = dict(
        scale=scale, causal=causal, window=window, softcap=cap, alibi_slopes=slopes,
        return_lse=True,
    )  # fmt: skip
    chunk = router.cache_as_pages(Lq, window, slopes is not None)
    page = _pages_of(kc, vc) if chunk and not paged and not leftpad.any() else 0
    if paged:
        out, lse = _attend_pages(qb, kc, vc, bt, total, **rule)
    elif page:  # a chunk against a contiguous cache: its rows as pages, each sequence's own
        assert rows_of is not None
        per = P // page
        table = rows_of[:, None] * per + np.arange(per)
        kp, vp = (x.reshape(-1, page, *x.shape[2:]) for x in (kc, vc))
        out, lse = _attend_pages(qb, kp, vp, table, total, **rule)
    elif not leftpad.any():  # a contiguous cache is pages of seqlen_cache, one per sequence
        assert rows_of is not None
        out, lse = _attend_pages(qb, kc, vc, rows_of[:, None], total, **rule)
    else:  # left padding: each sequence's keys start at its own offset
        assert rows_of is not None
        out = np.empty((B, H, Lq, dv), np.result_type(qa, kc, vc))
        lse = np.empty((B, H, Lq), numerics.acc_dtype(out.dtype))
        for b in range(B):
            keys = slice(int(leftpad[b]), int(total[b]))
            one = dict(rule, alibi_slopes=None if slopes is None else slopes[b : b + 1])
            out[b : b + 1], lse[b : b + 1] = _attend_pages(
                qb[b : b + 1], kc[rows_of[b], keys][None], vc[rows_of[b], keys][None],
                np.zeros((1, 1), np.int64), np.array([keys.stop - keys.start]), **one,
            )  # fmt: skip
    want = want_of(q, k_cache, v_cache)
    res = give(np.ascontiguousarray(out.transpose(0, 2, 1, 3)), want)
    if return_softmax_lse:
        return res, give(lse, want, exact=True)
    return res

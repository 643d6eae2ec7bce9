"""The decode step's opt-in fast road (``precision="fast"``) for int8 K/V, and its NumPy
emulation.

The exact road (the default) widens every stored code to float32 and takes each product in
float32. The fast road rounds each query row to int8 first, symmetric with one scale per
(query row, head), ``s_q = max|q| / 127``, ``c = rint(q / s_q)`` (halves to even), and takes
its products with the int8 keys in int32, exactly (AVX2's ``vpmaddubsw``/``vpmaddwd`` in the
native step, AVX512_VNNI's ``vpdpbusd`` where the CPU has it); a score is then
``float(c · k) · (s_q · scale) · k_scale``. The values' products are integers too: each query
row's weights over a block of ``BLOCK`` keys, ``u = p · v_scale`` (the softmax weight times the
value row's scale), are rounded to int16 against the block's largest, ``w = rint(u · 32767 /
max|u|)``, the products ``w · v`` (the value codes) summed in int32, exactly, and the sum taken
into the output times ``max|u| / 32767``; the softmax's denominator stays the float sum of
``p``. As llama.cpp rounds q to K's dot type, vLLM's CPU backend widens FP8 to bfloat16, and
ONNX Runtime's VNNI road, it changes the numbers, so it is opted into, never chosen for a
caller.

Error bound. ``|q - c · s_q| <= s_q / 2`` per element, so each score moves by at most
``ε = scale · (s_q / 2) · Σ_i |k_i|`` (``k`` the key's stored value, its codes times its
scale; soft-capping does not enlarge a move). Where every score of a row moves by at most
``ε``, each weight moves by a factor within ``[e^{-2ε}, e^{2ε}]`` and the output by at most
``(e^{2ε} − 1) · max|v|`` from the exact road's output on the same stored K/V. The weights'
rounding adds at most ``n / 65534 · max|v|`` (``n`` the keys of a block, at most ``BLOCK``:
``2^-10 · max|v|`` for 64): ``|w − u · 32767 / M| <= 1/2`` for a block of largest weight ``M =
p_t · v_scale_t``, so its numerator moves by at most ``n · M / 65534 · 127`` (codes within
±127) while the denominator holds at least ``p_t`` for each block, and ``127 · v_scale_t`` is
key ``t``'s ``max|v|`` (its largest code 127, as :func:`qkv.quantize_kv` stores a row).
:func:`bound` is the sum of the two.

Every clone of the native step and :func:`scores` here give the same scores bit for bit: the
rounding of q is the same float32 operations in the same order, the products are integers,
and the rest is two float32 multiplications. Given the same float32 weights, every clone
rounds them to the same int16 codes and sums the same int32 products (the AVX2, AVX-512 and
VNNI code take them into the accumulators by the same float32 operations too; the baseline
clone, without FMA, computes its weights and that last step with other roundings).
:func:`attend` is the road with the native step off (``QKV_NATIVE=0``): the same scores, the
softmax in float64 and the weights rounded as the native step rounds them, in blocks of
``BLOCK`` keys from each sequence's first (the native step's blocks start where each of its
pieces starts, so with several threads its blocks can lie elsewhere).

>>> import numpy as np
>>> q = np.array([[0.5, -1.0, 0.25]], np.float32)
>>> codes, s = quantize_rows(q)
>>> codes.tolist(), bool(s[0] == np.float32(1.0) / np.float32(127))
([[64, -127, 32]], True)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import numerics
from ...errors import InputError

__all__ = [
    "BLOCK",
    "attend",
    "bound",
    "check_precision",
    "quantize_rows",
    "round_weights",
    "scores",
]

_F32 = np.float32
BLOCK = 64  # keys per block of weights rounded together (the native step's DECODE_BK)


def check_precision(precision: Any, name: str = "precision") -> str:
    """``precision`` checked: one of :data:`qkv.numerics.PRECISIONS`, else
    :class:`qkv.InputError` (a ``ValueError``) naming ``name`` and the allowed values.

    >>> check_precision("fast")
    'fast'
    >>> check_precision("quick")
    Traceback (most recent call last):
    ...
    qkv.errors.InputError: precision: expected 'exact' or 'fast', got 'quick'
    """
    if not isinstance(precision, str) or precision not in numerics.PRECISIONS:
        raise InputError(f"{name}: expected 'exact' or 'fast', got {precision!r}")
    return precision


def quantize_rows(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row (last axis) of float32 ``q`` rounded to int8 as the native step rounds it:
    ``(codes, scales)``, ``codes * scales[..., None]`` within ``scales / 2`` of ``q``. A row of
    zeros: codes 0, scale 0; a row holding an infinity or NaN: codes 0, scale NaN."""
    x = np.asarray(q, dtype=_F32)
    ax = np.abs(x)
    finite = np.isfinite(x).all(axis=-1)
    amax = np.where(finite, ax.max(axis=-1, initial=_F32(0)), _F32(0)).astype(_F32)
    ok = finite & (amax > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(ok, _F32(127) / np.where(ok, amax, _F32(1)), _F32(0)).astype(_F32)
        y = np.rint(np.where(ok[..., None], x, _F32(0)) * inv[..., None])
    codes = np.clip(y, -127, 127).astype(np.int8)
    scales = np.where(finite, amax / _F32(127), _F32(np.nan)).astype(_F32)
    return codes, scales


def _grouped(q: np.ndarray, kv_heads: int) -> np.ndarray:
    """``q (B, H, L, d)`` as ``(B, kv_heads, group · L, d)``: kv head h's rows, row r of query
    head ``h · group + r // L``."""
    B, H, L, d = q.shape
    return q.reshape(B, kv_heads, (H // kv_heads) * L, d)


def scores(q: np.ndarray, k: np.ndarray, k_scale: np.ndarray, scale: float) -> np.ndarray:
    """The fast road's scores, float32 ``(B, H, L, S)``, of ``q (B, H, L, d)`` (float32)
    against int8 codes ``k (B, kv_heads, S, d)`` with their float32 ``k_scale (B, kv_heads,
    S)``: bit for bit the native step's (before any soft-cap)."""
    B, H, L, d = q.shape
    kvh = k.shape[1]
    codes, s = quantize_rows(_grouped(np.asarray(q, _F32), kvh))
    dot = np.einsum("bhrd,bhsd->bhrs", codes.astype(np.int64), k.astype(np.int64))
    factor = (s * _F32(scale)).astype(_F32)
    out = (dot.astype(_F32) * factor[..., None]).astype(_F32)
    out = (out * np.asarray(k_scale, _F32)[:, :, None, :]).astype(_F32)
    return out.reshape(B, H, L, -1)


def round_weights(u: np.ndarray) -> np.ndarray:
    """Weights ``u (..., n)`` rounded as the fast road rounds a block's: each row against its
    largest, ``rint(u · 32767 / max|u|) · max|u| / 32767`` (halves to even), in float64; a row
    of zeros stays 0.

    >>> round_weights(np.array([[1.0, 0.5, 1e-6]])).tolist() == [[1.0, 16384 / 32767, 0.0]]
    True
    """
    u = np.asarray(u, np.float64)
    m = np.abs(u).max(axis=-1, keepdims=True, initial=0.0)
    safe = np.where(m > 0, m, 1.0)
    return np.where(m > 0, np.rint(u * (32767 / safe)) * safe / 32767, 0.0)


def attend(
    q: np.ndarray,
    k: np.ndarray,
    k_scale: np.ndarray,
    v: np.ndarray,
    v_scale: np.ndarray,
    scale: float,
    *,
    keys: np.ndarray | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The fast road in NumPy: ``(out (B, H, L, dv), lse (B, H, L))`` in float64 of ``q``
    against int8 ``k`` (:func:`scores`) and int8 ``v (B, kv_heads, S, dv)`` with its scales
    ``v_scale (B, kv_heads, S)``, the weights rounded in blocks of :data:`BLOCK` of each
    sequence's visible keys (:func:`round_weights`), sequence ``b`` seeing the keys ``keys[b]``
    (booleans ``(B, S)``; None: all). A row that sees no key: out 0, lse -inf."""
    B, H, L, _ = q.shape
    kvh = k.shape[1]
    S = k.shape[2]
    s = scores(q, k, k_scale, scale).astype(np.float64)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if keys is not None:
        s = np.where(keys[:, None, None, :], s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    none = m == -np.inf
    p = np.exp(s - np.where(none, 0.0, m))
    total = p.sum(axis=-1, keepdims=True)
    u = p.reshape(B, kvh, -1, S) * np.asarray(v_scale, np.float64)[:, :, None, :]
    seen = np.ones((B, S), bool) if keys is None else np.asarray(keys, bool)
    for b in range(B):  # each sequence's visible keys in blocks of BLOCK from its first
        at = np.flatnonzero(seen[b])
        n = at.size
        if n == 0:
            continue
        ub = np.zeros((*u.shape[1:3], -(-n // BLOCK) * BLOCK))
        ub[..., :n] = u[b][..., at]
        ub = round_weights(ub.reshape(*ub.shape[:2], -1, BLOCK)).reshape(ub.shape)
        u[b] = 0.0
        u[b][..., at] = ub[..., :n]
    vg = np.asarray(v, np.float64)
    out = np.einsum("bhrs,bhsd->bhrd", u, vg).reshape(B, H, L, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(none, 0.0, out / np.where(none, 1.0, total))
        lse = np.where(none, -np.inf, m + np.log(np.where(none, 1.0, total)))[..., 0]
    return out, lse


def bound(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    keys: np.ndarray | None = None,
) -> np.ndarray:
    """How far the fast road's output may lie from the exact road's on the same stored K/V:
    ``(e^{2ε} − 1) · max|v| + n / 65534 · max|v|`` per query row ``(B, H, L, 1)``, ``ε =
    scale · (s_q / 2) · max_j Σ_i |k_ji|`` over the keys ``j`` the row sees and ``n`` the
    most keys of a block, ``min(BLOCK, keys seen)`` (the scores' rounding, then the weights';
    see the module's text) (``k``, ``v``: the stored values, float, ``(B, kv_heads, S, ·)``,
    each value row as :func:`qkv.quantize_kv` stores it, ``max|v|`` 127 times its scale;
    ``keys`` as :func:`attend`'s)."""
    B, H, L, _ = q.shape
    kvh = k.shape[1]
    _, s = quantize_rows(_grouped(np.asarray(q, _F32), kvh))  # (B, kvh, R)
    l1 = np.abs(np.asarray(k, np.float64)).sum(axis=-1)  # (B, kvh, S)
    vmax = np.abs(np.asarray(v, np.float64)).max(axis=-1)  # (B, kvh, S)
    if keys is not None:
        l1 = np.where(keys[:, None, :], l1, 0.0)
        vmax = np.where(keys[:, None, :], vmax, 0.0)
    eps = scale * (s.astype(np.float64) / 2) * l1.max(axis=-1, initial=0.0)[..., None]
    seen = np.full(B, k.shape[2]) if keys is None else np.asarray(keys, bool).sum(axis=-1)
    n = np.minimum(seen, BLOCK)[:, None, None]
    out = (np.expm1(2 * eps) + n / 65534) * vmax.max(axis=-1, initial=0.0)[..., None]
    return out.reshape(B, H, L, 1)

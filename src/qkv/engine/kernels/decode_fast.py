"""The decode step's opt-in fast road (``precision="fast"``) for int8 K/V, and its NumPy
emulation.

The exact road (the default) widens every stored code to float32 and takes each product in
float32. The fast road rounds each query row to int8 first, symmetric with one scale per
(query row, head), ``s_q = max|q| / 127``, ``c = rint(q / s_q)`` (halves to even), and takes
its products with the int8 keys in int32, exactly (AVX2's ``vpmaddubsw``/``vpmaddwd`` in the
native step, AVX512_VNNI's ``vpdpbusd`` where the CPU has it); a score is then
``float(c · k) · (s_q · scale) · k_scale``. The weights' products with the values stay those
of the exact road. As llama.cpp rounds q to K's dot type, vLLM's CPU backend widens FP8 to
bfloat16, and ONNX Runtime's VNNI road, it changes the numbers, so it is opted into, never
chosen for a caller.

Error bound. ``|q - c · s_q| <= s_q / 2`` per element, so each score moves by at most
``ε = scale · (s_q / 2) · Σ_i |k_i|`` (``k`` the key's stored value, its codes times its
scale; soft-capping does not enlarge a move). Where every score of a row moves by at most
``ε``, each weight moves by a factor within ``[e^{-2ε}, e^{2ε}]`` and the output by at most
``(e^{2ε} − 1) · max|v|`` from the exact road's output on the same stored K/V
(:func:`bound`).

Every clone of the native step and :func:`scores` here give the same scores bit for bit: the
rounding of q is the same float32 operations in the same order, the products are integers,
and the rest is two float32 multiplications. :func:`attend` is the road with the native step
off (``QKV_NATIVE=0``): the same scores, the softmax and the values' products in float64.

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

__all__ = ["attend", "bound", "check_precision", "quantize_rows", "scores"]

_F32 = np.float32


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


def attend(
    q: np.ndarray,
    k: np.ndarray,
    k_scale: np.ndarray,
    v: np.ndarray,
    scale: float,
    *,
    keys: np.ndarray | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The fast road in NumPy: ``(out (B, H, L, dv), lse (B, H, L))`` in float64 of ``q``
    against int8 ``k`` (:func:`scores`) and the values ``v (B, kv_heads, S, dv)`` (their
    stored values, float), sequence ``b`` seeing the keys ``keys[b]`` (booleans ``(B, S)``;
    None: all). A row that sees no key: out 0, lse -inf."""
    B, H, L, _ = q.shape
    kvh = k.shape[1]
    s = scores(q, k, k_scale, scale).astype(np.float64)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if keys is not None:
        s = np.where(keys[:, None, None, :], s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    none = m == -np.inf
    p = np.exp(s - np.where(none, 0.0, m))
    total = p.sum(axis=-1, keepdims=True)
    vg = np.asarray(v, np.float64)
    pg = p.reshape(B, kvh, -1, s.shape[-1])
    out = np.einsum("bhrs,bhsd->bhrd", pg, vg).reshape(B, H, L, -1)
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
    ``(e^{2ε} − 1) · max|v|`` per query row ``(B, H, L, 1)``, ``ε = scale · (s_q / 2) ·
    max_j Σ_i |k_ji|`` over the keys ``j`` the row sees (``k``, ``v``: the stored values,
    float, ``(B, kv_heads, S, ·)``; ``keys`` as :func:`attend`'s)."""
    B, H, L, _ = q.shape
    kvh = k.shape[1]
    _, s = quantize_rows(_grouped(np.asarray(q, _F32), kvh))  # (B, kvh, R)
    l1 = np.abs(np.asarray(k, np.float64)).sum(axis=-1)  # (B, kvh, S)
    vmax = np.abs(np.asarray(v, np.float64)).max(axis=-1)  # (B, kvh, S)
    if keys is not None:
        l1 = np.where(keys[:, None, :], l1, 0.0)
        vmax = np.where(keys[:, None, :], vmax, 0.0)
    eps = scale * (s.astype(np.float64) / 2) * l1.max(axis=-1, initial=0.0)[..., None]
    out = np.expm1(2 * eps) * vmax.max(axis=-1, initial=0.0)[..., None]
    return out.reshape(B, H, L, 1)

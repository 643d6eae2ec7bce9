"""Launch the Triton kernels on canonical 4-D tensors: block sizes, grids, splits, autotuning.

Layout: ``q (Z, Hq, L, d)``, ``k (Z, Hkv, S, d)``, ``v (Z, Hkv, S, dv)`` with
``Hq = group · Hkv``, any strides; the :class:`Options`' ``mask`` a bool tensor and ``bias`` a
float tensor broadcastable to ``(Z, Hq, L, S)`` (expanded views, stride 0 where broadcast).
Outputs are new contiguous tensors: ``out (Z, Hq, L, dv)`` in q's dtype and ``lse (Z, Hq, L)``
in float32.

On a device the prefill forward is autotuned over a few block shapes; under Triton's
interpreter (``TRITON_INTERPRET=1``, CPU tensors) no autotuning runs and small fixed blocks
keep the interpreted cases fast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import triton

from . import _kernels as K

__all__ = ["Options", "backward", "decode", "forward", "prefill"]

MAX_HEAD_DIM = 256  # d and dv beyond this fall back (see qkv.gpu.api)
DECODE_MAX_ROWS = 64  # group · L up to which one program holds all rows of a kv head


@dataclass(frozen=True)
class Options:
    """What the kernels need besides ``q``, ``k`` and ``v`` (already checked by ``make_plan``):
    the scale, causal, the window's sides, the grouping, and the canonical bool ``mask`` and
    float ``bias`` when the call has one."""

    scale: float
    causal: bool
    left: int | None
    right: int | None
    group: int
    mask: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def _interpreted() -> bool:
    return K.INTERPRETED


def _p2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


def _strides4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0) if t is None else tuple(t.stride())  # type: ignore[return-value]


def _flags(q: torch.Tensor, opts: Options) -> dict[str, Any]:
    upcast = _interpreted() and q.dtype == torch.bfloat16
    return {
        "GROUP": opts.group,
        "CAUSAL": opts.causal,
        "HAS_LEFT": opts.left is not None,
        "HAS_RIGHT": opts.right is not None,
        "HAS_MASK": opts.mask is not None,
        "HAS_BIAS": opts.bias is not None,
        "UPCAST": upcast,
        "IEEE": upcast or q.dtype == torch.float32,
    }


def _mask_args(q: torch.Tensor, opts: Options) -> tuple[torch.Tensor, torch.Tensor]:
    """Pointers for absent mask/bias: any tensor of the right device (never read)."""
    m = opts.mask.view(torch.uint8) if opts.mask is not None else q
    return m, (opts.bias if opts.bias is not None else q)


def _mask_strides(opts: Options) -> tuple[int, ...]:
    """The mask's and the bias's four strides each (zeros for an absent one)."""
    return (*_strides4(opts.mask), *_strides4(opts.bias))


def _outputs(q: torch.Tensor, dv: int, S: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """New ``out (Z, Hq, L, dv)`` in q's dtype and ``lse (Z, Hq, L)`` in float32, and whether
    there is nothing to attend (no row or no key): then they are final already, out 0 and
    lse ``-inf``."""
    Z, Hq, L, _ = q.shape
    out = torch.empty((Z, Hq, L, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((Z, Hq, L), dtype=torch.float32, device=q.device)
    empty = out.numel() == 0 or S == 0
    if empty:
        out.zero_()
        lse.fill_(-math.inf)
    return out, lse, empty


def _scalars(opts: Options) -> tuple[int, int, float]:
    return (opts.left or 0, opts.right or 0, opts.scale * K.LOG2E)


@cache
def _tuned_prefill() -> Any:
    """The prefill kernel wrapped in ``triton.autotune``: built only when a device runs it."""
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in [
            (128, 64, 4, 3),
            (128, 128, 8, 3),
            (64, 64, 4, 4),
            (128, 32, 4, 4),
            (64, 32, 4, 2),  # fits 256-wide heads
        ]
    ]
    return triton.autotune(configs, key=["size_key", "d", "dv"])(K.prefill_fwd)


def prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: Options
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` by the prefill kernel (online softmax, band tiles only)."""
    Z, Hq, L, d = q.shape
    S, dv = k.shape[2], v.shape[3]
    out, lse, empty = _outputs(q, dv, S)
    if empty:
        return out, lse
    left, right, qk_scale = _scalars(opts)
    args = (
        q, k, v, out, lse, *_mask_args(q, opts),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *_mask_strides(opts),
        Hq, L, S, d, dv, left, right, qk_scale,
        triton.next_power_of_2(L) * 65536 + triton.next_power_of_2(S),
    )  # fmt: skip
    blocks = {"BLOCK_D": _p2(d), "BLOCK_DV": _p2(dv)}
    if _interpreted():
        grid: tuple[int, int] | Callable[[dict[str, Any]], tuple[int, int]]
        grid = (triton.cdiv(L, 16), Z * Hq)
        K.prefill_fwd[grid](*args, **_flags(q, opts), BLOCK_M=16, BLOCK_N=16, **blocks)
    else:  # pragma: no cover - needs a GPU
        kernel = _tuned_prefill()
        grid = lambda meta: (triton.cdiv(L, meta["BLOCK_M"]), Z * Hq)  # noqa: E731
        kernel[grid](*args, **_flags(q, opts), **blocks)
    return out, lse


def _splits(q: torch.Tensor, Z: int, Hkv: int, S: int, block_n: int) -> int:
    """Key splits so that about two programs per streaming multiprocessor stream K/V."""
    if _interpreted():
        return max(1, min(4, triton.cdiv(S, 4 * block_n)))
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count  # pragma: no cover
    want = max(1, 2 * sms // max(Z * Hkv, 1))  # pragma: no cover
    return max(1, min(want, triton.cdiv(S, 4 * block_n), 64))  # pragma: no cover


def decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: Options, splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` by split-K decoding: keys split over programs, partials merged.

    Each program reads one kv head's share of the keys once for all ``group · L`` query rows
    that use it. ``splits`` forces the number of key splits (tests); ``None`` picks it.
    """
    Z, Hq, L, d = q.shape
    Hkv, S, dv = k.shape[1], k.shape[2], v.shape[3]
    rows = opts.group * L
    if rows > DECODE_MAX_ROWS:
        raise ValueError(f"decode: group · L = {rows} exceeds {DECODE_MAX_ROWS}; use prefill")
    out, lse, empty = _outputs(q, dv, S)
    if empty:
        return out, lse
    block_n = 16 if _interpreted() else 64
    n = splits if splits is not None else _splits(q, Z, Hkv, S, block_n)
    chunk = triton.cdiv(triton.cdiv(S, n), block_n) * block_n
    n = triton.cdiv(S, chunk)
    block_dv = _p2(dv)
    part_out = torch.empty((Z * Hq * L, n, block_dv), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((Z * Hq * L, n), dtype=torch.float32, device=q.device)
    left, right, qk_scale = _scalars(opts)
    K.decode_split[(n, Z * Hkv)](
        q, k, v, part_out, part_lse, *_mask_args(q, opts),
        *q.stride(), *k.stride(), *v.stride(), *_mask_strides(opts),
        Hkv, L, S, d, dv, left, right, qk_scale, chunk, n,
        **_flags(q, opts),
        BLOCK_M=_p2(rows), BLOCK_N=block_n, BLOCK_D=_p2(d), BLOCK_DV=block_dv,
        **({} if _interpreted() else {"num_warps": 4, "num_stages": 2}),
    )  # fmt: skip
    K.decode_merge[(Z * Hq * L,)](
        part_out, part_lse, out, lse, L, Hq, dv, *out.stride(), n,
        BLOCK_S=triton.next_power_of_2(n), BLOCK_DV=block_dv,
    )  # fmt: skip
    return out, lse


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: Options, kernel: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill or decode by shape (few query rows per kv head: decode), or as forced."""
    if kernel == "auto":
        kernel = "decode" if opts.group * q.shape[2] <= 16 else "prefill"
    if kernel == "decode":
        return decode(q, k, v, opts)
    return prefill(q, k, v, opts)


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    opts: Options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` by the FlashAttention-2 backward from the saved ``out`` and ``lse``.

    Three launches: ``δ = rowsum(dO ∘ O)``; dk, dv per key block (grouped query heads summed
    inside the program, no atomics); dq per query block. Weights are recomputed from lse.
    """
    Z, Hq, L, d = q.shape
    Hkv, S, dv = k.shape[1], k.shape[2], v.shape[3]
    dq = torch.zeros((Z, Hq, L, d), dtype=q.dtype, device=q.device)
    dk = torch.zeros((Z, Hkv, S, d), dtype=k.dtype, device=q.device)
    dvt = torch.zeros((Z, Hkv, S, dv), dtype=v.dtype, device=q.device)
    if q.numel() == 0 or S == 0 or out.numel() == 0:
        return dq, dk, dvt
    out = out.contiguous()
    do = grad_out.to(q.dtype).contiguous()
    delta = torch.empty((Z, Hq, L), dtype=torch.float32, device=q.device)
    wide = max(d, dv) > 128  # 64-row tiles of 256-wide heads would not fit in shared memory
    bm, bn = (16, 16) if _interpreted() else ((32, 32) if wide else (64, 64))
    K.bwd_delta[(triton.cdiv(L, bm), Z * Hq)](out, do, delta, L, dv, BLOCK_M=bm, BLOCK_DV=_p2(dv))
    m, b = _mask_args(q, opts)
    left, right, qk_scale = _scalars(opts)
    common = (*q.stride(), *k.stride(), *v.stride(), *_mask_strides(opts))
    consts = {
        **_flags(q, opts),
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_D": _p2(d),
        "BLOCK_DV": _p2(dv),
    }
    if not _interpreted():  # pragma: no cover - needs a GPU
        consts.update(num_warps=4, num_stages=2)
    K.bwd_dkdv[(triton.cdiv(S, bn), Z * Hkv)](
        q, k, v, do, lse, delta, dk, dvt, m, b, *common,
        Hkv, L, S, d, dv, left, right, qk_scale, opts.scale, **consts,
    )  # fmt: skip
    K.bwd_dq[(triton.cdiv(L, bm), Z * Hq)](
        q, k, v, do, lse, delta, dq, m, b, *common,
        Hq, L, S, d, dv, left, right, qk_scale, opts.scale, **consts,
    )  # fmt: skip
    return dq, dk, dvt

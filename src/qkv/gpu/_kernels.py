"""Triton kernels: prefill forward, split-K decode + merge, FlashAttention-2 backward.

Each kernel must equal :func:`qkv.reference.attention` (forward) or
:func:`qkv.engine.grad.reference_attention_vjp` (backward) on the same plan. Tensors arrive in the
canonical layout of :mod:`qkv.gpu.launch`: ``q (Z, Hq, L, d)``, ``k (Z, Hkv, S, d)``,
``v (Z, Hkv, S, dv)``, a bool mask (as ``uint8``) or float bias with strides broadcast to
``(Z, Hq, L, S)``; query head ``h`` reads kv head ``h // GROUP``.

Scores are kept in base 2 (``s · scale · log2 e``) so the softmax uses ``exp2``; lse leaves in
natural log. Query row ``i`` sits at absolute position ``S − L + i`` (bottom-right causal); a
row that may attend no key gets output 0 and lse ``−inf``.

Whether the kernels are compiled for a device or run by Triton's interpreter is fixed when
Triton and this module are imported: ``TRITON_INTERPRET=1`` must be set before Triton's own
first import, since Triton's library functions (``tl.sum``, ``tl.zeros``, …) are themselves
compiled or interpreted from then on. :data:`INTERPRETED` is true only when both are.
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED = bool(triton.knobs.runtime.interpret) and type(tl.sum).__name__ == (
    "InterpretedFunction"
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32; float32 inputs use IEEE products (not TF32).

    ``UPCAST`` converts both operands to float32 first (exact): Triton 3.9's interpreter
    miscomputes ``tl.dot`` on bfloat16, so the launcher sets it there.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _key_bounds(
    p_first, p_last, S, left, right, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key tiles for rows at positions ``p_first..p_last``: ``(lo, u_lo, u_hi, hi)``.

    Keys in ``[lo, hi)`` may be seen by some row; tiles in ``[u_lo, u_hi)`` (whole tiles) are
    seen by every row and need no mask; ``[lo, u_lo)`` and ``[u_hi, hi)`` are the diagonal and
    edge tiles that pay for it. ``lo``, ``u_lo`` and ``u_hi`` are multiples of ``BLOCK_N``.
    """
    lo = p_first * 0
    hi = lo + S
    f_lo = lo
    f_hi = hi
    if CAUSAL:
        hi = tl.minimum(hi, p_last + 1)
        f_hi = tl.minimum(f_hi, p_first + 1)
    if HAS_RIGHT:
        hi = tl.minimum(hi, p_last + right + 1)
        f_hi = tl.minimum(f_hi, p_first + right + 1)
    if HAS_LEFT:
        lo = tl.maximum(lo, p_first - left)
        f_lo = tl.maximum(f_lo, p_last - left)
    hi = tl.maximum(hi, 0)
    lo = tl.minimum(lo, S)
    lo = (lo // BLOCK_N) * BLOCK_N
    f_hi = tl.maximum(f_hi, 0)
    f_lo = tl.minimum(f_lo, S)
    u_lo = ((f_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    u_hi = (f_hi // BLOCK_N) * BLOCK_N
    empty = u_hi <= u_lo
    u_lo = tl.where(empty, lo, u_lo)
    u_hi = tl.where(empty, lo, u_hi)
    return lo, u_lo, u_hi, hi


@triton.jit
def _logits(
    s, pos, rows_ok, cols, S, left, right, mask_ptr, mrow, stride_mn, bias_ptr, brow, stride_bn,
    STRUCT: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Base-2 scores of one tile plus bias, ``−inf`` where a row may not see a key.

    ``STRUCT`` applies the key edge, causal and window tests (diagonal and edge tiles only);
    the user's mask and bias apply to every tile that has them.
    """
    inside = rows_ok[:, None] & (cols[None, :] < S)
    if HAS_BIAS:
        b = tl.load(
            bias_ptr + brow[:, None] + cols[None, :].to(tl.int64) * stride_bn,
            mask=inside,
            other=0.0,
        )
        s = s + b.to(tl.float32) * 1.4426950408889634
    if STRUCT:
        ok = cols[None, :] < S
        if CAUSAL:
            ok = ok & (cols[None, :] <= pos[:, None])
        if HAS_LEFT:
            ok = ok & (cols[None, :] >= pos[:, None] - left)
        if HAS_RIGHT:
            ok = ok & (cols[None, :] <= pos[:, None] + right)
        s = tl.where(ok, s, float("-inf"))
    if HAS_MASK:
        m = tl.load(
            mask_ptr + mrow[:, None] + cols[None, :].to(tl.int64) * stride_mn,
            mask=inside,
            other=0,
        )
        s = tl.where(m != 0, s, float("-inf"))
    return s


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, k_ptr, v_ptr, stride_kn, stride_kd, stride_vn, stride_vd, start, stop,
    pos, rows_ok, offs_d, offs_dv, d, dv, S, left, right, qk_scale,
    mask_ptr, mrow, stride_mn, bias_ptr, brow, stride_bn,
    BLOCK_N: tl.constexpr, STRUCT: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Online softmax over the key tiles ``start, start + BLOCK_N, … < stop``."""
    for n0 in range(start, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cols64 = cols.to(tl.int64)
        kt = tl.load(
            k_ptr + cols64[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            mask=(cols[None, :] < S) & (offs_d[:, None] < d),
            other=0.0,
        )
        s = _dot(q, kt, UPCAST, IEEE) * qk_scale
        s = _logits(
            s, pos, rows_ok, cols, S, left, right, mask_ptr, mrow, stride_mn, bias_ptr, brow,
            stride_bn, STRUCT, CAUSAL, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + cols64[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
            mask=(cols[:, None] < S) & (offs_dv[None, :] < dv),
            other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _finish(acc, l_i, m_i):
    """``(out, lse)`` from the running sums; no key at all gives 0 and ``−inf``."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    return out, lse


@triton.jit
def prefill_fwd(
    Q, K, V, Out, Lse, Mask, Bias,
    sqz, sqh, sqm, sqd, skz, skh, skn, skd, svz, svh, svn, svd, soz, soh, som, sod,
    smz, smh, smm, smn, sbz, sbh, sbm, sbn,
    Hq, L, S, d, dv, left, right, qk_scale, size_key,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """One block of ``BLOCK_M`` query rows of one head: out and lse (grid ``(⌈L/BM⌉, Z·Hq)``).

    Key tiles outside the causal/window band are never visited; the band's whole tiles run
    without a mask and only the diagonal and edge tiles test each entry.
    """
    pid_m = tl.program_id(0)
    zh = tl.program_id(1)
    z = (zh // Hq).to(tl.int64)
    h = (zh % Hq).to(tl.int64)
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = rows < L
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + z * sqz + h * sqh + rows64[:, None] * sqm + offs_d[None, :] * sqd,
        mask=rows_ok[:, None] & (offs_d[None, :] < d),
        other=0.0,
    )
    pos = rows + (S - L)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, L) - 1
    lo, u_lo, u_hi, hi = _key_bounds(
        pid_m * BLOCK_M + (S - L), last + (S - L), S, left, right, CAUSAL, HAS_LEFT, HAS_RIGHT,
        BLOCK_N,
    )  # fmt: skip
    k_ptr = K + z * skz + hk * skh
    v_ptr = V + z * svz + hk * svh
    mask_ptr = Mask + z * smz + h * smh
    bias_ptr = Bias + z * sbz + h * sbh
    mrow = rows64 * smm
    brow = rows64 * sbm
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # stage 1: tiles left of the band's full part (window edge, or the key tail when causal)
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_ptr, v_ptr, skn, skd, svn, svd, lo, u_lo, pos, rows_ok, offs_d,
        offs_dv, d, dv, S, left, right, qk_scale, mask_ptr, mrow, smn, bias_ptr, brow, sbn,
        BLOCK_N, True, CAUSAL, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, UPCAST, IEEE,
    )  # fmt: skip
    # stage 2: tiles every row sees whole: no mask
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_ptr, v_ptr, skn, skd, svn, svd, u_lo, u_hi, pos, rows_ok, offs_d,
        offs_dv, d, dv, S, left, right, qk_scale, mask_ptr, mrow, smn, bias_ptr, brow, sbn,
        BLOCK_N, False, CAUSAL, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, UPCAST, IEEE,
    )  # fmt: skip
    # stage 3: the diagonal (causal), the right window edge and the ragged last tile
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_ptr, v_ptr, skn, skd, svn, svd, u_hi, hi, pos, rows_ok, offs_d,
        offs_dv, d, dv, S, left, right, qk_scale, mask_ptr, mrow, smn, bias_ptr, brow, sbn,
        BLOCK_N, True, CAUSAL, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, UPCAST, IEEE,
    )  # fmt: skip
    out, lse = _finish(acc, l_i, m_i)
    tl.store(
        Out + z * soz + h * soh + rows64[:, None] * som + offs_dv[None, :] * sod,
        out.to(Out.dtype.element_ty),
        mask=rows_ok[:, None] & (offs_dv[None, :] < dv),
    )
    tl.store(Lse + zh.to(tl.int64) * L + rows64, lse, mask=rows_ok)


@triton.jit
def decode_split(
    Q, K, V, PartOut, PartLse, Mask, Bias,
    sqz, sqh, sqm, sqd, skz, skh, skn, skd, svz, svh, svn, svd,
    smz, smh, smm, smn, sbz, sbh, sbm, sbn,
    Hkv, L, S, d, dv, left, right, qk_scale, chunk, splits,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Split ``pid(0)`` of the keys for all ``GROUP · L`` query rows of one kv head.

    Grid ``(splits, Z·Hkv)``. Row ``r`` is query ``r % L`` of head ``hk · GROUP + r // L``, so
    each kv head is read once for its whole group. Writes a normalised partial output and lse
    per row (lse ``−inf`` where the split holds no visible key) for :func:`decode_merge`.
    """
    sp = tl.program_id(0)
    zh = tl.program_id(1)
    z = (zh // Hkv).to(tl.int64)
    hk = (zh % Hkv).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    rows_ok = r < GROUP * L
    g = (r // L).to(tl.int64)
    i = (r % L).to(tl.int64)
    h = hk * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + z * sqz + h[:, None] * sqh + i[:, None] * sqm + offs_d[None, :] * sqd,
        mask=rows_ok[:, None] & (offs_d[None, :] < d),
        other=0.0,
    )
    pos = (r % L) + (S - L)
    lo, u_lo, u_hi, hi = _key_bounds(
        S - L, S - 1, S, left, right, CAUSAL, HAS_LEFT, HAS_RIGHT, BLOCK_N
    )
    start = tl.maximum(lo, sp * chunk)
    stop = tl.minimum(hi, sp * chunk + chunk)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, K + z * skz + hk * skh, V + z * svz + hk * svh, skn, skd, svn, svd,
        start, stop, pos, rows_ok, offs_d, offs_dv, d, dv, S, left, right, qk_scale,
        Mask + z * smz, h * smh + i * smm, smn, Bias + z * sbz, h * sbh + i * sbm, sbn,
        BLOCK_N, True, CAUSAL, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, UPCAST, IEEE,
    )  # fmt: skip
    out, lse = _finish(acc, l_i, m_i)
    row = ((z * Hkv + hk) * GROUP + g) * L + i  # (Z, Hq, L) flattened
    part = row * splits + sp
    tl.store(
        PartOut + part[:, None] * BLOCK_DV + offs_dv[None, :],
        out,
        mask=rows_ok[:, None] & (offs_dv[None, :] < dv),
    )
    tl.store(PartLse + part, lse, mask=rows_ok)


@triton.jit
def decode_merge(
    PartOut, PartLse, Out, Lse, L, Hq, dv, soz, soh, som, sod, splits,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Merge the splits' ``(out, lse)`` of one query row: grid ``(Z·Hq·L,)``.

    ``lse = log Σ exp(lse_s)``, ``out = Σ exp(lse_s − lse) · out_s`` (the merge of
    :func:`qkv.merge`); rows no split saw give 0 and ``−inf``.
    """
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    lse_s = tl.load(PartLse + row * splits + sp, mask=sp < splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    total = tl.sum(w, 0)
    parts = tl.load(
        PartOut + (row * splits + sp)[:, None] * BLOCK_DV + offs_dv[None, :],
        mask=(sp[:, None] < splits) & (offs_dv[None, :] < dv),
        other=0.0,
    )
    empty = total == 0.0
    out = tl.sum(w[:, None] * parts, 0) / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
    zh = row // L
    i = row % L
    z = zh // Hq
    h = zh % Hq
    tl.store(
        Out + z * soz + h * soh + i * som + offs_dv * sod,
        out.to(Out.dtype.element_ty),
        mask=offs_dv < dv,
    )
    tl.store(Lse + row, lse)


@triton.jit
def bwd_delta(
    Out, dOut, Delta, L, dv, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """``δ = rowsum(dO ∘ O)`` in float32, contiguous ``(Z·Hq, L, dv)``: grid ``(⌈L/BM⌉, Z·Hq)``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    zh = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_DV)
    ok = (rows[:, None] < L) & (offs[None, :] < dv)
    at = (zh * L + rows.to(tl.int64))[:, None] * dv + offs[None, :]
    o = tl.load(Out + at, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(dOut + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(Delta + zh * L + rows, tl.sum(o * do, 1), mask=rows < L)


@triton.jit
def _bwd_p(
    q, kt, lse2, qk_scale, pos, rows_ok, cols, S, left, right, mask_ptr, mrow, stride_mn,
    bias_ptr, brow, stride_bn, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """The tile of weights ``P = exp(Z − lse)``, recomputed; masked entries and empty rows 0."""
    s = _dot(q, kt, UPCAST, IEEE) * qk_scale
    s = _logits(
        s, pos, rows_ok, cols, S, left, right, mask_ptr, mrow, stride_mn, bias_ptr, brow,
        stride_bn, True, CAUSAL, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
    )  # fmt: skip
    return tl.math.exp2(s - lse2[:, None])


@triton.jit
def _row_terms(dOut, Lse, Delta, zh, L, rows64, rows_ok, offs_dv, dv):
    """A block of query rows' terms of the backward: dO, lse in base 2 (+inf for a row with no
    key, so its p is 0) and δ = rowsum(dO ∘ O)."""
    do = tl.load(
        dOut + (zh * L + rows64)[:, None] * dv + offs_dv[None, :],
        mask=rows_ok[:, None] & (offs_dv[None, :] < dv),
        other=0.0,
    )
    lse = tl.load(Lse + zh * L + rows64, mask=rows_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + zh * L + rows64, mask=rows_ok, other=0.0)
    return do, lse2, delta


@triton.jit
def bwd_dkdv(
    Q, K, V, dOut, Lse, Delta, dK, dV, Mask, Bias,
    sqz, sqh, sqm, sqd, skz, skh, skn, skd, svz, svh, svn, svd,
    smz, smh, smm, smn, sbz, sbh, sbm, sbn,
    Hkv, L, S, d, dv, left, right, qk_scale, scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """dk and dv of one key block of one kv head, summed over its ``GROUP`` query heads.

    Grid ``(⌈S/BN⌉, Z·Hkv)``; no atomics. Only query blocks that can see the key block are
    visited. ``dOut`` is contiguous ``(Z, Hq, L, dv)``; dk, dv contiguous like k, v.
    """
    pid_n = tl.program_id(0)
    zh = tl.program_id(1)
    z = (zh // Hkv).to(tl.int64)
    hk = (zh % Hkv).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols64 = cols.to(tl.int64)
    cols_ok = cols < S
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kt = tl.load(
        K + z * skz + hk * skh + cols64[None, :] * skn + offs_d[:, None] * skd,
        mask=cols_ok[None, :] & (offs_d[:, None] < d),
        other=0.0,
    )
    vt = tl.load(
        V + z * svz + hk * svh + cols64[None, :] * svn + offs_dv[:, None] * svd,
        mask=cols_ok[None, :] & (offs_dv[:, None] < dv),
        other=0.0,
    )
    # query rows that can see some key of this block
    n_first = pid_n * BLOCK_N
    n_last = tl.minimum(n_first + BLOCK_N, S) - 1
    p_lo = n_first * 0 - L - S  # below any position
    p_hi = n_first * 0 + 2 * S + L
    if CAUSAL:
        p_lo = tl.maximum(p_lo, n_first)
    if HAS_RIGHT:
        p_lo = tl.maximum(p_lo, n_first - right)
    if HAS_LEFT:
        p_hi = tl.minimum(p_hi, n_last + left)
    i_lo = tl.maximum(p_lo - (S - L), 0)
    i_hi = tl.minimum(p_hi - (S - L) + 1, L)
    i_lo = (i_lo // BLOCK_M) * BLOCK_M
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dvacc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        zh_q = z * (Hkv * GROUP) + h
        for m0 in range(i_lo, i_hi, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            rows64 = rows.to(tl.int64)
            rows_ok = rows < L
            q = tl.load(
                Q + z * sqz + h * sqh + rows64[:, None] * sqm + offs_d[None, :] * sqd,
                mask=rows_ok[:, None] & (offs_d[None, :] < d),
                other=0.0,
            )
            do, lse2, delta = _row_terms(dOut, Lse, Delta, zh_q, L, rows64, rows_ok, offs_dv, dv)
            p = _bwd_p(
                q, kt, lse2, qk_scale, rows + (S - L), rows_ok, cols, S, left, right,
                Mask + z * smz + h * smh, rows64 * smm, smn, Bias + z * sbz + h * sbh,
                rows64 * sbm, sbn, CAUSAL, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, UPCAST, IEEE,
            )  # fmt: skip
            dvacc += _dot(tl.trans(p).to(do.dtype), do, UPCAST, IEEE)
            dp = _dot(do, vt, UPCAST, IEEE)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds).to(q.dtype), q, UPCAST, IEEE)
    at = zh.to(tl.int64) * S + cols64
    tl.store(
        dK + at[:, None] * d + offs_d[None, :],
        (dk * scale).to(dK.dtype.element_ty),
        mask=cols_ok[:, None] & (offs_d[None, :] < d),
    )
    tl.store(
        dV + at[:, None] * dv + offs_dv[None, :],
        dvacc.to(dV.dtype.element_ty),
        mask=cols_ok[:, None] & (offs_dv[None, :] < dv),
    )


@triton.jit
def bwd_dq(
    Q, K, V, dOut, Lse, Delta, dQ, Mask, Bias,
    sqz, sqh, sqm, sqd, skz, skh, skn, skd, svz, svh, svn, svd,
    smz, smh, smm, smn, sbz, sbh, sbm, sbn,
    Hq, L, S, d, dv, left, right, qk_scale, scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """dq of one block of query rows: grid ``(⌈L/BM⌉, Z·Hq)``; visits only the band's tiles."""
    pid_m = tl.program_id(0)
    zh = tl.program_id(1)
    z = (zh // Hq).to(tl.int64)
    h = (zh % Hq).to(tl.int64)
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    rows_ok = rows < L
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + z * sqz + h * sqh + rows64[:, None] * sqm + offs_d[None, :] * sqd,
        mask=rows_ok[:, None] & (offs_d[None, :] < d),
        other=0.0,
    )
    zh64 = zh.to(tl.int64)
    do, lse2, delta = _row_terms(dOut, Lse, Delta, zh64, L, rows64, rows_ok, offs_dv, dv)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, L) - 1
    lo, u_lo, u_hi, hi = _key_bounds(
        pid_m * BLOCK_M + (S - L), last + (S - L), S, left, right, CAUSAL, HAS_LEFT, HAS_RIGHT,
        BLOCK_N,
    )  # fmt: skip
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cols64 = cols.to(tl.int64)
        kt = tl.load(
            K + z * skz + hk * skh + cols64[None, :] * skn + offs_d[:, None] * skd,
            mask=(cols[None, :] < S) & (offs_d[:, None] < d),
            other=0.0,
        )
        vt = tl.load(
            V + z * svz + hk * svh + cols64[None, :] * svn + offs_dv[:, None] * svd,
            mask=(cols[None, :] < S) & (offs_dv[:, None] < dv),
            other=0.0,
        )
        p = _bwd_p(
            q, kt, lse2, qk_scale, rows + (S - L), rows_ok, cols, S, left, right,
            Mask + z * smz + h * smh, rows64 * smm, smn, Bias + z * sbz + h * sbh, rows64 * sbm,
            sbn, CAUSAL, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, UPCAST, IEEE,
        )  # fmt: skip
        dp = _dot(do, vt, UPCAST, IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(kt.dtype), tl.trans(kt), UPCAST, IEEE)
    tl.store(
        dQ + (zh64 * L + rows64)[:, None] * d + offs_d[None, :],
        (dq * scale).to(dQ.dtype.element_ty),
        mask=rows_ok[:, None] & (offs_d[None, :] < d),
    )

// The FlashAttention-2 backward of backward.cpp for bfloat16 queries, keys, values and dO,
// with all five tile products on vdpbf16ps (bf16.h) instead of BLAS:
//
//     S = scale · Q Kᵀ,  P = exp(S − lse)  (causal/window applied; 0 where hidden)
//     dP = dO Vᵀ,  dS = P ∘ (dP − delta) · scale
//     dV += Pᵀ dO,  dK += dSᵀ Q,  dQ += dS K
//
// P and dS are rounded to bfloat16 for the last three products, as FlashAttention's and
// PyTorch's bfloat16 backwards do; everything else is float32, and dQ, dK, dV come out in
// float32. A work item is one kv head's block of 64 keys ("keys in lanes": S, dP, P and dS
// are held as rows of 64 key lanes, dK and dV transposed, columns of 64 key lanes); it visits
// the query blocks of the kv head's query heads that see its keys. The keys' pair words for
// S and dP and for dQ are packed once per item; dQ rows are shared between items and added
// under a lock per query block. A boolean mask or a float32 bias is read per row of a step,
// as the forward applies it (the bias added to the scaled score before lse is taken off, a
// hidden key's weight 0). d and dv must be even.

#include <mutex>

#include "bf16.h"

namespace {

#if QKV_X86

constexpr int64_t BKEYS = LANES;  // keys per work item: the lanes of S, dP, dK, dV
constexpr int64_t BROWS = 64;     // query rows per step

struct Bufs {
    Arena arena;
    uint32_t *kp, *vp, *kt;  // K, V pairs of d (dv) by key lane; K pairs of keys by column
    float *dkt, *dvt;        // (d, BKEYS), (dv, BKEYS)
    float *s, *dp;           // (BROWS, BKEYS): S then P; dP then dS
    uint32_t *pp, *dsp;      // (BROWS / 2, BKEYS): P, dS as pairs of rows
    uint32_t *dot, *qt;      // (BROWS / 2, dvp), (BROWS / 2, dqp): dO, Q as pairs of rows
    uint32_t* dsw;           // (BROWS, BKEYS / 2): dS as pairs of keys
    float* dql;              // (BROWS, dpad)
    float* delta;  // (BROWS): rowsum(dO ∘ O) of a step's rows, when the caller gives none
    int32_t *lo, *hi;
    bool make(int64_t d, int64_t dv, int64_t dvp, int64_t dqp, int64_t dpad) {
        const int64_t words = d / 2 * BKEYS + dv / 2 * BKEYS + BKEYS / 2 * dpad + d * BKEYS +
                              dv * BKEYS + 2 * BROWS * BKEYS + BROWS * BKEYS +
                              BROWS / 2 * (dvp + dqp) + BROWS * BKEYS / 2 + BROWS * dpad +
                              3 * BROWS;
        if (!arena.make(size_t(words + 16 * 16) * 4)) return false;
        kp = arena.take<uint32_t>(d / 2 * BKEYS);
        vp = arena.take<uint32_t>(dv / 2 * BKEYS);
        kt = arena.take<uint32_t>(BKEYS / 2 * dpad);
        dkt = arena.take<float>(d * BKEYS);
        dvt = arena.take<float>(dv * BKEYS);
        s = arena.take<float>(BROWS * BKEYS);
        dp = arena.take<float>(BROWS * BKEYS);
        pp = arena.take<uint32_t>(BROWS / 2 * BKEYS);
        dsp = arena.take<uint32_t>(BROWS / 2 * BKEYS);
        dot = arena.take<uint32_t>(BROWS / 2 * dvp);
        qt = arena.take<uint32_t>(BROWS / 2 * dqp);
        dsw = arena.take<uint32_t>(BROWS * BKEYS / 2);
        dql = arena.take<float>(BROWS * dpad);
        delta = arena.take<float>(BROWS);
        lo = arena.take<int32_t>(BROWS);
        hi = arena.take<int32_t>(BROWS);
        return true;
    }
};

// x's rows [k0, k0 + n) (row stride rs, cols even) as pair words of its columns, by key lane:
// out[p * BKEYS + j] = (x[k0 + j][2p], x[k0 + j][2p + 1]); 0 for lanes j >= n.
void pack_by_lane(const uint16_t* x, int64_t rs, int64_t n, int64_t cols, uint32_t* out) {
    for (int64_t p = 0; p < cols / 2; ++p)
        for (int64_t j = 0; j < BKEYS; ++j) {
            uint32_t w = 0;
            if (j < n) std::memcpy(&w, x + j * rs + 2 * p, 4);
            out[p * BKEYS + j] = w;
        }
}

// delta[r] = Σ_c x[r][c] · y[r][c] for rows r < nr of two (nr x n) bfloat16 matrices (row
// stride n), in float32.
QKV_BF16 void row_dots(const uint16_t* x, const uint16_t* y, int64_t nr, int64_t n, float* delta) {
    for (int64_t r = 0; r < nr; ++r) {
        const uint16_t* xr = x + r * n;
        const uint16_t* yr = y + r * n;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < n; c += 32) {
            const __mmask32 m = n - c >= 32 ? ~__mmask32(0) : (__mmask32(1) << (n - c)) - 1;
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, xr + c),
                                   (__m512bh)_mm512_maskz_loadu_epi16(m, yr + c));
        }
        delta[r] = _mm512_reduce_add_ps(acc);
    }
}

// Where a step's rows read their mask or bias: row r's entry for key k0 + j at
// r * rs + j * cs (a mask, or a bias, or neither).
struct MaskRows {
    const uint8_t* mask;
    const float* bias;
    int64_t rs, cs;
};

// The elementwise steps for rows [0, nr) of a step (see the top of the file): P into b.s, dS
// into b.dp; then both as pairs of rows (b.pp, b.dsp) and dS as pairs of keys (b.dsw). Rows
// from nr to the next even count are 0.
QKV_BF16 void weights_step(Bufs& b, int64_t nr, int64_t k0, int64_t k1, const float* lse,
                           const float* delta, float scale, const MaskRows& mr) {
    const __m512 sc = _mm512_set1_ps(scale);
    alignas(64) float add[BKEYS];     // the row's bias by key lane
    alignas(64) uint8_t keep[BKEYS];  // the row's mask by key lane
    const int64_t nk = k1 - k0;
    for (int64_t r = 0; r < nr; ++r) {
        const __m512 l = _mm512_set1_ps(lse[r]), dl = _mm512_set1_ps(delta[r]);
        if (mr.bias) {
            const float* br = mr.bias + r * mr.rs;
            for (int64_t j = 0; j < BKEYS; ++j) add[j] = j < nk ? br[j * mr.cs] : 0.0f;
        }
        if (mr.mask) {
            const uint8_t* m = mr.mask + r * mr.rs;
            for (int64_t j = 0; j < BKEYS; ++j) keep[j] = j < nk && m[j * mr.cs] ? 1 : 0;
        }
        const __m512i lo = _mm512_set1_epi32(std::max<int32_t>(b.lo[r], int32_t(k0)));
        const __m512i hi = _mm512_set1_epi32(std::min<int32_t>(b.hi[r], int32_t(k1)));
        for (int v = 0; v < LV; ++v) {
            float* s = b.s + r * BKEYS + 16 * v;
            float* dp = b.dp + r * BKEYS + 16 * v;
            const __m512i key = _mm512_add_epi32(
                _mm512_set1_epi32(int32_t(k0 + 16 * v)),
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
            __mmask16 seen = _mm512_cmpge_epi32_mask(key, lo) & _mm512_cmplt_epi32_mask(key, hi);
            __m512 y = _mm512_mul_ps(_mm512_load_ps(s), sc);
            if (mr.bias) y = _mm512_add_ps(y, _mm512_load_ps(add + 16 * v));
            if (mr.mask) {
                const __m128i kv = _mm_load_si128(reinterpret_cast<const __m128i*>(keep + 16 * v));
                seen &= _mm_test_epi8_mask(kv, kv);
            }
            // s − lse may be a little above 0 (lse rounded): exp_lanes is exact there too
            const __m512 x = _mm512_sub_ps(y, l);
            const __m512 p = _mm512_maskz_mov_ps(seen, exp_lanes(x));
            const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(_mm512_load_ps(dp), dl)), sc);
            _mm512_store_ps(s, p);
            _mm512_store_ps(dp, ds);
        }
    }
    if (nr & 1) {
        std::memset(b.s + nr * BKEYS, 0, BKEYS * sizeof(float));
        std::memset(b.dp + nr * BKEYS, 0, BKEYS * sizeof(float));
    }
    for (int64_t i = 0; i < (nr + 1) / 2; ++i)
        for (int v = 0; v < LV; ++v) {
            const float* s = b.s + 2 * i * BKEYS + 16 * v;
            const float* ds = b.dp + 2 * i * BKEYS + 16 * v;
            _mm512_store_si512(b.pp + i * BKEYS + 16 * v,
                               pair_words(_mm512_load_ps(s), _mm512_load_ps(s + BKEYS)));
            _mm512_store_si512(b.dsp + i * BKEYS + 16 * v,
                               pair_words(_mm512_load_ps(ds), _mm512_load_ps(ds + BKEYS)));
        }
    for (int64_t r = 0; r < nr; ++r)
        for (int v = 0; v < LV; v += 2) {  // keys 2k, 2k + 1 are neighbours: no mixing needed
            const float* ds = b.dp + r * BKEYS + 16 * v;
            const __m512i w =
                (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(ds + 16), _mm512_load_ps(ds));
            _mm512_store_si512(b.dsw + r * (BKEYS / 2) + 8 * v, w);
        }
}

QKV_BF16 void backward_item(const qkv_backward_args& a, Bufs& b, int64_t kvh, int64_t kb,
                            std::vector<std::mutex>& locks, int64_t dvp, int64_t dqp,
                            int64_t dpad) {
    const int64_t d = a.d, dv = a.dv, L = a.L;
    const int64_t k0 = kb * BKEYS, k1 = std::min(a.S, k0 + BKEYS), nk = k1 - k0;
    const int64_t nqb = (L + BROWS - 1) / BROWS;
    const uint16_t* K = static_cast<const uint16_t*>(a.k) + a.k_off[kvh] + k0 * a.k_rs;
    const uint16_t* V = static_cast<const uint16_t*>(a.v) + a.v_off[kvh] + k0 * a.v_rs;
    pack_by_lane(K, a.k_rs, nk, d, b.kp);
    pack_by_lane(V, a.v_rs, nk, dv, b.vp);
    std::memset(b.kt, 0, size_t(BKEYS / 2 * dpad) * 4);
    pack_row_pairs(K, a.k_rs, nk, d, dpad, b.kt);
    std::memset(b.dkt, 0, size_t(d * BKEYS) * 4);
    std::memset(b.dvt, 0, size_t(dv * BKEYS) * 4);
    for (int64_t g = 0; g < a.group; ++g) {
        const int64_t h = kvh * a.group + g;
        const uint16_t* Q = static_cast<const uint16_t*>(a.q) + a.q_off[h];
        const uint16_t* DO = static_cast<const uint16_t*>(a.dout) + h * L * dv;
        const float* LSE = static_cast<const float*>(a.lse) + h * L;
        const float* DELTA = a.delta ? static_cast<const float*>(a.delta) + h * L : nullptr;
        const uint16_t* OUT = static_cast<const uint16_t*>(a.out) + h * L * dv;
        float* DQ = static_cast<float*>(a.dq) + h * L * d;
        for (int64_t qb = 0; qb < nqb; ++qb) {
            const int64_t r0 = qb * BROWS, nr = std::min(BROWS, L - r0);
            for (int64_t r = 0; r < nr; ++r) {
                int64_t lo, hi;
                bounds(a, a.S - L + r0 + r, &lo, &hi);
                b.lo[r] = int32_t(lo);
                b.hi[r] = int32_t(hi);
            }
            if (b.hi[nr - 1] <= k0 || b.lo[0] >= k1) continue;  // no row sees these keys
            const uint16_t* q = Q + r0 * a.q_rs;
            const uint16_t* dout = DO + r0 * dv;
            dp_rows(nr, b.kp, BKEYS, q, a.q_rs, 2, d / 2, b.s, BKEYS, FROM_ZERO, nullptr);
            dp_rows(nr, b.vp, BKEYS, dout, dv, 2, dv / 2, b.dp, BKEYS, FROM_ZERO, nullptr);
            const float* delta = DELTA ? DELTA + r0 : b.delta;
            if (!DELTA) row_dots(dout, OUT + r0 * dv, nr, dv, b.delta);
            MaskRows mr{nullptr, nullptr, a.m_rs, a.m_cs};
            if (a.mask || a.bias) {
                const int64_t at = a.m_off[h] + r0 * a.m_rs + k0 * a.m_cs;
                mr.mask = a.mask ? a.mask + at : nullptr;
                mr.bias = a.bias ? static_cast<const float*>(a.bias) + at : nullptr;
            }
            weights_step(b, nr, k0, k1, LSE + r0, delta, float(a.scale), mr);
            pack_row_pairs(dout, dv, nr, dv, dvp, b.dot);
            pack_row_pairs(q, a.q_rs, nr, d, dqp, b.qt);
            const int64_t rp = (nr + 1) / 2;
            dp_rows(dv, b.pp, BKEYS, reinterpret_cast<const uint16_t*>(b.dot), 2, 2 * dvp, rp,
                    b.dvt, BKEYS, FROM_OUT, nullptr);
            dp_rows(d, b.dsp, BKEYS, reinterpret_cast<const uint16_t*>(b.qt), 2, 2 * dqp, rp,
                    b.dkt, BKEYS, FROM_OUT, nullptr);
            for (int64_t c = 0; c < d; c += LANES)
                dp_rows(nr, b.kt + c, dpad, reinterpret_cast<const uint16_t*>(b.dsw), BKEYS, 2,
                        (nk + 1) / 2, b.dql + c, dpad, FROM_ZERO, nullptr);
            std::lock_guard<std::mutex> hold(locks[size_t(h * nqb + qb)]);
            for (int64_t r = 0; r < nr; ++r) {
                float* dq = DQ + (r0 + r) * d;
                const float* x = b.dql + r * dpad;
#pragma omp simd
                for (int64_t c = 0; c < d; ++c) dq[c] += x[c];
            }
        }
    }
    float* DK = static_cast<float*>(a.dk) + (kvh * a.S + k0) * d;
    float* DV = static_cast<float*>(a.dvo) + (kvh * a.S + k0) * dv;
    for (int64_t j = 0; j < nk; ++j) {
        for (int64_t c = 0; c < d; ++c) DK[j * d + c] = b.dkt[c * BKEYS + j];
        for (int64_t c = 0; c < dv; ++c) DV[j * dv + c] = b.dvt[c * BKEYS + j];
    }
}

int run_backward_bf16(const qkv_backward_args& a) {
    const int64_t nkb = (a.S + BKEYS - 1) / BKEYS, ntasks = a.nkv * nkb;
    const int64_t nqb = (a.L + BROWS - 1) / BROWS;
    const int64_t dvp = (a.dv + 31) / 32 * 32, dqp = (a.d + 31) / 32 * 32;
    const int64_t dpad = (a.d + LANES - 1) / LANES * LANES;
    std::vector<std::mutex> locks;
    try {
        locks = std::vector<std::mutex>(size_t(a.nkv * a.group * nqb));
    } catch (const std::bad_alloc&) {
        return 1;
    }
    return for_tasks<Bufs>(
        ntasks, a.threads, nullptr,
        [&](Bufs& b) { return b.make(a.d, a.dv, dvp, dqp, dpad); },
        [&](Bufs& b, int64_t t) {
        const int64_t kvh = t % a.nkv, kb = t / a.nkv;  // early key blocks first (causal)
        backward_item(a, b, kvh, kb, locks, dvp, dqp, dpad);
    });
}

#endif  // QKV_X86

}  // namespace

extern "C" {

// q, k, v, dout bfloat16 (uint16 bits; dout contiguous), lse (+inf for rows with no key) and
// delta float32 (or NULL: taken from out, bfloat16 and contiguous, as rowsum(dO ∘ O)), dq, dk,
// dvo float32 zeroed by the caller, a bias float32; otherwise as qkv_backward_f32 (gemm and the
// block sizes unused). 0 done; 1 no memory; 2 bad arguments, or a
// CPU without AVX512_BF16.
int qkv_backward_bf16(const qkv_backward_args* a) {
    if (!a || a->L < 1 || a->S < 1 || a->d < 2 || a->d % 2 || a->dv < 2 || a->dv % 2 ||
        ((a->mask || a->bias) && !a->m_off) || (a->mask && a->bias) ||
        a->S >= (int64_t(1) << 31) || a->nkv < 1 || a->group < 1 || (!a->delta && !a->out))
        return 2;
    return QKV_ON_BF16(run_backward_bf16(*a));
}

}  // extern "C"

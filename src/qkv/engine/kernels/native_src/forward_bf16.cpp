// Fused prefill forward with bfloat16 tile products: the recurrence of forward.cpp, for
// bfloat16 queries, keys and values, with both products on AVX512_BF16's vdpbf16ps (each
// float32 lane adds two bfloat16 products, exactly, to its sum) instead of BLAS.
//
// Must equal qkv.reference.attention applied to the same (bfloat16) numbers, up to the one
// rounding FlashAttention and PyTorch make too: the weights P are rounded to bfloat16 for the
// second product. Scores, the running max and sum, the accumulator, out and lse are float32.
//
// Layout: a work item is 64 query rows of one head, held "queries in lanes": four vectors of
// 16 rows. Its queries are packed once, pair by pair of the d axis (q[r][2p], q[r][2p+1] in
// one 32-bit word, the form vdpbf16ps multiplies), so each key's pair word is broadcast from
// K as it lies in memory (no packing of K). Per tile of up to 64 keys:
//
//     Sᵀ (keys x 64 rows)  = K_tile · Q_blkᵀ        6 keys x 4 vectors of accumulators
//     per lane (query row): scale, hide keys outside [lo, hi), m' = max(m, max S),
//         P = exp(S − m'), l = l · exp(m − m') + Σ P                  (float32)
//     P packed as pairs of keys in bfloat16; the tile's V packed as pairs of rows
//     accᵀ (dv x 64 rows) = accᵀ · exp(m − m') + Vᵀ · Pᵀ     6 columns x 4 vectors
//
// and out = acc / l, lse = m + log l (l = 0: out 0, lse −inf) at the end. Causal and windows
// come as each row's bounds; boolean masks, biases and the score variants are not taken here
// (the Python side sends those problems to the float32 kernels). d must be even.

#include "common.h"

#include <cstdlib>

#if QKV_X86
#include <immintrin.h>
#endif

namespace {

#if QKV_X86

#define QKV_BF16                                                                      \
    __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,fma," \
                          "prefer-vector-width=512")))

constexpr int64_t BQ = 64;  // query rows per work item
constexpr int RV = 4;       // ... as vectors of 16 float32 lanes
constexpr int64_t BK = 64;  // keys per tile
constexpr int KJ = 6;       // keys per step of the first product
constexpr int CJ = 6;       // value columns per step of the second

// A worker's buffers, made once per thread (64-byte aligned: the products load whole vectors).
struct Tiles {
    uint32_t* qp = nullptr;  // (d / 2, BQ) query pair words
    float* st = nullptr;     // (BK, BQ) scores of the tile
    uint32_t* pp = nullptr;  // (BK / 2, BQ) weight pair words (pairs of keys)
    uint32_t* vp = nullptr;  // (BK / 2, dvp) value pair words (pairs of rows)
    float* acc = nullptr;    // (dv, BQ)
    float *m = nullptr, *l = nullptr, *alpha = nullptr;
    int32_t *lo = nullptr, *hi = nullptr;
    void* mem = nullptr;
    Tiles() = default;
    Tiles(const Tiles&) = delete;
    Tiles& operator=(const Tiles&) = delete;
    ~Tiles() { std::free(mem); }
    bool make(int64_t d, int64_t dv, int64_t dvp) {
        const size_t words = size_t(d / 2 * BQ + BK * BQ + BK / 2 * BQ + BK / 2 * dvp +
                                    dv * BQ + 5 * BQ);
        mem = std::aligned_alloc(64, (words * 4 + 63) / 64 * 64);
        if (!mem) return false;
        uint32_t* w = static_cast<uint32_t*>(mem);
        qp = w;
        w += d / 2 * BQ;
        st = reinterpret_cast<float*>(w);
        w += BK * BQ;
        pp = w;
        w += BK / 2 * BQ;
        vp = w;
        w += BK / 2 * dvp;
        acc = reinterpret_cast<float*>(w);
        w += dv * BQ;
        float* f = reinterpret_cast<float*>(w);
        m = f;
        l = f + BQ;
        alpha = f + 2 * BQ;
        lo = reinterpret_cast<int32_t*>(f + 3 * BQ);
        hi = reinterpret_cast<int32_t*>(f + 4 * BQ);
        return true;
    }
};

// float32 -> bfloat16 bits, rounding to nearest even (NaN stays NaN).
QKV_INLINE uint32_t bf16_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// Sᵀ[j][r] for keys j < NJ of the tile (rows k, k + k_rs, ...) and the 64 rows: the first
// product, NJ x 4 accumulators over the d / 2 pairs.
template <int NJ>
QKV_BF16 QKV_INLINE void scores_step(const uint32_t* __restrict qp, int64_t pairs,
                                     const uint16_t* __restrict k, int64_t k_rs,
                                     float* __restrict st) {
    __m512 acc[NJ][RV];
    for (int j = 0; j < NJ; ++j)
        for (int r = 0; r < RV; ++r) acc[j][r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh q[RV];
        for (int r = 0; r < RV; ++r)
            q[r] = (__m512bh)_mm512_load_si512(qp + p * BQ + 16 * r);
        for (int j = 0; j < NJ; ++j) {
            uint32_t w;
            std::memcpy(&w, k + j * k_rs + 2 * p, 4);
            const __m512bh kb = (__m512bh)_mm512_set1_epi32(int(w));
            for (int r = 0; r < RV; ++r) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], q[r], kb);
        }
    }
    for (int j = 0; j < NJ; ++j)
        for (int r = 0; r < RV; ++r) _mm512_store_ps(st + j * BQ + 16 * r, acc[j][r]);
}

// accᵀ[c] for columns c < NC (from c0) = accᵀ[c] · alpha + Σ over the tile's key pairs of
// P pair words times V pair words: the second product, NC x 4 accumulators.
template <int NC>
QKV_BF16 QKV_INLINE void values_step(const uint32_t* __restrict pp, int64_t kpairs,
                                     const uint32_t* __restrict vp, int64_t dvp,
                                     const float* __restrict alpha, float* __restrict acc) {
    __m512 a[NC][RV];
    __m512 al[RV];
    for (int r = 0; r < RV; ++r) al[r] = _mm512_load_ps(alpha + 16 * r);
    for (int c = 0; c < NC; ++c)
        for (int r = 0; r < RV; ++r)
            a[c][r] = _mm512_mul_ps(_mm512_load_ps(acc + c * BQ + 16 * r), al[r]);
    for (int64_t p = 0; p < kpairs; ++p) {
        __m512bh w[RV];
        for (int r = 0; r < RV; ++r)
            w[r] = (__m512bh)_mm512_load_si512(pp + p * BQ + 16 * r);
        for (int c = 0; c < NC; ++c) {
            const __m512bh vb = (__m512bh)_mm512_set1_epi32(int(vp[p * dvp + c]));
            for (int r = 0; r < RV; ++r) a[c][r] = _mm512_dpbf16_ps(a[c][r], w[r], vb);
        }
    }
    for (int c = 0; c < NC; ++c)
        for (int r = 0; r < RV; ++r) _mm512_store_ps(acc + c * BQ + 16 * r, a[c][r]);
}

template <template <int> class Step, typename... A>
QKV_BF16 QKV_INLINE void by_width(int n, A... args) {
    switch (n) {
        case 1: Step<1>::run(args...); break;
        case 2: Step<2>::run(args...); break;
        case 3: Step<3>::run(args...); break;
        case 4: Step<4>::run(args...); break;
        case 5: Step<5>::run(args...); break;
        default: Step<6>::run(args...); break;
    }
}
template <int N>
struct Scores {
    QKV_BF16 static void run(const uint32_t* qp, int64_t pairs, const uint16_t* k, int64_t k_rs,
                             float* st) {
        scores_step<N>(qp, pairs, k, k_rs, st);
    }
};
template <int N>
struct Values {
    QKV_BF16 static void run(const uint32_t* pp, int64_t kpairs, const uint32_t* vp, int64_t dvp,
                             const float* alpha, float* acc) {
        values_step<N>(pp, kpairs, vp, dvp, alpha, acc);
    }
};

// Rows 2i and 2i + 1 of the tile's values (dv bfloat16 each) as dv pair words.
QKV_BF16 void pack_values(const uint16_t* v, int64_t v_rs, int64_t n, int64_t dv, int64_t dvp,
                          uint32_t* vp) {
    static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i ilo = _mm512_loadu_si512(lo_idx);
    const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
    for (int64_t p = 0; p < (n + 1) / 2; ++p) {
        const uint16_t* a = v + 2 * p * v_rs;
        const bool has_b = 2 * p + 1 < n;  // an odd tile's last row pairs with zeros
        for (int64_t c = 0; c < dv; c += 32) {
            const __mmask32 m = dv - c >= 32 ? ~__mmask32(0) : (__mmask32(1) << (dv - c)) - 1;
            const __m512i x = _mm512_maskz_loadu_epi16(m, a + c);
            const __m512i y = has_b ? _mm512_maskz_loadu_epi16(m, a + v_rs + c)
                                    : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + p * dvp + c, _mm512_permutex2var_epi16(x, ilo, y));
            _mm512_storeu_si512(vp + p * dvp + c + 16, _mm512_permutex2var_epi16(x, ihi, y));
        }
    }
}

// exp(x) for x <= 0 in the 16 lanes of x: exp_neg<float> of common.h (the same reduction and
// polynomial, so the same numbers), written with AVX-512 operations; 2^n by vscalefps.
QKV_BF16 QKV_INLINE __m512 exp_lanes(__m512 x) {
    const __m512 low = _mm512_set1_ps(-87.0f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);  // NaN: false, stays NaN
    x = _mm512_mask_blend_ps(under, x, low);
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic),
                                   magic);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(_knot_mask16(under), _mm512_scalef_ps(p, n));
}

// The softmax step of one tile of n keys starting at key c0 (its scores in t.st), 16 rows at
// a time: see the top of the file. Writes the weights' pair words to t.pp and each row's
// factor to t.alpha. Keys every row of the item sees need no test.
QKV_BF16 void softmax_step(Tiles& t, int64_t n, int64_t c0, float scale) {
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512 sc = _mm512_set1_ps(scale);
    static const uint16_t mix_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                         8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i mix = _mm512_loadu_si512(mix_idx);
    for (int r = 0; r < RV; ++r) {
        const __m512i lo = _mm512_load_si512(t.lo + 16 * r), hi = _mm512_load_si512(t.hi + 16 * r);
        const bool all = _mm512_reduce_max_epi32(lo) <= c0 && _mm512_reduce_min_epi32(hi) >= c0 + n;
        const __m512 m_old = _mm512_load_ps(t.m + 16 * r);
        __m512 mx = m_old;
        float* s = t.st + 16 * r;
        for (int64_t j = 0; j < n; ++j) {
            __m512 x = _mm512_mul_ps(_mm512_load_ps(s + j * BQ), sc);
            if (!all) {
                const __m512i key = _mm512_set1_epi32(int32_t(c0 + j));
                const __mmask16 seen = _mm512_cmpge_epi32_mask(key, lo) & _mm512_cmplt_epi32_mask(key, hi);
                x = _mm512_mask_blend_ps(seen, ninf, x);
            }
            _mm512_store_ps(s + j * BQ, x);
            mx = _mm512_max_ps(x, mx);  // a NaN score is left out here; its weight carries it
        }
        // nothing visible yet: every weight is 0 (the reference 0 keeps −inf − −inf away)
        const __m512 ref = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ), mx,
                                                _mm512_setzero_ps());
        const __m512 alpha = exp_lanes(_mm512_sub_ps(m_old, ref));  // m = −inf: 0
        _mm512_store_ps(t.alpha + 16 * r, alpha);
        _mm512_store_ps(t.m + 16 * r, mx);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = 0; p < (n + 1) / 2; ++p) {
            const __m512 a = exp_lanes(_mm512_sub_ps(_mm512_load_ps(s + 2 * p * BQ), ref));
            const __m512 b = 2 * p + 1 < n
                                 ? exp_lanes(_mm512_sub_ps(_mm512_load_ps(s + (2 * p + 1) * BQ), ref))
                                 : _mm512_setzero_ps();  // an odd tile's last key pairs with 0
            sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a low, b high
            _mm512_store_si512(t.pp + p * BQ + 16 * r, _mm512_permutexvar_epi16(mix, both));
        }
        const __m512 l = _mm512_load_ps(t.l + 16 * r);
        _mm512_store_ps(t.l + 16 * r, _mm512_fmadd_ps(l, alpha, sum));
    }
}

// One work item: rows [r0, r0 + rows) of query head h (see the top of the file).
QKV_BF16 void forward_item(const qkv_prefill_args& a, Tiles& t, int64_t h, int64_t r0,
                           int64_t rows, int64_t dvp) {
    const float ninf = -std::numeric_limits<float>::infinity();
    const int64_t d = a.d, dv = a.dv, pairs = d / 2;
    const float* q = static_cast<const float*>(a.q) + a.q_off[h] + r0 * a.q_rs;
    const uint16_t* K = static_cast<const uint16_t*>(a.k) + a.k_off[h];
    const uint16_t* V = static_cast<const uint16_t*>(a.v) + a.v_off[h];
    for (int64_t r = 0; r < BQ; ++r) {
        int64_t lo = 0, hi = 0;  // rows past the end see nothing
        if (r < rows) bounds(a, a.S - a.L + r0 + r, &lo, &hi);
        t.lo[r] = int32_t(lo);
        t.hi[r] = int32_t(hi);
        t.m[r] = ninf;
        t.l[r] = 0;
        for (int64_t p = 0; p < pairs; ++p)
            t.qp[p * BQ + r] = r < rows ? bf16_bits(q[r * a.q_rs + 2 * p]) |
                                              bf16_bits(q[r * a.q_rs + 2 * p + 1]) << 16
                                        : 0u;
    }
    std::memset(t.acc, 0, size_t(dv * BQ) * sizeof(float));
    const int64_t klo = t.lo[0], khi = t.hi[rows - 1];  // both nondecreasing in the row
    for (int64_t c0 = klo; c0 < khi; c0 += BK) {
        const int64_t n = std::min(BK, khi - c0);
        for (int64_t j = 0; j < n; j += KJ)
            by_width<Scores>(int(std::min<int64_t>(KJ, n - j)), t.qp, pairs,
                             K + (c0 + j) * a.k_rs, a.k_rs, t.st + j * BQ);
        softmax_step(t, n, c0, float(a.scale));
        pack_values(V + c0 * a.v_rs, a.v_rs, n, dv, dvp, t.vp);
        for (int64_t c = 0; c < dv; c += CJ)
            by_width<Values>(int(std::min<int64_t>(CJ, dv - c)), t.pp, (n + 1) / 2, t.vp + c,
                             dvp, t.alpha, t.acc + c * BQ);
    }
    float* out = static_cast<float*>(a.out) + (h * a.L + r0) * dv;
    float* lse = static_cast<float*>(a.lse) + h * a.L + r0;
    for (int64_t r = 0; r < rows; ++r) {
        const float li = t.l[r];
        if (li == 0.0f) {  // no visible key: 0 and −inf, never NaN
            for (int64_t c = 0; c < dv; ++c) out[r * dv + c] = 0;
            lse[r] = ninf;
            continue;
        }
        const float inv = 1.0f / li;
        for (int64_t c = 0; c < dv; ++c) out[r * dv + c] = t.acc[c * BQ + r] * inv;
        lse[r] = t.m[r] + std::log(li);
    }
}

bool cpu_has_bf16() {
    __builtin_cpu_init();
    return best_isa() == 3 && __builtin_cpu_supports("avx512bf16");
}

int run_bf16(const qkv_prefill_args& a) {
    const int64_t nqb = (a.L + BQ - 1) / BQ, ntasks = a.nb * nqb;
    const int64_t dvp = (a.dv + 31) / 32 * 32;
    return for_tasks<Tiles>(
        ntasks, a.threads, nullptr, [&](Tiles& t) { return t.make(a.d, a.dv, dvp); },
        [&](Tiles& t, int64_t task) {
        // latest query blocks first: under causal they cost the most
        const int64_t qb = nqb - 1 - task / a.nb, h = task % a.nb;
        const int64_t r0 = qb * BQ;
        forward_item(a, t, h, r0, std::min(BQ, a.L - r0), dvp);
    });
}

#endif  // QKV_X86

}  // namespace

extern "C" {

// Whether this CPU (and this build) runs qkv_prefill_bf16: AVX-512 with AVX512_BF16.
int qkv_bf16_products(void) {
#if QKV_X86
    return cpu_has_bf16() ? 1 : 0;
#else
    return 0;
#endif
}

// q float32 (bfloat16 values), k and v bfloat16 (uint16 bits), out and lse float32; the
// fields as for qkv_prefill_f32 (offsets and strides in elements of each operand's own type;
// no mask or bias; gemm and the block sizes unused). 0 done; 1 no memory; 2 bad arguments, or
// a CPU without AVX512_BF16.
int qkv_prefill_bf16(const qkv_prefill_args* a) {
    if (!a || a->L < 1 || a->S < 0 || a->d < 2 || a->d % 2 || a->dv < 1 || a->mask || a->bias ||
        a->S >= (int64_t(1) << 31))
        return 2;
#if QKV_X86
    if (!cpu_has_bf16()) return 2;
    return run_bf16(*a);
#else
    return 2;
#endif
}

}  // extern "C"

// What the bfloat16 kernels (forward_bf16.cpp, backward_bf16.cpp) share: AVX512_BF16's
// vdpbf16ps as one generic tile step, pair packing, the vector exponential.
//
// vdpbf16ps adds to each float32 lane two bfloat16 products, exactly: a[2i]·b[2i] + a[2i+1]·b[2i+1].
// A product of two matrices is written as sums over pairs of the inner axis: one operand
// holds, for each pair p, a vector of 64 lanes of pair words (two bfloat16 in 32 bits; the
// lanes are the output's columns), the other is read as it lies: its pair word for output row i
// and pair p is broadcast. So
//
//     out[i][lanes] (+)= Σ_p  A[p][lanes] · B(i, p)          (dp_step)
//
// with 6 rows x 4 vectors of accumulators held in registers over all pairs.

#pragma once

#include <cstdlib>

#include "common.h"

#if QKV_X86
#include <immintrin.h>

namespace {

constexpr int64_t LANES = 64;  // the output lanes of one tile step: 4 vectors of 16
constexpr int LV = 4;
constexpr int NI_MAX = 6;  // output rows per tile step

// float32 -> bfloat16 bits, rounding to nearest even (NaN stays NaN).
QKV_INLINE uint32_t bf16_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// How a tile step starts its accumulators: from 0, from out, or from out times a factor per
// lane (the online softmax's rescaling).
enum Start { FROM_ZERO, FROM_OUT, FROM_SCALED };

// out[i * out_is + lanes] for rows i < NI (see the top of the file): A's pair p at
// a + p * a_ps (64 lanes, 64-byte aligned), B's pair word for row i and pair p at the
// bfloat16 elements b + i * b_is + p * b_ps (any alignment).
template <int NI>
QKV_BF16 QKV_INLINE void dp_step(const uint32_t* __restrict a, int64_t a_ps,
                                 const uint16_t* __restrict b, int64_t b_is, int64_t b_ps,
                                 int64_t pairs, float* __restrict out, int64_t out_is, Start start,
                                 const float* __restrict factor) {
    __m512 acc[NI][LV];
    __m512 f[LV];
    if (start == FROM_SCALED)
        for (int r = 0; r < LV; ++r) f[r] = _mm512_load_ps(factor + 16 * r);
    for (int i = 0; i < NI; ++i)
        for (int r = 0; r < LV; ++r) {
            if (start == FROM_ZERO) {
                acc[i][r] = _mm512_setzero_ps();
            } else {
                acc[i][r] = _mm512_load_ps(out + i * out_is + 16 * r);
                if (start == FROM_SCALED) acc[i][r] = _mm512_mul_ps(acc[i][r], f[r]);
            }
        }
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh x[LV];
        for (int r = 0; r < LV; ++r) x[r] = (__m512bh)_mm512_load_si512(a + p * a_ps + 16 * r);
        for (int i = 0; i < NI; ++i) {
            uint32_t w;
            std::memcpy(&w, b + i * b_is + p * b_ps, 4);
            const __m512bh y = (__m512bh)_mm512_set1_epi32(int(w));
            for (int r = 0; r < LV; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], x[r], y);
        }
    }
    for (int i = 0; i < NI; ++i)
        for (int r = 0; r < LV; ++r) _mm512_store_ps(out + i * out_is + 16 * r, acc[i][r]);
}

// dp_step over rows [0, rows): NI_MAX at a time, then the rest.
QKV_BF16 void dp_rows(int64_t rows, const uint32_t* a, int64_t a_ps, const uint16_t* b,
                      int64_t b_is, int64_t b_ps, int64_t pairs, float* out, int64_t out_is,
                      Start start, const float* factor) {
    int64_t i = 0;
    for (; i + NI_MAX <= rows; i += NI_MAX)
        dp_step<NI_MAX>(a, a_ps, b + i * b_is, b_is, b_ps, pairs, out + i * out_is, out_is,
                        start, factor);
    switch (rows - i) {
        case 1: dp_step<1>(a, a_ps, b + i * b_is, b_is, b_ps, pairs, out + i * out_is, out_is, start, factor); break;
        case 2: dp_step<2>(a, a_ps, b + i * b_is, b_is, b_ps, pairs, out + i * out_is, out_is, start, factor); break;
        case 3: dp_step<3>(a, a_ps, b + i * b_is, b_is, b_ps, pairs, out + i * out_is, out_is, start, factor); break;
        case 4: dp_step<4>(a, a_ps, b + i * b_is, b_is, b_ps, pairs, out + i * out_is, out_is, start, factor); break;
        case 5: dp_step<5>(a, a_ps, b + i * b_is, b_is, b_ps, pairs, out + i * out_is, out_is, start, factor); break;
        default: break;
    }
}

// Rows 2p and 2p + 1 of a (n x cols) bfloat16 matrix (row stride rs) as pair words:
// out[p * out_ps + c] = (x[2p][c], x[2p + 1][c]), for p < ceil(n / 2) and c < cols (an odd n's
// last row pairs with 0; words from cols up to the next multiple of 32 are 0).
QKV_BF16 void pack_row_pairs(const uint16_t* x, int64_t rs, int64_t n, int64_t cols,
                             int64_t out_ps, uint32_t* out) {
    static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                        37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                        11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i ilo = _mm512_loadu_si512(lo_idx);
    const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
    for (int64_t p = 0; p < (n + 1) / 2; ++p) {
        const uint16_t* a = x + 2 * p * rs;
        const bool has_b = 2 * p + 1 < n;
        for (int64_t c = 0; c < cols; c += 32) {
            const __mmask32 m = cols - c >= 32 ? ~__mmask32(0) : (__mmask32(1) << (cols - c)) - 1;
            const __m512i u = _mm512_maskz_loadu_epi16(m, a + c);
            const __m512i w = has_b ? _mm512_maskz_loadu_epi16(m, a + rs + c) : _mm512_setzero_si512();
            _mm512_storeu_si512(out + p * out_ps + c, _mm512_permutex2var_epi16(u, ilo, w));
            _mm512_storeu_si512(out + p * out_ps + c + 16, _mm512_permutex2var_epi16(u, ihi, w));
        }
    }
}

// Two float32 vectors (pair members a and b, 16 lanes each) as 16 pair words (a low).
QKV_BF16 QKV_INLINE __m512i pair_words(__m512 a, __m512 b) {
    static const uint16_t mix_idx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                         21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                         11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a's 16 low, b's 16 high
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(mix_idx), both);
}

// exp(x) for x <= 0 in the 16 lanes of x: exp_neg<float> of common.h (the same reduction and
// polynomial, so the same numbers), written with AVX-512 operations; 2^n by vscalefps.
QKV_BF16 QKV_INLINE __m512 exp_lanes(__m512 x) {
    const __m512 low = _mm512_set1_ps(-87.0f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);  // NaN: false, stays NaN
    x = _mm512_mask_blend_ps(under, x, low);
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 n =
        _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic), magic);
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

// A block of memory carved into 64-byte aligned pieces, freed as one.
struct Arena {
    void* mem = nullptr;
    char* next = nullptr;
    Arena() = default;
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;
    ~Arena() { std::free(mem); }
    bool make(size_t bytes) {
        mem = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
        next = static_cast<char*>(mem);
        return mem != nullptr;
    }
    template <typename T>
    T* take(int64_t n) {
        T* p = reinterpret_cast<T*>(next);
        next += (size_t(n) * sizeof(T) + 63) / 64 * 64;
        return p;
    }
};

}  // namespace

// call (an int status) where this CPU runs the bfloat16 kernels, else 2.
#define QKV_ON_BF16(call) (cpu_has_bf16() ? (call) : 2)
#else
#define QKV_ON_BF16(call) 2
#endif  // QKV_X86

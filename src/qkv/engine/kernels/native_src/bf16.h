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
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

// AMX (Advanced Matrix Extensions): eight tile registers of 16 rows x 64 bytes and
// tdpbf16ps, which adds to a 16 x 16 float32 tile C the products of a 16 x 32 bfloat16 tile A
// (rows as they lie in memory) and a tile B of 16 rows of pair words (the form vdpbf16ps
// multiplies: B's row p holds pair p of the inner axis for 16 columns), each pair's two
// products summed exactly as vdpbf16ps sums them. One tdpbf16ps is 8192 products; on a CPU
// with AMX it runs about 16 times the rate of AVX-512's vdpbf16ps.
// Compilers before GCC 11 and Clang 13 have no AMX intrinsics: there the library builds
// without the road (cpu_has_amx() false, the tile functions empty).
#ifndef QKV_HAS_AMX
#if (defined(__clang__) && __clang_major__ >= 13) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define QKV_HAS_AMX 1
#else
#define QKV_HAS_AMX 0
#endif
#endif
#if QKV_HAS_AMX
#define QKV_AMX                                                                              \
    __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,amx-tile,amx-bf16," \
                          "fma,prefer-vector-width=512")))
#else
#define QKV_AMX QKV_BF16
#endif

// The clone codes (qkv_prefill_args.isa) of the bfloat16 kernels above AVX-512's 3: AVX-512
// with AVX512_BF16's vdpbf16ps, and with AMX's tiles where the CPU has them (0 asks for the
// widest too).
constexpr int64_t BF16_ISA = 4;
constexpr int64_t AMX_ISA = 5;

// Whether this CPU and its OS run the QKV_AMX code: AMX-TILE and AMX-BF16 (CPUID leaf 7 EDX
// bits 24 and 22), the tile state enabled in XCR0 (bits 17 and 18), and, on Linux, this
// process granted the tile data (arch_prctl ARCH_REQ_XCOMP_PERM; without it the first tile
// instruction faults). Asked once per process.
inline bool cpu_has_amx() {
    static const bool ok = [] {
        if (!QKV_HAS_AMX || !cpu_has_bf16()) return false;
        unsigned a = 0, b = 0, c = 0, d = 0;
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;
        unsigned lo = 0, hi = 0;
        __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if (((lo >> 17) & 3u) != 3u) return false;
#if defined(__linux__)
        return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                       18 /* XFEATURE_XTILEDATA */) == 0;
#else
        return false;
#endif
    }();
    return ok;
}

// GCC's tile intrinsics are statements of inline assembly that do not tell the compiler they
// read or write memory: this barrier orders them against the plain loads and stores around.
#define QKV_TILE_FENCE() __asm__ __volatile__("" ::: "memory")

// Every tile register 16 rows x 64 bytes (palette 1), for the calling thread.
#if QKV_HAS_AMX
QKV_AMX inline void tiles_begin() {
    struct alignas(64) Config {
        uint8_t palette, start;
        uint8_t reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; ++i) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    QKV_TILE_FENCE();  // (GCC's ldtilecfg tells of reading 8 of its 64 bytes)
    _tile_loadconfig(&cfg);
}

// The calling thread's tiles back to their initial state (a thread holding tiles saves 8 KiB
// more at every switch).
QKV_AMX inline void tiles_end() {
    _tile_release();
}
#else
inline void tiles_begin() {}
inline void tiles_end() {}
#endif

// out (16 x 16 words, row stride os) = the transpose of in (16 x 16 words, row stride is).
QKV_BF16 inline void transpose_words16(const uint32_t* in, int64_t is, uint32_t* out,
                                      int64_t os) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(in + i * is);
    for (int i = 0; i < 16; i += 4) {  // in each 128-bit lane, a 4 x 4 transpose
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        t[i + 2] = _mm512_unpacklo_epi32(r[i + 2], r[i + 3]);
        t[i + 3] = _mm512_unpackhi_epi32(r[i + 2], r[i + 3]);
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);      // column 4L of rows i..i+3, lane L
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);  // column 4L + 1
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; ++k) {  // the lanes: out row 4L + k = lane L of r[k], r[4 + k], ...
        const __m512i v0 = _mm512_shuffle_i32x4(r[k], r[4 + k], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i v1 = _mm512_shuffle_i32x4(r[k], r[4 + k], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i v3 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], _MM_SHUFFLE(3, 2, 3, 2));
        _mm512_storeu_si512(out + k * os, _mm512_shuffle_i32x4(v0, v2, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_storeu_si512(out + (4 + k) * os,
                            _mm512_shuffle_i32x4(v0, v2, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm512_storeu_si512(out + (8 + k) * os,
                            _mm512_shuffle_i32x4(v1, v3, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_storeu_si512(out + (12 + k) * os,
                            _mm512_shuffle_i32x4(v1, v3, _MM_SHUFFLE(3, 1, 3, 1)));
    }
}

// call (an int status) where this CPU runs the bfloat16 kernels, else 2.
#define QKV_ON_BF16(call) (cpu_has_bf16() ? (call) : 2)
#else
#define QKV_ON_BF16(call) 2
#endif  // QKV_X86

// The library's own tile products for the fused prefill (forward.cpp), in place of a BLAS
// call per tile: C (m x n) = A · B, or C += A · B; A (m x k) and B (k x n) row-major.
//
// Short rows and small heads make many small products (a 16-row block against 16 keys of
// d = 64 is 16k multiply-adds): there BLAS's cost per call (argument checks, buffers, its own
// packing) is most of the time. This is a register-blocked micro-kernel with no per-call setup:
// MR rows of C by NR vectors of W lanes held in registers while the k loop broadcasts one
// element of A per row and loads NR vectors of B's row. Written once with GCC's vector types
// and compiled in each clone (common.h) with that clone's lane width and register count:
//
//     baseline (SSE2, 16 registers)    W = 4 floats, 4 rows x 2 vectors
//     AVX2 + FMA (16 registers)        W = 8 floats, 6 rows x 2 vectors
//     AVX-512 (32 registers)           W = 16 floats, 6 rows x 4 vectors, then 8 x 2
//
// (doubles: half the lanes). n must be a multiple of W (the caller pads B's rows and C's
// with zeros, or reads them where they are that wide); m and k are any. Every product is
// summed in the order of k, as one row of a BLAS product may be.

#pragma once

#include <cstring>
#include <type_traits>

#include "common.h"

#if QKV_X86
#include <immintrin.h>
#endif

namespace {

// The operands of one product; the caller's pointers are float or double as the clone's.
struct ProdArgs {
    int64_t m, n, k;
    const void* a;
    int64_t lda;
    const void* b;
    int64_t ldb;
    void* c;
    int64_t ldc;
    int64_t accumulate;  // 0: C = A · B; 1: C += A · B
};

template <typename T, int W>
struct Lanes {
    typedef T type __attribute__((vector_size(W * sizeof(T))));
};

// Lane comparisons of GCC's vector types (`a > b`, `a >= b`, `a < b`): each lane all ones
// where it holds, else zeros, as the operators give them, NaN comparing false. GCC compiles a
// 64-byte vector's comparison written in a template without a clone's target lane by lane, a
// branch per lane, even once the template is inlined into the AVX-512 clone (whose
// comparisons give mask registers): there the softmax step took three quarters of a short
// prefill's time, 3 to 4 times the AVX2 clone's. Those are written with the comparison's
// builtin, which GCC checks against the target only where it is finally compiled, the clone.
enum { LANES_GT, LANES_GE, LANES_LT };

// x's bytes as a To (of x's size)
template <typename To, typename From>
QKV_INLINE To same_bits(const From& x) {
    static_assert(sizeof(To) == sizeof(From), "the same width");
    To out;
    std::memcpy(&out, &x, sizeof(To));
    return out;
}

template <int OP, typename V>
QKV_INLINE auto lanes_cmp(V a, V b) {
    typedef decltype(a > b) M;
#if QKV_X86
    if constexpr (sizeof(V) == 64) {
        typedef std::remove_cv_t<std::remove_reference_t<decltype(a[0])>> E;
        typedef float F32 __attribute__((vector_size(64)));
        typedef double F64 __attribute__((vector_size(64)));
        typedef int I32 __attribute__((vector_size(64)));
        typedef long long I64 __attribute__((vector_size(64)));
        const unsigned short all16 = 0xFFFF;
        const unsigned char all8 = 0xFF;
        if constexpr (std::is_floating_point<E>::value) {
            constexpr int imm = OP == LANES_GT ? 30 : OP == LANES_GE ? 29 : 17;  // _CMP_*_OQ
            if constexpr (sizeof(E) == 4)
                return same_bits<M>(__builtin_ia32_cvtmask2d512(__builtin_ia32_cmpps512_mask(
                    same_bits<F32>(a), same_bits<F32>(b), imm, all16, 4)));
            else
                return same_bits<M>(__builtin_ia32_cvtmask2q512(__builtin_ia32_cmppd512_mask(
                    same_bits<F64>(a), same_bits<F64>(b), imm, all8, 4)));
        } else {
            constexpr int imm = OP == LANES_GT ? 6 : OP == LANES_GE ? 5 : 1;  // _MM_CMPINT_*
            if constexpr (sizeof(E) == 4)
                return same_bits<M>(__builtin_ia32_cvtmask2d512(
                    __builtin_ia32_cmpd512_mask(same_bits<I32>(a), same_bits<I32>(b), imm, all16)));
            else
                return same_bits<M>(__builtin_ia32_cvtmask2q512(
                    __builtin_ia32_cmpq512_mask(same_bits<I64>(a), same_bits<I64>(b), imm, all8)));
        }
    }
#endif
    if constexpr (OP == LANES_GT)
        return M(a > b);
    else if constexpr (OP == LANES_GE)
        return M(a >= b);
    else
        return M(a < b);
}

// Rows [0, MR) and vectors [0, NR) of a block of C (MR, NR compile-time: in registers).
// (No scale factor: one more register held through the k loop spills a vector of B on AVX2.)
template <typename T, int W, int MR, int NR, bool Acc>
QKV_INLINE void micro_block(int64_t k, const T* __restrict a, int64_t lda, const T* __restrict b,
                            int64_t ldb, T* __restrict c, int64_t ldc) {
    typedef typename Lanes<T, W>::type V;
    V acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int r = 0; r < NR; ++r) acc[i][r] = V{};
    for (int64_t p = 0; p < k; ++p) {
        V bv[NR];
        for (int r = 0; r < NR; ++r) std::memcpy(&bv[r], b + p * ldb + r * W, sizeof(V));
        for (int i = 0; i < MR; ++i) {
            const T x = a[i * lda + p];
            for (int r = 0; r < NR; ++r) acc[i][r] += x * bv[r];
        }
    }
    for (int i = 0; i < MR; ++i) {
        for (int r = 0; r < NR; ++r) {
            V out = acc[i][r];
            if (Acc) {
                V old;
                std::memcpy(&old, c + i * ldc + r * W, sizeof(V));
                out += old;
            }
            std::memcpy(c + i * ldc + r * W, &out, sizeof(V));
        }
    }
}

// The rows [0, m) of one strip of NR vectors: blocks of MR rows, then the remainder rows
// (at most one block of 4 and one of 1 to 3, each its own compile-time size).
template <typename T, int W, int MR, int NR, bool Acc>
QKV_INLINE void strip(int64_t m, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
                      T* c, int64_t ldc) {
    int64_t i = 0;
    for (; i + MR <= m; i += MR)
        micro_block<T, W, MR, NR, Acc>(k, a + i * lda, lda, b, ldb, c + i * ldc, ldc);
    if (MR > 4 && i + 4 <= m) {
        micro_block<T, W, 4, NR, Acc>(k, a + i * lda, lda, b, ldb, c + i * ldc, ldc);
        i += 4;
    }
    a += i * lda;
    c += i * ldc;
    switch (m - i) {  // MR is at most 8: 0 to 3 rows are left
        case 3: micro_block<T, W, 3, NR, Acc>(k, a, lda, b, ldb, c, ldc); break;
        case 2: micro_block<T, W, 2, NR, Acc>(k, a, lda, b, ldb, c, ldc); break;
        case 1: micro_block<T, W, 1, NR, Acc>(k, a, lda, b, ldb, c, ldc); break;
        default: break;
    }
}

// C = A · B (+ C): strips of 4 vectors of columns MR4 rows at a time (MR4 > 0: the AVX-512
// clone's 32 registers hold 6 x 4 accumulators), then of 2 vectors MR rows at a time, then
// one of 1 vector. Measured on an AVX-512 CPU (one thread, operands in L1/L2, aligned), a
// tile's scores (512 x 768 keys, d = 64) and its values (512 x 64, 768 keys): 8 x 2 blocks
// 150-159 GFLOP/s, 6 x 4 160-170, of an FMA peak of 206-212 (8 x 2 reads a vector of B per 8
// FMAs, 6 x 4 one per 6, and broadcasts A's elements 8 per 16 FMAs against 6 per 24).
template <typename T, int W, int MR, int MR4, bool Acc>
QKV_INLINE void product(const ProdArgs& p) {
    const T* a = static_cast<const T*>(p.a);
    const T* b = static_cast<const T*>(p.b);
    T* c = static_cast<T*>(p.c);
    int64_t j = 0;
    if constexpr (MR4 > 0) {
        for (; j + 4 * W <= p.n; j += 4 * W)
            strip<T, W, MR4, 4, Acc>(p.m, p.k, a, p.lda, b + j, p.ldb, c + j, p.ldc);
    }
    for (; j + 2 * W <= p.n; j += 2 * W)
        strip<T, W, MR, 2, Acc>(p.m, p.k, a, p.lda, b + j, p.ldb, c + j, p.ldc);
    if (j < p.n) strip<T, W, MR, 1, Acc>(p.m, p.k, a, p.lda, b + j, p.ldb, c + j, p.ldc);
}

template <typename T, int W, int MR, int MR4>
QKV_INLINE void tile_product(const ProdArgs& p) {
    if (p.accumulate)
        product<T, W, MR, MR4, true>(p);
    else
        product<T, W, MR, MR4, false>(p);
}

#define QKV_PRODUCT_CLONE(attr, clone, W32, MR32, W64, MR64, MR4)                                 \
    attr void prod_##clone##_f32(const ProdArgs& p) { tile_product<float, W32, MR32, MR4>(p); }  \
    attr void prod_##clone##_f64(const ProdArgs& p) { tile_product<double, W64, MR64, MR4>(p); }
QKV_PRODUCT_CLONE(, base, 4, 4, 2, 4, 0)
#if QKV_X86
QKV_PRODUCT_CLONE(QKV_AVX2, avx2, 8, 6, 4, 6, 0)
QKV_PRODUCT_CLONE(QKV_AVX512, avx512, 16, 8, 8, 8, 6)
#endif
#undef QKV_PRODUCT_CLONE

typedef void (*prod_t)(const ProdArgs&);

// The clone's float32 FMA peak, the measure the products are judged by (bench/machine.py):
// `rounds` rounds of CHAINS independent vector FMAs of W lanes, held in registers (more chains
// than an FMA's latency times the FMAs a core starts per cycle, so none waits), the FLOP done
// returned. No memory is read in the loop.
constexpr int FMA_CHAINS = 12;
template <int W>
QKV_INLINE double fma_rounds(int64_t rounds) {
    typedef typename Lanes<float, W>::type V;
    V acc[FMA_CHAINS];
    for (int i = 0; i < FMA_CHAINS; ++i) acc[i] = V{} + float(i) * 1e-3f;
    V a = V{} + 0.9999999f, b = V{} + 1e-7f;
    for (int64_t t = 0; t < rounds; ++t) {
        for (int i = 0; i < FMA_CHAINS; ++i) acc[i] = acc[i] * a + b;
        __asm__ volatile("" : "+x"(a));  // (a stays a register, not folded into a constant)
    }
    float kept = 0;  // the results used, so the loop is not removed
    for (int i = 0; i < FMA_CHAINS; ++i)
        for (int u = 0; u < W; ++u) kept += acc[i][u];
    __asm__ volatile("" : : "x"(kept));
    return 2.0 * W * FMA_CHAINS * double(rounds);
}

typedef double (*fma_t)(int64_t);
double fma_base(int64_t n) { return fma_rounds<4>(n); }
#if QKV_X86
QKV_AVX2 double fma_avx2(int64_t n) { return fma_rounds<8>(n); }
QKV_AVX512 double fma_avx512(int64_t n) { return fma_rounds<16>(n); }
#endif

// A piece of keys packed for the scores' product: rows [0, n) of k (row stride k_rs, d
// columns) times scale into kt (d x lds) transposed, its columns [n, lds) zero. The scale is
// applied here, where every key is read and written anyway, so the scores' product reads the
// queries where they are (a scaled copy of them cost as much as this packing on short rows).
struct PackArgs {
    const void* k;
    int64_t k_rs, n, d;
    void* kt;
    int64_t lds;
    double scale;
};

// The transposition's blocks of B x B (B = 8: AVX2, 4: SSE), then the edges one by one.
template <typename T, int B, typename Block>
QKV_INLINE void pack_keys(const PackArgs& p, const Block& block) {
    const T* k = static_cast<const T*>(p.k);
    T* kt = static_cast<T*>(p.kt);
    const T scale = T(p.scale);
    const int64_t n = p.n, d = p.d, lds = p.lds, nb = B > 1 ? n / B * B : 0;
    const int64_t db = B > 1 ? d / B * B : 0;
    for (int64_t j = 0; j < nb; j += B)
        for (int64_t c = 0; c < db; c += B)
            block(k + j * p.k_rs + c, p.k_rs, kt + c * lds + j, lds, scale);
    for (int64_t j = 0; j < nb; ++j)  // the columns past the blocks
        for (int64_t c = db; c < d; ++c) kt[c * lds + j] = k[j * p.k_rs + c] * scale;
    for (int64_t c = 0; c < d; ++c) {  // the keys past the blocks, and the zero padding
        T* row = kt + c * lds;
        for (int64_t j = nb; j < n; ++j) row[j] = k[j * p.k_rs + c] * scale;
        for (int64_t j = n; j < lds; ++j) row[j] = 0;
    }
}

template <typename T>
QKV_INLINE void pack_plain(const PackArgs& p) {
    pack_keys<T, 1>(p, [](const T*, int64_t, T*, int64_t, T) {});
}

#if QKV_X86
// 8 x 8 floats times scale: rows of src (stride ss) become rows of dst (stride ds) as its
// columns.
QKV_AVX2 inline void transpose8(const float* src, int64_t ss, float* dst, int64_t ds,
                                float scale) {
    __m256 r[8], t[8], u[8];
    const __m256 f = _mm256_set1_ps(scale);
    for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(_mm256_loadu_ps(src + i * ss), f);
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
        u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + i * ds, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ds, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

// 4 x 4 floats times scale (SSE, in every x86-64 CPU).
inline void transpose4(const float* src, int64_t ss, float* dst, int64_t ds, float scale) {
    const __m128 f = _mm_set1_ps(scale);
    __m128 r0 = _mm_mul_ps(_mm_loadu_ps(src), f), r1 = _mm_mul_ps(_mm_loadu_ps(src + ss), f);
    __m128 r2 = _mm_mul_ps(_mm_loadu_ps(src + 2 * ss), f);
    __m128 r3 = _mm_mul_ps(_mm_loadu_ps(src + 3 * ss), f);
    _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
    _mm_storeu_ps(dst, r0);
    _mm_storeu_ps(dst + ds, r1);
    _mm_storeu_ps(dst + 2 * ds, r2);
    _mm_storeu_ps(dst + 3 * ds, r3);
}

void pack_base_f32(const PackArgs& p) { pack_keys<float, 4>(p, transpose4); }
QKV_AVX2 void pack_avx2_f32(const PackArgs& p) { pack_keys<float, 8>(p, transpose8); }
QKV_AVX512 void pack_avx512_f32(const PackArgs& p) { pack_keys<float, 8>(p, transpose8); }
void pack_base_f64(const PackArgs& p) { pack_plain<double>(p); }
QKV_AVX2 void pack_avx2_f64(const PackArgs& p) { pack_plain<double>(p); }
QKV_AVX512 void pack_avx512_f64(const PackArgs& p) { pack_plain<double>(p); }
#else
void pack_base_f32(const PackArgs& p) { pack_plain<float>(p); }
void pack_base_f64(const PackArgs& p) { pack_plain<double>(p); }
#endif

typedef void (*pack_t)(const PackArgs&);

// The product of the clone isa runs, its key packing, and its lane width in T (what n must be
// a multiple of).
struct Products {
    prod_t run;
    pack_t pack;
    int64_t width;
};

template <typename T>
Products pick_products(int isa) {
    const int64_t lanes = isa == 3 && QKV_X86 ? 64 : isa == 2 && QKV_X86 ? 32 : 16;
    const int64_t width = lanes / int64_t(sizeof(T));
    if (sizeof(T) == 4)
        return {pick_clone<prod_t>(isa, QKV_CLONES(prod, f32)),
                pick_clone<pack_t>(isa, QKV_CLONES(pack, f32)), width};
    return {pick_clone<prod_t>(isa, QKV_CLONES(prod, f64)),
            pick_clone<pack_t>(isa, QKV_CLONES(pack, f64)), width};
}

}  // namespace

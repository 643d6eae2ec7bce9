// K and V stored as 16-bit floats, widened to float32 rows at a time by the float32 prefill,
// packed walk and backward (forward.cpp, backward.cpp): each work item widens the keys it
// reads into its own buffers, so no float32 copy of the whole K/V is made.

#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

#if QKV_X86
#include <immintrin.h>
#endif

namespace {

// K and V stored as 16-bit floats (abi.h's KV_BF16 and KV_F16), widened to float32 a task's visible
// keys at a time into the worker's buffers, exactly (every 16-bit value is a float32), for the
// float32 tile products. Integer operations only, so that each clone vectorizes them (GCC converts
// _Float16 one value at a time): a float16 normal moves its fields into float32's with the exponent
// bias raised by 112, a subnormal is its mantissa times 2^-24, infinities and NaN keep their kind.
template <int FORMAT>
QKV_INLINE void widen_rows_body(const uint16_t* __restrict src, int64_t rs, int64_t rows,
                                int64_t cols, float* __restrict dst) {
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* __restrict x = src + r * rs;
        uint32_t* __restrict y = reinterpret_cast<uint32_t*>(dst + r * cols);
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) {
            const uint32_t w = x[c];
            if (FORMAT == KV_BF16) {
                y[c] = w << 16;
            } else {
                const uint32_t sign = (w & 0x8000u) << 16, em = w & 0x7FFFu, e = em >> 10;
                const uint32_t normal = sign | ((em << 13) + (112u << 23));
                const uint32_t special = sign | 0x7F800000u | ((em & 0x3FFu) << 13);
                const float sub = float(int32_t(em)) * 0x1p-24f;
                uint32_t subu;
                std::memcpy(&subu, &sub, 4);
                y[c] = e == 0 ? (subu | sign) : e == 31 ? special : normal;
            }
        }
    }
}

typedef void (*widen_t)(const uint16_t*, int64_t, int64_t, int64_t, float*);
#define QKV_WIDEN(attr, clone)                                                                \
    attr void widen_##clone##_bf16(const uint16_t* s, int64_t rs, int64_t n, int64_t c,       \
                                   float* d) {                                                \
        widen_rows_body<KV_BF16>(s, rs, n, c, d);                                             \
    }                                                                                         \
    attr void widen_##clone##_f16(const uint16_t* s, int64_t rs, int64_t n, int64_t c,        \
                                  float* d) {                                                 \
        widen_rows_body<KV_F16>(s, rs, n, c, d);                                              \
    }
QKV_WIDEN(, base)
#if QKV_X86
QKV_WIDEN(QKV_AVX2, avx2)
QKV_WIDEN(QKV_AVX512, avx512)
#endif

widen_t pick_widen(int isa, int format) {
    if (format == KV_BF16) return pick_clone<widen_t>(isa, QKV_CLONES(widen, bf16));
    return pick_clone<widen_t>(isa, QKV_CLONES(widen, f16));
}

// The float32 prefill's output narrowed back to the 16-bit form its q came in (qkv_prefill_bf16,
// qkv_prefill_f16): rows x cols contiguous floats to as many 16-bit values, rounding to nearest
// even as NumPy (float16) and ml_dtypes (bfloat16) do, so that the bits equal the widened call's
// output narrowed in Python. Integer operations and one float addition (float16's subnormals,
// rounded by the addition itself), so that each clone vectorizes them. NaN becomes a quiet NaN
// of its sign (the caller does not keep a call with an output that is not finite).
template <int FORMAT>
QKV_INLINE void narrow_rows_body(const float* __restrict src, int64_t n,
                                 uint16_t* __restrict dst) {
    const uint32_t* __restrict x = reinterpret_cast<const uint32_t*>(src);
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) {
        const uint32_t u = x[c];
        if (FORMAT == KV_BF16) {
            const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
            const uint32_t even = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
            dst[c] = uint16_t(nan ? ((u >> 16) | 0x40u) : even);
        } else {
            const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
            // at least 2^16 (infinite in float16 once rounded) or not finite
            const uint32_t big = a > 0x7F800000u ? 0x7E00u : 0x7C00u;
            // below 2^-14: float16's subnormals, rounded by adding 2^-1 (whose last place is
            // float16's smallest subnormal, 2^-24)
            float t;
            std::memcpy(&t, &a, 4);
            t += 0.5f;
            uint32_t tu;
            std::memcpy(&tu, &t, 4);
            const uint32_t sub = tu - 0x3F000000u;
            // normal: the exponent rebiased by -112, the mantissa rounded to 10 bits
            const uint32_t normal = (a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
            const uint32_t h = a >= 0x47800000u ? big : a < 0x38800000u ? sub : normal;
            dst[c] = uint16_t(h | sign);
        }
    }
}

#if QKV_X86
// float16 in the x86 clones: F16C's conversion, which rounds to nearest even as IEEE 754 says
// (subnormals included), 8 values at a time; GCC leaves narrow_rows_body<KV_F16> scalar, and it
// then took a fifth of a short call's time.
QKV_AVX2 void narrow_f16c(const float* __restrict s, int64_t n, uint16_t* __restrict d) {
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m128i h =
            _mm256_cvtps_ph(_mm256_loadu_ps(s + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + c), h);
    }
    narrow_rows_body<KV_F16>(s + c, n - c, d + c);
}
#endif

typedef void (*narrow_t)(const float*, int64_t, uint16_t*);
#define QKV_NARROW(attr, clone, f16)                                                          \
    attr void narrow_##clone##_bf16(const float* s, int64_t n, uint16_t* d) {                 \
        narrow_rows_body<KV_BF16>(s, n, d);                                                   \
    }                                                                                         \
    attr void narrow_##clone##_f16(const float* s, int64_t n, uint16_t* d) { f16(s, n, d); }
QKV_NARROW(, base, narrow_rows_body<KV_F16>)
#if QKV_X86
QKV_NARROW(QKV_AVX2, avx2, narrow_f16c)
QKV_NARROW(QKV_AVX512, avx512, narrow_f16c)
#endif

// ([[maybe_unused]]: the backward's unit includes this header and narrows nothing)
[[maybe_unused]] narrow_t pick_narrow(int isa, int format) {
    if (format == KV_BF16) return pick_clone<narrow_t>(isa, QKV_CLONES(narrow, bf16));
    return pick_clone<narrow_t>(isa, QKV_CLONES(narrow, f16));
}

}  // namespace

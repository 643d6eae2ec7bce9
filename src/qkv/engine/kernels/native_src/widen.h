// K and V stored as 16-bit floats, widened to float32 rows at a time by the float32 prefill,
// packed walk and backward (forward.cpp, backward.cpp): each work item widens the keys it
// reads into its own buffers, so no float32 copy of the whole K/V is made.

#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

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

}  // namespace

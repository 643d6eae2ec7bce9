// Decode for qkv: a few query rows per kv head (a model's decoding step: group · L rows, L usually 1)
// against a long run of cached keys. Memory-bound, so no BLAS: each work item streams one
// piece of one kv head's keys and values once, the rows' dot products taken while a key row is
// in L1, with the online softmax of the prefill kernel (running max, sum, rescaled
// accumulator). The pieces of a head are merged at the end as qkv.merge merges parts:
//
//     M = max_i m_i,  l = Σ_i l_i · exp(m_i − M),  out = Σ_i acc_i · exp(m_i − M) / l,
//     lse = M + log l                                  (no key at all: out 0, lse −inf)
//
// Threads: the items go to the team of an OpenMP runtime the process already runs (the
// caller passes its GOMP_parallel: PyTorch's, between whose operations a model calls this, so
// that the same threads that just ran PyTorch's operation run these, with no second team
// competing for the cores), else to native threads started for the call.

#include "common.h"

#if QKV_X86
#include <immintrin.h>
#endif

namespace {

constexpr int64_t DECODE_BK = 64;  // keys per score block
// keys per part of a block where a piece reads every kv head (pages: decode_piece_vec), a
// multiple of every clone's score tiles' keys
constexpr int64_t DECODE_PK = 16;

#define QKV_LAMBDA_INLINE __attribute__((always_inline))

// tanh(x) for the soft-capped scores, vectorisable: (1 - e)/(1 + e) with e = exp(-2|x|) from
// exp_neg, and for |x| < 1/16 (where 1 - e would lose digits) its Taylor series to x^9
// (the next term is below 1e-14 of x there). NaN stays NaN; tanh(±inf) = ±1.
template <typename T>
QKV_INLINE T tanh_capped(T x) {
    const T ax = x < 0 ? -x : x;
    const T e = exp_neg(T(-2) * ax);
    const T big = (T(1) - e) / (T(1) + e);
    const T x2 = ax * ax;
    const T small =
        ax * (T(1) + x2 * (T(-1) / 3 + x2 * (T(2) / 15 + x2 * (T(-17) / 315 + x2 * T(62) / 2835))));
    const T y = ax < T(0.0625) ? small : big;
    return x < 0 ? -y : y;
}

// Soft-capping of a block's scores s[r * DECODE_BK + j], j < n: c · tanh(s / c).
template <typename T>
QKV_INLINE void softcap_block(T* __restrict s, int64_t R, int64_t n, T c) {
    const T inv = T(1) / c;
    for (int64_t r = 0; r < R; ++r) {
        T* __restrict sr = s + r * DECODE_BK;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) sr[j] = c * tanh_capped(sr[j] * inv);
    }
}

// Query row r (< group · L) of kv head h of sequence b: row r % L of its head r / L.
template <typename T>
QKV_INLINE const T* query_row(const qkv_decode_args& a, int64_t b, int64_t h, int64_t r) {
    return static_cast<const T*>(a.q) + b * a.q_bs + (h * a.group + r / a.L) * a.q_hs +
           (r % a.L) * a.q_ls;
}

// A piece's start: the scaled query rows of kv head h of sequence b into qs (R x d), the rows'
// running max -inf, sum 0 and accumulators (R x dv) 0.
template <typename T>
QKV_INLINE void decode_start(const qkv_decode_args& a, int64_t b, int64_t h, int64_t d,
                             int64_t dv, T* __restrict qs, T* __restrict m, T* __restrict l,
                             T* __restrict acc) {
    const int64_t R = a.group * a.L;
    const T sc = T(a.scale);
    for (int64_t r = 0; r < R; ++r) {
        const T* qr = query_row<T>(a, b, h, r);
#pragma omp simd
        for (int64_t t = 0; t < d; ++t) qs[r * d + t] = qr[t] * sc;
        m[r] = -std::numeric_limits<T>::infinity();
        l[r] = 0;
        for (int64_t c = 0; c < dv; ++c) acc[r * dv + c] = 0;
    }
}

// One row's online-softmax step over a block's n scores sr, which become their weights
// exp(s - m): moves the running max *m and sum *l and returns the factor exp(m_old - m_new) by
// which the row's accumulator must be scaled. Scores all -inf (infinite inputs) make the row
// NaN, left to the caller (weights 0, factor 1).
template <typename T>
QKV_INLINE T decode_row_step(T* __restrict sr, int64_t n, T* __restrict m, T* __restrict l) {
    const T ninf = -std::numeric_limits<T>::infinity();
    const T mold = *m;
    const T mnew = std::max(mold, lane_max(sr, 0, n));
    if (mnew == ninf) {
        *l = std::numeric_limits<T>::quiet_NaN();
        for (int64_t j = 0; j < n; ++j) sr[j] = 0;
        return T(1);
    }
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
        const T p = exp_neg(sr[j] - mnew);
        sr[j] = p;
        sum += p;
    }
    const T alpha = mold == ninf ? T(0) : exp_neg(mold - mnew);
    *l = *l * alpha + sum;
    *m = mnew;
    return alpha;
}

// Row r's keys among the n of the block from key b0 of a sequence whose keys end at hi: all
// n, or (a.causal) those before its causal limit hi - (L - 1) + r % L (row r of a kv head is
// row r % L of its query head).
QKV_INLINE int64_t row_keys(const qkv_decode_args& a, int64_t hi, int64_t r, int64_t b0,
                            int64_t n) {
    if (!a.causal) return n;
    return std::max<int64_t>(0, std::min<int64_t>(n, hi - (a.L - 1) + r % a.L - b0));
}

// decode_row_step on the first nr of the block's n scores (row_keys), the weights of the others
// 0: a row that sees none of the block keeps its max and sum (factor 1).
template <typename T>
QKV_INLINE T decode_row_step_upto(T* __restrict sr, int64_t n, int64_t nr, T* __restrict m,
                                  T* __restrict l) {
    if (nr == n) return decode_row_step(sr, n, m, l);
    for (int64_t j = nr; j < n; ++j) sr[j] = 0;
    return nr > 0 ? decode_row_step(sr, nr, m, l) : T(1);
}

struct Bf16 {
    uint16_t bits;
};
struct F16 {
    uint16_t bits;
};
struct I8 {
    int8_t code;
};
struct E4m3 {
    uint8_t code;
};
// int8 codes read by the fast road (precision="fast"): the keys' products with the query
// rows rounded to int8, in int32 (score_tile_i8); the values as I8's.
struct I8q {
    int8_t code;
};

// Stored keys and values read as the compute type T, widened in registers: get() one value,
// line() the values of one 64-byte line of storage as per_line 64-byte vectors of T at out. A
// scaled format's values are its codes: the caller multiplies by the row's scale (once per
// key, not per value) times `unit`, what line() gives one code as (get() gives it as 1).
template <typename T, typename E>
struct Kv {  // stored as T
    static constexpr bool scaled = false;
    static constexpr int per_line = 1;
    static constexpr int order = 1;  // line()'s order: as stored (see strided_order)
    static constexpr bool direct = true;  // no line(): callers load registers from storage
    static constexpr T unit = 1;
    static QKV_INLINE T get(const E* p) { return *p; }
};

typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef float F32x16 __attribute__((vector_size(64)));

// a where the lanes of `where` are all ones, else b: with masks, not ?: (which GCC takes a
// lane at a time on clones narrower than the vector, as it does comparisons of 64-byte
// vectors there: callers build `where` by arithmetic shifts instead).
QKV_INLINE U32x16 pick(U32x16 where, U32x16 a, U32x16 b) {
    return (a & where) | (b & ~where);
}

// 16 stored 16-bit values from p as the zero-extended 32-bit lanes of a 64-byte vector.
QKV_INLINE U32x16 halves(const void* p) {
    typedef uint16_t H __attribute__((vector_size(32)));
    H h;
    std::memcpy(&h, p, sizeof(H));
    return __builtin_convertvector(h, U32x16);
}

template <>
struct Kv<float, Bf16> {  // float32's high 16 bits
    static constexpr bool scaled = false;
    static constexpr bool direct = false;
    static constexpr int per_line = 2;
    // line() gives its 32 values as two vectors, the even-numbered values then the odd
    // ones: the low and high halves of each 32-bit word, one operation each (the caller holds
    // its query rows and accumulators in that order, strided_order()).
    static constexpr int order = 2;
    static constexpr float unit = 1;
    static QKV_INLINE float get(const Bf16* p) {
        const uint32_t u = uint32_t(p->bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    static QKV_INLINE void line(const Bf16* p, void* out) {
        U32x16 w;
        std::memcpy(&w, p, sizeof(w));
        const U32x16 even = w << 16, odd = w & 0xFFFF0000u;
        std::memcpy(out, &even, 64);
        std::memcpy(static_cast<char*>(out) + 64, &odd, 64);
    }
};

// Rows x[r * n : (r + 1) * n) (r < rows; n a multiple of 16 · P) moved between the natural
// order and the order of a line<V>() that reads P values per 32-bit word: within each 16 · P
// values, vector p's lane i holds value P · i + p (to_strided), or back.
QKV_INLINE void strided_order(float* x, int64_t rows, int64_t n, int P, bool to_strided) {
    float t[64];
    for (int64_t i = 0; i < rows * n; i += 16 * P) {
        for (int p = 0; p < P; ++p) {
            for (int j = 0; j < 16; ++j) {
                if (to_strided)
                    t[16 * p + j] = x[i + P * j + p];
                else
                    t[P * j + p] = x[i + 16 * p + j];
            }
        }
        std::memcpy(x + i, t, sizeof(float) * size_t(16 * P));
    }
}

// IEEE half precision, widened with integer operations in the baseline clone (the AVX-512 and
// AVX2 clones use F16C's conversion: read_line below; GCC converts vectors of _Float16 one lane
// at a time): a normal value's fields move into a float32's with the exponent bias raised by
// 112; a subnormal one is its mantissa times 2^-24; infinities and NaN keep their kind.
template <>
struct Kv<float, F16> {
    static constexpr bool scaled = false;
    static constexpr bool direct = false;
    static constexpr int per_line = 2;
    static constexpr int order = 1;
    static constexpr float unit = 1;
    static QKV_INLINE float get(const F16* p) {
        _Float16 h;
        std::memcpy(&h, p, 2);
        return float(h);
    }
    static QKV_INLINE F32x16 vec(const F16* p) {
        typedef U32x16 U;
        typedef F32x16 V;
        const U w = halves(p);
        const U sign = (w & 0x8000) << 16, em = w & 0x7FFF, e = em >> 10;
        const U normal = sign | ((em << 13) + (112u << 23));
        const U special = sign | 0x7F800000u | ((em & 0x3FF) << 13);
        const V sub = __builtin_convertvector(I32x16(em), V) * 0x1p-24f;
        U subu;
        std::memcpy(&subu, &sub, sizeof(U));
        const I32x16 ei = I32x16(e);  // 0..31
        const U zero = U((ei - 1) >> 31), top = U((30 - ei) >> 31);  // e == 0, e == 31
        const U bits = pick(zero, subu | sign, pick(top, special, normal));
        V x;
        std::memcpy(&x, &bits, sizeof(V));
        return x;
    }
    static QKV_INLINE void line(const F16* p, void* out) {
        const F32x16 x[2] = {vec(p), vec(p + 16)};
        std::memcpy(out, x, sizeof(x));
    }
};

// A float16 line by the CPU's own conversion (F16C's vcvtph2ps, exact for every value, NaN
// kept NaN) in the clones that have it; the baseline clone keeps the integer widening above.
// Measured on the B8 H32 kv8 S4096 d128 step: 11-12 -> 15-22 GB/s read (AVX-512), 3.5-4 ->
// 16-18 (AVX2). read_line() picks by the clone's lanes (value_tile's: its register's floats).
#if QKV_X86
QKV_AVX512 inline void f16_line_avx512(const F16* p, void* out) {
    float* y = static_cast<float*>(out);
    _mm512_storeu_ps(y, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
    _mm512_storeu_ps(y + 16,
                     _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))));
}

QKV_AVX2 inline void f16_line_avx2(const F16* p, void* out) {
    float* y = static_cast<float*>(out);
    for (int c = 0; c < 4; ++c)
        _mm256_storeu_ps(y + 8 * c,
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * c))));
}
#endif

// One line of stored K or V (64 bytes) widened into out, in the clone of `LANES` lanes.
template <typename T, typename E, int LANES>
QKV_INLINE void read_line(const E* p, void* out) {
#if QKV_X86
    if constexpr (std::is_same<E, F16>::value && LANES == 16) {
        f16_line_avx512(p, out);
        return;
    } else if constexpr (std::is_same<E, F16>::value && LANES == 8) {
        f16_line_avx2(p, out);
        return;
    }
#endif
    Kv<T, E>::line(p, out);
}

// An 8-bit format's line is read as 16 words of 4 codes, vector p holding each word's byte p
// (values 4i + p, strided_order): shifts and masks within the lanes, no permutes. GCC widens
// vectors of bytes one lane at a time, or through the stack.
template <>
struct Kv<float, I8> {  // int8 codes
    static constexpr bool scaled = true;
    static constexpr bool direct = false;
    static constexpr int per_line = 4;
    static constexpr int order = 4;
    // line() converts each code as it sits in its lane's top byte, zeros below: code · 2^24
    static constexpr float unit = 0x1p-24f;
    static QKV_INLINE float get(const I8* p) { return float(p->code); }
    static QKV_INLINE void line(const I8* p, void* out) {
        U32x16 w;
        std::memcpy(&w, p, 64);
        const U32x16 top = w & 0xFF000000u;
        const U32x16 b[4] = {w << 24, (w << 16) & 0xFF000000u, (w << 8) & 0xFF000000u, top};
        F32x16 x[4];
        for (int c = 0; c < 4; ++c) x[c] = __builtin_convertvector(I32x16(b[c]), F32x16);
        std::memcpy(out, x, sizeof(x));
    }
};

// The fast road's int8 codes: keys scored in int32 (score_tile_i8), values multiplied by
// int16 weights in int32 (round_weights, value_tile_i16_avx2), both read as the codes they are
// (no strided order).
template <>
struct Kv<float, I8q> {
    static constexpr bool scaled = true;
    static constexpr bool direct = false;
    static constexpr int per_line = 4;
    static constexpr int order = 1;
    static constexpr float unit = 1;
    static QKV_INLINE float get(const I8q* p) { return float(p->code); }
    static QKV_INLINE void line(const I8q* p, void* out) {
        float y[64];
        for (int t = 0; t < 64; ++t) y[t] = float(p[t].code);
        std::memcpy(out, y, sizeof(y));
    }
};

// The fast road's query row: x (d values) rounded to int8 codes c with one scale, symmetric,
// c = rint(x · (127 / max|x|)) (halves to even), returning the scale max|x| / 127 by which
// c approximates x (|x - c · scale| <= scale / 2). A row of zeros: codes 0, scale 0; a row with
// an infinity or NaN: codes 0, scale NaN (its scores NaN, as the exact road's). Every clone and
// the NumPy emulation (qkv.engine.kernels.decode_fast) take these float32 operations in this
// order, so the codes and scales agree bit for bit.
QKV_INLINE float quantize_row(const float* __restrict x, int64_t d, int8_t* __restrict c) {
    float amax = 0;
    bool finite = true;
    for (int64_t t = 0; t < d; ++t) {
        const float ax = std::fabs(x[t]);
        finite &= ax <= std::numeric_limits<float>::max();
        amax = ax > amax ? ax : amax;
    }
    if (!finite || amax == 0) {
        for (int64_t t = 0; t < d; ++t) c[t] = 0;
        return finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    }
    const float inv = 127.0f / amax;
    for (int64_t t = 0; t < d; ++t) {
        const float y = std::nearbyint(x[t] * inv);
        c[t] = int8_t(y > 127.0f ? 127.0f : (y < -127.0f ? -127.0f : y));
    }
    return amax / 127.0f;
}

// The R query rows of kv head h of sequence b rounded to int8 (quantize_row): codes at c (R x
// d), and each row's factor f[r] = its scale · the softmax scale, by which a row's int32
// product with a key's codes times the key's scale is its score.
QKV_INLINE void quantize_rows(const qkv_decode_args& a, int64_t b, int64_t h, int64_t d,
                              int8_t* __restrict c, float* __restrict f) {
    const float sc = float(a.scale);
    for (int64_t r = 0; r < a.group * a.L; ++r)
        f[r] = quantize_row(query_row<float>(a, b, h, r), d, c + r * d) * sc;
}

// float8 e4m3fn codes: sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities (the
// NaN code, never stored by quantize_kv, reads as 480). get(): a normal code's fields move
// into a float32's with the exponent bias raised by 120; a subnormal one (exponent 0) is its
// mantissa times 2^-9.
template <>
struct Kv<float, E4m3> {
    static constexpr bool scaled = true;
    static constexpr bool direct = false;
    static constexpr int per_line = 4;
    static constexpr int order = 4;
    static constexpr float unit = 1;
    static QKV_INLINE float get(const E4m3* p) {
        const uint32_t c = p->code, mag = c & 0x7F, sign = (c & 0x80) << 24;
        float f;
        if (mag >> 3) {
            const uint32_t u = sign | ((mag << 20) + (120u << 23));
            std::memcpy(&f, &u, 4);
        } else {
            f = float(int(mag)) * 0x1p-9f;
            f = sign ? -f : f;
        }
        return f;
    }
    // The code's magnitude bits go to float32's bits 20..26 (exponent 0..15, 3 mantissa bits)
    // and its sign to bit 31: that float32 (a subnormal one for exponent 0) times 2^120 is the
    // code's value, exactly, for normal and subnormal codes alike. `mags` holds each code's
    // magnitude bits at 20..26 and `signs` its sign bit at 31 (other bits are masked off).
    static QKV_INLINE F32x16 value(U32x16 mags, U32x16 signs) {
        const U32x16 bits = (mags & 0x07F00000u) | (signs & 0x80000000u);
        F32x16 x;
        std::memcpy(&x, &bits, sizeof(x));
        return x * 0x1p120f;
    }
    static QKV_INLINE void line(const E4m3* p, void* out) {
        typedef U32x16 U;
        U ws;
        std::memcpy(&ws, p, 64);
        const U mags[4] = {ws << 20, ws << 12, ws << 4, ws >> 4};
        const U signs[4] = {ws << 24, ws << 16, ws << 8, ws};
        for (int c = 0; c < 4; ++c) {
            const F32x16 x = value(mags[c], signs[c]);
            std::memcpy(static_cast<char*>(out) + 64 * c, &x, 64);
        }
    }
};

// Where a piece reads: kv head h of sequence b's keys, values and (scaled formats) scales.
template <typename E>
struct Rows {
    const E* k;
    const E* v;
    const float* ks;  // row j's scale at ks[j * ks_rs] (scaled formats; else unused)
    const float* vs;
    Rows(const qkv_decode_args& a, int64_t b, int64_t h)
        : k(static_cast<const E*>(a.k) + b * a.k_bs + h * a.k_hs),
          v(static_cast<const E*>(a.v) + b * a.v_bs + h * a.v_hs),
          ks(a.k_scale ? a.k_scale + b * a.ks_bs + h * a.ks_hs : nullptr),
          vs(a.v_scale ? a.v_scale + b * a.vs_bs + h * a.vs_hs : nullptr) {}
};

// A block's rows of K, V or scales: row j at p + j * rs (a run of rows) ...
template <typename E>
struct Strided {
    const E* p = nullptr;
    int64_t rs = 0;
    QKV_INLINE const E* operator[](int64_t j) const { return p + j * rs; }
    QKV_INLINE Strided from(int64_t j) const { return {p + j * rs, rs}; }  // rows from j on
};

// ... or at p[j] (rows listed one by one: pages through a block table).
template <typename E>
struct Listed {
    const E* const* p = nullptr;
    int64_t off = 0;  // added to every listed row (another head's part of it)
    QKV_INLINE const E* operator[](int64_t j) const { return p[j] + off; }
    QKV_INLINE Listed from(int64_t j) const { return {p + j, off}; }
};

// Where a piece finds the rows of a block of keys [b0, b0 + n) of kv head h of sequence b: the
// pieces ask list(b0, n, slot) for a block (before its rows are read; a no-op here), then
// k(b0, slot), v, ks, vs for its rows. Flat: the sequence's rows are one run (a cache's
// buffers, any strides), so a block is a Strided run, as it always was.
template <typename E>
struct Flat {
    typedef Strided<E> Kv_;
    typedef Strided<float> Sc_;
    const Rows<E> at;
    const int64_t k_rs, v_rs, ks_rs, vs_rs;
    Flat(const qkv_decode_args& a, int64_t b, int64_t h)
        : at(a, b, h), k_rs(a.k_rs), v_rs(a.v_rs), ks_rs(a.ks_rs), vs_rs(a.vs_rs) {}
    static constexpr bool all_heads = false;  // a piece reads one kv head
    QKV_INLINE void list(int64_t, int64_t, int) {}
    QKV_INLINE void ask(int, int64_t, int64_t) const {}
    QKV_INLINE Kv_ k(int64_t b0, int, int64_t = 0) const { return {at.k + b0 * k_rs, k_rs}; }
    QKV_INLINE Kv_ v(int64_t b0, int, int64_t = 0) const { return {at.v + b0 * v_rs, v_rs}; }
    // (scaled formats only: the scales are there)
    QKV_INLINE Sc_ ks(int64_t b0, int, int64_t = 0) const { return {at.ks + b0 * ks_rs, ks_rs}; }
    QKV_INLINE Sc_ vs(int64_t b0, int, int64_t = 0) const { return {at.vs + b0 * vs_rs, vs_rs}; }
};

// Paged: key position p lies in page block_table[p / page_size] at row p % page_size. A
// block's rows are listed when it is asked for (one division per block, the pages' runs of
// rows walked with additions), in two slots: the block being computed and the next one,
// whose rows are asked for into L2 meanwhile: its page rows whole (every head's: one head's
// rows lie a page row apart, and a CPU's prefetchers do not follow them), a share while each
// part of this block is computed (ask). Asked for row by row only, the paged step read int8
// at 28-33% of the contiguous step's rate on a Zen 4 CPU (2 threads, B8 H32 kv8 S4096 d128,
// pages of 16), float8 at 47-52%, float32 at 81-86%; whole when listed, 43-47%, 64-81% and
// 80-92%; in shares, 63-67%, 72-80% and (whole with the first head) 89-90%. The 16-bit forms
// stayed at 52-71% throughout, read a block of 64 keys per head, head after head; read
// DECODE_PK keys at a time, every head's (decode_piece_vec), with a share asked for per part,
// bfloat16 went from 59-63% to 75-84%, float16 from 54-56% to 74-80%, int8 to 77%, float8 to
// 80-87% and float32 to 92-99% (1 thread: bfloat16 and float16 from 53-58% to 67-74%). Parts
// of 8 keys measured the same as 16, of 4 slower (bfloat16 63%, 1 thread), of 32 much slower
// (53-57%: a part's rows of every head, 64 KiB of bfloat16 K, no longer fit in a 32 KiB
// L1); the scores in parts and the values a block per head, 44-52% (1 thread). Asked
// for into L1 (prefetcht0), or as non-temporal, 51-54% (1 thread); every other line or
// fewer (the CPU left to fetch the rest), 47-51%; nothing asked for, 40-50%; the next
// block's rows of the same head asked for by the tiles (Ahead) rather than in shares, the
// same as the shares; each share's lines found without ask's two divisions per run, slower
// (bfloat16 59-61% against 72-73%, 1 thread: the requests then come in tighter bursts). With
// K/V that lie in L3 (B1 S2048, 1 thread) the paged step ran at 74-81% of the contiguous
// one, so part of what remains is the work of the paged walk itself, not the memory. The
// inner loops read the listed rows as they read a Strided run, one pointer per row more.
template <typename E>
struct Paged {
    typedef Listed<E> Kv_;
    typedef Listed<float> Sc_;
    const E* kh;  // kv head h's rows in page 0
    const E* vh;
    const float* ksh;  // (scaled formats; else NULL)
    const float* vsh;
    const int32_t* table;  // sequence b's row of the block table
    const int64_t ps, k_ps, k_rs, v_ps, v_rs, ks_ps, ks_rs, vs_ps, vs_rs, k_hs, v_hs, ks_hs, vs_hs;
    static constexpr bool all_heads = true;
    const E* kl[2][DECODE_BK];
    const E* vl[2][DECODE_BK];
    const float* ksl[2][DECODE_BK];
    const float* vsl[2][DECODE_BK];
    // each slot's runs of page rows (every head's), K's and V's, and their bytes
    const char* runk[2][DECODE_BK];
    const char* runv[2][DECODE_BK];
    int64_t kbytes[2][DECODE_BK], vbytes[2][DECODE_BK];
    int runs[2] = {0, 0};
    Paged(const qkv_decode_args& a, int64_t b, int64_t h)
        : kh(static_cast<const E*>(a.k) + h * a.k_hs),
          vh(static_cast<const E*>(a.v) + h * a.v_hs),
          ksh(a.k_scale ? a.k_scale + h * a.ks_hs : nullptr),
          vsh(a.v_scale ? a.v_scale + h * a.vs_hs : nullptr),
          table(a.block_table + b * a.bt_rs),
          ps(a.page_size), k_ps(a.k_bs), k_rs(a.k_rs), v_ps(a.v_bs), v_rs(a.v_rs),
          ks_ps(a.ks_bs), ks_rs(a.ks_rs), vs_ps(a.vs_bs), vs_rs(a.vs_rs), k_hs(a.k_hs),
          v_hs(a.v_hs), ks_hs(a.ks_hs), vs_hs(a.vs_hs) {}
    // The rows of keys [b0, b0 + n) (n <= DECODE_BK) into the lists of `slot`.
    QKV_INLINE void list(int64_t b0, int64_t n, int slot) {
        runs[slot] = 0;
        if (n <= 0) return;
        int64_t page = b0 / ps, off = b0 - page * ps, j = 0;
        const E** K = kl[slot];
        const E** V = vl[slot];
        while (j < n) {
            const int64_t id = table[page], take = std::min(ps - off, n - j);
            const E* kp = kh + id * k_ps + off * k_rs;
            const E* vp = vh + id * v_ps + off * v_rs;
            for (int64_t i = 0; i < take; ++i) {
                K[j + i] = kp + i * k_rs;
                V[j + i] = vp + i * v_rs;
            }
            const int r = runs[slot]++;  // the page rows whole, every head's (ask)
            runk[slot][r] = reinterpret_cast<const char*>(kp);
            runv[slot][r] = reinterpret_cast<const char*>(vp);
            kbytes[slot][r] = take * k_rs * int64_t(sizeof(E));
            vbytes[slot][r] = take * v_rs * int64_t(sizeof(E));
            if (ksh) {
                const float* kq = ksh + id * ks_ps + off * ks_rs;
                const float* vq = vsh + id * vs_ps + off * vs_rs;
                for (int64_t i = 0; i < take; ++i) {
                    ksl[slot][j + i] = kq + i * ks_rs;
                    vsl[slot][j + i] = vq + i * vs_rs;
                }
            }
            j += take;
            off = 0;
            ++page;
        }
    }
    // Share `part` of `parts` of slot's page rows asked for (into L2), each run's lines in
    // order: the next block's, a share while each head of this one is computed.
    QKV_INLINE void ask(int slot, int64_t part, int64_t parts) const {
        for (int r = 0; r < runs[slot]; ++r) {
            const int64_t kb = kbytes[slot][r], vb = vbytes[slot][r];
            for (int64_t c = kb * part / parts / 64 * 64; c < kb * (part + 1) / parts; c += 64)
                __builtin_prefetch(runk[slot][r] + c, 0, 1);
            for (int64_t c = vb * part / parts / 64 * 64; c < vb * (part + 1) / parts; c += 64)
                __builtin_prefetch(runv[slot][r] + c, 0, 1);
        }
    }
    // head h + i's rows (decode_piece_vec's pieces read every head: all_heads)
    QKV_INLINE Kv_ k(int64_t, int slot, int64_t i = 0) const { return {kl[slot], i * k_hs}; }
    QKV_INLINE Kv_ v(int64_t, int slot, int64_t i = 0) const { return {vl[slot], i * v_hs}; }
    QKV_INLINE Sc_ ks(int64_t, int slot, int64_t i = 0) const { return {ksl[slot], i * ks_hs}; }
    QKV_INLINE Sc_ vs(int64_t, int slot, int64_t i = 0) const { return {vsl[slot], i * vs_hs}; }
};

// The fast road's values in integers. Each query row's weights over a block of keys, u_t =
// p_t · vscale_t (the softmax weight times the value row's int8 scale), are rounded to int16
// codes against the block's largest, w_t = rint(u_t · (32767 / max|u|)) (halves to even), so
// that a weight times a value code is an integer product: summed over the block in int32,
// exactly (|w| <= 32767, |code| <= 128, 64 keys: below 2^28), then taken into the row's float32
// accumulator once per block, times the block's weight scale max|u| / 32767. The values cost
// one integer multiply-add per two keys (vpdpwssd, or vpmaddwd and vpaddd) where the exact
// road takes a float32 FMA per key. Every clone rounds the weights by these float32
// operations in this order, so given the same weights u they give the same codes and the same
// int32 sums. Writes w[0, n) and, for an odd n, w[n] = 0 (the pad of the last pair of keys);
// returns the block's weight scale: 0 where every weight is 0, NaN where one is not finite
// (the output NaN, as the exact road's).
QKV_INLINE float round_weights(const float* __restrict u, int64_t n, int16_t* __restrict w) {
    float amax = 0, nan = 0;
#pragma omp simd reduction(max : amax) reduction(+ : nan)
    for (int64_t t = 0; t < n; ++t) {
        const float ax = std::fabs(u[t]);
        amax = ax > amax ? ax : amax;
        nan += u[t] * 0.0f;  // NaN if u[t] is infinite or NaN
    }
    if (n & 1) w[n] = 0;
    if (nan != 0 || amax == 0) {
        for (int64_t t = 0; t < n; ++t) w[t] = 0;
        return nan != 0 ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    }
    // weights below 2^-64 (a block far below the running max) scaled by 2^64 first, exactly,
    // so that 32767 / max stays finite
    const float up = amax < 0x1p-64f ? 0x1p64f : 1.0f;
    const float k = 32767.0f / (amax * up);
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) {
        const float y = std::nearbyint((u[t] * up) * k);
        w[t] = int16_t(y > 32767.0f ? 32767.0f : (y < -32767.0f ? -32767.0f : y));
    }
    return amax / 32767.0f;
}

// A block's integer values (one key at a time: the sums are exact, so in any order the
// same): R rows' accumulators acc (rows dv apart) become acc · alpha[r] + float(Σ_t w[r ·
// DECODE_BK + t] · v[t]) · wsc[r], the sums in `sum` (dv int32). The baseline clone's road,
// and that of head sizes without a road of their own in every clone.
template <typename A>
QKV_INLINE void value_rows_i16(float* __restrict acc, int64_t dv, int64_t R,
                               const int16_t* __restrict w, const float* __restrict wsc,
                               const float* __restrict alpha, const A& v, int64_t n,
                               int32_t* __restrict sum) {
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t c = 0; c < dv; ++c) sum[c] = 0;
        for (int64_t j = 0; j < n; ++j) {
            const int32_t wj = w[r * DECODE_BK + j];
            const I8q* __restrict vr = v[j];
#pragma omp simd
            for (int64_t c = 0; c < dv; ++c) sum[c] += wj * int32_t(vr[c].code);
        }
        float* __restrict ar = acc + r * dv;
        const float al = alpha[r], ws = wsc[r];
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) ar[c] = ar[c] * al + float(sum[c]) * ws;
    }
}

// One piece: rows' m, l, acc over keys [j0, j1) of kv head h of sequence b, for any head
// sizes. scratch holds the scaled rows (R x d) and the block's scores (R x DECODE_BK).
template <typename T, typename E, typename Src>
QKV_INLINE void decode_piece_body(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0,
                                  int64_t j1, T* __restrict scratch, T* __restrict m,
                                  T* __restrict l, T* __restrict acc) {
    typedef Kv<T, E> KV;
    const int64_t d = a.d, dv = a.dv, R = a.group * a.L;
    T* __restrict qs = scratch;
    T* __restrict s = scratch + R * d;
    decode_start(a, b, h, d, dv, qs, m, l, acc);
    // the fast road: the rows' int8 codes over qs, their factors after the scores
    constexpr bool IQ = std::is_same<E, I8q>::value;
    const int8_t* __restrict qc = reinterpret_cast<const int8_t*>(qs);
    float* __restrict qf = reinterpret_cast<float*>(s + R * DECODE_BK);
    if constexpr (IQ) quantize_rows(a, b, h, d, reinterpret_cast<int8_t*>(qs), qf);
    Src src(a, b, h);
    const int64_t hi = a.hi ? a.hi[b] : a.S;  // (the causal rows' limits: row_keys)
    for (int64_t b0 = j0; b0 < j1; b0 += DECODE_BK) {
        const int64_t n = std::min<int64_t>(DECODE_BK, j1 - b0);
        src.list(b0, n, 0);
        src.ask(0, 0, 1);
        const auto K = src.k(b0, 0);
        const auto Vr = src.v(b0, 0);
        for (int64_t j = 0; j < n; ++j) {
            const E* __restrict kr = K[j];
            const T ks = KV::scaled ? T(*src.ks(b0, 0)[j]) : T(1);
            if constexpr (IQ) {
                for (int64_t r = 0; r < R; ++r) {
                    const int8_t* __restrict qr = qc + r * d;
                    int32_t dot = 0;
#pragma omp simd reduction(+ : dot)
                    for (int64_t t = 0; t < d; ++t) dot += int32_t(qr[t]) * int32_t(kr[t].code);
                    s[r * DECODE_BK + j] = float(dot) * qf[r] * ks;
                }
                continue;
            }
            for (int64_t r = 0; r < R; ++r) {
                const T* __restrict qr = qs + r * d;
                T dot = 0;
#pragma omp simd reduction(+ : dot)
                for (int64_t t = 0; t < d; ++t) dot += qr[t] * KV::get(kr + t);
                s[r * DECODE_BK + j] = KV::scaled ? dot * ks : dot;
            }
        }
        if (a.softcap > 0) softcap_block(s, R, n, T(a.softcap));
        if constexpr (IQ) {  // the weights rounded to int16, the values' products in int32
            int16_t* __restrict wq = reinterpret_cast<int16_t*>(qf + R);  // R x DECODE_BK
            float* __restrict wsc = qf + R + R * DECODE_BK / 2;  // R scales, then R factors
            float* __restrict al = wsc + R;
            int32_t* __restrict sum = reinterpret_cast<int32_t*>(al + R);  // dv
            for (int64_t r = 0; r < R; ++r) {
                T* __restrict sr = s + r * DECODE_BK;
                al[r] = decode_row_step_upto(sr, n, row_keys(a, hi, r, b0, n), m + r, l + r);
                for (int64_t j = 0; j < n; ++j) sr[j] *= T(*src.vs(b0, 0)[j]);
                wsc[r] = round_weights(sr, n, wq + r * DECODE_BK);
            }
            value_rows_i16(acc, dv, R, wq, wsc, al, Vr, n, sum);
            continue;
        }
        for (int64_t r = 0; r < R; ++r) {
            T* __restrict sr = s + r * DECODE_BK;
            T* __restrict ar = acc + r * dv;
            const T alpha = decode_row_step_upto(sr, n, row_keys(a, hi, r, b0, n), m + r, l + r);
            if (alpha != T(1)) {
#pragma omp simd
                for (int64_t c = 0; c < dv; ++c) ar[c] *= alpha;
            }
            for (int64_t j = 0; j < n; ++j) {
                const T p = KV::scaled ? sr[j] * T(*src.vs(b0, 0)[j]) : sr[j];
                const E* __restrict vr = Vr[j];
#pragma omp simd
                for (int64_t c = 0; c < dv; ++c) ar[c] += p * KV::get(vr + c);
            }
        }
    }
}

// Sum of the lanes of a vector of 16 to 64 bytes: its halves added down to 16 bytes, then the
// lanes.
template <typename T, typename V>
QKV_INLINE T lane_sum(V x) {
    typedef T V32 __attribute__((vector_size(32)));
    typedef T V16 __attribute__((vector_size(16)));
    static_assert(sizeof(V) == 16 || sizeof(V) == 32 || sizeof(V) == 64, "a vector of 16-64 bytes");
    V32 lo;
    if constexpr (sizeof(V) == 64) {
        V32 hi;
        std::memcpy(&lo, &x, 32);
        std::memcpy(&hi, reinterpret_cast<const char*>(&x) + 32, 32);
        lo += hi;
    } else if constexpr (sizeof(V) == 32) {
        std::memcpy(&lo, &x, 32);
    }
    V16 a, b;
    if constexpr (sizeof(V) == 16) {
        std::memcpy(&a, &x, 16);
        b = V16{};
    } else {
        std::memcpy(&a, &lo, 16);
        std::memcpy(&b, reinterpret_cast<const char*>(&lo) + 16, 16);
    }
    a += b;
    if constexpr (sizeof(T) == 8) {
        return a[0] + a[1];
    } else {
        return (a[0] + a[2]) + (a[1] + a[3]);
    }
}

// The lane sums of four 16-lane float vectors at once: halves added pairwise across the four
// (a transpose by shuffles), so four sums cost about as much as one.
template <typename V>
QKV_INLINE void lane_sums4(const V* x, float* out) {
    typedef float V8 __attribute__((vector_size(32)));
    typedef float V4 __attribute__((vector_size(16)));
    // [a0..7 + a8..15, b0..7 + b8..15] and the same for c, d
    const V ab = __builtin_shufflevector(x[0], x[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                         21, 22, 23) +
                 __builtin_shufflevector(x[0], x[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                         28, 29, 30, 31);
    const V cd = __builtin_shufflevector(x[2], x[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                         21, 22, 23) +
                 __builtin_shufflevector(x[2], x[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                         28, 29, 30, 31);
    // [a 4 partial sums, b 4, c 4, d 4]
    const V y = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                        26, 27) +
                __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                        30, 31);
    // [a 2, b 2, c 2, d 2], then [a, b, c, d]
    const V8 z = __builtin_shufflevector(y, y, 0, 1, 4, 5, 8, 9, 12, 13) +
                 __builtin_shufflevector(y, y, 2, 3, 6, 7, 10, 11, 14, 15);
    const V4 w = __builtin_shufflevector(z, z, 0, 2, 4, 6) + __builtin_shufflevector(z, z, 1, 3, 5, 7);
    std::memcpy(out, &w, sizeof(w));
}

// The lane sums of sixteen 16-lane float vectors, out[f] that of x[f]: pairs of vectors halved
// and added level by level (8 + 4 + 2 + 1 adds), each level's vectors holding twice the
// sources in half the lanes.
template <typename V>
QKV_INLINE void lane_sums16(const V* x, float* out) {
    V y[8], z[4], u[2];
    for (int k = 0; k < 8; ++k)  // [x 8 partial sums, x' 8]
        y[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                       19, 20, 21, 22, 23) +
               __builtin_shufflevector(x[2 * k], x[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int k = 0; k < 4; ++k)  // 4 sources, 4 partial sums each
        z[k] = __builtin_shufflevector(y[2 * k], y[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(y[2 * k], y[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                       22, 23, 28, 29, 30, 31);
    for (int k = 0; k < 2; ++k)  // 8 sources, 2 each
        u[k] = __builtin_shufflevector(z[2 * k], z[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(z[2 * k], z[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                       22, 23, 26, 27, 30, 31);
    const V t = __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                        24, 26, 28, 30) +
                __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23,
                                        25, 27, 29, 31);
    std::memcpy(out, &t, sizeof(t));
}

// The lane sums of N float vectors for a clone whose registers hold L < 16 lanes (AVX2 8,
// baseline 4): each vector's parts of L lanes added (no operation crosses a register), then the
// same halving tree as lane_sums16 on L-lane vectors, L sums per vector.
typedef float F32x8 __attribute__((vector_size(32)));
typedef float F32x4 __attribute__((vector_size(16)));
template <int L, int N, typename V>
QKV_INLINE void lane_sums_narrow(const V* x, float* out) {
    typedef typename std::conditional<L == 8, F32x8, F32x4>::type P;
    static_assert(N % L == 0, "whole vectors of sums");
    P y[N];
    for (int f = 0; f < N; ++f) {
        P part[sizeof(V) / sizeof(P)];
        std::memcpy(part, &x[f], sizeof(V));
        y[f] = part[0];
        for (int c = 1; c < int(sizeof(V) / sizeof(P)); ++c) y[f] += part[c];
    }
    for (int f = 0; f < N; f += L) {
        P* g = y + f;
        if constexpr (L == 8) {
            // within each 16-byte half first (vshufps), across the halves once at the end
            // (vperm2f128): crossing them at every level (vpermd, 3 cycles each here) made
            // the tree cost as much as a d32 tile's 32 FMAs
            for (int k = 0; k < 4; ++k)  // half h: [a 2h+0..1 + 2h+2..3, b the same]
                g[k] = __builtin_shufflevector(g[2 * k], g[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
                       __builtin_shufflevector(g[2 * k], g[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
            for (int k = 0; k < 2; ++k)  // half h: the 4 sources' sums over their half h
                g[k] = __builtin_shufflevector(g[2 * k], g[2 * k + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
                       __builtin_shufflevector(g[2 * k], g[2 * k + 1], 1, 3, 9, 11, 5, 7, 13, 15);
            g[0] = __builtin_shufflevector(g[0], g[1], 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(g[0], g[1], 4, 5, 6, 7, 12, 13, 14, 15);
        } else {
            static_assert(L == 4, "4 or 8 lanes");
            for (int k = 0; k < 2; ++k)
                g[k] = __builtin_shufflevector(g[2 * k], g[2 * k + 1], 0, 1, 4, 5) +
                       __builtin_shufflevector(g[2 * k], g[2 * k + 1], 2, 3, 6, 7);
            g[0] = __builtin_shufflevector(g[0], g[1], 0, 2, 4, 6) +
                   __builtin_shufflevector(g[0], g[1], 1, 3, 5, 7);
        }
        std::memcpy(out + f, &g[0], sizeof(P));
    }
}

// The lane sums of NX vectors of T (LANES float lanes a register), out[f] that of x[f], by the
// cheapest tree the count allows.
template <typename T, int LANES, int NX, typename V>
QKV_INLINE void lane_sums(const V* x, T* out) {
    if constexpr (sizeof(T) == 4 && LANES < 16 && NX % LANES == 0) {
        lane_sums_narrow<LANES, NX>(x, out);
    } else if constexpr (sizeof(T) == 4 && LANES == 16 && NX == 16) {
        lane_sums16(x, out);
    } else if constexpr (sizeof(T) == 4 && LANES == 16 && NX % 4 == 0) {
        for (int f = 0; f < NX; f += 4) lane_sums4(x + f, out + f);
    } else {
        for (int f = 0; f < NX; ++f) out[f] = lane_sum<T>(x[f]);
    }
}

// The register V at p.
template <typename V, typename E>
QKV_INLINE V load(const E* p) {
    V x;
    std::memcpy(&x, p, sizeof(V));
    return x;
}

// The next block's rows of K or of V, asked for into L2 while this block is computed: the
// keys' rows by the scores, a key tile's rows at a time, and the values' by the values'
// products, each value tile the lines it reads itself, so that the requests are spread over
// the whole block. Both asked for during the scores measured 7-20% slower on bfloat16 and
// float16 steps (B1 and B8 H32 kv8 S4096 d128), the same on steps bound by their arithmetic
// (int8). Every line is asked for: with the requests spread, asking for every other line (the
// CPU fetching its neighbour), as the step did where a key brings 256 bytes or more per query
// row, measured 20-25% slower (float32 B8 and B1, bfloat16 with one query row per kv head).
template <typename E, int BYTES, typename A>
struct Ahead {
    A rows{};  // Strided or Listed
    int64_t n = 0;  // rows [0, n) are asked for
    // bytes [from, from + SPAN) of row j
    template <int SPAN>
    QKV_INLINE void part(int64_t j, int from) const {
        if (j >= n) return;
        const char* p = reinterpret_cast<const char*>(rows[j]);
        for (int c = from; c < from + SPAN; c += 64) __builtin_prefetch(p + c, 0, 1);
    }
    QKV_INLINE void row(int64_t j) const { part<BYTES>(j, 0); }
};

// The scores of RB query rows (q, rows D apart, in line()'s order) against KB keys (key kk's
// row at k[kk]: Strided or Listed) into s[i * DECODE_BK + kk]: each key line widened once for the RB rows, each
// query vector loaded once for the KB keys, and the RB · KB lane sums added up together. V is
// the clone's register of T (LANES float lanes), NVL of them per line of storage.
template <typename T, typename E, typename V, int D, int RB, int KB, int LANES, typename A>
QKV_INLINE void score_tile(const T* __restrict q, const A& k, T* __restrict s) {
    typedef Kv<T, E> KV;
    constexpr int W = int(sizeof(V) / sizeof(T)), EL = int(64 / sizeof(E));
    constexpr int NVL = int(KV::per_line * 64 / sizeof(V)), LK = int(D * sizeof(E) / 64);
    V x[RB][KB] = {};
    for (int l = 0; l < LK; ++l) {
        // one key's line widened at a time (the rows' vectors as operands), so that a row
        // alone (and AVX2's two rows of 64 or fewer) takes 8 keys' sums, not 8 lines' registers
        if constexpr (!KV::direct && (RB == 1 || (LANES == 8 && D * sizeof(T) <= 256))) {
            for (int kk = 0; kk < KB; ++kk) {
                V kv[NVL];
                read_line<T, E, LANES>(k[kk] + l * EL, kv);
                for (int p = 0; p < NVL; ++p)
                    for (int i = 0; i < RB; ++i)
                        x[i][kk] += load<V>(q + i * D + (l * NVL + p) * W) * kv[p];
            }
            continue;
        }
        V kv[KB][NVL];
        if constexpr (!KV::direct)
            for (int kk = 0; kk < KB; ++kk) read_line<T, E, LANES>(k[kk] + l * EL, kv[kk]);
        for (int p = 0; p < NVL; ++p) {
            for (int i = 0; i < RB; ++i) {
                const V qv = load<V>(q + i * D + (l * NVL + p) * W);
                for (int kk = 0; kk < KB; ++kk) {
                    if constexpr (KV::direct)  // as an operand (a copy to the stack stalls)
                        x[i][kk] += qv * load<V>(k[kk] + l * EL + p * W);
                    else
                        x[i][kk] += qv * kv[kk][p];
                }
            }
        }
    }
    constexpr int NX = RB * KB;
    T out[NX];
    lane_sums<T, LANES, NX>(&x[0][0], out);
    for (int i = 0; i < RB; ++i)
        for (int kk = 0; kk < KB; ++kk) s[i * DECODE_BK + kk] = out[i * KB + kk];
}

#if QKV_X86
// score_tile for bfloat16 keys and query rows whose values are bfloat16 (q, the rows' bits,
// unscaled, rows D apart): vdpbf16ps takes a key line's 32 values as stored, with no widening,
// and its products are exact, summed in float32 as the FMAs of score_tile sum them; the scale
// multiplies each sum. It reads a subnormal bfloat16 as 0 and flushes a subnormal sum to 0:
// the rows it is given have none (rows_are_bf16), and with theirs below 2^64 the keys' and the
// sums' change a score by less than d · 2^-62, far below float32's rounding of the weights.
//
// 8-bit keys take the same road: an int8 code is an integer of at most 8 bits, a float8 e4m3fn
// code a value of 4 significant bits between 2^-9 and 448, each a bfloat16 value exactly (and
// none subnormal there), converted in registers (dp_keys, 32 codes in order, as a bfloat16
// line's); their row's scale then multiplies the score, as on the widening road.
QKV_BF16 inline __m512bh dp_keys(const Bf16* k) { return (__m512bh)_mm512_loadu_si512(k); }

QKV_BF16 inline __m512 dp_int8(__m128i c) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)); }

// 16 codes, one per 32-bit lane, as Kv<float, E4m3>::value() places them
QKV_BF16 inline __m512 dp_e4m3(__m128i c) {
    const U32x16 w = (U32x16)_mm512_cvtepu8_epi32(c);
    return (__m512)Kv<float, E4m3>::value(w << 20, w << 24);
}

template <typename E>
QKV_BF16 inline __m512bh dp_keys(const E* k) {
    const __m128i* p = reinterpret_cast<const __m128i*>(k);
    const __m128i lo = _mm_loadu_si128(p), hi = _mm_loadu_si128(p + 1);
    if constexpr (std::is_same<E, I8>::value)
        return _mm512_cvtne2ps_pbh(dp_int8(hi), dp_int8(lo));
    else
        return _mm512_cvtne2ps_pbh(dp_e4m3(hi), dp_e4m3(lo));
}

template <int D, int RB, int KB, typename E, typename A>
QKV_BF16 inline void score_tile_dp(const uint16_t* __restrict q, const A& k, float scale,
                                 float* __restrict s) {
    __m512 x[RB][KB];
    for (int i = 0; i < RB; ++i)
        for (int kk = 0; kk < KB; ++kk) x[i][kk] = _mm512_setzero_ps();
    for (int l = 0; l < D / 32; ++l) {
        __m512bh kv[KB];
        for (int kk = 0; kk < KB; ++kk) kv[kk] = dp_keys(k[kk] + l * 32);
        for (int i = 0; i < RB; ++i) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + i * D + l * 32);
            for (int kk = 0; kk < KB; ++kk) x[i][kk] = _mm512_dpbf16_ps(x[i][kk], qv, kv[kk]);
        }
    }
    constexpr int NX = RB * KB;
    F32x16 flat[NX];
    std::memcpy(flat, x, sizeof(flat));
    float out[NX];
    lane_sums<float, 16, NX>(flat, out);
    for (int i = 0; i < RB; ++i)
        for (int kk = 0; kk < KB; ++kk) s[i * DECODE_BK + kk] = out[i * KB + kk] * scale;
}
#endif

// The fast road's scores: RB query rows of int8 codes q (rows D apart) by KB keys of int8
// codes k[kk], each product summed exactly in int32, s[i * DECODE_BK + kk] = float(that sum)
// · f[i] (the key's scale multiplies it after: decode_piece_vec). The sums are exact, and
// float() of an int32 rounds alike everywhere, so every clone's scores agree bit for bit.
// AVX2 (and the AVX-512 clone, which runs the same AVX2 code: no VNNI road, as none can be
// tested here): vpmaddubsw takes unsigned bytes by signed ones, so it gets |k| and q with k's
// sign (vpsignb, as llama.cpp's q8 dot products): each pair's sum is at most 2 · 128 · 127 =
// 32512 < 2^15, no saturation; vpmaddwd by ones then sums pairs of those into int32 lanes.
#if QKV_X86
QKV_AVX2 inline __m128i i8_sums4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

QKV_AVX2 inline int32_t i8_sum(__m256i a) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
    return _mm_cvtsi128_si32(x);
}

template <int D, int RB, int KB, typename A>
QKV_AVX2 inline void score_tile_i8_avx2(const int8_t* __restrict q, const float* __restrict f,
                                        const A& k, float* __restrict s) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i x[RB * KB];
    for (int i = 0; i < RB * KB; ++i) x[i] = _mm256_setzero_si256();
    for (int l = 0; l < D / 32; ++l) {
        __m256i kv[KB], ka[KB];
        for (int kk = 0; kk < KB; ++kk) {
            kv[kk] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[kk] + l * 32));
            ka[kk] = _mm256_sign_epi8(kv[kk], kv[kk]);  // |k| (-128: 128 as unsigned)
        }
        for (int i = 0; i < RB; ++i) {
            const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * D + l * 32));
            for (int kk = 0; kk < KB; ++kk) {
                const __m256i p = _mm256_maddubs_epi16(ka[kk], _mm256_sign_epi8(qv, kv[kk]));
                x[i * KB + kk] = _mm256_add_epi32(x[i * KB + kk], _mm256_madd_epi16(p, ones));
            }
        }
    }
    int32_t dot[RB * KB];
    if constexpr ((RB * KB) % 4 == 0) {
        for (int i = 0; i < RB * KB; i += 4)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dot + i), i8_sums4(x[i], x[i + 1], x[i + 2], x[i + 3]));
    } else {
        for (int i = 0; i < RB * KB; ++i) dot[i] = i8_sum(x[i]);
    }
    for (int i = 0; i < RB; ++i)
        for (int kk = 0; kk < KB; ++kk) s[i * DECODE_BK + kk] = float(dot[i * KB + kk]) * f[i];
}
#endif

#if QKV_X86
// The fast road's integer values (round_weights) in the AVX2 clone, and the AVX-512 clone's
// (no VNNI there): RB rows by CV chunks of 16 values, the block's keys [0, n) two at a time.
// Each chunk of a key row's codes is widened to int16 (vpmovsxbw) and the two keys' chunks
// interleaved word by word (vpunpcklwd, vpunpckhwd), so that each int32 lane holds (v_t[c],
// v_{t+1}[c]) for the pair of weights (w_t, w_{t+1}) broadcast as one int32: vpmaddwd sums the
// two products exactly and vpaddd adds them to the lane's int32 sum (an odd last key pairs with
// zeros and the pad weight 0). The interleave leaves a chunk's columns in the order [0-3,
// 8-11] [4-7, 12-15], put back (vperm2i128) once per block, when the sums are taken into the
// float32 accumulators: acc · alpha, then + float(sum) · the weight scale (one FMA), the
// operations of value_tile_i16_vnni. Paged in parts (first, last): a part's sums start from
// and go back to `part` (rows DV apart, in the registers' order) until the block's last.
template <int DV, int RB, int CV, typename A, typename N>
QKV_AVX2 inline void value_tile_i16_avx2(float* __restrict acc, int32_t* __restrict part,
                                         const int16_t* __restrict w, const float* __restrict wsc,
                                         const float* __restrict alpha, const A& v, int64_t n,
                                         bool first, bool last, int c0, const N& next) {
    __m256i x[RB][2 * CV];
    for (int i = 0; i < RB; ++i)
        for (int c = 0; c < 2 * CV; ++c)
            x[i][c] = first ? _mm256_setzero_si256()
                            : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(part + i * DV + c0 * 16 + c * 8));
    const int from = c0 * 16;  // the first byte of a value row this tile reads
    constexpr int SPAN = CV * 16 < 64 ? 64 : CV * 16;
    const bool ask = from % 64 == 0;  // the tile that starts a line asks for it
    for (int64_t j = 0; j < n; j += 2) {
        const bool pair = j + 1 < n;
        if (ask) {
            next.template part<SPAN>(j, from);
            next.template part<SPAN>(j + 1, from);
        }
        const int8_t* va = reinterpret_cast<const int8_t*>(v[j]) + from;
        const int8_t* vb = pair ? reinterpret_cast<const int8_t*>(v[j + 1]) + from : nullptr;
        __m256i lo[CV], hi[CV];
        for (int c = 0; c < CV; ++c) {
            const __m256i ya = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(va + 16 * c)));
            const __m256i yb = pair ? _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vb + 16 * c)))
                                    : _mm256_setzero_si256();
            lo[c] = _mm256_unpacklo_epi16(ya, yb);
            hi[c] = _mm256_unpackhi_epi16(ya, yb);
        }
        for (int i = 0; i < RB; ++i) {
            int32_t wp;
            std::memcpy(&wp, w + i * DECODE_BK + j, 4);
            const __m256i wv = _mm256_set1_epi32(wp);
            for (int c = 0; c < CV; ++c) {
                x[i][2 * c] = _mm256_add_epi32(x[i][2 * c], _mm256_madd_epi16(lo[c], wv));
                x[i][2 * c + 1] = _mm256_add_epi32(x[i][2 * c + 1], _mm256_madd_epi16(hi[c], wv));
            }
        }
    }
    if (!last) {
        for (int i = 0; i < RB; ++i)
            for (int c = 0; c < 2 * CV; ++c)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(part + i * DV + c0 * 16 + c * 8), x[i][c]);
        return;
    }
    for (int i = 0; i < RB; ++i) {
        const __m256 al = _mm256_set1_ps(alpha[i]), ws = _mm256_set1_ps(wsc[i]);
        for (int c = 0; c < CV; ++c) {
            const __m256i s0 = _mm256_permute2x128_si256(x[i][2 * c], x[i][2 * c + 1], 0x20);
            const __m256i s1 = _mm256_permute2x128_si256(x[i][2 * c], x[i][2 * c + 1], 0x31);
            float* o = acc + i * DV + from + 16 * c;
            _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), ws, _mm256_mul_ps(_mm256_loadu_ps(o), al)));
            _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), ws,
                                                    _mm256_mul_ps(_mm256_loadu_ps(o + 8), al)));
        }
    }
}

template <int DV, int RB, int CV, typename A, typename N>
QKV_AVX2 inline void value_rows_i16_avx2(float* acc, int32_t* part, const int16_t* w,
                                         const float* wsc, const float* alpha, const A& v,
                                         int64_t n, bool first, bool last, const N& next) {
    for (int c0 = 0; c0 < DV / 16; c0 += CV)
        value_tile_i16_avx2<DV, RB, CV>(acc, part, w, wsc, alpha, v, n, first, last, c0, next);
}

// value_tile_i16_avx2 where the CPU has AVX512_VNNI: chunks of 32 values, vpdpwssd taking the
// two products and their sum into the lane in one operation. The interleave leaves the
// chunk's columns in the order [0-3, 8-11, 16-19, 24-27] [4-7, ...], put back (vpermt2q)
// once per block. The same int32 sums and float32 operations as the AVX2 tile's, so the same
// accumulators bit for bit.
template <int DV, int RB, int CV, typename A, typename N>
QKV_VNNI inline void value_tile_i16_vnni(float* __restrict acc, int32_t* __restrict part,
                                         const int16_t* __restrict w, const float* __restrict wsc,
                                         const float* __restrict alpha, const A& v, int64_t n,
                                         bool first, bool last, int c0, const N& next) {
    __m512i x[RB][2 * CV];
    for (int i = 0; i < RB; ++i)
        for (int c = 0; c < 2 * CV; ++c)
            x[i][c] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(part + i * DV + c0 * 32 + c * 16);
    const int from = c0 * 32;
    constexpr int SPAN = CV * 32 < 64 ? 64 : CV * 32;
    const bool ask = from % 64 == 0;
    for (int64_t j = 0; j < n; j += 2) {
        const bool pair = j + 1 < n;
        if (ask) {
            next.template part<SPAN>(j, from);
            next.template part<SPAN>(j + 1, from);
        }
        const int8_t* va = reinterpret_cast<const int8_t*>(v[j]) + from;
        const int8_t* vb = pair ? reinterpret_cast<const int8_t*>(v[j + 1]) + from : nullptr;
        __m512i lo[CV], hi[CV];
        for (int c = 0; c < CV; ++c) {
            const __m512i ya = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + 32 * c)));
            const __m512i yb = pair ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + 32 * c)))
                                    : _mm512_setzero_si512();
            lo[c] = _mm512_unpacklo_epi16(ya, yb);
            hi[c] = _mm512_unpackhi_epi16(ya, yb);
        }
        for (int i = 0; i < RB; ++i) {
            int32_t wp;
            std::memcpy(&wp, w + i * DECODE_BK + j, 4);
            const __m512i wv = _mm512_set1_epi32(wp);
            for (int c = 0; c < CV; ++c) {
                x[i][2 * c] = _mm512_dpwssd_epi32(x[i][2 * c], lo[c], wv);
                x[i][2 * c + 1] = _mm512_dpwssd_epi32(x[i][2 * c + 1], hi[c], wv);
            }
        }
    }
    if (!last) {
        for (int i = 0; i < RB; ++i)
            for (int c = 0; c < 2 * CV; ++c) _mm512_storeu_si512(part + i * DV + c0 * 32 + c * 16, x[i][c]);
        return;
    }
    const __m512i ia = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i ib = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int i = 0; i < RB; ++i) {
        const __m512 al = _mm512_set1_ps(alpha[i]), ws = _mm512_set1_ps(wsc[i]);
        for (int c = 0; c < CV; ++c) {
            const __m512i s0 = _mm512_permutex2var_epi64(x[i][2 * c], ia, x[i][2 * c + 1]);
            const __m512i s1 = _mm512_permutex2var_epi64(x[i][2 * c], ib, x[i][2 * c + 1]);
            float* o = acc + i * DV + from + 32 * c;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), ws, _mm512_mul_ps(_mm512_loadu_ps(o), al)));
            _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), ws,
                                                     _mm512_mul_ps(_mm512_loadu_ps(o + 16), al)));
        }
    }
}

template <int DV, int RB, int CV, typename A, typename N>
QKV_VNNI inline void value_rows_i16_vnni(float* acc, int32_t* part, const int16_t* w,
                                         const float* wsc, const float* alpha, const A& v,
                                         int64_t n, bool first, bool last, const N& next) {
    for (int c0 = 0; c0 < DV / 32; c0 += CV)
        value_tile_i16_vnni<DV, RB, CV>(acc, part, w, wsc, alpha, v, n, first, last, c0, next);
}

// The fast road's scores where the CPU has AVX512_VNNI (the VNNI piece, head sizes 64 and
// 128): vpdpbusd adds four products of unsigned by signed bytes into each int32 lane, 64 codes
// a register. The keys are taken as unsigned, k + 128 (their sign bit flipped, one vpxorq per
// key line shared by the rows), against the rows' codes as they are: Σ (k + 128) · q = k · q +
// 128 · Σ q, and 128 · Σ q is the row's own (corr, once per piece), subtracted from the sum.
// The products are at most 255 · 127 and vpdpbusd does not saturate: the sums are exact, and
// the scores the other clones' bit for bit. Against |k| and q negated under k's sign bits
// (three operations per key line and one more per row and line), 1 thread, B8 H32 kv8 S4096
// d128: see piece_vnni. A tile of four rows by four keys sums its sixteen registers' lanes
// together (i32_sums16) and takes the scores a vector at a time.
QKV_VNNI inline __m512i i32_sums16(const __m512i* x) {
    // 16 -> 8: [x 2p's 8 partial sums, x 2p+1's 8]
    __m512i t[8], u[4], v[2];
    for (int p = 0; p < 8; ++p)
        t[p] = _mm512_add_epi32(_mm512_shuffle_i64x2(x[2 * p], x[2 * p + 1], 0x44),
                                _mm512_shuffle_i64x2(x[2 * p], x[2 * p + 1], 0xEE));
    // 8 -> 4: 128-bit lane L holds source 4q + L's 4 partial sums
    for (int q = 0; q < 4; ++q)
        u[q] = _mm512_add_epi32(_mm512_shuffle_i32x4(t[2 * q], t[2 * q + 1], 0x88),
                                _mm512_shuffle_i32x4(t[2 * q], t[2 * q + 1], 0xDD));
    // 4 -> 2: lane L holds sources 8r + L (elements 0, 1) and 8r + 4 + L (2, 3)
    for (int r = 0; r < 2; ++r)
        v[r] = _mm512_add_epi32(_mm512_unpacklo_epi64(u[2 * r], u[2 * r + 1]),
                                _mm512_unpackhi_epi64(u[2 * r], u[2 * r + 1]));
    // 2 -> 1: lane L holds sources L, 4 + L, 8 + L, 12 + L
    const __m512 a = _mm512_castsi512_ps(v[0]), b = _mm512_castsi512_ps(v[1]);
    return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(a, b, 0x88)),
                            _mm512_castps_si512(_mm512_shuffle_ps(a, b, 0xDD)));
}

template <int D, int RB, int KB, typename A>
QKV_VNNI inline void score_tile_i8_vnni(const int8_t* __restrict q, const float* __restrict f,
                                        const int32_t* __restrict corr, const A& k,
                                        float* __restrict s) {
    static_assert(D % 64 == 0, "whole registers of codes");
    __m512i x[RB * KB];
    for (int i = 0; i < RB * KB; ++i) x[i] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8(-128);
    for (int l = 0; l < D / 64; ++l) {
        __m512i ku[KB];
        for (int kk = 0; kk < KB; ++kk) ku[kk] = _mm512_xor_si512(_mm512_loadu_si512(k[kk] + l * 64), flip);
        for (int i = 0; i < RB; ++i) {
            const __m512i qv = _mm512_loadu_si512(q + i * D + l * 64);
            for (int kk = 0; kk < KB; ++kk) x[i * KB + kk] = _mm512_dpbusd_epi32(x[i * KB + kk], ku[kk], qv);
        }
    }
    if constexpr (RB == 4 && KB == 4) {
        // element 4L + m of the sums is row m's by key L: to row i's keys at 4i + kk
        const __m512i sums = i32_sums16(x);
        const __m512i rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const __m512i each = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        const __m512i c = _mm512_permutexvar_epi32(each, _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(corr))));
        const __m512 fv = _mm512_permutexvar_ps(each, _mm512_castps128_ps512(_mm_loadu_ps(f)));
        const __m512i dot = _mm512_sub_epi32(_mm512_permutexvar_epi32(rows, sums), c);
        const __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), fv);
        _mm_storeu_ps(s, _mm512_castps512_ps128(y));
        _mm_storeu_ps(s + DECODE_BK, _mm512_extractf32x4_ps(y, 1));
        _mm_storeu_ps(s + 2 * DECODE_BK, _mm512_extractf32x4_ps(y, 2));
        _mm_storeu_ps(s + 3 * DECODE_BK, _mm512_extractf32x4_ps(y, 3));
    } else {
        for (int i = 0; i < RB; ++i)
            for (int kk = 0; kk < KB; ++kk)
                s[i * DECODE_BK + kk] = float(_mm512_reduce_add_epi32(x[i * KB + kk]) - corr[i]) * f[i];
    }
}
#endif

template <int D, int RB, int KB, int LANES, typename A>
QKV_INLINE void score_tile_i8(const int8_t* __restrict q, const float* __restrict f, const A& k,
                              float* __restrict s) {
#if QKV_X86
    if constexpr (LANES >= 8 && D % 32 == 0) {
        score_tile_i8_avx2<D, RB, KB>(q, f, k, s);
        return;
    }
#endif
    for (int i = 0; i < RB; ++i) {
        for (int kk = 0; kk < KB; ++kk) {
            const I8q* __restrict kr = k[kk];
            int32_t dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int t = 0; t < D; ++t) dot += int32_t(q[i * D + t]) * int32_t(kr[t].code);
            s[i * DECODE_BK + kk] = float(dot) * f[i];
        }
    }
}

// RB rows' accumulators' registers [c0, c0 + CV) (acc, rows DV apart, in line()'s order)
// scaled by alpha[i], plus the n weighted value rows w[i * DECODE_BK + j] · v[j] (row j at
// v[j]: Strided or Listed): held in
// registers over the block, each value line widened once for the RB rows.
template <typename T, typename E, typename V, int DV, int RB, int CV, typename A, typename N>
QKV_INLINE void value_tile(T* __restrict acc, const T* __restrict w, const T* __restrict alpha,
                           const A& v, int64_t n, int c0,
                           const Ahead<E, int(DV * sizeof(E)), N>& next) {
    typedef Kv<T, E> KV;
    constexpr int W = int(sizeof(V) / sizeof(T)), EL = int(64 / sizeof(E));
    constexpr int NVL = int(KV::per_line * 64 / sizeof(V));
    static_assert(CV % NVL == 0, "whole lines");
    V x[RB][CV];
    for (int i = 0; i < RB; ++i) {
        for (int c = 0; c < CV; ++c) {
            std::memcpy(&x[i][c], acc + i * DV + (c0 + c) * W, sizeof(V));
            x[i][c] *= alpha[i];
        }
    }
    const int64_t at = (c0 / NVL) * EL;  // the tile's first value in a row
    // the bytes of a value row this tile reads
    constexpr int SPAN = KV::direct ? CV * int(sizeof(V)) : CV / NVL * 64;
    const int from = KV::direct ? c0 * int(sizeof(V)) : c0 / NVL * 64;
    for (int64_t j = 0; j < n; ++j) {
        next.template part<SPAN>(j, from);
        V y[CV];
        if constexpr (KV::direct)
            for (int c = 0; c < CV; ++c) y[c] = load<V>(v[j] + at + c * W);
        else
            for (int g = 0; g < CV / NVL; ++g)
                read_line<T, E, int(sizeof(V) / 4)>(v[j] + at + g * EL, y + g * NVL);
        for (int i = 0; i < RB; ++i) {
            // the weight as a scalar operand: one broadcast (V{} + w cost an add before it)
            const T wij = w[i * DECODE_BK + j];
            for (int c = 0; c < CV; ++c) x[i][c] += wij * y[c];
        }
    }
    for (int i = 0; i < RB; ++i)
        for (int c = 0; c < CV; ++c) std::memcpy(acc + i * DV + (c0 + c) * W, &x[i][c], sizeof(V));
}

// value_tile over all of a row group's registers, CV at a time, each asking for its part of
// the rows `next`.
template <typename T, typename E, typename V, int DV, int RB, int CV, typename A, typename N>
QKV_INLINE void value_rows(T* acc, const T* w, const T* alpha, const A& v, int64_t n,
                           const Ahead<E, int(DV * sizeof(E)), N>& next) {
    constexpr int NV = int(DV * sizeof(T) / sizeof(V));
    static_assert(NV % CV == 0, "whole tiles");
    for (int c0 = 0; c0 < NV; c0 += CV) value_tile<T, E, V, DV, RB, CV>(acc, w, alpha, v, n, c0, next);
}

// Tile sizes for a clone of LANES float lanes: AVX-512's 32 registers take four rows by four
// keys (two for 8-bit lines, four registers each) and four rows by four registers of values;
// narrower clones' 16 take two rows, and one where a line fills 8 registers or more. NVL:
// registers per line; NV: per row of values.
//
// AVX2 on rows of 64 floats or fewer (NV <= 8) of float32 or 16-bit K/V (NVL 2 or 4; a
// 16-bit key's line widened one key at a time: score_tile): two rows by four keys, and a row
// alone (group 1, or the row left over) by eight keys, so that a tile's lane sums are one
// halving tree (lane_sums_narrow) and its chains of FMAs (each FMA waiting for the one before
// it in its chain, a row's registers long) run 8 at a time, not 2 or 4; a row alone adds its
// values 8 registers at a time. Measured on the float32 step, 1 thread: B1 H8 kv2 S512 d32
// 70 -> 40 us (with head size 32's road of its own: piece_split), B1 H12 kv12 S512 d64 157 ->
// 144 us. Longer rows (the memory-bound step, B8 H32 kv8 S4096 d128) keep their tiles.
template <int LANES, int NVL, int NV>
struct Tiles {
    static constexpr bool wide = LANES >= 16;
    static constexpr bool short_rows = LANES == 8 && NVL <= 4 && NV <= 8;
    static constexpr int score_rows = wide ? 4 : 2;
    static constexpr int keys = wide ? (NVL >= 4 ? 2 : 4) : (NVL >= 8 ? 1 : (short_rows ? 4 : 2));
    // keys per tile of a row alone (a multiple of keys)
    static constexpr int lone_keys = short_rows ? 8 : keys;
    static constexpr int value_rows = wide ? 4 : (NVL >= 8 ? 1 : 2);
    // registers of values per tile for value_rows rows, and for fewer
    static constexpr int many = wide ? (NV < 4 ? NV : 4) : (NVL > 4 ? NVL : (NV < 4 ? NV : 4));
    static constexpr int few = wide ? (NV < 8 ? NV : 8) : (short_rows && NVL <= 2 && NV == 8 ? 8 : many);
};

// The piece of decode_piece_body for head sizes D and DV known at compile time, multiples of
// 64 bytes, written with vectors of the clone's register width (GCC/Clang vector
// extensions). A block's scores are taken in tiles of rows by keys (score_tile), and its values
// added in tiles of rows by registers of the accumulators (value_tile), so that each key and
// value line is widened once per tile of rows and the accumulators stay in registers. The
// same recurrence as decode_piece_body.
//
// Src::all_heads (pages): the piece takes every kv head of sequence b (h is ignored), head i's
// m, l and acc at m + i * R, l + i * R, acc + i * R * DV, and its scores, weights and values
// in parts of DECODE_PK keys with the heads inside: a page row holds every head's keys side
// by side (NHD), so one head's rows lie a whole page row apart (2 KiB for 8 bfloat16 heads of
// 128); taken a part at a time, every head's, the part's rows (32 KiB of bfloat16 K at most)
// are read whole while they are in L1. Each head's block keeps its recurrence: the scores of
// all its parts, then one step of m and l for the block, then the values part after part,
// each accumulator taking the same operations in the same order as the block taken whole
// (the bits of a block read head after head).
template <typename T, typename E, int D, int DV, int LANES, bool DP = false, typename Src = Flat<E>>
QKV_INLINE void decode_piece_vec(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0,
                                 int64_t j1, T* __restrict scratch, T* __restrict m,
                                 T* __restrict l, T* __restrict acc) {
    constexpr int VB = LANES * 4 < 64 ? LANES * 4 : 64;  // bytes per register
    typedef T V __attribute__((vector_size(VB), aligned(sizeof(T))));
    typedef Kv<T, E> KV;
    constexpr int NVL = int(KV::per_line * 64 / VB), NV = int(DV * sizeof(T) / VB);
    typedef Tiles<LANES, NVL, NV> TS;
    // IQ: the fast road's int8 scores (score_tile_i8), four rows by two keys: 8 int32
    // accumulators, 2 key registers and their magnitudes, within AVX2's 16 registers (four
    // keys on VNNI, within AVX-512's 32: 1 thread, B8 H32 kv8 S4096 d128, 6.1 -> 5.9 ms)
    constexpr bool IQ = std::is_same<E, I8q>::value;
    // DP: the clone's dot products, vdpbf16ps on the rows' bfloat16 bits (BF) or, for the
    // fast road, vpdpbusd on their int8 codes (score_tile_i8_vnni)
    constexpr bool BF = DP && !IQ;
    constexpr int RS = IQ ? 4 : TS::score_rows, KB = IQ ? (DP ? 4 : 2) : TS::keys;
    constexpr int RV = TS::value_rows;
    constexpr int K1 = IQ ? KB : TS::lone_keys;
    static_assert(K1 % KB == 0, "a lone row's tile a multiple of the rows' tiles");
    const int64_t R = a.group * a.L;
    const int64_t NH = Src::all_heads ? a.kv_heads : 1;  // heads of this piece
    const int64_t h0 = Src::all_heads ? 0 : h;
    T* __restrict qall = scratch;  // each head's scaled rows
    T* __restrict s = qall + NH * R * D;  // each head's block of scores
    T* __restrict alpha = s + NH * R * DECODE_BK;  // each head's factors
    T* __restrict ones = alpha + NH * R;  // R factors of 1
    T* __restrict vsc = ones + R;  // a block's value scales (scaled formats)
    // the fast road's integer values (round_weights): each head's rows' int16 weights and
    // weight scales, and (pages in parts) their int32 sums between the parts of a block
    int16_t* __restrict wq = reinterpret_cast<int16_t*>(vsc + DECODE_BK);
    float* __restrict wsc = reinterpret_cast<float*>(vsc + DECODE_BK) + NH * R * DECODE_BK / 2;
    int32_t* __restrict isum = reinterpret_cast<int32_t*>(wsc + NH * R);
    for (int64_t r = 0; r < R; ++r) ones[r] = T(1);
    constexpr int64_t PK = DECODE_PK;
    static_assert(PK % K1 == 0 && PK % KB == 0 && DECODE_BK % PK == 0, "whole tiles per part");
    for (int64_t i = 0; i < NH; ++i) {
        T* qs = qall + i * R * D;
        decode_start(a, b, h0 + i, D, DV, qs, m + i * R, l + i * R, acc + i * R * DV);
        if constexpr (BF) {  // the rows' bfloat16 bits, unscaled, over qs
            uint16_t* qb = reinterpret_cast<uint16_t*>(qs);
            for (int64_t r = 0; r < R; ++r) {
                const float* qr = query_row<float>(a, b, h0 + i, r);
                for (int t = 0; t < D; ++t) {
                    uint32_t u;
                    std::memcpy(&u, qr + t, 4);
                    qb[r * D + t] = uint16_t(u >> 16);
                }
            }
        } else if constexpr (IQ) {  // the rows' int8 codes over qs, their factors after them
            quantize_rows(a, b, h0 + i, D, reinterpret_cast<int8_t*>(qs), qs + R * D / 4);
            if constexpr (DP) {  // and each row's 128 · Σ q (score_tile_i8_vnni)
                const int8_t* c = reinterpret_cast<const int8_t*>(qs);
                int32_t* corr = reinterpret_cast<int32_t*>(qs + R * D / 4 + R);
                for (int64_t r = 0; r < R; ++r) {
                    int32_t sum = 0;
                    for (int t = 0; t < D; ++t) sum += c[r * D + t];
                    corr[r] = 128 * sum;
                }
            }
        } else if constexpr (KV::order > 1) {
            strided_order(qs, R, D, KV::order, true);
        }
    }
    Src src(a, b, h0);
    const int64_t hi = a.hi ? a.hi[b] : a.S;  // (the causal rows' limits: row_keys)
    typedef typename Src::Kv_ A;
    typedef std::integral_constant<int, 1> One;
    typedef std::integral_constant<int, RS> Rows_;
    typedef std::integral_constant<int, KB> Keys_;
    typedef std::integral_constant<int, K1> Lone_;
    // (lambdas inlined by force: one left a function of its own would be compiled without
    // the clone's target, its vectors taken a half or a quarter at a time)
    // Pages in parts (PARTS): PK keys at a time, every head's, in the AVX-512 clones. In the
    // AVX2 clone that walk measured slower than a block per head, head after head (Zen 4, 2
    // threads, B8 H32 kv8 S4096 d128, pages of 16, old and new alternating: bfloat16 10.3-10.8
    // against 12.6-13.5 ms, int8 10.8-12.9 against 13.3-19.2), so the narrower clones keep
    // the block per head.
    constexpr bool PARTS = Src::all_heads && LANES >= 16;
    // The rows read after the keys or values of head i's block from b0 (n keys, listed in
    // `slot`), asked for while they are computed (Ahead) into L2 (into L1 they measured
    // slower: the rows of this block compete with them there): the next block's, or (pages
    // a block per head) the next head's in this block. Pages in parts ask for the next
    // block's page rows whole, a share per part (Src::ask), and take no Ahead's.
    // rows(b0, slot, i): head i's rows of the block from b0 listed in slot.
    auto next = [&](auto bytes, int64_t i, int64_t b0, int64_t n, int slot, auto rows) QKV_LAMBDA_INLINE {
        constexpr int B = decltype(bytes)::value;
        if constexpr (PARTS) return Ahead<E, B, A>{rows(b0 + DECODE_BK, slot ^ 1, 0), 0};
        const bool same = Src::all_heads && i + 1 < NH;
        const int64_t ahead = same ? n : std::min<int64_t>(DECODE_BK, j1 - b0 - n);
        return same ? Ahead<E, B, A>{rows(b0, slot, i + 1), ahead}
                    : Ahead<E, B, A>{rows(b0 + DECODE_BK, slot ^ 1, 0), ahead};
    };
    typedef std::integral_constant<int, int(D * sizeof(E))> KBytes;
    typedef std::integral_constant<int, int(DV * sizeof(E))> VBytes;
    // head i's scores of keys [c0, c1) of the block of n keys from b0 (its rows listed in
    // `slot`), into si: c0 a multiple of the tiles' keys (K1), so that a block taken in parts
    // is taken in the tiles it is taken in whole
    auto scores_of = [&](int64_t i, int64_t b0, int64_t n, int64_t c0, int64_t c1, int slot) QKV_LAMBDA_INLINE {
        const T* qs = qall + i * R * D;
        T* si = s + i * R * DECODE_BK;
        // score_tile, or score_tile_dp on the rows' bits, for RB rows from r by KB keys from j
        auto scores = [&](auto rb, auto kb, int64_t r, const A& K, int64_t j) QKV_LAMBDA_INLINE {
            constexpr int RB = decltype(rb)::value, KBt = decltype(kb)::value;
            T* out = si + r * DECODE_BK + j;
#if QKV_X86
            if constexpr (BF) {
                score_tile_dp<D, RB, KBt, E>(reinterpret_cast<const uint16_t*>(qs) + r * D,
                                             K.from(j), float(a.scale), out);
                return;
            }
            if constexpr (IQ && DP) {
                score_tile_i8_vnni<D, RB, KBt>(reinterpret_cast<const int8_t*>(qs) + r * D,
                                               qs + R * D / 4 + r,
                                               reinterpret_cast<const int32_t*>(qs + R * D / 4 + R) + r,
                                               K.from(j), out);
                return;
            }
#endif
            if constexpr (IQ) {
                score_tile_i8<D, RB, KBt, LANES>(reinterpret_cast<const int8_t*>(qs) + r * D,
                                                 qs + R * D / 4 + r, K.from(j), out);
                return;
            }
            score_tile<T, E, V, D, RB, KBt, LANES>(qs + r * D, K.from(j), out);
        };
        const A K = src.k(b0, slot, i);
        const auto knext = next(KBytes{}, i, b0, n, slot, [&](int64_t nb0, int ns, int64_t ni) { return src.k(nb0, ns, ni); });
        // keys [j, j + k1): the row groups' tiles of kb keys, a row alone's one tile of k1
        auto key_tiles = [&](auto kb, auto k1, int64_t j) QKV_LAMBDA_INLINE {
            constexpr int KBt = decltype(kb)::value, K1t = decltype(k1)::value;
            for (int64_t t = j; t < j + K1t; ++t) knext.row(t);
            int64_t r = 0;
            for (; r + RS <= R; r += RS)
                for (int64_t jj = j; jj < j + K1t; jj += KBt) scores(Rows_{}, kb, r, K, jj);
            for (; r < R; ++r) scores(One{}, k1, r, K, j);
        };
        int64_t j = c0;
        if constexpr (K1 > KB) {
            if (R % RS)  // (every row in a group: the rows' tiles in the order of the others)
                for (; j + K1 <= c1; j += K1) key_tiles(Keys_{}, Lone_{}, j);
            for (; j + KB <= c1; j += KB) key_tiles(Keys_{}, Keys_{}, j);
            for (; j < c1; ++j) key_tiles(One{}, One{}, j);
        } else {  // the other tiles as they were (the memory-bound steps measured no faster)
            for (; j + KB <= c1; j += KB) {
                for (int64_t t = j; t < j + KB; ++t) knext.row(t);
                int64_t r = 0;
                for (; r + RS <= R; r += RS) scores(Rows_{}, Keys_{}, r, K, j);
                for (; r < R; ++r) scores(One{}, Keys_{}, r, K, j);
            }
            for (; j < c1; ++j) {
                int64_t r = 0;
                for (; r + RS <= R; r += RS) scores(Rows_{}, One{}, r, K, j);
                for (; r < R; ++r) scores(One{}, One{}, r, K, j);
            }
        }
    };
    // head i's block's scores (scaled, capped) made weights: its rows' m and l updated, and
    // the factors of their accumulators at alpha + i * R
    auto weights_of = [&](int64_t i, int64_t b0, int64_t n, int slot) QKV_LAMBDA_INLINE {
        T* si = s + i * R * DECODE_BK;
        T* alphai = alpha + i * R;
        if constexpr (KV::scaled) {  // (score_tile_dp's codes are read as they are: unit 1)
            constexpr T kunit = DP || IQ ? T(1) : KV::unit;
            const auto KS = src.ks(b0, slot, i);
            for (int64_t t = 0; t < n; ++t) vsc[t] = T(*KS[t]) * kunit;
            for (int64_t r = 0; r < R; ++r)
#pragma omp simd
                for (int64_t t = 0; t < n; ++t) si[r * DECODE_BK + t] *= vsc[t];
        }
        if (a.softcap > 0) softcap_block(si, R, n, T(a.softcap));
        for (int64_t r = 0; r < R; ++r)
            alphai[r] = decode_row_step_upto(si + r * DECODE_BK, n, row_keys(a, hi, r, b0, n),
                                             m + i * R + r, l + i * R + r);
        if constexpr (KV::scaled) {  // the weights times each value row's scale
            const auto VS = src.vs(b0, slot, i);
            for (int64_t t = 0; t < n; ++t) vsc[t] = T(*VS[t]) * KV::unit;
            for (int64_t r = 0; r < R; ++r)
#pragma omp simd
                for (int64_t t = 0; t < n; ++t) si[r * DECODE_BK + t] *= vsc[t];
        }
        if constexpr (IQ)  // rounded to int16 (the fast road's values)
            for (int64_t r = 0; r < R; ++r)
                wsc[i * R + r] = round_weights(si + r * DECODE_BK, n, wq + (i * R + r) * DECODE_BK);
    };
    // head i's weighted values of keys [c0, c1) of the block added to its accumulators, which
    // the first part (c0 0) scales by alpha; the later ones by 1 (exact: each accumulator takes
    // the operations, in the order, of the block taken whole)
    auto values_of = [&](int64_t i, int64_t b0, int64_t n, int64_t c0, int64_t c1, int slot) QKV_LAMBDA_INLINE {
        T* acci = acc + i * R * DV;
        const T* w = s + i * R * DECODE_BK + c0;
        const T* al = c0 == 0 ? alpha + i * R : ones;
        const A Vb = src.v(b0, slot, i).from(c0);
        const int64_t nc = c1 - c0;
        auto vnext = next(VBytes{}, i, b0, n, slot, [&](int64_t nb0, int ns, int64_t ni) { return src.v(nb0, ns, ni).from(c0); });
        vnext.n = std::max<int64_t>(0, vnext.n - c0);  // (rows from c0 on)
        if constexpr (IQ) {  // the integer values: the block's int16 weights from c0 on
            const int16_t* wi = wq + i * R * DECODE_BK + c0;
            const float* wsi = wsc + i * R;
            const float* ali = alpha + i * R;  // (the block's factors, taken with its last part)
            int32_t* parti = isum + i * R * DV;
            const bool first = c0 == 0, last = c1 == n;
#if QKV_X86
            // four rows (two, one) share each widened, interleaved chunk
            auto rows = [&](auto rb, auto cv, int64_t r) QKV_LAMBDA_INLINE {
                constexpr int RB = decltype(rb)::value, CV = decltype(cv)::value;
                if constexpr (DP)
                    value_rows_i16_vnni<DV, RB, CV>(acci + r * DV, parti + r * DV, wi + r * DECODE_BK,
                                                    wsi + r, ali + r, Vb, nc, first, last, vnext);
                else
                    value_rows_i16_avx2<DV, RB, CV>(acci + r * DV, parti + r * DV, wi + r * DECODE_BK,
                                                    wsi + r, ali + r, Vb, nc, first, last, vnext);
            };
            if constexpr (LANES >= 8) {
                constexpr int CH = DP ? DV / 32 : DV / 16;  // chunks of a row
                constexpr int C4 = DP ? 2 : 1, C2 = CH < 4 ? CH : 4;
                typedef std::integral_constant<int, C4> C4_;
                typedef std::integral_constant<int, C2> C2_;
                int64_t r = 0;
                for (; r + 4 <= R; r += 4, vnext.n = 0) rows(std::integral_constant<int, 4>{}, C4_{}, r);
                if (r + 2 <= R) {
                    rows(std::integral_constant<int, 2>{}, C2_{}, r);
                    r += 2;
                    vnext.n = 0;
                }
                for (; r < R; ++r, vnext.n = 0) rows(One{}, C2_{}, r);
                return;
            }
#endif
            // (the baseline clone: no parts, c0 0 and c1 n)
            value_rows_i16(acci, DV, R, wi, wsi, ali, Vb, nc, reinterpret_cast<int32_t*>(parti));
            return;
        }
        // the values' tiles (each row group's tiles read the block again; the first row
        // group's ask for the next block's values)
        int64_t r = 0;
        for (; r + RV <= R; r += RV, vnext.n = 0)
            value_rows<T, E, V, DV, RV, TS::many>(acci + r * DV, w + r * DECODE_BK, al + r, Vb, nc, vnext);
        if (RV > 2 && r + 2 <= R) {
            value_rows<T, E, V, DV, 2, TS::few>(acci + r * DV, w + r * DECODE_BK, al + r, Vb, nc, vnext);
            r += 2;
            vnext.n = 0;
        }
        for (; r < R; ++r, vnext.n = 0)
            value_rows<T, E, V, DV, 1, TS::few>(acci + r * DV, w + r * DECODE_BK, al + r, Vb, nc, vnext);
    };
    int slot = 0;
    src.list(j0, std::min<int64_t>(DECODE_BK, j1 - j0), slot);
    src.ask(slot, 0, 1);
    for (int64_t b0 = j0; b0 < j1; b0 += DECODE_BK, slot ^= 1) {
        const int64_t n = std::min<int64_t>(DECODE_BK, j1 - b0);
        src.list(b0 + DECODE_BK, std::min<int64_t>(DECODE_BK, j1 - b0 - n), slot ^ 1);
        if constexpr (Src::all_heads && !PARTS) {
            // a block per head, head after head; the next block's page rows: a share while
            // each head is computed, or (4-byte values, for which that measured faster) all
            // of it with the first
            const int64_t parts = sizeof(E) >= 4 ? 1 : NH;
            for (int64_t i = 0; i < NH; ++i) {
                if (i < parts) src.ask(slot ^ 1, i, parts);
                scores_of(i, b0, n, 0, n, slot);
                weights_of(i, b0, n, slot);
                values_of(i, b0, n, 0, n, slot);
            }
        } else if constexpr (PARTS) {
            // PK keys at a time, every head's (a page row holds every head's keys side by
            // side: its lines read close in time), first the scores, then the weights, then
            // the values; the next block's page rows asked for a share per part
            const int64_t chunks = (n + PK - 1) / PK, parts = 2 * chunks * NH;
            int64_t part = 0;
            for (int64_t c0 = 0; c0 < n; c0 += PK)
                for (int64_t i = 0; i < NH; ++i) {
                    src.ask(slot ^ 1, part++, parts);
                    scores_of(i, b0, n, c0, std::min(c0 + PK, n), slot);
                }
            for (int64_t i = 0; i < NH; ++i) weights_of(i, b0, n, slot);
            for (int64_t c0 = 0; c0 < n; c0 += PK)
                for (int64_t i = 0; i < NH; ++i) {
                    src.ask(slot ^ 1, part++, parts);
                    values_of(i, b0, n, c0, std::min(c0 + PK, n), slot);
                }
        } else {
            scores_of(0, b0, n, 0, n, slot);
            weights_of(0, b0, n, slot);
            values_of(0, b0, n, 0, n, slot);
        }
    }
    if constexpr (KV::order > 1)
        for (int64_t i = 0; i < NH; ++i) strided_order(acc + i * R * DV, R, DV, KV::order, false);
}

// The piece for head sizes without a road of their own (decode_piece_body; with pages, every
// head, one after another).
template <typename T, typename E, typename Src>
QKV_INLINE void decode_piece_general(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0,
                                     int64_t j1, T* sc, T* m, T* l, T* acc) {
    if constexpr (Src::all_heads) {
        const int64_t R = a.group * a.L;
        for (int64_t i = 0; i < a.kv_heads; ++i)
            decode_piece_body<T, E, Src>(a, b, i, j0, j1, sc, m + i * R, l + i * R, acc + i * R * a.dv);
    } else {
        decode_piece_body<T, E, Src>(a, b, h, j0, j1, sc, m, l, acc);
    }
}

// A piece: keys [j0, j1) of kv head h of sequence b (with a block table: of every kv head,
// h ignored, each head's m, l and acc after the previous head's), scratch, m, l, acc.
typedef void (*piece_t)(const qkv_decode_args&, int64_t, int64_t, int64_t, int64_t, void*,
                        void*, void*, void*);

}  // namespace

// The pieces, one function per clone, K/V form and where the rows lie (piece_<clone>_<form>:
// one run per sequence; piece_<clone>_<form>_paged: pages through a block table). Each
// clone's are compiled in units of their own, its contiguous pieces in one and its paged ones
// in another (decode_<clone>.cpp and decode_<clone>_paged.cpp: this file with QKV_DECODE_UNIT
// set to the clone's code, and QKV_DECODE_PAGED to 1 for the paged ones), so that the build
// compiles them in parallel, each instantiation once; this file itself (QKV_DECODE_UNIT 0)
// compiles the baseline clone's contiguous pieces, run_decode and the C ABI, and
// decode_paged.cpp the baseline's paged ones. Every unit declares them all. Hidden (pool.h's
// namespace): no part of the library's C ABI.
#ifndef QKV_DECODE_UNIT
#define QKV_DECODE_UNIT 0
#endif
#ifndef QKV_DECODE_PAGED
#define QKV_DECODE_PAGED 0
#endif
namespace qkv_native __attribute__((visibility("hidden"))) {

#define QKV_PIECE_HEAD(ATTR, NAME)                                                        \
    ATTR void NAME(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0, int64_t j1, \
                   void* sc, void* m, void* l, void* acc)
// LANES: the float lanes of the clone's registers
#define QKV_PIECES(ATTR, ISA, LANES)                                \
    QKV_PIECE(ATTR, piece_##ISA##_f32, float, float, LANES)         \
    QKV_PIECE(ATTR, piece_##ISA##_f64, double, double, LANES)       \
    QKV_PIECE(ATTR, piece_##ISA##_bf16, float, Bf16, LANES)         \
    QKV_PIECE(ATTR, piece_##ISA##_f16, float, F16, LANES)           \
    QKV_PIECE(ATTR, piece_##ISA##_i8, float, I8, LANES)             \
    QKV_PIECE(ATTR, piece_##ISA##_e4m3, float, E4m3, LANES)         \
    QKV_PIECE(ATTR, piece_##ISA##_i8q, float, I8q, LANES)
#define QKV_PIECE(ATTR, NAME, T, E, LANES) \
    QKV_PIECE_HEAD(ATTR, NAME);            \
    QKV_PIECE_HEAD(ATTR, NAME##_paged);
QKV_PIECES(, base, 4)
#if QKV_X86
QKV_PIECES(QKV_AVX2, avx2, 8)
QKV_PIECES(QKV_AVX512, avx512, 16)
QKV_PIECE(QKV_BF16, piece_avx512bf16_bf16, , , )
QKV_PIECE(QKV_BF16, piece_avx512bf16_i8, , , )
QKV_PIECE(QKV_BF16, piece_avx512bf16_e4m3, , , )
QKV_PIECE(QKV_VNNI, piece_avx512vnni_i8q, , , )
#endif
#undef QKV_PIECE

// This unit's pieces: Src the rows' road (Flat or Paged), SFX the name's ending.
#if QKV_DECODE_PAGED
#define QKV_SRC Paged
#define QKV_PIECE_NAME(NAME) NAME##_paged
#else
#define QKV_SRC Flat
#define QKV_PIECE_NAME(NAME) NAME
#endif
// This unit's clone: its attribute and float lanes (QKV_CLONE_ATTR unset: no pieces here).
#if QKV_DECODE_UNIT == 0
#define QKV_CLONE_ATTR
#define QKV_CLONE_LANES 4
#elif QKV_X86 && QKV_DECODE_UNIT == 2
#define QKV_CLONE_ATTR QKV_AVX2
#define QKV_CLONE_LANES 8
#elif QKV_X86 && QKV_DECODE_UNIT == 3
#define QKV_CLONE_ATTR QKV_AVX512
#define QKV_CLONE_LANES 16
#endif
#ifdef QKV_CLONE_LANES
// A piece's roads, each a function of its own (noinline: a piece function holding all three
// inlined made GCC's passes that grow faster than the function take most of the compile):
// head sizes 64 and 128 (and 32 for float32 and bfloat16) unrolled (vec), others general
// (any). One call per piece of >= 256 keys, in the clone's target.
#if QKV_DECODE_UNIT == 2 && QKV_DECODE_PAGED
// The AVX2 clone's paged roads without GCC's second scheduling pass (after register
// allocation): with it, the bfloat16 paged step measured 6-9% slower than when these roads
// shared a function with the contiguous ones (1 thread, B8 H32 kv8 S4096 d128; the
// score tiles' key loads moved next to their uses); without it, the same speed.
#define QKV_ROAD_OPT __attribute__((optimize("no-schedule-insns2")))
#else
#define QKV_ROAD_OPT
#endif
template <typename T, typename E, int D, typename Src>
__attribute__((noinline)) QKV_ROAD_OPT QKV_CLONE_ATTR void piece_vec(const qkv_decode_args& a, int64_t b,
                                                        int64_t h, int64_t j0, int64_t j1, T* sc,
                                                        T* m, T* l, T* acc) {
    decode_piece_vec<T, E, D, D, QKV_CLONE_LANES, false, Src>(a, b, h, j0, j1, sc, m, l, acc);
}

template <typename T, typename E, typename Src>
__attribute__((noinline)) QKV_CLONE_ATTR void piece_any(const qkv_decode_args& a, int64_t b,
                                                        int64_t h, int64_t j0, int64_t j1, T* sc,
                                                        T* m, T* l, T* acc) {
    decode_piece_general<T, E, Src>(a, b, h, j0, j1, sc, m, l, acc);
}

template <typename T, typename E, typename Src>
QKV_INLINE void piece_split(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0,
                            int64_t j1, void* sc, void* m, void* l, void* acc) {
    T* S = static_cast<T*>(sc);
    T* M = static_cast<T*>(m);
    T* L = static_cast<T*>(l);
    T* A = static_cast<T*>(acc);
    // head size 32 for float32 and bfloat16 K/V only (a small model's heads; the other forms'
    // rows of 32 are not whole lines, or not worth their compile time)
    constexpr bool d32 = std::is_same<E, float>::value || std::is_same<E, Bf16>::value;
    if constexpr (d32)
        if (a.d == 32 && a.dv == 32) return piece_vec<T, E, 32, Src>(a, b, h, j0, j1, S, M, L, A);
    if constexpr (d32)
        if (a.d == 256 && a.dv == 256) return piece_vec<T, E, 256, Src>(a, b, h, j0, j1, S, M, L, A);
    if (a.d == 64 && a.dv == 64)
        piece_vec<T, E, 64, Src>(a, b, h, j0, j1, S, M, L, A);
    else if (a.d == 128 && a.dv == 128)
        piece_vec<T, E, 128, Src>(a, b, h, j0, j1, S, M, L, A);
    else
        piece_any<T, E, Src>(a, b, h, j0, j1, S, M, L, A);
}

#define QKV_PIECE(ATTR, NAME, T, E, LANES)                                       \
    QKV_PIECE_HEAD(ATTR, QKV_PIECE_NAME(NAME)) {                                  \
        piece_split<T, E, QKV_SRC<E>>(a, b, h, j0, j1, sc, m, l, acc);            \
    }
#endif
#if QKV_DECODE_UNIT == 0
QKV_PIECES(, base, 4)
#elif QKV_X86 && QKV_DECODE_UNIT == 2
QKV_PIECES(QKV_AVX2, avx2, 8)
#elif QKV_X86 && QKV_DECODE_UNIT == 3
QKV_PIECES(QKV_AVX512, avx512, 16)
#endif
#undef QKV_PIECES
#undef QKV_PIECE
#undef QKV_PIECE_HEAD

#if QKV_X86 && QKV_DECODE_UNIT == 3  // with the AVX-512 pieces, which they fall back to
// Whether the R query rows of kv head h of sequence b hold bfloat16 values (a model's
// bfloat16 queries, widened to float32 by the caller: their low 16 bits 0) that
// score_tile_dp takes as they are: none subnormal (vdpbf16ps would read it as 0, however
// large the key it multiplies) and all below 2^64 in magnitude, so that the subnormal keys
// it reads as 0 change a score by less than d · 2^-62 (and infinities and NaN go the other
// way).
inline bool rows_are_bf16(const qkv_decode_args& a, int64_t b, int64_t h) {
    bool ok = true;
    for (int64_t r = 0; r < a.group * a.L; ++r) {
        const float* qr = query_row<float>(a, b, h, r);
        for (int64_t t = 0; t < a.d; ++t) {
            uint32_t u;
            std::memcpy(&u, qr + t, 4);
            const uint32_t e = (u >> 23) & 0xFF;
            ok &= (u & 0xFFFFu) == 0 && (e == 0 ? (u & 0x7FFFFFu) == 0 : e < 127 + 64);
        }
    }
    return ok;
}

// bfloat16, int8 or float8 e4m3fn K/V where the CPU has AVX512_BF16: the scores on vdpbf16ps
// for rows of bfloat16 values and head sizes 64 and 128, the values' products widened in
// registers (the weights are not bfloat16); other rows and sizes go to the AVX-512 piece.
// Each head size's road a function of its own, as piece_vec.
template <typename E, int D, typename Src>
__attribute__((noinline)) QKV_BF16 void piece_dp(const qkv_decode_args& a, int64_t b, int64_t h,
                                                 int64_t j0, int64_t j1, float* sc, float* m,
                                                 float* l, float* acc) {
    decode_piece_vec<float, E, D, D, 16, true, Src>(a, b, h, j0, j1, sc, m, l, acc);
}

template <typename E>
QKV_BF16 void piece_avx512bf16(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0,
                               int64_t j1, void* sc, void* m, void* l, void* acc, piece_t other) {
    typedef QKV_SRC<E> Src;
    float* S = static_cast<float*>(sc);
    float* M = static_cast<float*>(m);
    float* L = static_cast<float*>(l);
    float* A = static_cast<float*>(acc);
    const bool paged = Src::all_heads;  // (a piece of every head: decode_piece_vec)
    bool bf16 = true;
    for (int64_t i = paged ? 0 : h; i < (paged ? a.kv_heads : h + 1); ++i) bf16 &= rows_are_bf16(a, b, i);
    if (a.d == 64 && a.dv == 64 && bf16)
        piece_dp<E, 64, Src>(a, b, h, j0, j1, S, M, L, A);
    else if (a.d == 128 && a.dv == 128 && bf16)
        piece_dp<E, 128, Src>(a, b, h, j0, j1, S, M, L, A);
    else
        other(a, b, h, j0, j1, sc, m, l, acc);
}

#define QKV_PIECE_DP(FORM, E)                                                            \
    QKV_PIECE_HEAD_DP(QKV_PIECE_NAME(piece_avx512bf16_##FORM)) {                          \
        piece_avx512bf16<E>(a, b, h, j0, j1, sc, m, l, acc, QKV_PIECE_NAME(piece_avx512_##FORM)); \
    }
#define QKV_PIECE_HEAD_DP(NAME)                                                               \
    QKV_BF16 void NAME(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0, int64_t j1, \
                       void* sc, void* m, void* l, void* acc)
QKV_PIECE_DP(bf16, Bf16)
QKV_PIECE_DP(i8, I8)
QKV_PIECE_DP(e4m3, E4m3)
#undef QKV_PIECE_DP
#undef QKV_PIECE_HEAD_DP

// The fast road where the CPU has AVX512_VNNI: the int8 scores on vpdpbusd
// (score_tile_i8_vnni) for head sizes 64 and 128, the others on the AVX-512 piece. Measured
// on the AVX-512 piece's AVX2 scores, 1 thread, B8 H32 kv8 S4096 d128 (Zen 4): 1.62x the
// exact bfloat16 step's time. Its values in integers (value_tile_i16_vnni) took the step from
// 22.5 to 21.5 ns per key row there (shared machine, best of 7), and then the scores on the
// keys' flipped sign bit with a tile's sums reduced together (i32_sums16, where a call per
// four sums had stayed out of line) to 16.1 ns: 0.60-0.72x the bfloat16 step's time.
template <int D, typename Src>
__attribute__((noinline)) QKV_VNNI void piece_vnni(const qkv_decode_args& a, int64_t b, int64_t h,
                                                   int64_t j0, int64_t j1, float* sc, float* m,
                                                   float* l, float* acc) {
    decode_piece_vec<float, I8q, D, D, 16, true, Src>(a, b, h, j0, j1, sc, m, l, acc);
}

QKV_VNNI void QKV_PIECE_NAME(piece_avx512vnni_i8q)(const qkv_decode_args& a, int64_t b, int64_t h,
                                                   int64_t j0, int64_t j1, void* sc, void* m,
                                                   void* l, void* acc) {
    typedef QKV_SRC<I8q> Src;
    float* S = static_cast<float*>(sc);
    float* M = static_cast<float*>(m);
    float* L = static_cast<float*>(l);
    float* A = static_cast<float*>(acc);
    if (a.d == 64 && a.dv == 64)
        piece_vnni<64, Src>(a, b, h, j0, j1, S, M, L, A);
    else if (a.d == 128 && a.dv == 128)
        piece_vnni<128, Src>(a, b, h, j0, j1, S, M, L, A);
    else
        QKV_PIECE_NAME(piece_avx512_i8q)(a, b, h, j0, j1, sc, m, l, acc);
}
#endif
#undef QKV_SRC
#undef QKV_PIECE_NAME
#undef QKV_ROAD_OPT

}  // namespace qkv_native

#if QKV_DECODE_UNIT == 0 && !QKV_DECODE_PAGED
#include "widen.h"

namespace {

using namespace qkv_native;

// The piece for compute type T (float or double) and K/V storage `format` in the clone the
// call asked for (0 the widest, 4 AVX-512 with AVX512_BF16, as the prefill's codes), for rows
// in one run per sequence or in pages (`paged`); NULL for a format T does not read (every
// stored form but its own is computed in float).
template <typename T>
piece_t pick_piece(int64_t asked, int64_t format, bool paged) {
    const int isa = chosen_isa(asked);
#define QKV_PICK(FORM) \
    (paged ? pick_clone<piece_t>(isa, QKV_CLONES(piece, FORM##_paged)) : pick_clone<piece_t>(isa, QKV_CLONES(piece, FORM)))
    if (sizeof(T) == 8) return format == KV_SAME ? QKV_PICK(f64) : nullptr;
#if QKV_X86
    if ((asked == 0 || asked >= 4) && cpu_has_bf16()) {  // vdpbf16ps for the keys' scores
        if (format == KV_BF16) return paged ? piece_avx512bf16_bf16_paged : piece_avx512bf16_bf16;
        if (format == KV_INT8) return paged ? piece_avx512bf16_i8_paged : piece_avx512bf16_i8;
        if (format == KV_E4M3) return paged ? piece_avx512bf16_e4m3_paged : piece_avx512bf16_e4m3;
    }
    if (format == (KV_INT8 | KV_FAST) && (asked == 0 || asked >= 4) && cpu_has_vnni())
        return paged ? piece_avx512vnni_i8q_paged : piece_avx512vnni_i8q;
#endif
    switch (format) {
        case KV_SAME:
            return QKV_PICK(f32);
        case KV_BF16:
            return QKV_PICK(bf16);
        case KV_F16:
            return QKV_PICK(f16);
        case KV_INT8:
            return QKV_PICK(i8);
        case KV_E4M3:
            return QKV_PICK(e4m3);
        case KV_INT8 | KV_FAST:
            return QKV_PICK(i8q);
        default:
            return nullptr;
    }
#undef QKV_PICK
}

// Each sequence's run of visible keys [lo, hi) from a boolean mask row; false when a row's
// visible keys are not one run, or none.
bool mask_runs(const qkv_decode_args& a, std::vector<int64_t>& lo, std::vector<int64_t>& hi) {
    lo.resize(size_t(a.nseq));
    hi.resize(size_t(a.nseq));
    for (int64_t b = 0; b < a.nseq; ++b) {
        const uint8_t* m = a.mask + b * a.mask_bs;
        int64_t j = 0;
        while (j < a.S && !m[j * a.mask_js]) ++j;
        if (j == a.S) return false;
        const int64_t first = j;
        while (j < a.S && m[j * a.mask_js]) ++j;
        const int64_t last = j;
        while (j < a.S && !m[j * a.mask_js]) ++j;
        if (j != a.S) return false;  // a second run
        lo[size_t(b)] = first;
        hi[size_t(b)] = last;
    }
    return true;
}

template <typename T>
int run_decode(const qkv_decode_args& given) {
    qkv_decode_args a = given;
    std::vector<int64_t> mlo, mhi;
    if (a.mask) {
        try {
            if (!mask_runs(a, mlo, mhi)) return 4;
        } catch (...) {
            return 1;
        }
        a.lo = mlo.data();
        a.hi = mhi.data();
    }
    // Every sequence's run of keys lies in the buffers, whatever the caller's lengths say
    // (a cache whose lengths outgrew its buffers is refused, never read past its end).
    for (int64_t b = 0; b < a.nseq; ++b) {
        const int64_t lo = a.lo ? a.lo[b] : 0, hi = a.hi ? a.hi[b] : a.S;
        if (lo < 0 || hi > a.S || lo > hi) return 5;
    }
    // Paged: every page those keys lie in is one of the pool's (else nothing is read).
    if (a.block_table) {
        if (a.page_size < 1 || a.num_blocks < 0 || a.bt_rs < 0) return 2;
        for (int64_t b = 0; b < a.nseq; ++b) {
            const int64_t lo = a.lo ? a.lo[b] : 0, hi = a.hi ? a.hi[b] : a.S;
            if (lo == hi) continue;
            const int32_t* row = a.block_table + b * a.bt_rs;
            for (int64_t p = lo / a.page_size; p <= (hi - 1) / a.page_size; ++p)
                if (row[p] < 0 || row[p] >= a.num_blocks) return 6;
        }
    }
    const int64_t R = a.group * a.L, units = a.nseq * a.kv_heads;
    if (units == 0) return 0;  // no sequence: nothing to write
    const int64_t threads = std::max<int64_t>(1, a.threads);
    const int64_t least = 256;  // keys per piece at least
    int64_t longest = 0;
    for (int64_t b = 0; b < a.nseq; ++b)
        longest = std::max(longest, (a.hi ? a.hi[b] : a.S) - (a.lo ? a.lo[b] : 0));
    // Pages: a piece takes every kv head of its sequence (decode_piece_vec), so a split has
    // one item per sequence; else one per sequence and head.
    const bool paged = a.block_table != nullptr;
    const int64_t items = paged ? a.nseq : units;
    // a few items per thread, so that none waits long for the last; pieces of >= least keys
    // (one thread: none split, as it would only add pieces to merge)
    const int64_t want = threads > 1 ? (4 * threads + items - 1) / items : 1;
    const int64_t splits = std::max<int64_t>(1, std::min(want, longest / least));
    const int64_t ntasks = items * splits, nparts = units * splits;
    // the part of head h of sequence b over its piece c: a paged piece's heads side by side
    auto part = [&](int64_t b, int64_t h, int64_t c) {
        return paged ? (b * splits + c) * a.kv_heads + h : (b * a.kv_heads + h) * splits + c;
    };
    // One piece per head (one thread, or short runs of keys): its accumulators are the
    // output's rows (part(b, h, 0) = b · kv_heads + h, the output's head), normalised in place
    // below; else every piece's go to `parts`, merged into the output.
    const bool whole = splits == 1;
    std::vector<T> parts;
    try {
        parts.resize(size_t(nparts * R * (whole ? 2 : 2 + a.dv)));
    } catch (...) {
        return 1;
    }
    const piece_t piece = pick_piece<T>(a.isa, a.kv_format, paged);
    if (!piece) return 2;
    const bool scaled = a.kv_format == KV_INT8 || a.kv_format == KV_E4M3 || a.kv_format == (KV_INT8 | KV_FAST);
    if (scaled && !(a.k_scale && a.v_scale)) return 2;
    T* PM = parts.data();  // per item: R maxima, then R sums, then R x dv accumulators
    T* PL = PM + nparts * R;
    T* PA = whole ? static_cast<T*>(a.out) : PL + nparts * R;
    // see decode_piece_vec (a paged piece holds every head's scaled rows, scores and factors)
    const int64_t NH = paged ? a.kv_heads : 1;
    // (the fast road's integer values: each head's rows' int16 weights, weight scales and
    // factors, and their int32 sums)
    const int64_t ints = a.kv_format == (KV_INT8 | KV_FAST) ? NH * R * (DECODE_BK / 2 + 2 + a.dv) + a.dv : 0;
    const int64_t scratch = R * (NH * (a.d + DECODE_BK + 1) + 1) + DECODE_BK + ints;
    auto init = [&](std::vector<T>& sc) {
        sc.resize(size_t(scratch));
        return true;
    };
    auto work = [&](std::vector<T>& sc, int64_t t) {
        const int64_t c = t % splits, h = paged ? 0 : (t / splits) % a.kv_heads;
        const int64_t b = t / (splits * (paged ? 1 : a.kv_heads));
        const int64_t lo = a.lo ? a.lo[b] : 0, hi = a.hi ? a.hi[b] : a.S;
        const int64_t width = (hi - lo + splits - 1) / splits;
        const int64_t j0 = std::min(lo + c * width, hi), j1 = std::min(j0 + width, hi);
        const int64_t p = part(b, h, c);
        piece(a, b, h, j0, j1, sc.data(), PM + p * R, PL + p * R, PA + p * R * a.dv);
    };
    if (for_tasks<std::vector<T>>(ntasks, threads, a.parallel, init, work)) return 1;
    // merge each head's pieces into its rows of out and lse
    const T ninf = -std::numeric_limits<T>::infinity();
    T* OUT = static_cast<T*>(a.out);
    T* LSE = static_cast<T*>(a.lse);
    // set where an output is not finite: an integer flag per element, or-ed (a float sum of
    // o · 0, NaN for an infinite or NaN o, chained one dependent addition per output element:
    // a fifth of a B8 H8 S16 d64 step's time)
    int32_t bad = 0;
    // row `at`'s output o, its weighted sum of values, divided by the sum of its weights
    // lsum, and its lse M + log(lsum); a row with no key at all (M -inf, lsum 0): output 0,
    // lse -inf (a NaN lsum carried from a piece makes the row NaN)
    auto finish_row = [&](T* o, T M, T lsum, int64_t at) {
        if (M == ninf && lsum == T(0)) {
            for (int64_t c = 0; c < a.dv; ++c) o[c] = 0;
            if (LSE) LSE[at] = ninf;
            return;
        }
        const T inv = T(1) / lsum;
        int32_t row_bad = 0;
#pragma omp simd reduction(| : row_bad)
        for (int64_t e = 0; e < a.dv; ++e) {
            o[e] *= inv;
            row_bad |= int32_t(!(std::fabs(o[e]) <= std::numeric_limits<T>::max()));
        }
        bad |= row_bad;
        if (LSE) LSE[at] = M + std::log(lsum);
    };
    // the prior part's row r of unit u: its output (normalised: a sum of weights 1) and lse
    const T* PO = static_cast<const T*>(a.prior_out);
    const T* PS = static_cast<const T*>(a.prior_lse);
    const bool prior = PO && PS;
    // adds the prior part of row r of unit (ub, uh) to o, a sum of weights lsum whose largest
    // score is M (M raised to the prior's lse where that is larger: o and lsum rescaled)
    auto add_prior = [&](T* o, T& M, T& lsum, int64_t ub, int64_t uh, int64_t r) {
        const T pl = PS[ub * a.pl_bs + uh * a.pl_hs + r];
        const T* po = PO + ub * a.po_bs + uh * a.po_hs + r * a.dv;
        if (pl != pl) {  // NaN carried from the prior part
            lsum = pl;
            return;
        }
        if (pl == ninf) return;  // a prior part with no key
        if (M == ninf) {  // no key of this call's: the prior part alone
            for (int64_t e = 0; e < a.dv; ++e) o[e] = 0;
            lsum = 0;
            M = pl;
        } else if (pl > M) {
            const T w = exp_neg(M - pl);
            for (int64_t e = 0; e < a.dv; ++e) o[e] *= w;
            lsum *= w;
            M = pl;
        }
        const T w = exp_neg(pl - M);
        lsum += w;
        for (int64_t e = 0; e < a.dv; ++e) o[e] += po[e] * w;
    };
    for (int64_t u = 0; u < units; ++u) {
        const int64_t ub = u / a.kv_heads, uh = u % a.kv_heads;
        for (int64_t r = 0; r < R; ++r) {
            T* o = OUT + (u * R + r) * a.dv;
            if (whole) {  // (the piece's accumulators are the row already)
                T M = PM[u * R + r], lsum = PL[u * R + r];
                if (prior && lsum == lsum) add_prior(o, M, lsum, ub, uh, r);
                finish_row(o, M, lsum, u * R + r);
                continue;
            }
            T M = ninf;
            for (int64_t c = 0; c < splits; ++c) M = std::max(M, PM[part(ub, uh, c) * R + r]);
            if (prior) M = std::max(M, PS[ub * a.pl_bs + uh * a.pl_hs + r]);
            T lsum = 0;
            for (int64_t c = 0; c < a.dv; ++c) o[c] = 0;
            for (int64_t c = 0; c < splits; ++c) {
                const int64_t t = part(ub, uh, c);
                const T mi = PM[t * R + r], li = PL[t * R + r];
                if (li != li) {  // NaN carried from a piece
                    lsum = li;
                    continue;
                }
                if (mi == ninf) continue;  // a piece with no key
                const T w = exp_neg(mi - M);
                lsum += li * w;
                const T* ai = PA + (t * R + r) * a.dv;
                for (int64_t e = 0; e < a.dv; ++e) o[e] += ai[e] * w;
            }
            if (prior && lsum == lsum) add_prior(o, M, lsum, ub, uh, r);
            finish_row(o, M, lsum, u * R + r);
        }
    }
    return bad ? 3 : 0;
}

// q and out in the 16-bit form `format` (KV_BF16 or KV_F16; q's strides in its elements),
// computed in float32 as run_decode<float> computes them on q widened (exactly), and the
// output narrowed to nearest even: the bits of that call's output narrowed as NumPy, ml_dtypes
// and PyTorch narrow it. lse stays float32. A small call on 16-bit tensors spent as long in
// PyTorch's widening of q and narrowing of the output as in the step.
int run_decode_io16(const qkv_decode_args& a, int format) {
    const int64_t H = a.kv_heads * a.group, rows = a.nseq * H * a.L;
    std::vector<float> qw, ow;
    try {
        qw.resize(size_t(rows * a.d));
        ow.resize(size_t(rows * a.dv));
    } catch (...) {
        return 1;
    }
    const int isa = chosen_isa(a.isa);
    const widen_t widen = pick_widen(isa, format);
    const uint16_t* q = static_cast<const uint16_t*>(a.q);
    for (int64_t b = 0; b < a.nseq; ++b)
        for (int64_t h = 0; h < H; ++h)
            widen(q + b * a.q_bs + h * a.q_hs, a.q_ls, a.L, a.d, qw.data() + (b * H + h) * a.L * a.d);
    qkv_decode_args w = a;
    w.q = qw.data();
    w.q_bs = H * a.L * a.d;
    w.q_hs = a.L * a.d;
    w.q_ls = a.d;
    w.out = ow.data();
    const int status = run_decode<float>(w);
    if (status == 0) pick_narrow(isa, format)(ow.data(), rows * a.dv, static_cast<uint16_t*>(a.out));
    return status;
}

// Whether the decode step refuses a's sizes (status 2).
inline bool bad_decode_args(const qkv_decode_args* a) {
    return !a || a->nseq < 0 || a->kv_heads < 1 || a->group < 1 || a->L < 1 || a->d < 1 ||
           a->dv < 1 || a->S < 0;
}

}  // namespace

extern "C" {

int qkv_decode_f32_bf16io(const qkv_decode_args* a) {
    if (bad_decode_args(a)) return 2;
    return run_decode_io16(*a, KV_BF16);
}

int qkv_decode_f32_f16io(const qkv_decode_args* a) {
    if (bad_decode_args(a)) return 2;
    return run_decode_io16(*a, KV_F16);
}

int qkv_decode_f32(const qkv_decode_args* a) {
    if (bad_decode_args(a)) return 2;
    return run_decode<float>(*a);
}

int qkv_decode_f64(const qkv_decode_args* a) {
    if (bad_decode_args(a)) return 2;
    return run_decode<double>(*a);
}

// A kept small call (see abi.h): fn on a copy of the kept arguments t, the call's four
// addresses put in (t itself may serve another thread's call at the same time).
int qkv_decode_at(qkv_decode_fn fn, const qkv_decode_args* t, const void* q, const void* k,
                  const void* v, void* out) {
    if (!fn || !t) return 2;
    const qkv_decode_args a = with_addresses(*t, q, k, v, out);
    return fn(&a);
}

int64_t qkv_decode_args_size(void) { return int64_t(sizeof(qkv_decode_args)); }

int64_t qkv_kv_format_code(const char* name) {
    if (!name) return -1;
    if (!std::strcmp(name, "bfloat16")) return KV_BF16;
    if (!std::strcmp(name, "float16")) return KV_F16;
    if (!std::strcmp(name, "int8")) return KV_INT8;
    if (!std::strcmp(name, "int8 fast")) return KV_INT8 | KV_FAST;
    if (!std::strcmp(name, "float8_e4m3fn")) return KV_E4M3;
    return -1;
}

// The widest vector clone this CPU runs: 1 baseline, 2 AVX2, 3 AVX-512.
int qkv_best_isa(void) { return best_isa(); }

}  // extern "C"
#endif  // QKV_DECODE_UNIT == 0 && !QKV_DECODE_PAGED


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

namespace {

constexpr int64_t DECODE_BK = 64;  // keys per score block

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

// A piece's start: the scaled query rows of kv head h of sequence b into qs (R x d), the rows'
// running max -inf, sum 0 and accumulators (R x dv) 0.
template <typename T>
QKV_INLINE void decode_start(const qkv_decode_args& a, int64_t b, int64_t h, int64_t d,
                             int64_t dv, T* __restrict qs, T* __restrict m, T* __restrict l,
                             T* __restrict acc) {
    const int64_t R = a.group * a.L, L = a.L;
    const T sc = T(a.scale);
    const T* Q = static_cast<const T*>(a.q) + b * a.q_bs + h * a.group * a.q_hs;
    for (int64_t r = 0; r < R; ++r) {
        const T* qr = Q + (r / L) * a.q_hs + (r % L) * a.q_ls;
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

// How K and V are stored (qkv_decode_args::kv_format; see abi.h).
enum : int64_t { KV_SAME = 0, KV_BF16 = 1, KV_F16 = 2, KV_INT8 = 3, KV_E4M3 = 4 };

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

// Stored keys and values read as the compute type T, widened in registers: get() one value,
// row<V, N>() the next N · 64 / sizeof(T) values as N 64-byte vectors V of T. A scaled format's
// values are its codes: the caller multiplies by the row's scale (once per key, not per value).
template <typename T, typename E>
struct Kv {  // stored as T
    static constexpr bool scaled = false;
    static constexpr bool by_vector = true;  // vec<V>() reads one vector (else row<V, N>() only)
    static constexpr bool paired = false;    // row<V, N>()'s order: as stored
    static QKV_INLINE T get(const E* p) { return *p; }
    template <typename V>
    static QKV_INLINE V vec(const E* p) {
        V x;
        std::memcpy(&x, p, sizeof(V));
        return x;
    }
    template <typename V, int N>
    static QKV_INLINE void row(const E* p, V* out) {
        for (int c = 0; c < N; ++c) out[c] = vec<V>(p + c * int(64 / sizeof(T)));
    }
};

typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));

// 16 stored 16-bit values from p as the zero-extended 32-bit lanes of a 64-byte vector.
QKV_INLINE U32x16 halves(const void* p) {
    typedef uint16_t H __attribute__((vector_size(32)));
    H h;
    std::memcpy(&h, p, sizeof(H));
    return __builtin_convertvector(h, U32x16);
}

// row<V, N>() of a 16-bit format that reads one vector of 16 values at a time (Self::vec).
template <typename Self, typename E>
struct VectorRows {
    template <typename V, int N>
    static QKV_INLINE void row(const E* p, V* out) {
        for (int c = 0; c < N; ++c) out[c] = Self::template vec<V>(p + c * 16);
    }
};

template <>
struct Kv<float, Bf16> {  // float32's high 16 bits
    static constexpr bool scaled = false;
    static constexpr bool by_vector = false;
    // row<V, N>() gives each 64 bytes' 32 values as two vectors, the even-numbered values then
    // the odd ones: the low and high halves of each 32-bit word, one operation each (the
    // caller holds its query rows and accumulators in that order, paired_order()).
    static constexpr bool paired = true;
    static QKV_INLINE float get(const Bf16* p) {
        const uint32_t u = uint32_t(p->bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    template <typename V, int N>
    static QKV_INLINE void row(const Bf16* p, V* out) {
        static_assert(N % 2 == 0, "rows of whole 64-byte lines");
        for (int c = 0; c < N; c += 2) {
            U32x16 w;
            std::memcpy(&w, p + c * 16, sizeof(w));
            const U32x16 even = w << 16, odd = w & 0xFFFF0000u;
            std::memcpy(&out[c], &even, sizeof(V));
            std::memcpy(&out[c + 1], &odd, sizeof(V));
        }
    }
};

// Rows x[r * n : (r + 1) * n) (r < rows; n a multiple of 32) moved between the natural order
// and Kv<float, Bf16>::row's: within each 32 values, the 16 even-numbered then the 16 odd
// (to_pairs), or back.
QKV_INLINE void paired_order(float* x, int64_t rows, int64_t n, bool to_pairs) {
    float t[32];
    for (int64_t i = 0; i < rows * n; i += 32) {
        for (int j = 0; j < 16; ++j) {
            if (to_pairs) {
                t[j] = x[i + 2 * j];
                t[16 + j] = x[i + 2 * j + 1];
            } else {
                t[2 * j] = x[i + j];
                t[2 * j + 1] = x[i + 16 + j];
            }
        }
        std::memcpy(x + i, t, sizeof(t));
    }
}

// IEEE half precision, widened with integer operations (GCC converts vectors of _Float16 one
// lane at a time): a normal value's fields move into a float32's with the exponent bias raised
// by 112; a subnormal one is its mantissa times 2^-24; infinities and NaN keep their kind.
template <>
struct Kv<float, F16> : VectorRows<Kv<float, F16>, F16> {
    static constexpr bool scaled = false;
    static constexpr bool by_vector = true;
    static constexpr bool paired = false;
    static QKV_INLINE float get(const F16* p) {
        _Float16 h;
        std::memcpy(&h, p, 2);
        return float(h);
    }
    template <typename V>
    static QKV_INLINE V vec(const F16* p) {
        typedef U32x16 U;
        typedef int32_t I __attribute__((vector_size(64)));
        const U w = halves(p);
        const U sign = (w & 0x8000) << 16, em = w & 0x7FFF, e = em >> 10;
        const U normal = sign | ((em << 13) + (112u << 23));
        const U special = sign | 0x7F800000u | ((em & 0x3FF) << 13);
        const V sub = __builtin_convertvector(I(em), V) * 0x1p-24f;
        U subu;
        std::memcpy(&subu, &sub, sizeof(U));
        const U bits = e == 0 ? (subu | sign) : (e == 31 ? special : normal);
        V x;
        std::memcpy(&x, &bits, sizeof(V));
        return x;
    }
};

// A row of 64·G bytes as 4·G vectors of 16 lanes of 32 bits, lane i of vector c holding byte
// 16c + i in its top 8 bits (the rest 0): each 64 bytes loaded at once, and each quarter's
// 4 words repeated in 4 lanes (a permute in registers), each lane shifted left by its
// byte's place. GCC widens vectors of bytes one lane at a time, or through the stack.
template <int G, typename U>
QKV_INLINE void bytes_high(const void* p, U* out) {
    const U shift = {24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0};
    for (int g = 0; g < G; ++g) {
        U w;
        std::memcpy(&w, static_cast<const char*>(p) + 64 * g, 64);
        out[4 * g + 0] = __builtin_shufflevector(w, w, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3) << shift;
        out[4 * g + 1] = __builtin_shufflevector(w, w, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7) << shift;
        out[4 * g + 2] = __builtin_shufflevector(w, w, 8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11) << shift;
        out[4 * g + 3] = __builtin_shufflevector(w, w, 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15) << shift;
    }
}

// bytes_high for a row of N vectors (N / 4 whole 64-byte lines).
template <int N>
QKV_INLINE void line_bytes(const void* p, U32x16* out) {
    static_assert(N % 4 == 0, "rows of whole 64-byte lines");
    bytes_high<N / 4>(p, out);
}

template <>
struct Kv<float, I8> {  // int8 codes
    static constexpr bool scaled = true;
    static constexpr bool by_vector = false;
    static constexpr bool paired = false;
    static QKV_INLINE float get(const I8* p) { return float(p->code); }
    template <typename V, int N>
    static QKV_INLINE void row(const I8* p, V* out) {
        U32x16 w[N];
        line_bytes<N>(p, w);
        for (int c = 0; c < N; ++c) out[c] = __builtin_convertvector(I32x16(w[c]) >> 24, V);
    }
};

// float8 e4m3fn codes: sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities. A
// normal code's fields move into a float32's with the exponent bias raised by 120; a
// subnormal one (exponent 0) is its mantissa times 2^-9.
template <>
struct Kv<float, E4m3> {
    static constexpr bool scaled = true;
    static constexpr bool by_vector = false;
    static constexpr bool paired = false;
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
    template <typename V, int N>
    static QKV_INLINE void row(const E4m3* p, V* out) {
        typedef U32x16 U;
        U ws[N];
        line_bytes<N>(p, ws);
        for (int c = 0; c < N; ++c) {
            const U w = ws[c] >> 24;
            const U mag = w & 0x7F, sign = (w & 0x80) << 24;
            const U normal = sign | ((mag << 20) + (120u << 23));
            const V sub = __builtin_convertvector(I32x16(mag), V) * 0x1p-9f;
            U subu;
            std::memcpy(&subu, &sub, sizeof(U));
            const U bits = (mag >> 3) != 0 ? normal : (subu | sign);
            std::memcpy(&out[c], &bits, sizeof(V));
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

// One piece: rows' m, l, acc over keys [j0, j1) of kv head h of sequence b, for any head
// sizes. scratch holds the scaled rows (R x d) and the block's scores (R x DECODE_BK).
template <typename T, typename E>
QKV_INLINE void decode_piece_body(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0,
                                  int64_t j1, T* __restrict scratch, T* __restrict m,
                                  T* __restrict l, T* __restrict acc) {
    typedef Kv<T, E> KV;
    const int64_t d = a.d, dv = a.dv, R = a.group * a.L;
    T* __restrict qs = scratch;
    T* __restrict s = scratch + R * d;
    decode_start(a, b, h, d, dv, qs, m, l, acc);
    const Rows<E> at(a, b, h);
    for (int64_t b0 = j0; b0 < j1; b0 += DECODE_BK) {
        const int64_t n = std::min<int64_t>(DECODE_BK, j1 - b0);
        for (int64_t j = 0; j < n; ++j) {
            const E* __restrict kr = at.k + (b0 + j) * a.k_rs;
            const T ks = KV::scaled ? T(at.ks[(b0 + j) * a.ks_rs]) : T(1);
            for (int64_t r = 0; r < R; ++r) {
                const T* __restrict qr = qs + r * d;
                T dot = 0;
#pragma omp simd reduction(+ : dot)
                for (int64_t t = 0; t < d; ++t) dot += qr[t] * KV::get(kr + t);
                s[r * DECODE_BK + j] = KV::scaled ? dot * ks : dot;
            }
        }
        if (a.softcap > 0) softcap_block(s, R, n, T(a.softcap));
        for (int64_t r = 0; r < R; ++r) {
            T* __restrict sr = s + r * DECODE_BK;
            T* __restrict ar = acc + r * dv;
            const T alpha = decode_row_step(sr, n, m + r, l + r);
            if (alpha != T(1)) {
#pragma omp simd
                for (int64_t c = 0; c < dv; ++c) ar[c] *= alpha;
            }
            for (int64_t j = 0; j < n; ++j) {
                const T p = KV::scaled ? sr[j] * T(at.vs[(b0 + j) * a.vs_rs]) : sr[j];
                const E* __restrict vr = at.v + (b0 + j) * a.v_rs;
#pragma omp simd
                for (int64_t c = 0; c < dv; ++c) ar[c] += p * KV::get(vr + c);
            }
        }
    }
}

// Sum of the lanes of a 64-byte vector: its halves added down to 16 bytes, then the lanes.
template <typename T, typename V>
QKV_INLINE T lane_sum(V x) {
    typedef T V32 __attribute__((vector_size(32)));
    typedef T V16 __attribute__((vector_size(16)));
    static_assert(sizeof(V) == 64, "a 64-byte vector");
    V32 lo, hi;
    std::memcpy(&lo, &x, 32);
    std::memcpy(&hi, reinterpret_cast<const char*>(&x) + 32, 32);
    lo += hi;
    V16 a, b;
    std::memcpy(&a, &lo, 16);
    std::memcpy(&b, reinterpret_cast<const char*>(&lo) + 16, 16);
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

// The piece of decode_piece_body for head sizes D and DV known at compile time, multiples of
// 64 bytes, written with vectors of 64 bytes (GCC/Clang vector extensions; each clone
// splits them into its own registers): a key row is loaded once for all the rows, each
// row's dot product summed in lanes and added up once, and each row's accumulator held in
// registers while a block's values are added. The same recurrence as decode_piece_body.
template <typename T, typename E, int D, int DV>
QKV_INLINE void decode_piece_vec(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0,
                                 int64_t j1, T* __restrict scratch, T* __restrict m,
                                 T* __restrict l, T* __restrict acc) {
    typedef T V __attribute__((vector_size(64), aligned(sizeof(T))));
    typedef Kv<T, E> KV;
    constexpr int W = int(64 / sizeof(T)), NQ = D / W, NV = DV / W;
    const int64_t R = a.group * a.L;
    T* __restrict qs = scratch;
    T* __restrict s = scratch + R * D;
    decode_start(a, b, h, D, DV, qs, m, l, acc);
    if constexpr (KV::paired) paired_order(qs, R, D, true);
    const Rows<E> at(a, b, h);
    const E* K = at.k;
    const E* V0 = at.v;
    for (int64_t b0 = j0; b0 < j1; b0 += DECODE_BK) {
        const int64_t n = std::min<int64_t>(DECODE_BK, j1 - b0);
        const int64_t ahead = std::min<int64_t>(DECODE_BK, j1 - b0 - n);  // the next block's
        for (int64_t j = 0; j < n; ++j) {
            const E* kr = K + (b0 + j) * a.k_rs;
            if (j < ahead) {  // ask for the next block's rows while this one is computed
                const char* kn = reinterpret_cast<const char*>(kr + DECODE_BK * a.k_rs);
                const char* vn = reinterpret_cast<const char*>(V0 + (b0 + DECODE_BK + j) * a.v_rs);
                for (int c = 0; c < int(D * sizeof(E)); c += 64) __builtin_prefetch(kn + c);
                for (int c = 0; c < int(DV * sizeof(E)); c += 64) __builtin_prefetch(vn + c);
            }
            V kv[NQ];
            KV::template row<V, NQ>(kr, kv);
            const T ks = KV::scaled ? T(at.ks[(b0 + j) * a.ks_rs]) : T(1);
            int64_t r = 0;
            if constexpr (sizeof(T) == 4) {  // four rows' sums at once
                for (; r + 4 <= R; r += 4) {
                    V x[4];
                    for (int i = 0; i < 4; ++i) {
                        const V* qv = reinterpret_cast<const V*>(qs + (r + i) * D);
                        x[i] = qv[0] * kv[0];
                        for (int c = 1; c < NQ; ++c) x[i] += qv[c] * kv[c];
                    }
                    T sums[4];
                    lane_sums4(x, sums);
                    for (int i = 0; i < 4; ++i)
                        s[(r + i) * DECODE_BK + j] = KV::scaled ? sums[i] * ks : sums[i];
                }
            }
            for (; r < R; ++r) {
                const V* qv = reinterpret_cast<const V*>(qs + r * D);
                V x = qv[0] * kv[0];
                for (int c = 1; c < NQ; ++c) x += qv[c] * kv[c];
                s[r * DECODE_BK + j] = KV::scaled ? lane_sum<T>(x) * ks : lane_sum<T>(x);
            }
        }
        if (a.softcap > 0) softcap_block(s, R, n, T(a.softcap));
        T alpha[2];
        for (int64_t r = 0; r < R; ++r) {
            alpha[r & 1] = decode_row_step(s + r * DECODE_BK, n, m + r, l + r);
            if (!(r & 1) && r + 1 < R) continue;  // rows go in pairs: one value row, two rows
            const int64_t r0 = r & ~int64_t(1);
            const int pair = int(r - r0) + 1;  // 2, or 1 for a last odd row
            T* a0 = acc + r0 * DV;
            T* a1 = a0 + DV;
            const T* s0 = s + r0 * DECODE_BK;
            const T* s1 = s0 + DECODE_BK;
            V x0[NV], x1[NV] = {};  // x1 unused for a last odd row
            for (int c = 0; c < NV; ++c) {
                std::memcpy(&x0[c], a0 + c * W, sizeof(V));
                x0[c] *= alpha[0];
                if (pair == 2) {
                    std::memcpy(&x1[c], a1 + c * W, sizeof(V));
                    x1[c] *= alpha[1];
                }
            }
            if (pair == 2) {
                for (int64_t j = 0; j < n; ++j) {
                    const T vsj = KV::scaled ? T(at.vs[(b0 + j) * a.vs_rs]) : T(1);
                    const T p0 = s0[j] * vsj, p1 = s1[j] * vsj;
                    const E* vr = V0 + (b0 + j) * a.v_rs;
                    if constexpr (KV::by_vector) {  // each vector loaded as it is used
                        for (int c = 0; c < NV; ++c) {
                            const V y = KV::template vec<V>(vr + c * W);
                            x0[c] += p0 * y;
                            x1[c] += p1 * y;
                        }
                    } else {  // bytes: whole 64-byte lines at once
                        V y[NV];
                        KV::template row<V, NV>(vr, y);
                        for (int c = 0; c < NV; ++c) {
                            x0[c] += p0 * y[c];
                            x1[c] += p1 * y[c];
                        }
                    }
                }
            } else {
                for (int64_t j = 0; j < n; ++j) {
                    const T p0 = KV::scaled ? s0[j] * T(at.vs[(b0 + j) * a.vs_rs]) : s0[j];
                    const E* vr = V0 + (b0 + j) * a.v_rs;
                    if constexpr (KV::by_vector) {
                        for (int c = 0; c < NV; ++c) x0[c] += p0 * KV::template vec<V>(vr + c * W);
                    } else {
                        V y[NV];
                        KV::template row<V, NV>(vr, y);
                        for (int c = 0; c < NV; ++c) x0[c] += p0 * y[c];
                    }
                }
            }
            for (int c = 0; c < NV; ++c) {
                std::memcpy(a0 + c * W, &x0[c], sizeof(V));
                if (pair == 2) std::memcpy(a1 + c * W, &x1[c], sizeof(V));
            }
        }
    }
    if constexpr (KV::paired) paired_order(acc, R, DV, false);
}

// The piece for the head sizes of the arguments: unrolled for 64 and 128, else general.
template <typename T, typename E>
QKV_INLINE void decode_piece_any(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0,
                                 int64_t j1, T* sc, T* m, T* l, T* acc) {
    if (a.d == 64 && a.dv == 64)
        decode_piece_vec<T, E, 64, 64>(a, b, h, j0, j1, sc, m, l, acc);
    else if (a.d == 128 && a.dv == 128)
        decode_piece_vec<T, E, 128, 128>(a, b, h, j0, j1, sc, m, l, acc);
    else
        decode_piece_body<T, E>(a, b, h, j0, j1, sc, m, l, acc);
}

typedef void (*piece_t)(const qkv_decode_args&, int64_t, int64_t, int64_t, int64_t, void*,
                        void*, void*, void*);

#define QKV_PIECE(ATTR, NAME, T, E)                                                         \
    ATTR void NAME(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0, int64_t j1, \
                   void* sc, void* m, void* l, void* acc) {                                 \
        decode_piece_any<T, E>(a, b, h, j0, j1, static_cast<T*>(sc), static_cast<T*>(m),   \
                               static_cast<T*>(l), static_cast<T*>(acc));                   \
    }
#define QKV_PIECES(ATTR, ISA)                                \
    QKV_PIECE(ATTR, piece_##ISA##_f32, float, float)         \
    QKV_PIECE(ATTR, piece_##ISA##_f64, double, double)       \
    QKV_PIECE(ATTR, piece_##ISA##_bf16, float, Bf16)         \
    QKV_PIECE(ATTR, piece_##ISA##_f16, float, F16)           \
    QKV_PIECE(ATTR, piece_##ISA##_i8, float, I8)             \
    QKV_PIECE(ATTR, piece_##ISA##_e4m3, float, E4m3)
QKV_PIECES(, base)
#if QKV_X86
QKV_PIECES(QKV_AVX2, avx2)
QKV_PIECES(QKV_AVX512, avx512)
#endif
#undef QKV_PIECES
#undef QKV_PIECE

// The piece for compute type T (float or double) and K/V storage `format` in the clone isa;
// NULL for a format T does not read (every stored form but its own is computed in float).
template <typename T>
piece_t pick_piece(int isa, int64_t format) {
    if (sizeof(T) == 8) return format == KV_SAME ? pick_clone<piece_t>(isa, QKV_CLONES(piece, f64)) : nullptr;
    switch (format) {
        case KV_SAME:
            return pick_clone<piece_t>(isa, QKV_CLONES(piece, f32));
        case KV_BF16:
            return pick_clone<piece_t>(isa, QKV_CLONES(piece, bf16));
        case KV_F16:
            return pick_clone<piece_t>(isa, QKV_CLONES(piece, f16));
        case KV_INT8:
            return pick_clone<piece_t>(isa, QKV_CLONES(piece, i8));
        case KV_E4M3:
            return pick_clone<piece_t>(isa, QKV_CLONES(piece, e4m3));
        default:
            return nullptr;
    }
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
    const int64_t R = a.group * a.L, units = a.nseq * a.kv_heads;
    if (units == 0) return 0;  // no sequence: nothing to write
    const int64_t threads = std::max<int64_t>(1, a.threads);
    const int64_t least = 256;  // keys per piece at least
    int64_t longest = 0;
    for (int64_t b = 0; b < a.nseq; ++b)
        longest = std::max(longest, (a.hi ? a.hi[b] : a.S) - (a.lo ? a.lo[b] : 0));
    // a few items per thread, so that none waits long for the last; pieces of >= least keys
    const int64_t want = (4 * threads + units - 1) / units;
    const int64_t splits = std::max<int64_t>(1, std::min(want, longest / least));
    const int64_t ntasks = units * splits;
    std::vector<T> parts;
    try {
        parts.resize(size_t(ntasks * R * (2 + a.dv)));
    } catch (...) {
        return 1;
    }
    const piece_t piece = pick_piece<T>(chosen_isa(a.isa), a.kv_format);
    if (!piece) return 2;
    if ((a.kv_format == KV_INT8 || a.kv_format == KV_E4M3) && !(a.k_scale && a.v_scale)) return 2;
    T* PM = parts.data();  // per item: R maxima, then R sums, then R x dv accumulators
    T* PL = PM + ntasks * R;
    T* PA = PL + ntasks * R;
    const int64_t scratch = R * (a.d + DECODE_BK);
    auto init = [&](std::vector<T>& sc) {
        sc.resize(size_t(scratch));
        return true;
    };
    auto work = [&](std::vector<T>& sc, int64_t t) {
        const int64_t c = t % splits, h = (t / splits) % a.kv_heads;
        const int64_t b = t / (splits * a.kv_heads);
        const int64_t lo = a.lo ? a.lo[b] : 0, hi = a.hi ? a.hi[b] : a.S;
        const int64_t width = (hi - lo + splits - 1) / splits;
        const int64_t j0 = std::min(lo + c * width, hi), j1 = std::min(j0 + width, hi);
        piece(a, b, h, j0, j1, sc.data(), PM + t * R, PL + t * R, PA + t * R * a.dv);
    };
    if (for_tasks<std::vector<T>>(ntasks, threads, a.parallel, init, work)) return 1;
    // merge each head's pieces into its rows of out and lse
    const T ninf = -std::numeric_limits<T>::infinity();
    T* OUT = static_cast<T*>(a.out);
    T* LSE = static_cast<T*>(a.lse);
    T bad = 0;  // becomes NaN if an output is not finite
    for (int64_t u = 0; u < units; ++u) {
        for (int64_t r = 0; r < R; ++r) {
            T M = ninf;
            for (int64_t c = 0; c < splits; ++c) M = std::max(M, PM[(u * splits + c) * R + r]);
            T* o = OUT + (u * R + r) * a.dv;
            T lsum = 0;
            for (int64_t c = 0; c < a.dv; ++c) o[c] = 0;
            for (int64_t c = 0; c < splits; ++c) {
                const int64_t t = u * splits + c;
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
            if (M == ninf && lsum == T(0)) {  // no key at all
                if (LSE) LSE[u * R + r] = ninf;
                continue;
            }
            const T inv = T(1) / lsum;
            for (int64_t e = 0; e < a.dv; ++e) {
                o[e] *= inv;
                bad += o[e] * T(0);
            }
            if (LSE) LSE[u * R + r] = M + std::log(lsum);
        }
    }
    return bad == bad ? 0 : 3;
}

}  // namespace

extern "C" {

int qkv_decode_f32(const qkv_decode_args* a) {
    if (!a || a->nseq < 0 || a->kv_heads < 1 || a->group < 1 || a->L < 1 || a->d < 1 ||
        a->dv < 1 || a->S < 0)
        return 2;
    return run_decode<float>(*a);
}

int qkv_decode_f64(const qkv_decode_args* a) {
    if (!a || a->nseq < 0 || a->kv_heads < 1 || a->group < 1 || a->L < 1 || a->d < 1 ||
        a->dv < 1 || a->S < 0)
        return 2;
    return run_decode<double>(*a);
}

int64_t qkv_decode_args_size(void) { return int64_t(sizeof(qkv_decode_args)); }

// The widest vector clone this CPU runs: 1 baseline, 2 AVX2, 3 AVX-512.
int qkv_best_isa(void) { return best_isa(); }

}  // extern "C"

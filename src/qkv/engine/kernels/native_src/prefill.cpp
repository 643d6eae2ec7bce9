// Fused prefill forward for qkv: online-softmax attention over (head, query block) tasks.
//
// Must equal qkv.reference.attention (the Python side checks nothing twice: it hands over a
// checked plan's arrays). The loop per task is the FlashAttention-2 recurrence of
// qkv/engine/kernels/tiled.py, with the softmax step fused between the two tile products:
//
//     S   = scale · Q_blk · K_tileᵀ                       (BLAS gemm)
//     per row, while the tile is in cache: mask, bias, edge; m' = max(m, max S);
//         P = exp(S − m'); l = l · exp(m − m') + Σ P; acc *= exp(m − m')
//     acc += P · V_tile                                   (BLAS gemm, beta = 1)
//     out = acc / l, lse = m + log l                      (l = 0: out 0, lse −inf)
//
// Tasks are taken from a shared counter by native threads (latest query blocks first: under
// causal they see the most keys). The packed varlen walk runs the same block over packed
// sequences: tasks (sequence, kv head, query block), costliest first. Key tiles that no row
// of the block may see are skipped; across the causal/window edge keys go in narrow pieces,
// each with the rows that see part of it, and each row only exponentiates its visible keys.
//
// BLAS is not linked: the caller passes sgemm/dgemm function pointers with the Fortran
// calling convention (SciPy's cython_blas exports them). Nothing here uses Python, so the
// library is a plain C ABI loaded with ctypes, which releases the GIL during the call.
//
// Vector width is chosen at run time: the softmax step is one generic inline body, compiled
// in three clones (AVX-512, AVX2+FMA, and the x86-64 baseline; elsewhere only the baseline),
// so the compiler picks each clone's own lane width. No -march flag is needed.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#define QKV_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__) && defined(__GNUC__)
#define QKV_X86 1
#define QKV_AVX512 \
    __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,fma,prefer-vector-width=512")))
#define QKV_AVX2 __attribute__((target("avx2,fma")))
#else
#define QKV_X86 0
#endif

// The three clones of a function (baseline, AVX2, AVX-512) as arguments to pick_clone; where
// the clones are not compiled (not x86), only the baseline.
#if QKV_X86
#define QKV_CLONES(pre, sfx) pre##_base_##sfx, pre##_avx2_##sfx, pre##_avx512_##sfx
#else
#define QKV_CLONES(pre, sfx) pre##_base_##sfx, nullptr, nullptr
#endif

extern "C" {

typedef void (*sgemm_t)(const char*, const char*, const int*, const int*, const int*,
                        const float*, const float*, const int*, const float*, const int*,
                        const float*, float*, const int*);
typedef void (*dgemm_t)(const char*, const char*, const int*, const int*, const int*,
                        const double*, const double*, const int*, const double*, const int*,
                        const double*, double*, const int*);

// Everything one call needs. Offsets and strides are in elements; the last axis of q, k, v
// (and of out) is contiguous. Per query head h (the flattened batch), its queries start at
// q + q_off[h], its kv head's keys and values at k + k_off[h] and v + v_off[h], its mask or
// bias entry (row i, key j) at m_off[h] + i * m_rs + j * m_cs.
struct qkv_prefill_args {
    int64_t nb, L, S, d, dv;
    const void* q;
    const int64_t* q_off;
    int64_t q_rs;
    const void* k;
    const int64_t* k_off;
    int64_t k_rs;
    const void* v;
    const int64_t* v_off;
    int64_t v_rs;
    void* out;  // (nb, L, dv) contiguous
    void* lse;  // (nb, L) contiguous
    const uint8_t* mask;  // bool mask (1 = may attend) or NULL
    const void* bias;     // float bias in the compute dtype or NULL
    const int64_t* m_off;
    int64_t m_rs, m_cs;
    double scale;
    int64_t causal;
    int64_t left, right;  // window sides; -1 = unbounded
    int64_t threads;
    int64_t isa;  // 0 = best available, 1 = baseline, 2 = AVX2, 3 = AVX-512
    void* gemm;   // sgemm for float32, dgemm for float64
    int64_t block_q, block_k;
};

// The packed varlen walk (qkv.engine.kernels.packed's layout): q (total_q, heads, d), k and
// v (total_k, heads / group, ·), sequence b in rows cq[b]:cq[b + 1] and ck[b]:ck[b + 1], each
// attending alone (causal bottom-right within it, windows likewise). Token and head strides
// in elements; the last axis is contiguous. Only the sequences listed in seqs are computed:
// out (total_q, heads, dv) and lse (total_q, heads) are contiguous and keep what the caller
// put in the other rows (and in those of sequences with no key).
struct qkv_varlen_args {
    int64_t nseq, heads, group, d, dv;
    const void* q;
    int64_t q_ts, q_hs;
    const void* k;
    int64_t k_ts, k_hs;
    const void* v;
    int64_t v_ts, v_hs;
    const int64_t* cq;
    const int64_t* ck;
    const int64_t* seqs;
    void* out;
    void* lse;
    uint8_t* bad;  // per sequence (batch entries), set to 1 where an output is not finite; or NULL
    double scale;
    int64_t causal;
    int64_t left, right;
    int64_t threads;
    int64_t isa;
    void* gemm;
    int64_t block_q, block_k;
};

// The FlashAttention-2 backward. q, k, v as above but k_off/v_off are per kv head (nkv of
// them), q_off and m_off per query head; query head t * group + g reads kv head t. dout, lse
// (rows with no key given as +inf), delta = rowsum(dO ∘ O) and the outputs are contiguous;
// dq, dk, dv must be zeroed by the caller.
struct qkv_backward_args {
    int64_t nkv, group, L, S, d, dv;
    const void* q;
    const int64_t* q_off;
    int64_t q_rs;
    const void* k;
    const int64_t* k_off;
    int64_t k_rs;
    const void* v;
    const int64_t* v_off;
    int64_t v_rs;
    const void* dout;   // (nkv * group, L, dv)
    const void* lse;    // (nkv * group, L)
    const void* delta;  // (nkv * group, L)
    void* dq;           // (nkv * group, L, d)
    void* dk;           // (nkv, S, d)
    void* dvo;          // (nkv, S, dv)
    const uint8_t* mask;
    const void* bias;
    const int64_t* m_off;
    int64_t m_rs, m_cs;
    double scale;
    int64_t causal;
    int64_t left, right;
    int64_t threads;
    int64_t isa;
    void* gemm;
    int64_t block_q, block_k;
};

}  // extern "C"

namespace {

// exp(x) for x <= 0 (x - max of the row), as a branch-free polynomial the compiler
// vectorises. Range reduction x = n ln2 + r with |r| <= ln2/2; 2^n is built in the exponent
// bits, with n read from the low bits of x·log2(e) + 1.5·2^p (no float-to-int conversion).
// Below exp(-87) (float) or exp(-708) (double) the result is exactly 0, so a hidden key (-inf)
// weighs nothing; NaN stays NaN. Upper: also clamp large x (the backward's s - lse may be a
// little above 0, and a caller's lse may be wrong).
template <bool Upper = false>
QKV_INLINE float exp_neg(float x) {
    const bool under = x < -87.0f;  // NaN compares false and passes through
    x = under ? -87.0f : x;
    if (Upper) x = x > 88.0f ? 88.0f : x;
    const float magic = 12582912.0f;  // 1.5 · 2^23
    float t = x * 1.44269504088896341f + magic;
    float n = t - magic;
    float r = x - n * 0.693145751953125f;  // ln2 in two parts (Cody-Waite)
    r = r - n * 1.42860682030941723212e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t ti, mi;
    std::memcpy(&ti, &t, 4);
    std::memcpy(&mi, &magic, 4);
    int32_t bits = (ti - mi + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, 4);
    return under ? 0 : p * two_n;
}

template <bool Upper = false>
QKV_INLINE double exp_neg(double x) {
    const bool under = x < -708.0;
    x = under ? -708.0 : x;
    if (Upper) x = x > 709.0 ? 709.0 : x;
    const double magic = 6755399441055744.0;  // 1.5 · 2^52
    double t = x * 1.4426950408889634074 + magic;
    double n = t - magic;
    double r = x - n * 6.93147180369123816490e-01;
    r = r - n * 1.90821492927058770002e-10;
    double p = 1.0 / 479001600.0;  // Taylor to r^12: error below 2e-16 for |r| <= ln2/2
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    int64_t ti, mi;
    std::memcpy(&ti, &t, 8);
    std::memcpy(&mi, &magic, 8);
    int64_t bits = (ti - mi + 1023) << 52;
    double two_n;
    std::memcpy(&two_n, &bits, 8);
    return under ? 0 : p * two_n;
}

// Max of s[a:b) as an OpenMP simd max reduction, which each clone runs in its own vector width
// (a select on a comparison is not vectorised without it); a NaN score may or may not become
// the max, and either way its row comes out NaN (the sum carries it).
template <typename T>
QKV_INLINE T lane_max(const T* __restrict s, int64_t a, int64_t b) {
    T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = a; j < b; ++j) m = s[j] > m ? s[j] : m;
    return m;
}

// One row's softmax step on its scores s[0:n) (the tile's columns), of which [jl, jh) are
// visible to the row by causal/window. Applies bias and mask, moves the running max m,
// writes the weights exp(s - m) over the visible columns (0 elsewhere) and returns the factor
// exp(m_old - m_new) by which the row's accumulator and sum must be scaled.
template <typename T>
QKV_INLINE void row_step(T* __restrict s, int64_t n, int64_t jl, int64_t jh,
                         const uint8_t* __restrict mrow, const T* __restrict brow, int64_t m_cs,
                         T* __restrict m, T* __restrict l, T* __restrict acc, int64_t dv) {
    const T ninf = -std::numeric_limits<T>::infinity();
    if (brow) {
        if (m_cs == 1) {
#pragma omp simd
            for (int64_t j = jl; j < jh; ++j) s[j] += brow[j];
        } else {
            for (int64_t j = jl; j < jh; ++j) s[j] += brow[j * m_cs];
        }
    }
    if (mrow) {
        if (m_cs == 1) {
#pragma omp simd
            for (int64_t j = jl; j < jh; ++j) s[j] = mrow[j] ? s[j] : ninf;
        } else {
            for (int64_t j = jl; j < jh; ++j) s[j] = mrow[j * m_cs] ? s[j] : ninf;
        }
    }
    const T mx = lane_max(s, jl, jh);
    T mold = *m;
    T mnew = std::max(mold, mx);
    for (int64_t j = 0; j < jl; ++j) s[j] = 0;
    for (int64_t j = jh; j < n; ++j) s[j] = 0;
    if (mnew == ninf) {  // nothing visible yet: weights 0, unless a score is NaN
        bool nan = false;
        for (int64_t j = jl; j < jh; ++j) {
            nan |= s[j] != s[j];
            s[j] = 0;
        }
        if (nan) *l = std::numeric_limits<T>::quiet_NaN();
        return;
    }
    T sum = 0;  // summed as the weights are written (a simd reduction: lanes, then added)
#pragma omp simd reduction(+ : sum)
    for (int64_t j = jl; j < jh; ++j) {
        const T p = exp_neg(s[j] - mnew);
        s[j] = p;
        sum += p;
    }
    T alpha = mold == ninf ? T(0) : exp_neg(mold - mnew);  // mold == mnew: exactly 1
    if (alpha != T(1)) {
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) acc[c] *= alpha;
    }
    *l = *l * alpha + sum;
    *m = mnew;
}

// The softmax step over rows [0, rows) of a score tile, stride lds.
struct StepArgs {
    void* s;
    int64_t lds, rows, n;
    const int64_t* jl;
    const int64_t* jh;
    const uint8_t* mask;
    const void* bias;
    int64_t m_rs, m_cs;
    void* m;
    void* l;
    void* acc;
    int64_t dv;
};

template <typename T>
QKV_INLINE void tile_step(const StepArgs& a) {
    T* s = static_cast<T*>(a.s);
    T* m = static_cast<T*>(a.m);
    T* l = static_cast<T*>(a.l);
    T* acc = static_cast<T*>(a.acc);
    const T* bias = static_cast<const T*>(a.bias);
    for (int64_t i = 0; i < a.rows; ++i) {
        row_step<T>(s + i * a.lds, a.n, a.jl[i], a.jh[i], a.mask ? a.mask + i * a.m_rs : nullptr,
                    bias ? bias + i * a.m_rs : nullptr, a.m_cs, m + i, l + i, acc + i * a.dv,
                    a.dv);
    }
}

void step_base_f32(const StepArgs& a) { tile_step<float>(a); }
void step_base_f64(const StepArgs& a) { tile_step<double>(a); }
#if QKV_X86
QKV_AVX2 void step_avx2_f32(const StepArgs& a) { tile_step<float>(a); }
QKV_AVX2 void step_avx2_f64(const StepArgs& a) { tile_step<double>(a); }
QKV_AVX512 void step_avx512_f32(const StepArgs& a) { tile_step<float>(a); }
QKV_AVX512 void step_avx512_f64(const StepArgs& a) { tile_step<double>(a); }
#endif

// The backward's two elementwise steps on a (rows x n) tile, stride lds, rows' visible
// columns [jl, jh): the weights P = exp(S - lse) (mask and bias applied, 0 where hidden), then
// after dP = dO Vᵀ: dS = P ∘ (dP - delta) · scale, written over dP.
struct BwdArgs {
    void* s;
    void* dp;
    int64_t lds, rows, n;
    const int64_t* jl;
    const int64_t* jh;
    const uint8_t* mask;
    const void* bias;
    int64_t m_rs, m_cs;
    const void* lse;
    const void* delta;
    double scale;
};

template <typename T>
QKV_INLINE void bwd_weights(const BwdArgs& a) {
    const T ninf = -std::numeric_limits<T>::infinity();
    const T* lse = static_cast<const T*>(a.lse);
    const T* bias = static_cast<const T*>(a.bias);
    for (int64_t i = 0; i < a.rows; ++i) {
        T* __restrict s = static_cast<T*>(a.s) + i * a.lds;
        const int64_t jl = a.jl[i], jh = a.jh[i], cs = a.m_cs;
        if (bias) {
            const T* b = bias + i * a.m_rs;
            for (int64_t j = jl; j < jh; ++j) s[j] += b[j * cs];
        }
        if (a.mask) {
            const uint8_t* m = a.mask + i * a.m_rs;
            for (int64_t j = jl; j < jh; ++j) s[j] = m[j * cs] ? s[j] : ninf;
        }
        const T li = lse[i];
        for (int64_t j = 0; j < jl; ++j) s[j] = 0;
#pragma omp simd
        for (int64_t j = jl; j < jh; ++j) s[j] = exp_neg<true>(s[j] - li);
        for (int64_t j = jh; j < a.n; ++j) s[j] = 0;
    }
}

template <typename T>
QKV_INLINE void bwd_dscores(const BwdArgs& a) {
    const T* delta = static_cast<const T*>(a.delta);
    const T scale = T(a.scale);
    for (int64_t i = 0; i < a.rows; ++i) {
        const T* __restrict p = static_cast<const T*>(a.s) + i * a.lds;
        T* __restrict dp = static_cast<T*>(a.dp) + i * a.lds;
        const T di = delta[i];
#pragma omp simd
        for (int64_t j = 0; j < a.n; ++j) dp[j] = p[j] * (dp[j] - di) * scale;
    }
}

struct BwdSteps {
    void (*weights)(const BwdArgs&);
    void (*dscores)(const BwdArgs&);
};

void bw_base_f32(const BwdArgs& a) { bwd_weights<float>(a); }
void bd_base_f32(const BwdArgs& a) { bwd_dscores<float>(a); }
void bw_base_f64(const BwdArgs& a) { bwd_weights<double>(a); }
void bd_base_f64(const BwdArgs& a) { bwd_dscores<double>(a); }
#if QKV_X86
QKV_AVX2 void bw_avx2_f32(const BwdArgs& a) { bwd_weights<float>(a); }
QKV_AVX2 void bd_avx2_f32(const BwdArgs& a) { bwd_dscores<float>(a); }
QKV_AVX2 void bw_avx2_f64(const BwdArgs& a) { bwd_weights<double>(a); }
QKV_AVX2 void bd_avx2_f64(const BwdArgs& a) { bwd_dscores<double>(a); }
QKV_AVX512 void bw_avx512_f32(const BwdArgs& a) { bwd_weights<float>(a); }
QKV_AVX512 void bd_avx512_f32(const BwdArgs& a) { bwd_dscores<float>(a); }
QKV_AVX512 void bw_avx512_f64(const BwdArgs& a) { bwd_weights<double>(a); }
QKV_AVX512 void bd_avx512_f64(const BwdArgs& a) { bwd_dscores<double>(a); }
#endif

// The clone for the vector extension isa (3 AVX-512, 2 AVX2, else the baseline), where built.
template <typename F>
F pick_clone(int isa, F base, F avx2, F avx512) {
    if (isa == 3 && avx512) return avx512;
    if (isa == 2 && avx2) return avx2;
    return base;
}

template <typename T>
BwdSteps pick_bwd(int isa) {
    typedef void (*fn)(const BwdArgs&);
    if (sizeof(T) == 4)
        return {pick_clone<fn>(isa, QKV_CLONES(bw, f32)), pick_clone<fn>(isa, QKV_CLONES(bd, f32))};
    return {pick_clone<fn>(isa, QKV_CLONES(bw, f64)), pick_clone<fn>(isa, QKV_CLONES(bd, f64))};
}

int best_isa() {
#if QKV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
        return 3;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 2;
#endif
    return 1;
}

typedef void (*step_t)(const StepArgs&);

template <typename T>
step_t pick_step(int isa) {
    if (sizeof(T) == 4) return pick_clone<step_t>(isa, QKV_CLONES(step, f32));
    return pick_clone<step_t>(isa, QKV_CLONES(step, f64));
}

QKV_INLINE void gemm(sgemm_t f, const char* ta, const char* tb, int m, int n, int k, float alpha,
                     const float* a, int lda, const float* b, int ldb, float beta, float* c,
                     int ldc) {
    f(ta, tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
QKV_INLINE void gemm(dgemm_t f, const char* ta, const char* tb, int m, int n, int k,
                     double alpha, const double* a, int lda, const double* b, int ldb,
                     double beta, double* c, int ldc) {
    f(ta, tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// Keys [lo, hi) that the query at absolute position p may see (qkv.masks.key_bounds).
template <typename Args>
QKV_INLINE void bounds(const Args& a, int64_t p, int64_t* lo, int64_t* hi) {
    int64_t b = 0, e = a.S;
    if (a.causal) e = std::min(e, p + 1);
    if (a.left >= 0) b = std::max(b, p - a.left);
    if (a.right >= 0) e = std::min(e, p + a.right + 1);
    b = std::min(std::max(b, int64_t(0)), a.S);
    *lo = b;
    *hi = std::max(b, std::min(e, a.S));
}

// Width of the key pieces across the rows' bounds (see forward_block).
constexpr int64_t EDGE = 64;

// One forward work item: query rows [r0, r0 + rows) of one head of one sequence of L queries
// and S keys, with where its operands are and where its results go. Pointers are at the
// block's first row (q, out, lse, mask, bias) and at key k_first (k, v; mask and bias at 0).
template <typename T>
struct Block {
    const T* q;
    int64_t q_rs;
    const T* k;
    int64_t k_rs;
    const T* v;
    int64_t v_rs;
    int64_t k_first;
    int64_t L, S, r0, rows;
    T* out;
    int64_t out_rs;
    T* lse;
    int64_t lse_s;
    const uint8_t* mask;
    const T* bias;
    int64_t m_rs, m_cs;
    uint8_t* bad;  // set to 1 when an output is not finite (NULL: not asked)
};

// What every work item of one call shares: sizes, visibility rule, the BLAS and softmax step.
template <typename Gemm>
struct Shared {
    int64_t S;  // of the current item (bounds() reads it)
    int64_t d, dv, bk;
    int64_t causal, left, right;
    double scale;
    Gemm g;
    step_t step;
};

// A worker's tiles, allocated once per thread.
template <typename T>
struct Buffers {
    std::vector<T> s, acc, m, l;
    std::vector<T> qc, kc, vc;  // contiguous copies of strided operands (the varlen walk)
    std::vector<int64_t> lo, hi, jl, jh;
    bool make(int64_t bq, int64_t bk, int64_t dv) {
        try {
            s.resize(size_t(bq * bk));
            acc.resize(size_t(bq * std::max<int64_t>(dv, 1)));
            m.resize(size_t(bq));
            l.resize(size_t(bq));
            lo.resize(size_t(bq));
            hi.resize(size_t(bq));
            jl.resize(size_t(bq));
            jh.resize(size_t(bq));
        } catch (const std::bad_alloc&) {
            return false;
        }
        return true;
    }
};

// The FlashAttention-2 recurrence over one block of query rows (see the top of the file).
template <typename T, typename Gemm>
void forward_block(const Block<T>& b, Shared<Gemm> sh, Buffers<T>& buf) {
    const T ninf = -std::numeric_limits<T>::infinity();
    const int64_t rows = b.rows, dv = sh.dv, bk = sh.bk;
    sh.S = b.S;
    int64_t* lo = buf.lo.data();
    int64_t* hi = buf.hi.data();
    for (int64_t i = 0; i < rows; ++i) bounds(sh, b.S - b.L + b.r0 + i, &lo[i], &hi[i]);
    std::fill(buf.m.begin(), buf.m.begin() + rows, ninf);
    std::fill(buf.l.begin(), buf.l.begin() + rows, T(0));
    std::fill(buf.acc.begin(), buf.acc.begin() + rows * dv, T(0));
    const int64_t klo = lo[0], khi = hi[rows - 1];  // both nondecreasing in the row
    // Keys in pieces: as wide as bk where every row that sees part of a piece sees all of it;
    // across the rows' bounds (the causal diagonal, a window's edges) pieces of EDGE keys, so
    // the products computed for keys a row does not see stay a small part of the work.
    int64_t ra = 0, rb = 0;  // rows [ra, rb) see some key of the current piece
    int64_t nl = 0;          // the first row whose keys start after c0
    for (int64_t c0 = klo, c1; c0 < khi; c0 = c1) {
        while (ra < rows && hi[ra] <= c0) ++ra;
        if (ra >= rows) break;
        while (nl < rows && lo[nl] <= c0) ++nl;
        int64_t full = std::min(hi[ra], khi) - c0;
        if (nl < rows) full = std::min(full, lo[nl] - c0);
        c1 = std::min(c0 + (full >= EDGE ? std::min(full, bk) : std::min(EDGE, bk)), khi);
        const int64_t n = c1 - c0;
        while (rb < rows && lo[rb] < c1) ++rb;
        if (ra >= rb) continue;
        const int64_t nr = rb - ra;
        T* s = buf.s.data();
        // S (nr x n, row-major, ld n) = scale · Q[ra:rb] · K[c0:c1]ᵀ; in BLAS's column-major
        // terms Sᵀ = Kᵀᵀ · Qᵀ.
        gemm(sh.g, "T", "N", int(n), int(nr), int(sh.d), T(sh.scale),
             b.k + (c0 - b.k_first) * b.k_rs, int(b.k_rs), b.q + ra * b.q_rs, int(b.q_rs), T(0),
             s, int(n));
        for (int64_t i = ra; i < rb; ++i) {
            buf.jl[i] = std::min(std::max(lo[i] - c0, int64_t(0)), n);
            buf.jh[i] = std::max(std::min(hi[i] - c0, n), buf.jl[i]);
        }
        StepArgs sa;
        sa.s = s;
        sa.lds = n;
        sa.rows = nr;
        sa.n = n;
        sa.jl = buf.jl.data() + ra;
        sa.jh = buf.jh.data() + ra;
        const int64_t moff = ra * b.m_rs + c0 * b.m_cs;
        sa.mask = b.mask ? b.mask + moff : nullptr;
        sa.bias = b.bias ? b.bias + moff : nullptr;
        sa.m_rs = b.m_rs;
        sa.m_cs = b.m_cs;
        sa.m = buf.m.data() + ra;
        sa.l = buf.l.data() + ra;
        sa.acc = buf.acc.data() + ra * dv;
        sa.dv = dv;
        sh.step(sa);
        // acc[ra:rb] (nr x dv, ld dv) += P · V[c0:c1]; column-major: accᵀ += Vᵀ · Pᵀ
        gemm(sh.g, "N", "N", int(dv), int(nr), int(n), T(1), b.v + (c0 - b.k_first) * b.v_rs,
             int(b.v_rs), s,
             int(n), T(1), buf.acc.data() + ra * dv, int(dv));
    }
    T bad = 0;  // 0, or NaN when some output is not finite (0 * inf and NaN are NaN)
    for (int64_t i = 0; i < rows; ++i) {
        const T li = buf.l[i];
        const T* acc = buf.acc.data() + i * dv;
        T* out = b.out + i * b.out_rs;
        if (li == T(0)) {  // no visible key: 0 and -inf, never NaN
            for (int64_t c = 0; c < dv; ++c) out[c] = 0;
            b.lse[i * b.lse_s] = ninf;
        } else {
            const T inv = T(1) / li;
            for (int64_t c = 0; c < dv; ++c) {
                out[c] = acc[c] * inv;
                bad += out[c] * T(0);
            }
            b.lse[i * b.lse_s] = buf.m[i] + std::log(li);
        }
    }
    if (b.bad && bad != bad) __atomic_store_n(b.bad, uint8_t(1), __ATOMIC_RELAXED);
}

// Runs work(buffers, task) for tasks [0, ntasks) taken from a shared counter by `threads`
// native threads (this one included); 1 if a thread could not have its tiles.
template <typename T, typename Work>
int run_tasks(int64_t ntasks, int64_t threads, int64_t bq, int64_t bk, int64_t dv,
              const Work& work) {
    std::atomic<int64_t> next(0);
    std::atomic<int> failed(0);
    auto worker = [&]() {
        Buffers<T> buf;
        if (!buf.make(bq, bk, dv)) {
            failed = 1;
            return;
        }
        for (;;) {
            const int64_t t = next.fetch_add(1);
            if (t >= ntasks || failed) return;
            work(buf, t);
        }
    };
    const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(threads, ntasks));
    std::vector<std::thread> pool;
    try {
        for (int64_t i = 1; i < nthreads; ++i) pool.emplace_back(worker);
    } catch (...) {
        // fewer threads than asked: the ones running (and this one) share the tasks
    }
    worker();
    for (auto& th : pool) th.join();
    return failed ? 1 : 0;
}

template <typename Gemm, typename Args>
Shared<Gemm> shared_of(const Args& a, int64_t bk, step_t step) {
    Shared<Gemm> sh;
    sh.S = 0;
    sh.d = a.d;
    sh.dv = a.dv;
    sh.bk = bk;
    sh.causal = a.causal;
    sh.left = a.left;
    sh.right = a.right;
    sh.scale = a.scale;
    sh.g = reinterpret_cast<Gemm>(a.gemm);
    sh.step = step;
    return sh;
}

template <typename T, typename Gemm>
int run(const qkv_prefill_args& a) {
    const int64_t bq = std::max<int64_t>(1, a.block_q), bk = std::max<int64_t>(1, a.block_k);
    const int64_t nqb = (a.L + bq - 1) / bq;
    const int64_t ntasks = a.nb * nqb;
    const int isa = a.isa > 0 ? std::min<int>(int(a.isa), best_isa()) : best_isa();
    const Shared<Gemm> sh = shared_of<Gemm>(a, bk, pick_step<T>(isa));
    const T* Q = static_cast<const T*>(a.q);
    const T* K = static_cast<const T*>(a.k);
    const T* V = static_cast<const T*>(a.v);
    T* OUT = static_cast<T*>(a.out);
    T* LSE = static_cast<T*>(a.lse);
    const T* BIAS = static_cast<const T*>(a.bias);
    return run_tasks<T>(ntasks, a.threads, bq, bk, a.dv, [&](Buffers<T>& buf, int64_t t) {
        // latest query blocks first: under causal they cost the most
        const int64_t qb = nqb - 1 - t / a.nb, h = t % a.nb;
        const int64_t r0 = qb * bq;
        Block<T> b;
        b.q = Q + a.q_off[h] + r0 * a.q_rs;
        b.q_rs = a.q_rs;
        b.k = K + a.k_off[h];
        b.k_rs = a.k_rs;
        b.v = V + a.v_off[h];
        b.v_rs = a.v_rs;
        b.k_first = 0;
        b.L = a.L;
        b.S = a.S;
        b.r0 = r0;
        b.rows = std::min(bq, a.L - r0);
        b.out = OUT + (h * a.L + r0) * a.dv;
        b.out_rs = a.dv;
        b.lse = LSE + h * a.L + r0;
        b.lse_s = 1;
        const int64_t moff = a.m_off ? a.m_off[h] + r0 * a.m_rs : 0;
        b.mask = a.mask ? a.mask + moff : nullptr;
        b.bias = BIAS ? BIAS + moff : nullptr;
        b.m_rs = a.m_rs;
        b.m_cs = a.m_cs;
        b.bad = nullptr;
        forward_block<T, Gemm>(b, sh, buf);
    });
}

// The packed varlen walk: tasks are (sequence, kv head, query block) triples, costliest
// first, each running the query heads that share the kv head, over the packed arrays (no
// padding).
template <typename T, typename Gemm>
int run_varlen(const qkv_varlen_args& a) {
    const int64_t bq = std::max<int64_t>(1, a.block_q), bk = std::max<int64_t>(1, a.block_k);
    const int isa = a.isa > 0 ? std::min<int>(int(a.isa), best_isa()) : best_isa();
    const Shared<Gemm> sh = shared_of<Gemm>(a, bk, pick_step<T>(isa));
    struct Task {
        int64_t b, r0, cost;
    };
    std::vector<Task> tasks;
    try {
        for (int64_t i = 0; i < a.nseq; ++i) {
            const int64_t b = a.seqs[i];
            const int64_t L = a.cq[b + 1] - a.cq[b], S = a.ck[b + 1] - a.ck[b];
            if (L < 1 || S < 1) continue;  // the caller's zeros and -inf stand
            for (int64_t r0 = 0; r0 < L; r0 += bq) {
                const int64_t r1 = std::min(r0 + bq, L);
                int64_t seen = S;  // keys the block's last row may see, roughly its cost
                if (a.causal) seen = std::min(S, std::max<int64_t>(S - L + r1, 0));
                if (a.left >= 0 && a.right >= 0) seen = std::min(seen, a.left + a.right + 1);
                tasks.push_back({b, r0, (r1 - r0) * std::max<int64_t>(seen, 1)});
            }
        }
        std::stable_sort(tasks.begin(), tasks.end(),
                         [](const Task& x, const Task& y) { return x.cost > y.cost; });
    } catch (const std::bad_alloc&) {
        return 1;
    }
    const int64_t H = a.heads, nkv = H / a.group, ntasks = int64_t(tasks.size()) * nkv;
    const int64_t d = a.d, dv = a.dv;
    const T* Q = static_cast<const T*>(a.q);
    const T* K = static_cast<const T*>(a.k);
    const T* V = static_cast<const T*>(a.v);
    T* OUT = static_cast<T*>(a.out);
    T* LSE = static_cast<T*>(a.lse);
    // Packed rows are far apart (a token's heads lie between them): BLAS would re-read the
    // strided query rows for every key piece and walk the keys across cache-aliasing strides.
    // Each task copies its kv head's visible keys and values once, and each query head's rows,
    // into contiguous buffers (where memory allows; otherwise it reads them in place).
    const bool copy_q = a.q_ts != d, copy_kv = a.k_ts != d || a.v_ts != dv;
    return run_tasks<T>(ntasks, a.threads, bq, bk, dv, [&](Buffers<T>& buf, int64_t t) {
        const Task& task = tasks[size_t(t / nkv)];
        const int64_t kvh = t % nkv;
        const int64_t q0 = a.cq[task.b], k0 = a.ck[task.b];
        Block<T> b;
        b.L = a.cq[task.b + 1] - q0;
        b.S = a.ck[task.b + 1] - k0;
        b.r0 = task.r0;
        b.rows = std::min(bq, b.L - task.r0);
        Shared<Gemm> rule = sh;
        rule.S = b.S;
        int64_t klo, khi, unused;
        bounds(rule, b.S - b.L + b.r0, &klo, &unused);
        bounds(rule, b.S - b.L + b.r0 + b.rows - 1, &unused, &khi);
        b.k = K + k0 * a.k_ts + kvh * a.k_hs;
        b.k_rs = a.k_ts;
        b.v = V + k0 * a.v_ts + kvh * a.v_hs;
        b.v_rs = a.v_ts;
        b.k_first = 0;
        if (copy_kv && khi > klo) {
            try {
                buf.kc.resize(size_t((khi - klo) * d));
                buf.vc.resize(size_t((khi - klo) * dv));
                for (int64_t j = klo; j < khi; ++j) {
                    std::memcpy(&buf.kc[size_t((j - klo) * d)], b.k + j * a.k_ts,
                                size_t(d) * sizeof(T));
                    std::memcpy(&buf.vc[size_t((j - klo) * dv)], b.v + j * a.v_ts,
                                size_t(dv) * sizeof(T));
                }
                b.k = buf.kc.data();
                b.k_rs = d;
                b.v = buf.vc.data();
                b.v_rs = dv;
                b.k_first = klo;
            } catch (const std::bad_alloc&) {
                // read them in place
            }
        }
        bool q_copied = false;
        if (copy_q) {
            try {
                buf.qc.resize(size_t(b.rows * d));
                q_copied = true;
            } catch (const std::bad_alloc&) {
            }
        }
        b.mask = nullptr;
        b.bias = nullptr;
        b.m_rs = b.m_cs = 0;
        b.bad = a.bad ? a.bad + task.b : nullptr;
        for (int64_t h = kvh * a.group; h < (kvh + 1) * a.group; ++h) {
            const T* q = Q + (q0 + task.r0) * a.q_ts + h * a.q_hs;
            if (q_copied) {
                for (int64_t i = 0; i < b.rows; ++i)
                    std::memcpy(&buf.qc[size_t(i * d)], q + i * a.q_ts, size_t(d) * sizeof(T));
                b.q = buf.qc.data();
                b.q_rs = d;
            } else {
                b.q = q;
                b.q_rs = a.q_ts;
            }
            b.out = OUT + ((q0 + task.r0) * H + h) * dv;
            b.out_rs = H * dv;
            b.lse = LSE + (q0 + task.r0) * H + h;
            b.lse_s = H;
            forward_block<T, Gemm>(b, sh, buf);
        }
    });
}

// The backward: tasks are (kv head, key block) pairs, each owning its rows of dK and dV; it
// visits the kv head's query heads and their query blocks that see the key block. dQ rows are
// shared between tasks of different key blocks: each query block's rows are added under a
// lock.
template <typename T, typename Gemm>
int run_backward(const qkv_backward_args& a) {
    const int64_t bq = std::max<int64_t>(1, a.block_q), bk = std::max<int64_t>(1, a.block_k);
    const int64_t nkb = (a.S + bk - 1) / bk, nqb = (a.L + bq - 1) / bq;
    const int64_t nq = a.nkv * a.group, ntasks = a.nkv * nkb;
    const int isa = a.isa > 0 ? std::min<int>(int(a.isa), best_isa()) : best_isa();
    const BwdSteps steps = pick_bwd<T>(isa);
    const Gemm g = reinterpret_cast<Gemm>(a.gemm);
    const T* Q = static_cast<const T*>(a.q);
    const T* K = static_cast<const T*>(a.k);
    const T* V = static_cast<const T*>(a.v);
    const T* DO = static_cast<const T*>(a.dout);
    const T* LSE = static_cast<const T*>(a.lse);
    const T* DELTA = static_cast<const T*>(a.delta);
    T* DQ = static_cast<T*>(a.dq);
    T* DK = static_cast<T*>(a.dk);
    T* DV = static_cast<T*>(a.dvo);
    const T* BIAS = static_cast<const T*>(a.bias);
    std::vector<std::mutex> locks;
    try {
        locks = std::vector<std::mutex>(size_t(nq * nqb));
    } catch (const std::bad_alloc&) {
        return 1;
    }
    std::atomic<int64_t> next(0);
    std::atomic<int> failed(0);

    auto worker = [&]() {
        std::vector<T> sbuf, dpbuf;
        std::vector<int64_t> lo(bq), hi(bq), jl(bq), jh(bq);
        try {
            sbuf.resize(size_t(bq * bk));
            dpbuf.resize(size_t(bq * bk));
        } catch (const std::bad_alloc&) {
            failed = 1;
            return;
        }
        for (;;) {
            const int64_t t = next.fetch_add(1);
            if (t >= ntasks || failed) return;
            const int64_t kvh = t % a.nkv, kb = t / a.nkv;  // early key blocks first (causal)
            const int64_t c0 = kb * bk, c1 = std::min(c0 + bk, a.S);
            const T* k = K + a.k_off[kvh];
            const T* v = V + a.v_off[kvh];
            T* dk = DK + (kvh * a.S) * a.d;
            T* dv = DV + (kvh * a.S) * a.dv;
            for (int64_t gi = 0; gi < a.group; ++gi) {
                const int64_t h = kvh * a.group + gi;
                for (int64_t qb = 0; qb < nqb; ++qb) {
                    const int64_t r0 = qb * bq, rows = std::min(bq, a.L - r0);
                    for (int64_t i = 0; i < rows; ++i)
                        bounds(a, a.S - a.L + r0 + i, &lo[i], &hi[i]);
                    int64_t ra = 0, rb = rows;
                    while (ra < rows && hi[ra] <= c0) ++ra;
                    while (rb > ra && lo[rb - 1] >= c1) --rb;
                    if (ra >= rb) continue;
                    // the columns any of rows [ra, rb) may see
                    const int64_t e0 = std::max(c0, lo[ra]), e1 = std::min(c1, hi[rb - 1]);
                    if (e0 >= e1) continue;
                    const int64_t nr = rb - ra, n = e1 - e0;
                    for (int64_t i = ra; i < rb; ++i) {
                        jl[i] = std::min(std::max(lo[i] - e0, int64_t(0)), n);
                        jh[i] = std::max(std::min(hi[i] - e0, n), jl[i]);
                    }
                    const T* q = Q + a.q_off[h] + (r0 + ra) * a.q_rs;
                    const T* dO = DO + (h * a.L + r0 + ra) * a.dv;
                    T* s = sbuf.data();
                    T* dp = dpbuf.data();
                    // S = scale · Q Kᵀ (nr x n)
                    gemm(g, "T", "N", int(n), int(nr), int(a.d), T(a.scale), k + e0 * a.k_rs,
                         int(a.k_rs), q, int(a.q_rs), T(0), s, int(n));
                    BwdArgs ba;
                    ba.s = s;
                    ba.dp = dp;
                    ba.lds = n;
                    ba.rows = nr;
                    ba.n = n;
                    ba.jl = jl.data() + ra;
                    ba.jh = jh.data() + ra;
                    const int64_t moff =
                        a.m_off ? a.m_off[h] + (r0 + ra) * a.m_rs + e0 * a.m_cs : 0;
                    ba.mask = a.mask ? a.mask + moff : nullptr;
                    ba.bias = BIAS ? BIAS + moff : nullptr;
                    ba.m_rs = a.m_rs;
                    ba.m_cs = a.m_cs;
                    ba.lse = LSE + h * a.L + r0 + ra;
                    ba.delta = DELTA + h * a.L + r0 + ra;
                    ba.scale = a.scale;
                    steps.weights(ba);  // s = P
                    // dV[e0:e1] += Pᵀ dO (column-major: dVᵀ += dOᵀ P)
                    gemm(g, "N", "T", int(a.dv), int(n), int(nr), T(1), dO, int(a.dv), s,
                         int(n), T(1), dv + e0 * a.dv, int(a.dv));
                    // dP = dO Vᵀ (nr x n)
                    gemm(g, "T", "N", int(n), int(nr), int(a.dv), T(1), v + e0 * a.v_rs,
                         int(a.v_rs), dO, int(a.dv), T(0), dp, int(n));
                    steps.dscores(ba);  // dp = dS
                    // dK[e0:e1] += dSᵀ Q (column-major: dKᵀ += Qᵀ dS)
                    gemm(g, "N", "T", int(a.d), int(n), int(nr), T(1), q, int(a.q_rs), dp,
                         int(n), T(1), dk + e0 * a.d, int(a.d));
                    // dQ rows += dS K (column-major: dQᵀ += Kᵀ dSᵀ), under the block's lock
                    std::lock_guard<std::mutex> hold(locks[size_t(h * nqb + qb)]);
                    gemm(g, "N", "N", int(a.d), int(nr), int(n), T(1), k + e0 * a.k_rs,
                         int(a.k_rs), dp, int(n), T(1), DQ + (h * a.L + r0 + ra) * a.d,
                         int(a.d));
                }
            }
        }
    };

    const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(a.threads, ntasks));
    std::vector<std::thread> pool;
    try {
        for (int64_t i = 1; i < nthreads; ++i) pool.emplace_back(worker);
    } catch (...) {
    }
    worker();
    for (auto& th : pool) th.join();
    return failed ? 1 : 0;
}


// ---------------------------------------------------------------------------------------------
// Decode: a few query rows per kv head (a model's decoding step: group · L rows, L usually 1)
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

}  // namespace

extern "C" {

typedef void (*gomp_parallel_t)(void (*)(void*), void*, unsigned, unsigned);

// Offsets in elements; the last axis of q, k, v is contiguous. Query head h * group + g of
// sequence b reads kv head h of sequence b; its rows i < L start at
// q + b * q_bs + (h * group + g) * q_hs + i * q_ls.
// Returns 0, or 3 when an output is not finite (infinite or NaN inputs, an overflow: the
// caller's general path applies its rules to those), or 4 when a mask row is not one run of
// keys (nothing is computed); 1 without memory, 2 for bad arguments.
struct qkv_decode_args {
    int64_t nseq, kv_heads, group, L, d, dv, S;
    const void* q;
    int64_t q_bs, q_hs, q_ls;
    const void* k;
    int64_t k_bs, k_hs, k_rs;
    const void* v;
    int64_t v_bs, v_hs, v_rs;
    const int64_t* lo;  // per sequence, the keys [lo, hi) it sees; NULL: [0, S)
    const int64_t* hi;
    void* out;  // (nseq, kv_heads * group, L, dv) contiguous
    void* lse;  // (nseq, kv_heads * group, L) contiguous, or NULL
    double scale;
    int64_t threads;
    int64_t isa;
    void* parallel;   // GOMP_parallel of a running OpenMP runtime, or NULL
    double softcap;    // > 0: scores become softcap * tanh(score / softcap) (Gemma 2); else 0
    // A boolean mask (1 = may attend) of one row per sequence, read instead of lo/hi: each
    // sequence's visible keys must be one run (else status 4, nothing computed); or NULL.
    const uint8_t* mask;
    int64_t mask_bs, mask_js;  // its strides in bytes: sequence, key
};

}  // extern "C"

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

// One piece: rows' m, l, acc over keys [j0, j1) of kv head h of sequence b, for any head
// sizes. scratch holds the scaled rows (R x d) and the block's scores (R x DECODE_BK).
template <typename T>
QKV_INLINE void decode_piece_body(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0,
                                  int64_t j1, T* __restrict scratch, T* __restrict m,
                                  T* __restrict l, T* __restrict acc) {
    const int64_t d = a.d, dv = a.dv, R = a.group * a.L;
    T* __restrict qs = scratch;
    T* __restrict s = scratch + R * d;
    decode_start(a, b, h, d, dv, qs, m, l, acc);
    const T* K = static_cast<const T*>(a.k) + b * a.k_bs + h * a.k_hs;
    const T* V = static_cast<const T*>(a.v) + b * a.v_bs + h * a.v_hs;
    for (int64_t b0 = j0; b0 < j1; b0 += DECODE_BK) {
        const int64_t n = std::min<int64_t>(DECODE_BK, j1 - b0);
        for (int64_t j = 0; j < n; ++j) {
            const T* __restrict kr = K + (b0 + j) * a.k_rs;
            for (int64_t r = 0; r < R; ++r) {
                const T* __restrict qr = qs + r * d;
                T dot = 0;
#pragma omp simd reduction(+ : dot)
                for (int64_t t = 0; t < d; ++t) dot += qr[t] * kr[t];
                s[r * DECODE_BK + j] = dot;
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
                const T p = sr[j];
                const T* __restrict vr = V + (b0 + j) * a.v_rs;
#pragma omp simd
                for (int64_t c = 0; c < dv; ++c) ar[c] += p * vr[c];
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

// The piece of decode_piece_body for head sizes D and DV known at compile time, multiples of
// 64 bytes, written with vectors of 64 bytes (GCC/Clang vector extensions; each clone
// splits them into its own registers): a key row is loaded once for all the rows, each
// row's dot product summed in lanes and added up once, and each row's accumulator held in
// registers while a block's values are added. The same recurrence as decode_piece_body.
template <typename T, int D, int DV>
QKV_INLINE void decode_piece_vec(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0,
                                 int64_t j1, T* __restrict scratch, T* __restrict m,
                                 T* __restrict l, T* __restrict acc) {
    typedef T V __attribute__((vector_size(64), aligned(sizeof(T))));
    constexpr int W = int(64 / sizeof(T)), NQ = D / W, NV = DV / W;
    const int64_t R = a.group * a.L;
    T* __restrict qs = scratch;
    T* __restrict s = scratch + R * D;
    decode_start(a, b, h, D, DV, qs, m, l, acc);
    const T* K = static_cast<const T*>(a.k) + b * a.k_bs + h * a.k_hs;
    const T* V0 = static_cast<const T*>(a.v) + b * a.v_bs + h * a.v_hs;
    for (int64_t b0 = j0; b0 < j1; b0 += DECODE_BK) {
        const int64_t n = std::min<int64_t>(DECODE_BK, j1 - b0);
        const int64_t ahead = std::min<int64_t>(DECODE_BK, j1 - b0 - n);  // the next block's
        for (int64_t j = 0; j < n; ++j) {
            const T* kr = K + (b0 + j) * a.k_rs;
            if (j < ahead) {  // ask for the next block's rows while this one is computed
                const char* kn = reinterpret_cast<const char*>(kr + DECODE_BK * a.k_rs);
                const char* vn = reinterpret_cast<const char*>(V0 + (b0 + DECODE_BK + j) * a.v_rs);
                for (int c = 0; c < int(D * sizeof(T)); c += 64) __builtin_prefetch(kn + c);
                for (int c = 0; c < int(DV * sizeof(T)); c += 64) __builtin_prefetch(vn + c);
            }
            V kv[NQ];
            for (int c = 0; c < NQ; ++c) std::memcpy(&kv[c], kr + c * W, sizeof(V));
            for (int64_t r = 0; r < R; ++r) {
                const V* qv = reinterpret_cast<const V*>(qs + r * D);
                V x = qv[0] * kv[0];
                for (int c = 1; c < NQ; ++c) x += qv[c] * kv[c];
                s[r * DECODE_BK + j] = lane_sum<T>(x);
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
                    const T p0 = s0[j], p1 = s1[j];
                    const T* vr = V0 + (b0 + j) * a.v_rs;
                    for (int c = 0; c < NV; ++c) {
                        V y;
                        std::memcpy(&y, vr + c * W, sizeof(V));
                        x0[c] += p0 * y;
                        x1[c] += p1 * y;
                    }
                }
            } else {
                for (int64_t j = 0; j < n; ++j) {
                    const T p0 = s0[j];
                    const T* vr = V0 + (b0 + j) * a.v_rs;
                    for (int c = 0; c < NV; ++c) {
                        V y;
                        std::memcpy(&y, vr + c * W, sizeof(V));
                        x0[c] += p0 * y;
                    }
                }
            }
            for (int c = 0; c < NV; ++c) {
                std::memcpy(a0 + c * W, &x0[c], sizeof(V));
                if (pair == 2) std::memcpy(a1 + c * W, &x1[c], sizeof(V));
            }
        }
    }
}

// The piece for the head sizes of the arguments: unrolled for 64 and 128, else general.
template <typename T>
QKV_INLINE void decode_piece_any(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0,
                                 int64_t j1, T* sc, T* m, T* l, T* acc) {
    if (a.d == 64 && a.dv == 64)
        decode_piece_vec<T, 64, 64>(a, b, h, j0, j1, sc, m, l, acc);
    else if (a.d == 128 && a.dv == 128)
        decode_piece_vec<T, 128, 128>(a, b, h, j0, j1, sc, m, l, acc);
    else
        decode_piece_body<T>(a, b, h, j0, j1, sc, m, l, acc);
}

typedef void (*piece_t)(const qkv_decode_args&, int64_t, int64_t, int64_t, int64_t, void*,
                        void*, void*, void*);

#define QKV_PIECE(ATTR, NAME, T)                                                            \
    ATTR void NAME(const qkv_decode_args& a, int64_t b, int64_t h, int64_t j0, int64_t j1, \
                   void* sc, void* m, void* l, void* acc) {                                 \
        decode_piece_any<T>(a, b, h, j0, j1, static_cast<T*>(sc), static_cast<T*>(m),      \
                            static_cast<T*>(l), static_cast<T*>(acc));                      \
    }
QKV_PIECE(, piece_base_f32, float)
QKV_PIECE(, piece_base_f64, double)
#if QKV_X86
QKV_PIECE(QKV_AVX2, piece_avx2_f32, float)
QKV_PIECE(QKV_AVX2, piece_avx2_f64, double)
QKV_PIECE(QKV_AVX512, piece_avx512_f32, float)
QKV_PIECE(QKV_AVX512, piece_avx512_f64, double)
#endif
#undef QKV_PIECE

template <typename T>
piece_t pick_piece(int isa) {
    if (sizeof(T) == 4) return pick_clone<piece_t>(isa, QKV_CLONES(piece, f32));
    return pick_clone<piece_t>(isa, QKV_CLONES(piece, f64));
}

// The shared state of one call's work items, handed to every thread.
struct DecodeJob {
    const qkv_decode_args* a;
    piece_t piece;
    int64_t splits, ntasks, R, scratch, esize;
    char* pm;    // per item: R maxima
    char* pl;    // R sums
    char* pacc;  // R x dv accumulators
    std::atomic<int64_t> next;
    std::atomic<int> failed;
};

// A thread's loop: take the next item until none is left. Never throws (it may run on an
// OpenMP runtime's threads, through C).
void decode_worker(void* p) {
    DecodeJob& job = *static_cast<DecodeJob*>(p);
    const qkv_decode_args& a = *job.a;
    std::vector<char> scratch;
    try {
        scratch.resize(size_t(job.scratch * job.esize));
    } catch (...) {
        job.failed = 1;
        return;
    }
    for (;;) {
        const int64_t t = job.next.fetch_add(1);
        if (t >= job.ntasks || job.failed) return;
        const int64_t c = t % job.splits, h = (t / job.splits) % a.kv_heads;
        const int64_t b = t / (job.splits * a.kv_heads);
        const int64_t lo = a.lo ? a.lo[b] : 0, hi = a.hi ? a.hi[b] : a.S;
        const int64_t width = (hi - lo + job.splits - 1) / job.splits;
        const int64_t j0 = std::min(lo + c * width, hi), j1 = std::min(j0 + width, hi);
        job.piece(a, b, h, j0, j1, scratch.data(), job.pm + t * job.R * job.esize,
                  job.pl + t * job.R * job.esize, job.pacc + t * job.R * a.dv * job.esize);
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
    const int isa = a.isa > 0 ? std::min<int>(int(a.isa), best_isa()) : best_isa();
    DecodeJob job;
    job.a = &a;
    job.piece = pick_piece<T>(isa);
    job.splits = splits;
    job.ntasks = ntasks;
    job.R = R;
    job.scratch = R * (a.d + DECODE_BK);
    job.esize = int64_t(sizeof(T));
    job.pm = reinterpret_cast<char*>(parts.data());
    job.pl = job.pm + ntasks * R * job.esize;
    job.pacc = job.pl + ntasks * R * job.esize;
    job.next = 0;
    job.failed = 0;
    const int64_t nthreads = std::min(threads, ntasks);
    if (nthreads > 1 && a.parallel) {
        reinterpret_cast<gomp_parallel_t>(a.parallel)(decode_worker, &job, unsigned(nthreads), 0);
    } else {
        std::vector<std::thread> pool;
        try {
            for (int64_t i = 1; i < nthreads; ++i) pool.emplace_back(decode_worker, &job);
        } catch (...) {
        }
        decode_worker(&job);
        for (auto& th : pool) th.join();
    }
    if (job.failed) return 1;
    // merge each head's pieces into its rows of out and lse
    const T ninf = -std::numeric_limits<T>::infinity();
    const T* PM = reinterpret_cast<const T*>(job.pm);
    const T* PL = reinterpret_cast<const T*>(job.pl);
    const T* PA = reinterpret_cast<const T*>(job.pacc);
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

// 0 on success; 1 when memory for the tiles could not be had; 2 for a bad argument.
int qkv_prefill_f32(const qkv_prefill_args* a) {
    if (!a || !a->gemm || a->L < 1 || a->S < 0 || a->d < 1 || a->dv < 0) return 2;
    return run<float, sgemm_t>(*a);
}

int qkv_prefill_f64(const qkv_prefill_args* a) {
    if (!a || !a->gemm || a->L < 1 || a->S < 0 || a->d < 1 || a->dv < 0) return 2;
    return run<double, dgemm_t>(*a);
}

int qkv_varlen_f32(const qkv_varlen_args* a) {
    if (!a || !a->gemm || a->nseq < 0 || a->heads < 1 || a->group < 1 || a->d < 1 || a->dv < 1)
        return 2;
    return run_varlen<float, sgemm_t>(*a);
}

int qkv_varlen_f64(const qkv_varlen_args* a) {
    if (!a || !a->gemm || a->nseq < 0 || a->heads < 1 || a->group < 1 || a->d < 1 || a->dv < 1)
        return 2;
    return run_varlen<double, dgemm_t>(*a);
}

int64_t qkv_varlen_args_size(void) { return int64_t(sizeof(qkv_varlen_args)); }

int qkv_backward_f32(const qkv_backward_args* a) {
    if (!a || !a->gemm || a->L < 1 || a->S < 1 || a->d < 1 || a->dv < 1 || a->group < 1) return 2;
    return run_backward<float, sgemm_t>(*a);
}

int qkv_backward_f64(const qkv_backward_args* a) {
    if (!a || !a->gemm || a->L < 1 || a->S < 1 || a->d < 1 || a->dv < 1 || a->group < 1) return 2;
    return run_backward<double, dgemm_t>(*a);
}

int64_t qkv_backward_args_size(void) { return int64_t(sizeof(qkv_backward_args)); }

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

// The size of the argument struct, so the Python side can check it agrees on the layout.
int64_t qkv_args_size(void) { return int64_t(sizeof(qkv_prefill_args)); }

}  // extern "C"

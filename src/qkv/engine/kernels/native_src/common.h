// What every kernel family of qkv's native library shares: the vector clones and their
// run-time choice, the exponential the softmax steps use, the visibility rule (causal,
// windows), the BLAS shim and the one pool of threads that runs a call's work items.
//
// Vector width is chosen at run time: each elementwise step is one generic inline body,
// compiled in three clones (AVX-512, AVX2+FMA, and the x86-64 baseline; elsewhere only the
// baseline), so the compiler picks each clone's own lane width. No -march flag is needed.
// BLAS is not linked: the caller passes sgemm/dgemm function pointers with the Fortran calling
// convention (SciPy's cython_blas exports them). Nothing here uses Python, so the library is a
// plain C ABI loaded with ctypes, which releases the GIL during the call.

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <thread>
#include <vector>

#define QKV_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__) && defined(__GNUC__)
#define QKV_X86 1
#define QKV_AVX512 \
    __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,fma,prefer-vector-width=512")))
#define QKV_AVX2 __attribute__((target("avx2,fma,f16c")))
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

#include "abi.h"

namespace {

// The clone for the vector extension isa (3 AVX-512, 2 AVX2, else the baseline), where built.
template <typename F>
F pick_clone(int isa, F base, F avx2, F avx512) {
    if (isa == 3 && avx512) return avx512;
    if (isa == 2 && avx2) return avx2;
    return base;
}

// The widest clone this CPU runs (1 baseline, 2 AVX2, 3 AVX-512).
inline int best_isa() {
#if QKV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
        return 3;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return 2;
#endif
    return 1;
}

// The clone a call asked for (0: the widest), capped at what the CPU runs.
QKV_INLINE int chosen_isa(int64_t asked) {
    return asked > 0 ? std::min<int>(int(asked), best_isa()) : best_isa();
}

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

// Runs work(state, t) for tasks t in [0, ntasks), taken from a shared counter by `threads`
// threads (the caller one of them), each with its own state made once by init(state) (false:
// no memory). The threads are the team of a running OpenMP runtime when `parallel` is its
// GOMP_parallel (see abi.h), else native threads started for the call. Returns 1 if a thread
// could not make its state, else 0. Nothing here throws: it may run on the runtime's threads.
template <typename State, typename Init, typename Work>
int for_tasks(int64_t ntasks, int64_t threads, void* parallel, const Init& init,
              const Work& work) {
    std::atomic<int64_t> next(0);
    std::atomic<int> failed(0);
    auto worker = [&]() {
        State state;
        bool ok = false;
        try {
            ok = init(state);
        } catch (...) {
        }
        if (!ok) {
            failed = 1;
            return;
        }
        for (;;) {
            const int64_t t = next.fetch_add(1);
            if (t >= ntasks || failed) return;
            work(state, t);
        }
    };
    typedef decltype(worker) Worker;
    const int64_t n = std::max<int64_t>(1, std::min<int64_t>(threads, ntasks));
    if (n > 1 && parallel) {
        reinterpret_cast<gomp_parallel_t>(parallel)(
            [](void* p) { (*static_cast<Worker*>(p))(); }, &worker, unsigned(n), 0);
    } else {
        std::vector<std::thread> pool;
        try {
            for (int64_t i = 1; i < n; ++i) pool.emplace_back(worker);
        } catch (...) {
            // fewer threads than asked: the ones running (and this one) share the tasks
        }
        worker();
        for (auto& th : pool) th.join();
    }
    return failed ? 1 : 0;
}

}  // namespace

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
#include <memory>
#include <new>
#include <thread>
#include <vector>

#define QKV_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__) && defined(__GNUC__)
#define QKV_X86 1
#define QKV_AVX512 \
    __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,fma,prefer-vector-width=512")))
#define QKV_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-512 with AVX512_BF16's vdpbf16ps: the bfloat16 prefill and backward (bf16.h) and the
// decode step's bfloat16 scores (decode.cpp); cpu_has_bf16() says whether this CPU runs it.
#define QKV_BF16                                                                      \
    __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,fma," \
                          "prefer-vector-width=512")))
// AVX-512 with AVX512_VNNI's vpdpbusd: the decode step's fast int8 scores (decode.cpp);
// cpu_has_vnni() says whether this CPU runs it.
#define QKV_VNNI                                                                      \
    __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx512vnni,fma," \
                          "prefer-vector-width=512")))
// The intrinsics, read once here for every unit: GCC 12 warns that its own
// _mm512_undefined_ps's self-initialised `__Y` "may be used uninitialized" wherever an
// intrinsic built on it is inlined (a false report GCC 13 no longer makes: a few hundred of
// them in a build's log), so those two warnings are off for the header's own lines only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
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
#include "pool.h"

// Six functions name_<clone>_<f32|f64>(const Args&), one per clone and compute dtype, each
// running body<float> or body<double> (pick_clone chooses among them at run time).
#define QKV_CLONE_BODY(attr, name, clone, Args, body)                           \
    attr void name##_##clone##_f32(const Args& a) { body<float>(a); }         \
    attr void name##_##clone##_f64(const Args& a) { body<double>(a); }
#if QKV_X86
#define QKV_CLONE_SET(name, Args, body)              \
    QKV_CLONE_BODY(, name, base, Args, body)         \
    QKV_CLONE_BODY(QKV_AVX2, name, avx2, Args, body) \
    QKV_CLONE_BODY(QKV_AVX512, name, avx512, Args, body)
#else
#define QKV_CLONE_SET(name, Args, body) QKV_CLONE_BODY(, name, base, Args, body)
#endif

// The same six for a body templated on the clone's lane width too: body<float, W> and
// body<double, W / 2>, W the clone's floats per vector (4 baseline, 8 AVX2, 16 AVX-512).
#define QKV_LANE_CLONE_BODY(attr, name, clone, Args, body, W)                      \
    attr void name##_##clone##_f32(const Args& a) { body<float, W>(a); }          \
    attr void name##_##clone##_f64(const Args& a) { body<double, W / 2>(a); }
#if QKV_X86
#define QKV_LANE_CLONE_SET(name, Args, body)                  \
    QKV_LANE_CLONE_BODY(, name, base, Args, body, 4)          \
    QKV_LANE_CLONE_BODY(QKV_AVX2, name, avx2, Args, body, 8)  \
    QKV_LANE_CLONE_BODY(QKV_AVX512, name, avx512, Args, body, 16)
#else
#define QKV_LANE_CLONE_SET(name, Args, body) QKV_LANE_CLONE_BODY(, name, base, Args, body, 4)
#endif

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

#if QKV_X86
// Whether this CPU runs the QKV_BF16 code: AVX-512 with AVX512_BF16.
inline bool cpu_has_bf16() {
    __builtin_cpu_init();
    return best_isa() == 3 && __builtin_cpu_supports("avx512bf16");
}

// Whether this CPU runs the QKV_VNNI code: AVX-512 with AVX512_VNNI.
inline bool cpu_has_vnni() {
    __builtin_cpu_init();
    return best_isa() == 3 && __builtin_cpu_supports("avx512vnni");
}
#endif

// The clone a call asked for (0: the widest), capped at what the CPU runs.
QKV_INLINE int chosen_isa(int64_t asked) {
    return asked > 0 ? std::min<int>(int(asked), best_isa()) : best_isa();
}

// An allocator whose blocks start on a cache line (64 bytes): the vector loads and stores of
// the own tile products (tiles.h) then never straddle two lines where their rows are whole
// vectors apart. Large blocks from malloc start 16 bytes into a page (its header), so every
// 64-byte access to them straddled two lines: the AVX-512 products ran 10-12% slower so.
template <typename T>
struct LineAligned {
    typedef T value_type;
    static constexpr std::align_val_t line{64};
    LineAligned() = default;
    template <typename U>
    LineAligned(const LineAligned<U>&) {}
    T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), line)); }
    void deallocate(T* p, size_t) { ::operator delete(p, line); }
    template <typename U>
    bool operator==(const LineAligned<U>&) const { return true; }
    template <typename U>
    bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename T>
using lines_of = std::vector<T, LineAligned<T>>;

// The constants of exp_neg in T: where the result is 0 (below low) and the clamp for Upper,
// the rounding constant 1.5·2^p, log2(e), ln 2 in two parts (Cody-Waite), the exponent's bias
// and place, and the Taylor coefficients 1/k!, highest first (float to r^7; double to r^12,
// error below 2e-16 for |r| <= ln2/2).
template <typename T>
struct ExpParts;
template <>
struct ExpParts<float> {
    typedef int32_t Bits;
    static constexpr float low = -87.0f, high = 88.0f, magic = 12582912.0f;  // 1.5 · 2^23
    static constexpr float log2e = 1.44269504088896341f;
    static constexpr float ln2_hi = 0.693145751953125f, ln2_lo = 1.42860682030941723212e-6f;
    static constexpr int bias = 127, place = 23, terms = 8;
    static constexpr float coef[terms] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24,
                                          1.0f / 6,    0.5f,        1.0f,        1.0f};
};
template <>
struct ExpParts<double> {
    typedef int64_t Bits;
    static constexpr double low = -708.0, high = 709.0, magic = 6755399441055744.0;  // 1.5 · 2^52
    static constexpr double log2e = 1.4426950408889634074;
    static constexpr double ln2_hi = 6.93147180369123816490e-01;
    static constexpr double ln2_lo = 1.90821492927058770002e-10;
    static constexpr int bias = 1023, place = 52, terms = 13;
    static constexpr double coef[terms] = {
        1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320,
        1.0 / 5040,      1.0 / 720,      1.0 / 120,     1.0 / 24,     1.0 / 6,
        0.5,             1.0,            1.0};
};

// exp(x) for x <= 0 (x - max of the row), as a branch-free polynomial the compiler
// vectorises. Range reduction x = n ln2 + r with |r| <= ln2/2; 2^n is built in the exponent
// bits, with n read from the low bits of x·log2(e) + 1.5·2^p (no float-to-int conversion).
// Below exp(-87) (float) or exp(-708) (double) the result is exactly 0, so a hidden key (-inf)
// weighs nothing; NaN stays NaN. Upper: also clamp large x (the backward's s - lse may be a
// little above 0, and a caller's lse may be wrong).
template <bool Upper = false, typename T>
QKV_INLINE T exp_neg(T x) {
    typedef ExpParts<T> E;
    typedef typename E::Bits B;
    const bool under = x < E::low;  // NaN compares false and passes through
    x = under ? E::low : x;
    if (Upper) x = x > E::high ? E::high : x;
    const T t = x * E::log2e + E::magic;
    const T n = t - E::magic;
    T r = x - n * E::ln2_hi;
    r = r - n * E::ln2_lo;
    T p = E::coef[0];
    for (int i = 1; i < E::terms; ++i) p = p * r + E::coef[i];
    B ti, mi;
    std::memcpy(&ti, &t, sizeof(T));
    std::memcpy(&mi, &E::magic, sizeof(T));
    const B bits = (ti - mi + E::bias) << E::place;
    T two_n;
    std::memcpy(&two_n, &bits, sizeof(T));
    return under ? T(0) : p * two_n;
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

// A score tile's rows [0, rows) (stride lds, n columns), each row's visible columns
// [jl, jh), and where its mask or bias rows start (row stride m_rs, column stride m_cs): what
// the prefill's and the backward's elementwise steps read.
struct TileRows {
    void* s;
    int64_t lds, rows, n;
    const int64_t* jl;
    const int64_t* jh;
    const uint8_t* mask;
    const void* bias;
    int64_t m_rs, m_cs;
};

// A row's scores s[jl:jh) with its float bias added (brow; NULL: none) and the keys its
// boolean mask hides (mrow; NULL: none) set to -inf; the bias and mask step m_cs per key.
template <typename T>
QKV_INLINE void bias_and_mask(T* __restrict s, int64_t jl, int64_t jh, const T* __restrict brow,
                              const uint8_t* __restrict mrow, int64_t m_cs) {
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

// A work item of the packed varlen walk: query rows [r0, r0 + block) of sequence b, and a
// rough cost (rows times the keys the block's last row may see).
struct VarlenTask {
    int64_t b, r0, cost;
};

// The listed sequences' query blocks of bq rows, costliest first (those with no query or no
// key are left out: the caller's zeros and -inf stand); false without memory.
inline bool varlen_tasks(const qkv_varlen_args& a, int64_t bq, std::vector<VarlenTask>& tasks) {
    try {
        for (int64_t i = 0; i < a.nseq; ++i) {
            const int64_t b = a.seqs[i];
            const int64_t L = a.cq[b + 1] - a.cq[b], S = a.ck[b + 1] - a.ck[b];
            if (L < 1 || S < 1) continue;
            for (int64_t r0 = 0; r0 < L; r0 += bq) {
                const int64_t r1 = std::min(r0 + bq, L);
                int64_t seen = S;
                if (a.causal) seen = std::min(S, std::max<int64_t>(S - L + r1, 0));
                if (a.left >= 0 && a.right >= 0) seen = std::min(seen, a.left + a.right + 1);
                tasks.push_back({b, r0, (r1 - r0) * std::max<int64_t>(seen, 1)});
            }
        }
        std::stable_sort(tasks.begin(), tasks.end(),
                         [](const VarlenTask& x, const VarlenTask& y) { return x.cost > y.cost; });
    } catch (const std::bad_alloc&) {
        return false;
    }
    return true;
}

// Runs work(state, t) for tasks t in [0, ntasks) on `threads` threads (the caller one of
// them), each with its own state made once by init(state) (false: no memory). The tasks are
// cut into n runs of consecutive tasks (n threads); the k-th thread to start takes its run's
// tasks in order from the run's own counter (a cache line each), then helps with the other
// runs from theirs, task by task, so a thread that finishes early still shares the rest.
// With one counter for all, taken task by task, its cache line moved between the cores at
// every task, and each call's tasks went to whichever thread came first: short prefill
// tasks (a 16-key head, about a microsecond each) ran 1.25 times as fast on two threads as
// on one; 1.55 times with a run each (B4 H32 L = S = 16 d32, float32, 2-core AMX Xeon). Runs
// of consecutive tasks, not every n-th task: those interleaved the threads' outputs a head
// apart, and ran no faster than the one counter. Each thread meets the same tasks call after
// call, so their operands stay in its core's cache. The threads are the team of a running
// OpenMP runtime when `parallel` is its GOMP_parallel (see abi.h), else the library's kept
// threads (pool.h), else (the pool busy with another call) native threads started for the
// call. Returns 1 if a thread could not make its state, else 0. Nothing here throws: it may
// run on the runtime's threads.
template <typename State, typename Init, typename Work>
int for_tasks(int64_t ntasks, int64_t threads, void* parallel, const Init& init,
              const Work& work) {
    const int64_t n = std::max<int64_t>(1, std::min<int64_t>(threads, ntasks));
    struct alignas(64) Counter {  // (a cache line each)
        std::atomic<int64_t> taken{0};
    };
    Counter few[8];
    std::unique_ptr<Counter[]> many(n > 8 ? new (std::nothrow) Counter[size_t(n)] : nullptr);
    Counter* const counters = n > 8 && many ? many.get() : few;
    const int64_t runs = n > 8 && !many ? 1 : n;  // (no memory for n counters: one for all)
    alignas(64) std::atomic<int64_t> started(0);
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
        const int64_t own = started.fetch_add(1, std::memory_order_relaxed) % runs;
        for (int64_t j = 0; j < runs; ++j) {  // its own run, then the others'
            const int64_t r = (own + j) % runs;
            const int64_t first = r * ntasks / runs, end = (r + 1) * ntasks / runs;
            std::atomic<int64_t>& taken = counters[r].taken;
            for (;;) {
                const int64_t t = first + taken.fetch_add(1, std::memory_order_relaxed);
                if (t >= end || failed) break;
                work(state, t);
            }
            if (failed) return;
        }
    };
    typedef decltype(worker) Worker;
    void (*const trampoline)(void*) = [](void* p) { (*static_cast<Worker*>(p))(); };
    if (n == 1) {
        worker();
    } else if (parallel) {
        reinterpret_cast<gomp_parallel_t>(parallel)(trampoline, &worker, unsigned(n), 0);
    } else if (!qkv_native::pool_run(trampoline, &worker, unsigned(n))) {
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

// A kept small call's arguments (qkv_decode_at, qkv_prefill_at: see abi.h): a copy of the
// kept ones t with the call's operand and output addresses put in.
template <typename Args>
Args with_addresses(const Args& t, const void* q, const void* k, const void* v, void* out) {
    Args a = t;
    a.q = q;
    a.k = k;
    a.v = v;
    a.out = out;
    return a;
}

}  // namespace

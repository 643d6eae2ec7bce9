// The FlashAttention-2 backward for qkv: dQ, dK, dV recomputing the weights tile by tile from
// the forward's lse, as qkv/engine/kernels/tiled_backward.py states it:
//
//     S = scale · Q Kᵀ,  P = exp(S − lse)  (mask, bias, causal/window applied; 0 where hidden)
//     dV += Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP − delta) · scale,  dK += dSᵀ Q,  dQ += dS K
//
// with delta = rowsum(dO ∘ O). The products go through the caller's BLAS; the two elementwise
// steps run in the vector clone the CPU supports (common.h). K and V may also be stored as
// bfloat16 or float16 (float32 compute): each task widens its key block's rows (widen.h).

#include <mutex>

#include "common.h"
#include "widen.h"

namespace {

// The backward's two elementwise steps on a (rows x n) tile, stride lds, rows' visible
// columns [jl, jh): the weights P = exp(S - lse) (mask and bias applied, 0 where hidden), then
// after dP = dO Vᵀ: dS = P ∘ (dP - delta) · scale, written over dP.
struct BwdArgs : TileRows {
    void* dp;
    const void* lse;
    const void* delta;
    double scale;
};

template <typename T>
QKV_INLINE void bwd_weights(const BwdArgs& a) {
    const T* lse = static_cast<const T*>(a.lse);
    const T* bias = static_cast<const T*>(a.bias);
    for (int64_t i = 0; i < a.rows; ++i) {
        T* __restrict s = static_cast<T*>(a.s) + i * a.lds;
        const int64_t jl = a.jl[i], jh = a.jh[i], cs = a.m_cs;
        bias_and_mask(s, jl, jh, bias ? bias + i * a.m_rs : nullptr,
                      a.mask ? a.mask + i * a.m_rs : nullptr, cs);
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

QKV_CLONE_SET(bw, BwdArgs, bwd_weights)
QKV_CLONE_SET(bd, BwdArgs, bwd_dscores)

template <typename T>
BwdSteps pick_bwd(int isa) {
    typedef void (*fn)(const BwdArgs&);
    if (sizeof(T) == 4)
        return {pick_clone<fn>(isa, QKV_CLONES(bw, f32)), pick_clone<fn>(isa, QKV_CLONES(bd, f32))};
    return {pick_clone<fn>(isa, QKV_CLONES(bw, f64)), pick_clone<fn>(isa, QKV_CLONES(bd, f64))};
}

// The backward: tasks are (kv head, key block) pairs, each owning its rows of dK and dV; it
// visits the kv head's query heads and their query blocks that see the key block. dQ rows are
// shared between tasks of different key blocks: each query block's rows are added under a
// lock.
// kv_format: 0, K/V in T; else (T float) K/V stored as 16-bit floats of that format
// (widen.h), each task widening its key block's rows into its buffers.
template <typename T, typename Gemm>
int run_backward(const qkv_backward_args& a, int kv_format = 0) {
    const int64_t bq = std::max<int64_t>(1, a.block_q), bk = std::max<int64_t>(1, a.block_k);
    const int64_t nkb = (a.S + bk - 1) / bk, nqb = (a.L + bq - 1) / bq;
    const int64_t nq = a.nkv * a.group, ntasks = a.nkv * nkb;
    const int isa = chosen_isa(a.isa);
    const BwdSteps steps = pick_bwd<T>(isa);
    const widen_t widen = kv_format ? pick_widen(isa, kv_format) : nullptr;
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
    struct Tiles {
        std::vector<T> s, dp;
        std::vector<T> kc, vc;  // the key block's K/V rows, widened (stored K/V)
        std::vector<int64_t> lo, hi, jl, jh;
    };
    auto init = [&](Tiles& w) {
        w.s.resize(size_t(bq * bk));
        w.dp.resize(size_t(bq * bk));
        if (widen) {
            w.kc.resize(size_t(bk * a.d));
            w.vc.resize(size_t(bk * a.dv));
        }
        for (auto* x : {&w.lo, &w.hi, &w.jl, &w.jh}) x->resize(size_t(bq));
        return true;
    };
    return for_tasks<Tiles>(ntasks, a.threads, nullptr, init, [&](Tiles& w, int64_t t) {
        std::vector<int64_t>&lo = w.lo, &hi = w.hi, &jl = w.jl, &jh = w.jh;
        const int64_t kvh = t % a.nkv, kb = t / a.nkv;  // early key blocks first (causal)
        const int64_t c0 = kb * bk, c1 = std::min(c0 + bk, a.S);
        // K/V rows from `first` on: in place, or the block's rows widened into the buffers
        const T* k = K + a.k_off[kvh];
        const T* v = V + a.v_off[kvh];
        int64_t k_rs = a.k_rs, v_rs = a.v_rs, first = 0;
        if (widen) {
            const uint16_t* k16 = static_cast<const uint16_t*>(a.k) + a.k_off[kvh];
            const uint16_t* v16 = static_cast<const uint16_t*>(a.v) + a.v_off[kvh];
            float* kc = reinterpret_cast<float*>(w.kc.data());
            float* vc = reinterpret_cast<float*>(w.vc.data());
            widen(k16 + c0 * a.k_rs, a.k_rs, c1 - c0, a.d, kc);
            widen(v16 + c0 * a.v_rs, a.v_rs, c1 - c0, a.dv, vc);
            k = w.kc.data();
            v = w.vc.data();
            k_rs = a.d;
            v_rs = a.dv;
            first = c0;
        }
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
                T* s = w.s.data();
                T* dp = w.dp.data();
                // S = scale · Q Kᵀ (nr x n)
                gemm(g, "T", "N", int(n), int(nr), int(a.d), T(a.scale), k + (e0 - first) * k_rs,
                     int(k_rs), q, int(a.q_rs), T(0), s, int(n));
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
                gemm(g, "T", "N", int(n), int(nr), int(a.dv), T(1), v + (e0 - first) * v_rs,
                     int(v_rs), dO, int(a.dv), T(0), dp, int(n));
                steps.dscores(ba);  // dp = dS
                // dK[e0:e1] += dSᵀ Q (column-major: dKᵀ += Qᵀ dS)
                gemm(g, "N", "T", int(a.d), int(n), int(nr), T(1), q, int(a.q_rs), dp,
                     int(n), T(1), dk + e0 * a.d, int(a.d));
                // dQ rows += dS K (column-major: dQᵀ += Kᵀ dSᵀ), under the block's lock
                std::lock_guard<std::mutex> hold(locks[size_t(h * nqb + qb)]);
                gemm(g, "N", "N", int(a.d), int(nr), int(n), T(1), k + (e0 - first) * k_rs,
                     int(k_rs), dp, int(n), T(1), DQ + (h * a.L + r0 + ra) * a.d,
                     int(a.d));
            }
        }
    });
}

}  // namespace

extern "C" {

int qkv_backward_f32(const qkv_backward_args* a) {
    if (!a || !a->gemm || a->L < 1 || a->S < 1 || a->d < 1 || a->dv < 1 || a->group < 1) return 2;
    return run_backward<float, sgemm_t>(*a);
}

// The float32 backward with K and V stored as bfloat16 or float16 (everything else float32;
// K/V strides and offsets in their 16-bit elements).
int qkv_backward_f32_bf16kv(const qkv_backward_args* a) {
    if (!a || !a->gemm || a->L < 1 || a->S < 1 || a->d < 1 || a->dv < 1 || a->group < 1) return 2;
    return run_backward<float, sgemm_t>(*a, KV_BF16);
}

int qkv_backward_f32_f16kv(const qkv_backward_args* a) {
    if (!a || !a->gemm || a->L < 1 || a->S < 1 || a->d < 1 || a->dv < 1 || a->group < 1) return 2;
    return run_backward<float, sgemm_t>(*a, KV_F16);
}

int qkv_backward_f64(const qkv_backward_args* a) {
    if (!a || !a->gemm || a->L < 1 || a->S < 1 || a->d < 1 || a->dv < 1 || a->group < 1) return 2;
    return run_backward<double, dgemm_t>(*a);
}

int64_t qkv_backward_args_size(void) { return int64_t(sizeof(qkv_backward_args)); }

}  // extern "C"

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
// The tile products go through the caller's BLAS, or (products = 1) the library's own
// register-blocked micro-kernel (tiles.h: no per-call cost, the short rows' and small heads'
// case), and the softmax step runs in the vector clone the CPU supports (common.h). With the
// own products the block's queries are copied scaled once, the keys of each piece are packed
// transposed (d x n, zero-padded to the clone's lane width) for the scores' product, and the
// accumulator's rows are padded likewise. K and V may also be stored as bfloat16 or float16
// (float32 compute): each work item then widens the keys its rows see into its own buffers.

#include "common.h"
#include "tiles.h"
#include "widen.h"

namespace {

// One row's softmax step on its scores s[0:n) (the tile's columns), of which [jl, jh) are
// visible to the row by causal/window. Applies bias and mask, moves the running max m,
// writes the weights exp(s - m) over the visible columns (0 elsewhere) and returns the factor
// exp(m_old - m_new) by which the row's accumulator and sum must be scaled.
template <typename T>
QKV_INLINE void row_step(T* __restrict s, int64_t n, int64_t jl, int64_t jh,
                         const uint8_t* __restrict mrow, const T* __restrict brow, int64_t m_cs,
                         T* __restrict m, T* __restrict l, T* __restrict acc, int64_t dv) {
    const T ninf = -std::numeric_limits<T>::infinity();
    bias_and_mask(s, jl, jh, brow, mrow, m_cs);
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
struct StepArgs : TileRows {
    void* m;
    void* l;
    void* acc;
    int64_t dv;
    int64_t ldacc;  // the accumulator's row stride (dv, or dv padded for the own products)
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
                    bias ? bias + i * a.m_rs : nullptr, a.m_cs, m + i, l + i, acc + i * a.ldacc,
                    a.dv);
    }
}

QKV_CLONE_SET(step, StepArgs, tile_step)

typedef void (*step_t)(const StepArgs&);

template <typename T>
step_t pick_step(int isa) {
    if (sizeof(T) == 4) return pick_clone<step_t>(isa, QKV_CLONES(step, f32));
    return pick_clone<step_t>(isa, QKV_CLONES(step, f64));
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
    int64_t kmax;  // keys [0, kmax) only (a padding mask's key count); S: all
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
    Products prod;  // run NULL: BLAS (g) runs the tile products
};

// A worker's tiles, allocated once per thread.
template <typename T>
struct Buffers {
    std::vector<T> s, acc, m, l;
    std::vector<T> qc, kc, vc;  // contiguous copies of strided operands (the varlen walk)
    // the own products' scaled queries (bq x d), packed keys (d x bk), values (bk x ldacc)
    std::vector<T> qs, kt, vp;
    std::vector<int64_t> lo, hi, jl, jh;
    int64_t ldacc = 0;
    // width: the own products' lane width (their operands' rows padded to it), or 0 (BLAS)
    bool make(int64_t bq, int64_t bk, int64_t d, int64_t dv, int64_t width) {
        try {
            const int64_t w = std::max<int64_t>(width, 1);
            const int64_t bkp = (bk + w - 1) / w * w;
            ldacc = width ? (std::max<int64_t>(dv, 1) + w - 1) / w * w : std::max<int64_t>(dv, 1);
            s.resize(size_t(bq * bkp));
            acc.resize(size_t(bq * ldacc));
            if (width) {
                qs.resize(size_t(bq * d));
                kt.resize(size_t(d * bkp));
                if (ldacc != dv) vp.resize(size_t(bk * ldacc));
            }
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

// Stored 16-bit K/V (widen.h): keys [klo, khi) of one kv head, rows k16 + j * k_rs and
// v16 + j * v_rs, widened into buf's kc and vc, and b pointed at them. False without memory.
template <typename T>
bool widen_keys(widen_t widen, const uint16_t* k16, const uint16_t* v16, int64_t k_rs,
                int64_t v_rs, int64_t klo, int64_t khi, int64_t d, int64_t dv, Buffers<T>& buf,
                Block<T>& b) {
    if (khi <= klo) return true;  // no key: nothing is read
    try {
        buf.kc.resize(size_t((khi - klo) * d));
        buf.vc.resize(size_t((khi - klo) * dv));
    } catch (const std::bad_alloc&) {
        return false;
    }
    widen(k16 + klo * k_rs, k_rs, khi - klo, d, reinterpret_cast<float*>(buf.kc.data()));
    widen(v16 + klo * v_rs, v_rs, khi - klo, dv, reinterpret_cast<float*>(buf.vc.data()));
    b.k = buf.kc.data();
    b.k_rs = d;
    b.v = buf.vc.data();
    b.v_rs = dv;
    b.k_first = klo;
    return true;
}

// The FlashAttention-2 recurrence over one block of query rows (see the top of the file).
template <typename T, typename Gemm>
void forward_block(const Block<T>& b, Shared<Gemm> sh, Buffers<T>& buf) {
    const T ninf = -std::numeric_limits<T>::infinity();
    const int64_t rows = b.rows, dv = sh.dv, bk = sh.bk;
    sh.S = b.S;
    int64_t* lo = buf.lo.data();
    int64_t* hi = buf.hi.data();
    for (int64_t i = 0; i < rows; ++i) bounds(sh, b.S - b.L + b.r0 + i, &lo[i], &hi[i]);
    if (b.kmax < b.S) {  // a key count: the positions stay those of all S keys
        for (int64_t i = 0; i < rows; ++i) {
            hi[i] = std::min(hi[i], b.kmax);
            lo[i] = std::min(lo[i], hi[i]);
        }
    }
    std::fill(buf.m.begin(), buf.m.begin() + rows, ninf);
    std::fill(buf.l.begin(), buf.l.begin() + rows, T(0));
    const int64_t ldacc = buf.ldacc;
    std::fill(buf.acc.begin(), buf.acc.begin() + rows * ldacc, T(0));
    const int64_t klo = lo[0], khi = hi[rows - 1];  // both nondecreasing in the row
    if (sh.prod.run) {  // the scale folded into a contiguous copy of the block's queries
        const T scale = T(sh.scale);
        for (int64_t i = 0; i < rows; ++i) {
            const T* q = b.q + i * b.q_rs;
            T* qs = buf.qs.data() + i * sh.d;
            for (int64_t c = 0; c < sh.d; ++c) qs[c] = q[c] * scale;
        }
    }
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
        const T* kp = b.k + (c0 - b.k_first) * b.k_rs;
        const T* vt = b.v + (c0 - b.k_first) * b.v_rs;
        const int64_t w = sh.prod.width;
        const int64_t lds = sh.prod.run ? (n + w - 1) / w * w : n;
        if (sh.prod.run) {  // S (nr x lds) = (scale · Q[ra:rb]) · Kᵀ, Kᵀ packed (d x lds)
            T* kt = buf.kt.data();
            sh.prod.pack(PackArgs{kp, b.k_rs, n, sh.d, kt, lds});
            ProdArgs pa;
            pa.m = nr;
            pa.n = lds;
            pa.k = sh.d;
            pa.a = buf.qs.data() + ra * sh.d;
            pa.lda = sh.d;
            pa.b = kt;
            pa.ldb = lds;
            pa.c = s;
            pa.ldc = lds;
            pa.accumulate = 0;
            sh.prod.run(pa);
        } else {
            // S (nr x n, row-major, ld n) = scale · Q[ra:rb] · K[c0:c1]ᵀ; in BLAS's
            // column-major terms Sᵀ = Kᵀᵀ · Qᵀ.
            gemm(sh.g, "T", "N", int(n), int(nr), int(sh.d), T(sh.scale), kp, int(b.k_rs),
                 b.q + ra * b.q_rs, int(b.q_rs), T(0), s, int(n));
        }
        for (int64_t i = ra; i < rb; ++i) {
            buf.jl[i] = std::min(std::max(lo[i] - c0, int64_t(0)), n);
            buf.jh[i] = std::max(std::min(hi[i] - c0, n), buf.jl[i]);
        }
        StepArgs sa;
        sa.s = s;
        sa.lds = lds;
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
        sa.acc = buf.acc.data() + ra * ldacc;
        sa.dv = dv;
        sa.ldacc = ldacc;
        sh.step(sa);
        if (sh.prod.run) {  // acc[ra:rb] (nr x ldacc) += P · V[c0:c1], V's rows padded
            const T* vb = vt;
            int64_t ldv = b.v_rs;
            if (ldacc != dv) {
                T* vp = buf.vp.data();
                for (int64_t j = 0; j < n; ++j) {
                    std::memcpy(vp + j * ldacc, vt + j * b.v_rs, size_t(dv) * sizeof(T));
                    std::fill(vp + j * ldacc + dv, vp + (j + 1) * ldacc, T(0));
                }
                vb = vp;
                ldv = ldacc;
            }
            ProdArgs pa;
            pa.m = nr;
            pa.n = ldacc;
            pa.k = n;
            pa.a = s;
            pa.lda = lds;
            pa.b = vb;
            pa.ldb = ldv;
            pa.c = buf.acc.data() + ra * ldacc;
            pa.ldc = ldacc;
            pa.accumulate = 1;
            sh.prod.run(pa);
        } else {
            // acc[ra:rb] (nr x dv, ld dv) += P · V[c0:c1]; column-major: accᵀ += Vᵀ · Pᵀ
            gemm(sh.g, "N", "N", int(dv), int(nr), int(n), T(1), vt, int(b.v_rs), s, int(n),
                 T(1), buf.acc.data() + ra * ldacc, int(ldacc));
        }
    }
    T bad = 0;  // 0, or NaN when some output is not finite (0 * inf and NaN are NaN)
    for (int64_t i = 0; i < rows; ++i) {
        const T li = buf.l[i];
        const T* acc = buf.acc.data() + i * ldacc;
        T* out = b.out + i * b.out_rs;
        if (li == T(0)) {  // no visible key: 0 and -inf, never NaN
            for (int64_t c = 0; c < dv; ++c) out[c] = 0;
            b.lse[i * b.lse_s] = ninf;
        } else {
            const T inv = T(1) / li;
            T row_bad = 0;  // a simd sum: a serial one would wait on each add's latency
#pragma omp simd reduction(+ : row_bad)
            for (int64_t c = 0; c < dv; ++c) {
                const T o = acc[c] * inv;
                out[c] = o;
                row_bad += o * T(0);
            }
            bad += row_bad;
            b.lse[i * b.lse_s] = buf.m[i] + std::log(li);
        }
    }
    if (b.bad && bad != bad) __atomic_store_n(b.bad, uint8_t(1), __ATOMIC_RELAXED);
}

template <typename Gemm, typename Args>
Shared<Gemm> shared_of(const Args& a, int64_t bk, step_t step,
                       Products prod = {nullptr, nullptr, 0}) {
    Shared<Gemm> sh;
    sh.prod = prod;
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

// kv_format: 0, K/V in T; else (T float) K/V stored as 16-bit floats of that format, each
// task widening its visible keys into its worker's buffers (widen_rows_body).
template <typename T, typename Gemm>
int run(const qkv_prefill_args& a, int kv_format = 0) {
    // tiles no larger than the problem (a short call's buffers are made, and zeroed, per call)
    const int64_t bq = std::max<int64_t>(1, std::min(a.block_q, a.L));
    const int64_t bk = std::max<int64_t>(1, std::min(a.block_k, a.S));
    const int64_t nqb = (a.L + bq - 1) / bq;
    const int64_t ntasks = a.nb * nqb;
    const int isa = chosen_isa(a.isa);
    const Products prod = a.products ? pick_products<T>(isa) : Products{nullptr, nullptr, 0};
    const Shared<Gemm> sh = shared_of<Gemm>(a, bk, pick_step<T>(isa), prod);
    const widen_t widen = kv_format ? pick_widen(isa, kv_format) : nullptr;
    const T* Q = static_cast<const T*>(a.q);
    const T* K = static_cast<const T*>(a.k);
    const T* V = static_cast<const T*>(a.v);
    T* OUT = static_cast<T*>(a.out);
    T* LSE = static_cast<T*>(a.lse);
    const T* BIAS = static_cast<const T*>(a.bias);
    int no_memory = 0;  // a task could not widen its keys
    const int status = for_tasks<Buffers<T>>(
        ntasks, a.threads, nullptr,
        [&](Buffers<T>& buf) { return buf.make(bq, bk, a.d, a.dv, prod.width); },
        [&](Buffers<T>& buf, int64_t t) {
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
        b.kmax = a.counts ? std::max<int64_t>(0, std::min(a.counts[h], a.S)) : a.S;
        b.r0 = r0;
        b.rows = std::min(bq, a.L - r0);
        if (widen) {  // the keys some row of the block sees, widened
            Shared<Gemm> rule = sh;
            rule.S = a.S;
            int64_t klo, khi, unused;
            bounds(rule, a.S - a.L + r0, &klo, &unused);
            bounds(rule, a.S - a.L + r0 + b.rows - 1, &unused, &khi);
            khi = std::min(khi, b.kmax);
            klo = std::min(klo, khi);
            const uint16_t* k16 = static_cast<const uint16_t*>(a.k) + a.k_off[h];
            const uint16_t* v16 = static_cast<const uint16_t*>(a.v) + a.v_off[h];
            if (!widen_keys(widen, k16, v16, a.k_rs, a.v_rs, klo, khi, a.d, a.dv, buf, b)) {
                __atomic_store_n(&no_memory, 1, __ATOMIC_RELAXED);
                return;
            }
        }
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
    return status ? status : (no_memory ? 1 : 0);
}

// The packed varlen walk: tasks are (sequence, kv head, query block) triples, costliest
// first, each running the query heads that share the kv head, over the packed arrays (no
// padding).
// kv_format as run()'s: K/V stored as 16-bit floats, always widened into the task's buffers.
template <typename T, typename Gemm>
int run_varlen(const qkv_varlen_args& a, int kv_format = 0) {
    const int64_t bq = std::max<int64_t>(1, a.block_q), bk = std::max<int64_t>(1, a.block_k);
    const int isa = chosen_isa(a.isa);
    const Shared<Gemm> sh = shared_of<Gemm>(a, bk, pick_step<T>(isa));
    const widen_t widen = kv_format ? pick_widen(isa, kv_format) : nullptr;
    std::vector<VarlenTask> tasks;
    if (!varlen_tasks(a, bq, tasks)) return 1;
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
    int no_memory = 0;  // a task could not widen its keys
    const int status = for_tasks<Buffers<T>>(
        ntasks, a.threads, nullptr, [&](Buffers<T>& buf) { return buf.make(bq, bk, d, dv, 0); },
        [&](Buffers<T>& buf, int64_t t) {
        const VarlenTask& task = tasks[size_t(t / nkv)];
        const int64_t kvh = t % nkv;
        const int64_t q0 = a.cq[task.b], k0 = a.ck[task.b];
        Block<T> b;
        b.L = a.cq[task.b + 1] - q0;
        b.S = a.ck[task.b + 1] - k0;
        b.kmax = b.S;
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
        if (widen) {
            const uint16_t* k16 = static_cast<const uint16_t*>(a.k) + k0 * a.k_ts + kvh * a.k_hs;
            const uint16_t* v16 = static_cast<const uint16_t*>(a.v) + k0 * a.v_ts + kvh * a.v_hs;
            if (!widen_keys(widen, k16, v16, a.k_ts, a.v_ts, klo, khi, d, dv, buf, b)) {
                __atomic_store_n(&no_memory, 1, __ATOMIC_RELAXED);
                return;
            }
        } else if (copy_kv && khi > klo) {
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
    return status ? status : (no_memory ? 1 : 0);
}

}  // namespace

extern "C" {

// 0 on success; 1 when memory for the tiles could not be had; 2 for a bad argument.
int qkv_prefill_f32(const qkv_prefill_args* a) {
    if (!a || !(a->gemm || a->products) || a->L < 1 || a->S < 0 || a->d < 1 || a->dv < 0)
        return 2;
    return run<float, sgemm_t>(*a);
}

// The float32 prefill with K and V stored as bfloat16 or float16 (q, bias, out and lse float32;
// K/V strides and offsets in their 16-bit elements): for float16, and bfloat16 where the
// bfloat16 tile products do not run (no AVX512_BF16, a variant they do not take).
int qkv_prefill_f32_bf16kv(const qkv_prefill_args* a) {
    if (!a || !(a->gemm || a->products) || a->L < 1 || a->S < 0 || a->d < 1 || a->dv < 0)
        return 2;
    return run<float, sgemm_t>(*a, KV_BF16);
}

int qkv_prefill_f32_f16kv(const qkv_prefill_args* a) {
    if (!a || !(a->gemm || a->products) || a->L < 1 || a->S < 0 || a->d < 1 || a->dv < 0)
        return 2;
    return run<float, sgemm_t>(*a, KV_F16);
}

int qkv_prefill_f64(const qkv_prefill_args* a) {
    if (!a || !(a->gemm || a->products) || a->L < 1 || a->S < 0 || a->d < 1 || a->dv < 0)
        return 2;
    return run<double, dgemm_t>(*a);
}

int qkv_varlen_f32(const qkv_varlen_args* a) {
    if (!a || !a->gemm || a->nseq < 0 || a->heads < 1 || a->group < 1 || a->d < 1 || a->dv < 1)
        return 2;
    return run_varlen<float, sgemm_t>(*a);
}

// The packed walk with K and V stored as bfloat16 or float16 (as qkv_prefill_f32_f16kv).
int qkv_varlen_f32_bf16kv(const qkv_varlen_args* a) {
    if (!a || !a->gemm || a->nseq < 0 || a->heads < 1 || a->group < 1 || a->d < 1 || a->dv < 1)
        return 2;
    return run_varlen<float, sgemm_t>(*a, KV_BF16);
}

int qkv_varlen_f32_f16kv(const qkv_varlen_args* a) {
    if (!a || !a->gemm || a->nseq < 0 || a->heads < 1 || a->group < 1 || a->d < 1 || a->dv < 1)
        return 2;
    return run_varlen<float, sgemm_t>(*a, KV_F16);
}

int qkv_varlen_f64(const qkv_varlen_args* a) {
    if (!a || !a->gemm || a->nseq < 0 || a->heads < 1 || a->group < 1 || a->d < 1 || a->dv < 1)
        return 2;
    return run_varlen<double, dgemm_t>(*a);
}

int64_t qkv_varlen_args_size(void) { return int64_t(sizeof(qkv_varlen_args)); }

// The size of the argument struct, so the Python side can check it agrees on the layout.
int64_t qkv_args_size(void) { return int64_t(sizeof(qkv_prefill_args)); }

}  // extern "C"

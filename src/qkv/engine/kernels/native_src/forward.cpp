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
// Tasks are taken by native threads, a run of consecutive ones each first (for_tasks in
// common.h), latest query blocks first: under causal they see the most keys. The packed
// varlen walk runs the same block over packed sequences: tasks (sequence, kv head, query
// block), costliest first. Key tiles that no row of the block may see are skipped; across
// the causal/window edge keys go in narrow pieces, each with the rows that see part of it,
// and each row only exponentiates its visible keys.
//
// The tile products go through the caller's BLAS, or (products = 1) the library's own
// register-blocked micro-kernel (tiles.h: no per-call cost, the short rows' and small heads'
// case), and the softmax step runs in the vector clone the CPU supports (common.h). With the
// own products the block's queries are read where they are, the keys of each piece are packed
// transposed and scaled (d x n, zero-padded to the clone's lane width) for the scores'
// product, the accumulator's rows are padded likewise, and the softmax step goes a vector of
// lanes at a time over the padded rows (tile_step_lanes). K and V may also be stored as
// bfloat16 or float16 (float32 compute), and lie in pages (a paged cache's shared prefix): each
// piece's keys are then widened or gathered into the worker's kept rows just before its
// products read them (gather_rows), so they are read from memory once and used from L2.

#include "common.h"
#include "tiles.h"
#include "widen.h"

namespace {

// One row's softmax step on its scores s[0:n) (the tile's columns), of which [jl, jh) are
// visible to the row by causal/window. Applies bias and mask, moves the running max m,
// writes the weights exp(s - m) over the visible columns (0 elsewhere) and returns the factor
// exp(m_old - m_new) by which the row's accumulator and sum must be scaled.
// The start of a row's step (row_step, row_step_lanes): bias and mask applied, the new max
// into mnew, the columns outside [jl, jh) zeroed; false when nothing is visible yet (the
// row's weights then all 0, and l NaN where a visible score is).
template <typename T>
QKV_INLINE bool row_start(T* __restrict s, int64_t n, int64_t jl, int64_t jh,
                          const uint8_t* __restrict mrow, const T* __restrict brow, int64_t m_cs,
                          T mold, T* __restrict l, T& mnew) {
    bias_and_mask(s, jl, jh, brow, mrow, m_cs);
    mnew = std::max(mold, lane_max(s, jl, jh));
    for (int64_t j = 0; j < jl; ++j) s[j] = 0;
    for (int64_t j = jh; j < n; ++j) s[j] = 0;
    if (mnew != -std::numeric_limits<T>::infinity()) return true;
    bool nan = false;
    for (int64_t j = jl; j < jh; ++j) {
        nan |= s[j] != s[j];
        s[j] = 0;
    }
    if (nan) *l = std::numeric_limits<T>::quiet_NaN();
    return false;
}

// The end of a row's step: the accumulator rescaled by exp(mold - mnew), the new sum (with the
// row's weights' `sum`) and max. mold == mnew: exactly 1. mold == -inf: 0, and the accumulator
// is left as it is: every weight it summed was 0, so it holds 0 (or NaN, from an infinite
// value), which 0 times it would not change; the own products' first piece leaves it
// unwritten (forward_block).
template <typename T>
QKV_INLINE void row_end(T mold, T mnew, T sum, T* __restrict m, T* __restrict l,
                        T* __restrict acc, int64_t dv) {
    const bool unseen = mold == -std::numeric_limits<T>::infinity();
    const T alpha = unseen ? T(0) : exp_neg(mold - mnew);
    if (alpha != T(1) && !unseen) {
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) acc[c] *= alpha;
    }
    *l = *l * alpha + sum;
    *m = mnew;
}

template <typename T>
QKV_INLINE void row_step(T* __restrict s, int64_t n, int64_t jl, int64_t jh,
                         const uint8_t* __restrict mrow, const T* __restrict brow, int64_t m_cs,
                         T* __restrict m, T* __restrict l, T* __restrict acc, int64_t dv) {
    const T mold = *m;
    T mnew;
    if (!row_start(s, n, jl, jh, mrow, brow, m_cs, mold, l, mnew)) return;
    T sum = 0;  // summed as the weights are written (a simd reduction: lanes, then added)
#pragma omp simd reduction(+ : sum)
    for (int64_t j = jl; j < jh; ++j) {
        const T p = exp_neg(s[j] - mnew);
        s[j] = p;
        sum += p;
    }
    row_end(mold, mnew, sum, m, l, acc, dv);
}

// The softmax step over rows [0, rows) of a score tile, stride lds.
struct StepArgs : TileRows {
    void* m;
    void* l;
    void* acc;
    int64_t dv;
    int64_t ldacc;  // the accumulator's row stride (dv, or dv padded for the own products)
};

// The lanes of a where m holds all ones, else those of b (m: a comparison's lanes, all ones or
// all zeros), by bitwise operations: GCC compiles `m ? a : b` on its 64-byte vector types lane
// by lane in the AVX-512 clone, as it does their comparisons (lanes_cmp). The same lanes are
// chosen: the same bits.
template <typename M, typename V>
QKV_INLINE V pick_lanes(M m, V a, V b) {
    return same_bits<V>((same_bits<M>(a) & m) | (same_bits<M>(b) & ~m));
}

// The largest of v's W lanes, none of them NaN, in a tree of halves: the same value as a loop
// over the lanes from -inf (the largest of numbers does not depend on the order), without its
// W dependent comparisons, which took half of a 16-key row's softmax step (tile_step_lanes).
template <typename T, int W>
QKV_INLINE T fold_max(const typename Lanes<T, W>::type& v) {
    if constexpr (W == 1) {
        return v[0];
    } else {
        typedef typename Lanes<T, W / 2>::type H;
        H lo, hi;
        std::memcpy(&lo, &v, sizeof(H));
        std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(H), sizeof(H));
        return fold_max<T, W / 2>(pick_lanes(lanes_cmp<LANES_GT>(lo, hi), lo, hi));
    }
}

// exp_neg on W lanes at once, in place (the same steps, so the same results lane by lane;
// no vector is passed by value: that would change the ABI of a clone's calls).
template <typename T, int W>
QKV_INLINE void exp_neg_lanes(typename Lanes<T, W>::type& y) {
    typedef ExpParts<T> E;
    typedef typename Lanes<T, W>::type V;
    typedef typename Lanes<typename E::Bits, W>::type VB;
    V x = y;
    const VB under = lanes_cmp<LANES_LT>(x, V{} + E::low);  // NaN compares false: passes
    x = pick_lanes(under, V{} + E::low, x);
    const V t = x * E::log2e + E::magic;
    const V n = t - E::magic;
    V r = x - n * E::ln2_hi;
    r = r - n * E::ln2_lo;
    V p = V{} + E::coef[0];
    for (int i = 1; i < E::terms; ++i) p = p * r + E::coef[i];
    VB ti;
    std::memcpy(&ti, &t, sizeof(V));
    typename E::Bits mi;
    std::memcpy(&mi, &E::magic, sizeof(T));
    const VB bits = (ti - mi + E::bias) << E::place;
    V two_n;
    std::memcpy(&two_n, &bits, sizeof(V));
    y = pick_lanes(under, V{}, p * two_n);
}

// row_step a vector of W lanes at a time, for rows too wide for tile_step_lanes' runs. The
// same steps on the same inputs as row_step (row_start and row_end are row_step's own), and
// its sum in the same order: row_step's omp simd loop, which GCC runs W lanes wide from jl in
// each clone, adds column jl + k·W + u to lane u (k = 0, 1, ...) over the whole vectors,
// then the columns past the last whole vector one by one to lane 0, then lanes 0, 1, ...,
// W - 1 to 0; so here too, with those last columns' exponentials taken as one vector. Two
// vectors go at a time, so that one vector's exponential does not wait on the other's
// latency.
template <typename T, int W>
QKV_INLINE void row_step_lanes(T* __restrict s, int64_t n, int64_t jl, int64_t jh,
                               const uint8_t* __restrict mrow, const T* __restrict brow,
                               int64_t m_cs, T* __restrict m, T* __restrict l, T* __restrict acc,
                               int64_t dv) {
    typedef typename Lanes<T, W>::type V;
    const T mold = *m;
    T mnew;
    if (!row_start(s, n, jl, jh, mrow, brow, m_cs, mold, l, mnew)) return;
    const int64_t cnt = jh > jl ? jh - jl : 0;
    const int64_t nv = cnt / W, rest = cnt - nv * W;
    T* __restrict p = s + jl;
    V sum = V{};
    int64_t k = 0;
    for (; k + 2 <= nv; k += 2) {
        V x0, x1;
        std::memcpy(&x0, p + k * W, sizeof(V));
        std::memcpy(&x1, p + (k + 1) * W, sizeof(V));
        x0 -= mnew;
        x1 -= mnew;
        exp_neg_lanes<T, W>(x0);
        exp_neg_lanes<T, W>(x1);
        std::memcpy(p + k * W, &x0, sizeof(V));
        std::memcpy(p + (k + 1) * W, &x1, sizeof(V));
        sum += x0;
        sum += x1;
    }
    if (k < nv) {
        V x;
        std::memcpy(&x, p + k * W, sizeof(V));
        x -= mnew;
        exp_neg_lanes<T, W>(x);
        std::memcpy(p + k * W, &x, sizeof(V));
        sum += x;
    }
    T first = sum[0];
    if (rest) {
        V x = V{};
        std::memcpy(&x, p + nv * W, size_t(rest) * sizeof(T));
        x -= mnew;
        exp_neg_lanes<T, W>(x);
        std::memcpy(p + nv * W, &x, size_t(rest) * sizeof(T));
        for (int u = 0; u < rest; ++u) first += x[u];
    }
    T total = 0;
    total += first;
    for (int u = 1; u < W; ++u) total += sum[u];
    row_end(mold, mnew, total, m, l, acc, dv);
}

// The softmax step for the own products' score tiles, whose rows are padded to whole vectors
// of W lanes (lds, a multiple of W). Each row's max goes a vector at a time over the vectors
// that hold its visible columns ([jl, jh)), the lanes of its two edge vectors kept by whether
// their columns are visible (those between are all visible); then the weights of a run of
// rows go in one flat loop over those vectors, two at a time (the edge vectors' hidden lanes
// come out 0; the rows' other vectors and the padding are zeroed), and last each row's sum,
// rescaling and new max; each row's vectors are added in order. On short rows (16 to 64
// keys) the per-row omp simd loops of row_step spent as long on set-up and remainders as on
// the exponentials, and each row's few exponentials waited on each other's latency; the flat
// loop has the vectors of several rows in flight at once. Rows wider than LANES_MAX keys (the long
// prefill's 768-key pieces) go one at a time: by row_step_lanes in the AVX2 clone (3-5% faster
// than row_step's loops there), by row_step in the others (row_step_lanes measured 1-5% slower
// in the AVX-512 clone, with and without lanes_cmp, and no faster in the baseline's).
constexpr int64_t LANES_MAX = 128;

// The step over a tile's rows one at a time: by row_step, or (W > 0: the rows wider than
// LANES_MAX in the AVX2 clone) by row_step_lanes.
template <typename T, int W = 0>
QKV_INLINE void tile_step(const StepArgs& a) {
    T* s = static_cast<T*>(a.s);
    T* m = static_cast<T*>(a.m);
    T* l = static_cast<T*>(a.l);
    T* acc = static_cast<T*>(a.acc);
    const T* bias = static_cast<const T*>(a.bias);
    for (int64_t i = 0; i < a.rows; ++i) {
        const uint8_t* mrow = a.mask ? a.mask + i * a.m_rs : nullptr;
        const T* brow = bias ? bias + i * a.m_rs : nullptr;
        if constexpr (W == 0)
            row_step<T>(s + i * a.lds, a.n, a.jl[i], a.jh[i], mrow, brow, a.m_cs, m + i, l + i,
                        acc + i * a.ldacc, a.dv);
        else
            row_step_lanes<T, W>(s + i * a.lds, a.n, a.jl[i], a.jh[i], mrow, brow, a.m_cs, m + i,
                                 l + i, acc + i * a.ldacc, a.dv);
    }
}

QKV_CLONE_SET(step, StepArgs, tile_step)

template <typename T, int W>
QKV_INLINE void tile_step_lanes(const StepArgs& a) {
    if (a.lds > LANES_MAX) {
        if (W * sizeof(T) == 32) return tile_step<T, W>(a);  // the AVX2 clone's
        return tile_step<T>(a);
    }
    typedef typename Lanes<T, W>::type V;
    typedef typename ExpParts<T>::Bits Bits;
    typedef typename Lanes<Bits, W>::type VB;
    constexpr int R = 16;  // rows per run at most (their sums kept in V's on the stack)
    const T ninf = -std::numeric_limits<T>::infinity();
    T* s = static_cast<T*>(a.s);
    T* m = static_cast<T*>(a.m);
    T* l = static_cast<T*>(a.l);
    T* acc = static_cast<T*>(a.acc);
    const T* bias = static_cast<const T*>(a.bias);
    const int64_t lds = a.lds;
    Bits ninf_one;
    std::memcpy(&ninf_one, &ninf, sizeof(T));
    const VB ninf_bits = VB{} + ninf_one;
    // a run's rows stay in L1 between its passes (16 KiB)
    const int64_t run = std::max<int64_t>(1, std::min<int64_t>(R, (16 << 10) / (lds * sizeof(T))));
    // the lanes of the vector at column j whose columns lie in [lo, hi), as all-ones: two
    // loads from these (GCC built the compare of a lane index against lo and hi lane by lane
    // in the AVX-512 clone)
    Bits from[2 * W], below[2 * W];  // from: W zeros then W all-ones; below: the reverse
    for (int u = 0; u < W; ++u) {
        from[u] = below[W + u] = 0;
        from[W + u] = below[u] = Bits(-1);
    }
    const auto lanes_in = [&](int64_t j, int64_t lo, int64_t hi) __attribute__((always_inline)) {
        VB a, b;
        std::memcpy(&a, from + W - std::min<int64_t>(std::max<int64_t>(lo - j, 0), W), sizeof(VB));
        std::memcpy(&b, below + W - std::min<int64_t>(std::max<int64_t>(hi - j, 0), W), sizeof(VB));
        return a & b;
    };
    for (int64_t i0 = 0; i0 < a.rows; i0 += run) {
        const int nr = int(std::min<int64_t>(run, a.rows - i0));
        T mn[R];
        Bits lo[R], hi[R];
        bool live[R];
        V sums[R];
        // the vectors to exponentiate: those with a visible column (offsets from the run's
        // first row, and their rows); the others are zeroed here (under causal, about half of
        // a short tile)
        int32_t at[R * (LANES_MAX / W)];
        int16_t row_of[R * (LANES_MAX / W)];
        bool edge[R * (LANES_MAX / W)];  // whether the vector holds a hidden column
        int cnt = 0;
        for (int r = 0; r < nr; ++r) {  // bias and mask, and the new max
            const int64_t i = i0 + r;
            T* row = s + i * lds;
            const int64_t jl = a.jl[i], jh = std::min(a.jh[i], a.n);
            bias_and_mask(row, jl, jh, bias ? bias + i * a.m_rs : nullptr,
                          a.mask ? a.mask + i * a.m_rs : nullptr, a.m_cs);
            const int64_t vl = jh > jl ? jl / W * W : 0, vh = jh > jl ? (jh + W - 1) / W * W : 0;
            // the columns past jl's and jh's vector's edges are hidden (the select); those
            // between are all visible
            const int64_t el = vl + (vl < jl ? W : 0), eh = vh - (vh > jh ? W : 0);
            V mx = V{} + ninf;
            for (int64_t j = vl; j < vh; j += W) {
                V x;
                std::memcpy(&x, row + j, sizeof(V));
                if (j < el || j >= eh) {  // hidden lanes as -inf, which moves no max
                    const VB keep = lanes_in(j, jl, jh);
                    VB xb;
                    std::memcpy(&xb, &x, sizeof(V));
                    xb = (xb & keep) | (ninf_bits & ~keep);
                    std::memcpy(&x, &xb, sizeof(V));
                }
                mx = pick_lanes(lanes_cmp<LANES_GT>(x, mx), x, mx);
            }
            const T mnew = std::max(m[i], fold_max<T, W>(mx));  // (mx: no lane NaN)
            live[r] = mnew != ninf;
            sums[r] = V{};
            if (live[r]) {
                mn[r] = mnew;
                lo[r] = Bits(jl);
                hi[r] = Bits(jh);
                for (int64_t j = vl; j < vh; j += W) {
                    at[cnt] = int32_t(r * lds + j);
                    edge[cnt] = j < el || j >= eh;
                    row_of[cnt++] = int16_t(r);
                }
                std::fill(row, row + vl, T(0));
                std::fill(row + vh, row + lds, T(0));
            } else {  // nothing visible yet: weights 0, unless a score is NaN
                bool nan = false;
                for (int64_t j = jl; j < jh; ++j) nan |= row[j] != row[j];
                if (nan) l[i] = std::numeric_limits<T>::quiet_NaN();
                std::fill(row, row + lds, T(0));
            }
        }
        T* base = s + i0 * lds;
        V sum = V{};  // the row's, kept in a register until its last vector
        // a vector's weights: its hidden lanes zeroed, stored, added to its row's sum
        const auto put = [&](int t, V& p) __attribute__((always_inline)) {
            const int r = row_of[t];
            if (edge[t]) {  // p where visible, else +0 (as a select would): its bits and the
                // visible lanes' all-ones
                VB bits;
                std::memcpy(&bits, &p, sizeof(V));
                bits &= lanes_in(at[t] - r * lds, lo[r], hi[r]);
                std::memcpy(&p, &bits, sizeof(V));
            }
            std::memcpy(base + at[t], &p, sizeof(V));
            sum += p;
            if (t + 1 == cnt || row_of[t + 1] != r) {
                sums[r] = sum;
                sum = V{};
            }
        };
        int t = 0;
        for (; t + 2 <= cnt; t += 2) {  // the weights exp(s - m), two vectors at a time
            V p0, p1;
            std::memcpy(&p0, base + at[t], sizeof(V));
            std::memcpy(&p1, base + at[t + 1], sizeof(V));
            p0 -= mn[row_of[t]];
            p1 -= mn[row_of[t + 1]];
            exp_neg_lanes<T, W>(p0);
            exp_neg_lanes<T, W>(p1);
            put(t, p0);
            put(t + 1, p1);
        }
        if (t < cnt) {
            V p;
            std::memcpy(&p, base + at[t], sizeof(V));
            p -= mn[row_of[t]];
            exp_neg_lanes<T, W>(p);
            put(t, p);
        }
        for (int r = 0; r < nr; ++r) {  // sums, rescaling, new max
            if (!live[r]) continue;
            const int64_t i = i0 + r;
            T total = 0;  // lanes summed apart, then added
            for (int u = 0; u < W; ++u) total += sums[r][u];
            row_end(m[i], mn[r], total, m + i, l + i, acc + i * a.ldacc, a.dv);
        }
    }
}

// The lane widths are those of the clones' products (tiles.h), which pad the tile's rows.
QKV_LANE_CLONE_SET(step_lanes, StepArgs, tile_step_lanes)

typedef void (*step_t)(const StepArgs&);

// The softmax step of the clone isa; lanes: the own products' padded tiles' (their width
// being that clone's lane width), else BLAS's.
template <typename T>
step_t pick_step(int isa, bool lanes) {
    if (lanes) {
        if (sizeof(T) == 4) return pick_clone<step_t>(isa, QKV_CLONES(step_lanes, f32));
        return pick_clone<step_t>(isa, QKV_CLONES(step_lanes, f64));
    }
    if (sizeof(T) == 4) return pick_clone<step_t>(isa, QKV_CLONES(step, f32));
    return pick_clone<step_t>(isa, QKV_CLONES(step, f64));
}

// A block's results from its rows' accumulators (stride ldacc), sums l and maxima m:
// out = acc / l, lse = m + log l; a row with l = 0 saw no key: 0 and -inf, never NaN. lse
// NULL: not written (nor its log taken: a call whose caller reads the output alone).
struct FinishArgs {
    const void* acc;
    int64_t ldacc;
    const void* l;
    const void* m;
    void* out;
    int64_t out_rs;
    void* lse;
    int64_t lse_s;
    int64_t rows, dv;
    bool* bad;  // set when some output is not finite
};

// In the clones, W lanes at a time (a short block's normalisation was as much work as its
// softmax step, half of it summing each row's finiteness check across its lanes).
template <typename T, int W>
QKV_INLINE void tile_finish(const FinishArgs& a) {
    typedef typename Lanes<T, W>::type V;
    const T ninf = -std::numeric_limits<T>::infinity();
    const T* l = static_cast<const T*>(a.l);
    const T* m = static_cast<const T*>(a.m);
    T* lse = static_cast<T*>(a.lse);
    const int64_t dv = a.dv, dw = dv / W * W;
    // 0, or NaN when some output is not finite (0 * inf and NaN are NaN), lane by lane over
    // all rows, added across lanes once at the end
    V bad = V{};
    T bad_tail = 0;
    for (int64_t i = 0; i < a.rows; ++i) {
        const T li = l[i];
        const T* __restrict acc = static_cast<const T*>(a.acc) + i * a.ldacc;
        T* __restrict out = static_cast<T*>(a.out) + i * a.out_rs;
        if (li == T(0)) {
            for (int64_t c = 0; c < dv; ++c) out[c] = 0;
            if (lse) lse[i * a.lse_s] = ninf;
            continue;
        }
        const T inv = T(1) / li;
        int64_t c = 0;
        for (; c < dw; c += W) {
            V o;
            std::memcpy(&o, acc + c, sizeof(V));
            o *= inv;
            std::memcpy(out + c, &o, sizeof(V));
            bad += o * T(0);
        }
        for (; c < dv; ++c) {
            const T o = acc[c] * inv;
            out[c] = o;
            bad_tail += o * T(0);
        }
        if (lse) lse[i * a.lse_s] = m[i] + std::log(li);
    }
    for (int u = 0; u < W; ++u) bad_tail += bad[u];
    *a.bad = bad_tail != bad_tail;
}

QKV_LANE_CLONE_SET(finish, FinishArgs, tile_finish)

typedef void (*finish_t)(const FinishArgs&);

template <typename T>
finish_t pick_finish(int isa) {
    if (sizeof(T) == 4) return pick_clone<finish_t>(isa, QKV_CLONES(finish, f32));
    return pick_clone<finish_t>(isa, QKV_CLONES(finish, f64));
}

// Width of the key pieces across the rows' bounds (see forward_block): BLAS's, and the own
// products' (no cost per call: narrower pieces leave fewer hidden keys in the products; a
// short causal tile of 64 x 64 computed whole did twice the work its rows see).
constexpr int64_t EDGE = 64, EDGE_OWN = 32;
// Rows of a block from which V's rows, where they straddle cache lines, are copied to lines
// of their own before the values' product (forward_block): the copy is a 1/rows share of it.
constexpr int64_t VP_COPY_ROWS = 32;

// One forward work item: query rows [r0, r0 + rows) of one head of one sequence of L queries
// and S keys, with where its operands are and where its results go. Pointers are at the
// block's first row (q, out, lse, mask, bias) and at key k_first (k, v; mask and bias at 0).
// Where one kv head's key rows lie: K row j at k + (page * k_ps + row * k_rs) elements of es
// bytes each, (page, row) = (pages[j / page_size], j % page_size) with pages (a paged cache's
// prefix), else (0, j); V likewise.
struct KeyRows {
    const char* k;
    const char* v;
    int64_t k_rs, v_rs, es;
    const int32_t* pages;
    int64_t page_size, k_ps, v_ps;
};

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
    int64_t per_pos = 1;  // rows per query position: row r is at position r / per_pos of L / per_pos
    // Non-NULL: the keys lie there instead (pages, or 16-bit forms to widen), gathered a piece
    // at a time into the worker's kept rows (gather_rows); k, v, k_rs, v_rs, k_first unused.
    const KeyRows* at = nullptr;
    widen_t widen = nullptr;
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
    finish_t finish;
    Products prod;  // run NULL: BLAS (g) runs the tile products
};

// The row pitch of the packed keys (d rows of lds): lds, or one cache line more where lds
// would be a multiple of two lines. The scores' product reads a strip of every row of them
// for each block of query rows; rows a multiple of 128 bytes apart share a few of L1's sets
// (768 keys: 3 KiB apart, all 64 rows of d = 64 in 8 sets), more lines than their ways.
template <typename T>
constexpr int64_t kt_pitch(int64_t lds) {
    return lds * int64_t(sizeof(T)) % 128 ? lds : lds + 64 / int64_t(sizeof(T));
}

// v holds at least n elements: grown where it is shorter, never shrunk (a kept buffer's
// contents are whatever its last user left).
template <typename V>
void grow_to(V& v, int64_t n) {
    if (v.size() < size_t(n)) v.resize(size_t(n));
}

// A worker's tiles: each thread's kept from call to call (kept_buffers), grown as a call
// needs and never shrunk, so that their contents are whatever the last call left (every
// tile is written before it is read).
template <typename T>
struct Buffers {
    lines_of<T> s, acc;  // (rows whole vectors apart: tiles.h's operands)
    std::vector<T> m, l;
    std::vector<T> qc;          // a contiguous copy of strided query rows
    std::vector<T> oc;          // a block's output before it is narrowed (16-bit q and out)
                                // or put back (rows per position)
    std::vector<T> lc;          // and its lse (rows per position)
    // the own products' packed scaled keys (d x bk) and padded values (bk x ldacc)
    lines_of<T> kt, vp;
    std::vector<int64_t> lo, hi, jl, jh;
    int64_t ldacc = 0;
    // width: the own products' lane width (their operands' rows padded to it), or 0 (BLAS)
    bool make(int64_t bq, int64_t bk, int64_t d, int64_t dv, int64_t width) {
        try {
            const int64_t w = std::max<int64_t>(width, 1);
            const int64_t bkp = (bk + w - 1) / w * w;
            ldacc = width ? (std::max<int64_t>(dv, 1) + w - 1) / w * w : std::max<int64_t>(dv, 1);
            grow_to(s, bq * bkp);
            grow_to(acc, bq * ldacc);
            if (width) {
                grow_to(kt, d * (bkp + 64 / int64_t(sizeof(T))));  // kt_pitch's at most
                grow_to(vp, bk * ldacc);
            }
            for (auto* x : {&m, &l}) grow_to(*x, bq);
            for (auto* x : {&lo, &hi, &jl, &jh}) grow_to(*x, bq);
        } catch (const std::bad_alloc&) {
            return false;
        }
        return true;
    }
};

// A worker thread's tiles, kept from call to call (Buffers). Made afresh every call, they
// cost a page fault per 4 KiB at first touch and their zeroing wherever the allocator mapped
// them anew: B1 H8 kv2 L = S = 120 d64 with the grouped heads stacked (480 rows a block), one
// thread, 600 against 297 us kept; 480 faults a call at L = S = 512.
template <typename T>
Buffers<T>& kept_buffers() {
    static thread_local Buffers<T> buffers;
    return buffers;
}

// A worker thread's gathered keys and values, kept from call to call: slots 0 and 1 a varlen
// task's (up to KEEP_ROWS bytes each; larger ones in the call's buffers), 2 and 3 a prefill
// piece's (at most bk rows). Fresh memory for them every call cost a page fault per 4 KiB,
// about 1 ms of a shared prefix's 2048-key prefill (H32 kv8 d128, 2 threads).
constexpr size_t KEEP_ROWS = size_t(4) << 20;
template <typename T>
lines_of<T>* kept_rows() {
    static thread_local lines_of<T> rows[4];
    return rows;
}

// Keys [klo, khi) from `at` into kd (rows of d) and vd (rows of dv), a page's run of rows at a
// time: copied as they are (T), or widened from 16-bit forms (widen.h's widen).
template <typename T>
void gather_rows(widen_t widen, const KeyRows& at, int64_t klo, int64_t khi, int64_t d,
                 int64_t dv, T* kd, T* vd) {
    for (int64_t j = klo, take; j < khi; j += take) {
        int64_t page = 0, row = j;
        take = khi - j;
        if (at.pages) {
            page = at.pages[j / at.page_size];
            row = j % at.page_size;
            take = std::min(take, at.page_size - row);
        }
        const char* ks = at.k + (page * at.k_ps + row * at.k_rs) * at.es;
        const char* vs = at.v + (page * at.v_ps + row * at.v_rs) * at.es;
        T* kr = kd + (j - klo) * d;
        T* vr = vd + (j - klo) * dv;
        if (widen) {
            widen(reinterpret_cast<const uint16_t*>(ks), at.k_rs, take, d, reinterpret_cast<float*>(kr));
            widen(reinterpret_cast<const uint16_t*>(vs), at.v_rs, take, dv, reinterpret_cast<float*>(vr));
            continue;
        }
        for (int64_t i = 0; i < take; ++i) {
            std::memcpy(kr + i * d, ks + i * at.k_rs * at.es, size_t(d) * sizeof(T));
            std::memcpy(vr + i * dv, vs + i * at.v_rs * at.es, size_t(dv) * sizeof(T));
        }
    }
}

// A varlen task's keys [klo, khi) gathered from `at` into the thread's kept rows (or, larger
// than KEEP_ROWS, the call's kc and vc: not kept after it) and b pointed at them. False
// without memory (b unchanged).
template <typename T>
bool gather_keys(widen_t widen, const KeyRows& at, int64_t klo, int64_t khi, int64_t d,
                 int64_t dv, lines_of<T>& call_kc, lines_of<T>& call_vc, Block<T>& b) {
    if (khi <= klo) return true;  // no key: nothing is read
    const size_t nk = size_t((khi - klo) * d), nv = size_t((khi - klo) * dv);
    const bool keep = std::max(nk, nv) * sizeof(T) <= KEEP_ROWS;
    lines_of<T>& kc = keep ? kept_rows<T>()[0] : call_kc;
    lines_of<T>& vc = keep ? kept_rows<T>()[1] : call_vc;
    try {
        grow_to(kc, int64_t(nk));
        grow_to(vc, int64_t(nv));
    } catch (const std::bad_alloc&) {
        return false;
    }
    gather_rows(widen, at, klo, khi, d, dv, kc.data(), vc.data());
    b.k = kc.data();
    b.k_rs = d;
    b.v = vc.data();
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
    const int64_t at0 = b.S - b.L / b.per_pos;  // the first position's
    for (int64_t i = 0; i < rows; ++i) bounds(sh, at0 + (b.r0 + i) / b.per_pos, &lo[i], &hi[i]);
    if (b.kmax < b.S) {  // a key count: the positions stay those of all S keys
        for (int64_t i = 0; i < rows; ++i) {
            hi[i] = std::min(hi[i], b.kmax);
            lo[i] = std::min(lo[i], hi[i]);
        }
    }
    std::fill(buf.m.begin(), buf.m.begin() + rows, ninf);
    std::fill(buf.l.begin(), buf.l.begin() + rows, T(0));
    const int64_t ldacc = buf.ldacc;
    // The accumulator's rows start at 0. The own products write the first piece's rows
    // [ra, rb) without adding (no row of it was scaled: see row_step), and only the rows after
    // them are zeroed then (rows before ra see no key: never read, their l stays 0). BLAS adds
    // into zeros.
    bool first = sh.prod.run != nullptr;
    if (!first) std::fill(buf.acc.begin(), buf.acc.begin() + rows * ldacc, T(0));
    const int64_t klo = lo[0], khi = hi[rows - 1];  // both nondecreasing in the row
    // Keys in pieces: as wide as bk where every row that sees part of a piece sees all of it;
    // across the rows' bounds (the causal diagonal, a window's edges) pieces of EDGE keys
    // (EDGE_OWN for the own products), so the products computed for keys a row does not see
    // stay a small part of the work.
    const int64_t edge = sh.prod.run ? EDGE_OWN : EDGE;
    int64_t ra = 0, rb = 0;  // rows [ra, rb) see some key of the current piece
    int64_t nl = 0;          // the first row whose keys start after c0
    for (int64_t c0 = klo, c1; c0 < khi; c0 = c1) {
        while (ra < rows && hi[ra] <= c0) ++ra;
        if (ra >= rows) break;
        while (nl < rows && lo[nl] <= c0) ++nl;
        int64_t full = std::min(hi[ra], khi) - c0;
        if (nl < rows) full = std::min(full, lo[nl] - c0);
        c1 = std::min(c0 + (full >= edge ? std::min(full, bk) : std::min(edge, bk)), khi);
        const int64_t n = c1 - c0;
        while (rb < rows && lo[rb] < c1) ++rb;
        if (ra >= rb) continue;
        const int64_t nr = rb - ra;
        T* s = buf.s.data();
        const T* kp = b.k + (c0 - b.k_first) * b.k_rs;
        const T* vt = b.v + (c0 - b.k_first) * b.v_rs;
        int64_t k_rs = b.k_rs, v_rs = b.v_rs;
        if (b.at) {  // the piece's keys gathered (or widened) where its products read them
            T* kd = kept_rows<T>()[2].data();
            T* vd = kept_rows<T>()[3].data();
            gather_rows(b.widen, *b.at, c0, c1, sh.d, dv, kd, vd);
            kp = kd;
            vt = vd;
            k_rs = sh.d;
            v_rs = dv;
        }
        const int64_t w = sh.prod.width;
        const int64_t lds = sh.prod.run ? (n + w - 1) / w * w : n;
        if (sh.prod.run) {  // S (nr x lds) = (scale · Q[ra:rb]) · Kᵀ, Kᵀ packed (d x lds)
            T* kt = buf.kt.data();
            const int64_t ktp = kt_pitch<T>(lds);
            sh.prod.pack(PackArgs{kp, k_rs, n, sh.d, kt, ktp, sh.scale});
            ProdArgs pa;
            pa.m = nr;
            pa.n = lds;
            pa.k = sh.d;
            pa.a = b.q + ra * b.q_rs;
            pa.lda = b.q_rs;
            pa.b = kt;
            pa.ldb = ktp;
            pa.c = s;
            pa.ldc = lds;
            pa.accumulate = 0;
            sh.prod.run(pa);
        } else {
            // S (nr x n, row-major, ld n) = scale · Q[ra:rb] · K[c0:c1]ᵀ; in BLAS's
            // column-major terms Sᵀ = Kᵀᵀ · Qᵀ.
            gemm(sh.g, "T", "N", int(n), int(nr), int(sh.d), T(sh.scale), kp, int(k_rs),
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
            int64_t ldv = v_rs;
            // V's rows copied, padded, where they are not whole vectors (ldacc), or where they
            // straddle cache lines (a NumPy array's rows start 16 bytes into a line) and
            // enough rows read them to pay for the copy
            const bool straddle =
                (reinterpret_cast<uintptr_t>(vt) | uintptr_t(v_rs * sizeof(T))) % 64 != 0;
            if (ldacc != dv || (straddle && nr >= VP_COPY_ROWS)) {
                T* vp = buf.vp.data();
                for (int64_t j = 0; j < n; ++j) {
                    std::memcpy(vp + j * ldacc, vt + j * v_rs, size_t(dv) * sizeof(T));
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
            pa.accumulate = first ? 0 : 1;
            sh.prod.run(pa);
            if (first)
                std::fill(buf.acc.data() + rb * ldacc, buf.acc.data() + rows * ldacc, T(0));
            first = false;
        } else {
            // acc[ra:rb] (nr x dv, ld dv) += P · V[c0:c1]; column-major: accᵀ += Vᵀ · Pᵀ
            gemm(sh.g, "N", "N", int(dv), int(nr), int(n), T(1), vt, int(v_rs), s, int(n),
                 T(1), buf.acc.data() + ra * ldacc, int(ldacc));
        }
    }
    bool bad = false;
    FinishArgs fa;
    fa.acc = buf.acc.data();
    fa.ldacc = ldacc;
    fa.l = buf.l.data();
    fa.m = buf.m.data();
    fa.out = b.out;
    fa.out_rs = b.out_rs;
    fa.lse = b.lse;
    fa.lse_s = b.lse_s;
    fa.rows = rows;
    fa.dv = dv;
    fa.bad = &bad;
    sh.finish(fa);
    if (b.bad && bad) __atomic_store_n(b.bad, uint8_t(1), __ATOMIC_RELAXED);
}

template <typename Gemm, typename Args>
Shared<Gemm> shared_of(const Args& a, int64_t bk, step_t step, finish_t finish,
                       Products prod = {nullptr, nullptr, 0}) {
    Shared<Gemm> sh;
    sh.finish = finish;
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

// The lines of `rows` output rows of `bytes` each, `stride` elements apart, asked for to be
// written (prefetchw) before a block's work: the float32/float64 prefill's rows laid out
// apart (o_off), which the CPU's prefetchers do not follow, otherwise each waited for its
// lines when the block's results were written (B32 H12 L = S = 53 d32 float32 written
// (batch, L, heads, dv): 10% over the contiguous output's time, 4-5% asked for). The packed
// walks' token rows measured the same either way, the bfloat16 prefill's rows of one line
// slower asked for.
template <typename T>
QKV_INLINE void ask_rows(const T* out, int64_t rows, int64_t stride, int64_t bytes) {
    for (int64_t i = 0; i < rows; ++i) {
        const char* row = reinterpret_cast<const char*>(out + i * stride);
        for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(row + c, 1, 3);
    }
}

// kv_format: 0, K/V in T; else (T float) K/V stored as 16-bit floats of that format, each
// piece's keys widened into the worker's kept rows (gather_rows, widen_rows_body). io16 (with a
// kv_format): q and out in that 16-bit form too, each task widening its block's query rows and
// narrowing its output rows (narrow_rows_body); lse stays float32.
template <typename T, typename Gemm>
int run(const qkv_prefill_args& a, int kv_format = 0, bool io16 = false) {
    // tiles no larger than the problem (a short call's buffers are made, and zeroed, per call)
    const int64_t bq = std::max<int64_t>(1, std::min(a.block_q, a.L));
    const int64_t bk = std::max<int64_t>(1, std::min(a.block_k, a.S));
    const int64_t nqb = (a.L + bq - 1) / bq;
    const int64_t ntasks = a.nb * nqb;
    const int isa = chosen_isa(a.isa);
    const Products prod = a.products ? pick_products<T>(isa) : Products{nullptr, nullptr, 0};
    const step_t step = pick_step<T>(isa, prod.run != nullptr);
    const Shared<Gemm> sh = shared_of<Gemm>(a, bk, step, pick_finish<T>(isa), prod);
    const widen_t widen = kv_format ? pick_widen(isa, kv_format) : nullptr;
    const narrow_t narrow = io16 && kv_format ? pick_narrow(isa, kv_format) : nullptr;
    const T* Q = static_cast<const T*>(a.q);
    const T* K = static_cast<const T*>(a.k);
    const T* V = static_cast<const T*>(a.v);
    T* OUT = static_cast<T*>(a.out);
    T* LSE = static_cast<T*>(a.lse);
    const T* BIAS = static_cast<const T*>(a.bias);
    const bool gathered = widen || a.pages;
    const int64_t per_pos = std::max<int64_t>(1, a.per_pos);  // (rows per query position)
    if (per_pos > 1 && (a.L % per_pos || a.mask || a.bias)) return 2;
    // where row r of head h's output goes (abi.h: o_off), and the row stride there
    const auto out_at = [&](int64_t h, int64_t r) {
        if (!a.o_off) return (h * a.L + r) * a.dv;
        if (per_pos > 1) return a.o_off[h] + r % per_pos * a.o_hs + r / per_pos * a.o_rs;
        return a.o_off[h] + r * a.o_rs;
    };
    const int64_t out_rs = a.o_off ? a.o_rs : a.dv;
    // the row of the stack's operands, head after head, for row r taken position by position
    auto stacked_row = [&](int64_t r) { return r % per_pos * (a.L / per_pos) + r / per_pos; };
    int no_memory = 0;  // a task could not widen its query rows
    uint8_t bad = 0;    // some output is not finite (each block's normalisation checks)
    const int status = for_tasks<Buffers<T>*>(
        ntasks, a.threads, a.parallel,
        [&](Buffers<T>*& kept_tiles) {
            if (gathered) {  // a piece's gathered rows (the thread's kept ones)
                lines_of<T>* kept = kept_rows<T>();
                grow_to(kept[2], bk * a.d);
                grow_to(kept[3], bk * a.dv);
            }
            kept_tiles = &kept_buffers<T>();
            return kept_tiles->make(bq, bk, a.d, a.dv, prod.width);
        },
        [&](Buffers<T>*& kept_tiles, int64_t t) {
        Buffers<T>& buf = *kept_tiles;
        // latest query blocks first: under causal they cost the most
        const int64_t qb = nqb - 1 - t / a.nb, h = t % a.nb;
        const int64_t r0 = qb * bq;
        // stored 16-bit K/V or pages: each piece's keys gathered (widened) where they are used
        const int64_t es = widen ? 2 : int64_t(sizeof(T));  // bytes per stored element
        const KeyRows at{static_cast<const char*>(a.k) + a.k_off[h] * es,
                         static_cast<const char*>(a.v) + a.v_off[h] * es,
                         a.k_rs, a.v_rs, es, a.pages, a.page_size, a.k_ps, a.v_ps};
        Block<T> b;
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
        b.per_pos = per_pos;
        if (narrow || per_pos > 1) {
            // the block's query rows copied here (widened from 16 bits), its output (and, rows
            // per position, its lse) kept until narrowed or put back. Rows per position: row r
            // is head r % per_pos of the stack at position r / per_pos, which the stack's
            // operands hold head by head (that head's row at stacked_row(r))
            try {
                grow_to(buf.qc, b.rows * a.d);
                grow_to(buf.oc, b.rows * std::max<int64_t>(a.dv, 1));
                grow_to(buf.lc, b.rows);
            } catch (const std::bad_alloc&) {
                __atomic_store_n(&no_memory, 1, __ATOMIC_RELAXED);
                return;
            }
            if (narrow && per_pos == 1) {
                const uint16_t* q16 = static_cast<const uint16_t*>(a.q) + a.q_off[h] + r0 * a.q_rs;
                widen(q16, a.q_rs, b.rows, a.d, reinterpret_cast<float*>(buf.qc.data()));
            } else {
                for (int64_t i = 0; i < b.rows; ++i) {
                    const int64_t at = a.q_off[h] + stacked_row(r0 + i) * a.q_rs;
                    if (narrow)
                        widen(static_cast<const uint16_t*>(a.q) + at, a.q_rs, 1, a.d,
                              reinterpret_cast<float*>(buf.qc.data() + i * a.d));
                    else
                        std::memcpy(buf.qc.data() + i * a.d, Q + at, size_t(a.d) * sizeof(T));
                }
            }
            b.q = buf.qc.data();
            b.q_rs = a.d;
        } else {
            b.q = Q + a.q_off[h] + r0 * a.q_rs;
            b.q_rs = a.q_rs;
        }
        b.at = widen || a.pages ? &at : nullptr;  // (gathered a piece at a time)
        b.widen = widen;
        const bool kept = narrow || per_pos > 1;
        b.out = kept ? buf.oc.data() : OUT + out_at(h, r0);
        b.out_rs = kept ? a.dv : out_rs;
        b.lse = LSE ? (per_pos > 1 ? buf.lc.data() : LSE + h * a.L + r0) : nullptr;
        b.lse_s = 1;
        const int64_t moff = a.m_off ? a.m_off[h] + r0 * a.m_rs : 0;
        b.mask = a.mask ? a.mask + moff : nullptr;
        b.bias = BIAS ? BIAS + moff : nullptr;
        b.m_rs = a.m_rs;
        b.m_cs = a.m_cs;
        b.bad = &bad;
        if (a.o_off && !kept) ask_rows(b.out, b.rows, b.out_rs, a.dv * int64_t(sizeof(T)));
        forward_block<T, Gemm>(b, sh, buf);
        if (narrow && per_pos == 1 && !a.o_off)
            narrow(reinterpret_cast<const float*>(buf.oc.data()), b.rows * a.dv,
                   static_cast<uint16_t*>(a.out) + out_at(h, r0));
        else if (narrow && per_pos == 1)  // (rows apart: narrowed row by row)
            for (int64_t i = 0; i < b.rows; ++i)
                narrow(reinterpret_cast<const float*>(buf.oc.data() + i * a.dv), a.dv,
                       static_cast<uint16_t*>(a.out) + out_at(h, r0 + i));
        if (per_pos > 1)
            for (int64_t i = 0; i < b.rows; ++i) {
                const int64_t at = h * a.L + stacked_row(r0 + i);
                const int64_t o = a.o_off ? out_at(h, r0 + i) : at * a.dv;
                if (narrow)
                    narrow(reinterpret_cast<const float*>(buf.oc.data() + i * a.dv), a.dv,
                           static_cast<uint16_t*>(a.out) + o);
                else
                    std::memcpy(OUT + o, buf.oc.data() + i * a.dv, size_t(a.dv) * sizeof(T));
                if (LSE) LSE[at] = buf.lc[size_t(i)];
            }
    });
    return status ? status : (no_memory ? 1 : (bad ? 3 : 0));
}

// The packed varlen walk: tasks are (sequence, kv head, query block) triples, costliest
// first, each running the query heads that share the kv head, over the packed arrays (no
// padding).
// kv_format as run()'s: K/V stored as 16-bit floats, always widened into the task's buffers.
template <typename T, typename Gemm>
int run_varlen(const qkv_varlen_args& a, int kv_format = 0) {
    const int64_t bq = std::max<int64_t>(1, a.block_q), bk = std::max<int64_t>(1, a.block_k);
    const int isa = chosen_isa(a.isa);
    const Shared<Gemm> sh = shared_of<Gemm>(a, bk, pick_step<T>(isa, false), pick_finish<T>(isa));
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
    // each worker's kept tiles, and the call's own copies of keys too long to keep
    struct Worker {
        Buffers<T>* tiles;
        lines_of<T> kc, vc;
    };
    const int status = for_tasks<Worker>(
        ntasks, a.threads, a.parallel,
        [&](Worker& w) {
            w.tiles = &kept_buffers<T>();
            return w.tiles->make(bq, bk, d, dv, 0);
        },
        [&](Worker& w, int64_t t) {
        Buffers<T>& buf = *w.tiles;
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
        if (widen || (copy_kv && khi > klo)) {
            const int64_t es = widen ? 2 : int64_t(sizeof(T));  // bytes per stored element
            const KeyRows at{static_cast<const char*>(a.k) + (k0 * a.k_ts + kvh * a.k_hs) * es,
                             static_cast<const char*>(a.v) + (k0 * a.v_ts + kvh * a.v_hs) * es,
                             a.k_ts, a.v_ts, es, nullptr, 0, 0, 0};
            // (without memory: widened K/V cannot be had; copies are read in place instead)
            if (!gather_keys(widen, at, klo, khi, d, dv, w.kc, w.vc, b) && widen) {
                __atomic_store_n(&no_memory, 1, __ATOMIC_RELAXED);
                return;
            }
        }
        bool q_copied = false;
        if (copy_q) {
            try {
                grow_to(buf.qc, b.rows * d);
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

// 0 on success; 1 when memory for the tiles could not be had; 2 for a bad argument; 3 when
// some output is not finite (every output written: the caller applies its rules).
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

// q, K, V and out all bfloat16 (or all float16), computed in float32 as
// qkv_prefill_f32_bf16kv (f16kv) computes them on q widened, and the output rounded to nearest
// even: the bits of that call's output narrowed. lse is float32; q's offsets and row stride in
// its 16-bit elements. (qkv_prefill_bf16 is the bfloat16 tile products' kernel.)
int qkv_prefill_f32_bf16io(const qkv_prefill_args* a) {
    if (!a || !(a->gemm || a->products) || a->L < 1 || a->S < 0 || a->d < 1 || a->dv < 0 ||
        a->pages)
        return 2;
    return run<float, sgemm_t>(*a, KV_BF16, true);
}

int qkv_prefill_f32_f16io(const qkv_prefill_args* a) {
    if (!a || !(a->gemm || a->products) || a->L < 1 || a->S < 0 || a->d < 1 || a->dv < 0 ||
        a->pages)
        return 2;
    return run<float, sgemm_t>(*a, KV_F16, true);
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

// A kept small call (see abi.h): fn on a copy of the kept arguments t with the call's
// addresses put in (t itself may serve another thread's call at the same time).
int qkv_prefill_at(qkv_prefill_fn fn, const qkv_prefill_args* t, const void* q, const void* k,
                   const void* v, void* out, const int64_t* counts) {
    if (!fn || !t) return 2;
    qkv_prefill_args a = with_addresses(*t, q, k, v, out);
    if (counts) a.counts = counts;
    return fn(&a);
}

// A kept masked call (see abi.h): t's mask or bias (the one it holds) replaced by the call's.
int qkv_prefill_mask_at(qkv_prefill_fn fn, const qkv_prefill_args* t, const void* q,
                        const void* k, const void* v, void* out, const void* mask) {
    if (!fn || !t || !mask || (!t->mask && !t->bias)) return 2;
    qkv_prefill_args a = with_addresses(*t, q, k, v, out);
    if (t->mask)
        a.mask = static_cast<const uint8_t*>(mask);
    else
        a.bias = mask;
    return fn(&a);
}

// The size of the argument struct, so the Python side can check it agrees on the layout.
int64_t qkv_args_size(void) { return int64_t(sizeof(qkv_prefill_args)); }

// The status the float32/float64 prefill returns when some output is not finite (a library
// without this function returned 0 then).
int qkv_prefill_not_finite_status(void) { return 3; }

// The FMA peak micro-benchmark (tiles.h's fma_rounds) in the clone `isa` asks for (0: the
// widest this CPU runs, as the kernels'): the float32 FLOP done, for the caller to time.
double qkv_fma_peak(int64_t isa, int64_t rounds) {
    if (rounds < 0) return -1;
#if QKV_X86
    const fma_t f = pick_clone<fma_t>(chosen_isa(isa), fma_base, fma_avx2, fma_avx512);
#else
    const fma_t f = fma_base;
#endif
    return f(rounds);
}

}  // extern "C"

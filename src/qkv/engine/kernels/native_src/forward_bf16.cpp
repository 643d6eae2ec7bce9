// Fused prefill forward with bfloat16 tile products: the recurrence of forward.cpp, for
// bfloat16 queries, keys and values, with both products on AVX512_BF16's vdpbf16ps (each
// float32 lane adds two bfloat16 products, exactly, to its sum) instead of BLAS.
//
// Must equal qkv.reference.attention applied to the same (bfloat16) numbers, up to the one
// rounding FlashAttention and PyTorch make too: the weights P are rounded to bfloat16 for the
// second product. Scores, the running max and sum, the accumulator and lse are float32; out
// is rounded to bfloat16 once, at the end.
//
// Layout: a work item is 64 query rows of one head, held "queries in lanes": four vectors of
// 16 rows. Its queries are packed once, pair by pair of the d axis (q[r][2p], q[r][2p+1] in
// one 32-bit word, the form vdpbf16ps multiplies), so each key's pair word is broadcast from
// K as it lies in memory (no packing of K). Per tile of up to 64 keys:
//
//     Sᵀ (keys x 64 rows)  = K_tile · Q_blkᵀ        6 keys x 4 vectors of accumulators
//     per lane (query row): scale, hide keys outside [lo, hi), m' = max(m, max S),
//         P = exp(S − m'), l = l · exp(m − m') + Σ P                  (float32)
//     P packed as pairs of keys in bfloat16; the tile's V packed as pairs of rows
//     accᵀ (dv x 64 rows) = accᵀ · exp(m − m') + Vᵀ · Pᵀ     6 columns x 4 vectors
//
// and out = acc / l, lse = m + log l (l = 0: out 0, lse −inf) at the end. Causal and windows
// come as each row's bounds; a boolean mask or a float32 bias is read per tile into the
// scores' layout (keys by query lanes) and applied with the bounds, as forward.cpp's
// bias_and_mask does: the bias added to the scaled score, a hidden key −inf whatever its bias.
// The score variants are not taken here (the Python side sends those problems to the float32
// kernels), nor masks in the packed varlen walk. d must be even.

#include "bf16.h"

namespace {

#if QKV_X86

constexpr int64_t BQ = LANES;  // query rows per work item: the lanes of the tile steps
constexpr int RV = LV;
constexpr int64_t BK = 64;  // keys per tile

// A worker's buffers, made once per thread (64-byte aligned: the tile steps load whole vectors).
struct Tiles {
    Arena arena;
    uint32_t* qp;  // (d / 2, BQ) query pair words
    float* st;     // (BK, BQ) scores of the tile
    uint32_t* pp;  // (BK / 2, BQ) weight pair words (pairs of keys)
    uint32_t* vp;  // (BK / 2, dvp) value pair words (pairs of rows)
    float* acc;    // (dv, BQ)
    float *m, *l, *alpha;
    int32_t *lo, *hi;
    float* bt;     // (BK, BQ) the tile's bias, or 0
    uint64_t* mw;  // (BQ) the tile's mask, a word per row: bit j set where it sees key c0 + j
    // the AMX road's (forward_item with tiles): the weights as rows, the accumulator as
    // rows, and a block of keys past the end of K padded with zeros
    uint32_t* pa;   // (BQ, BK / 2) weight pair words, row by row
    float* acc_r;   // (BQ, dvp)
    float* pv;      // (BQ, dvp) the tile's P · V
    uint16_t* kpad; // (16, d)
    bool make(int64_t d, int64_t dv, int64_t dvp) {
        const int64_t words = (d / 2 + 15) / 16 * 16 * BQ + BK * BQ + BK / 2 * BQ +
                              BK / 2 * dvp + dv * BQ + 5 * BQ + BK * BQ + BK * BQ / 4 +
                              BQ * BK / 2 + 2 * BQ * dvp + 8 * d;
        if (!arena.make(size_t(words + 16 * 16) * 4)) return false;
        qp = arena.take<uint32_t>((d / 2 + 15) / 16 * 16 * BQ);  // (whole blocks of 16 pairs)
        st = arena.take<float>(BK * BQ);
        pp = arena.take<uint32_t>(BK / 2 * BQ);
        vp = arena.take<uint32_t>(BK / 2 * dvp);
        acc = arena.take<float>(dv * BQ);
        m = arena.take<float>(BQ);
        l = arena.take<float>(BQ);
        alpha = arena.take<float>(BQ);
        lo = arena.take<int32_t>(BQ);
        hi = arena.take<int32_t>(BQ);
        bt = arena.take<float>(BK * BQ);
        mw = arena.take<uint64_t>(BQ);  // (within the BK * BQ / 4 words counted above)
        pa = arena.take<uint32_t>(BQ * BK / 2);
        acc_r = arena.take<float>(BQ * dvp);
        pv = arena.take<float>(BQ * dvp);
        kpad = arena.take<uint16_t>(16 * d);
        return true;
    }
};

// The softmax step of one tile of n keys starting at key c0 (its scores in t.st), 16 rows at
// a time: see the top of the file. Writes the weights' pair words to t.pp and each row's
// factor to t.alpha. Keys every row of the item sees need no test. With `bias` the tile's
// t.bt is added to the scaled scores; with `mask` t.mw hides keys too.
QKV_BF16 void softmax_step(Tiles& t, int64_t n, int64_t c0, float scale, bool bias, bool mask) {
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < RV; ++r) {
        const __m512i lo = _mm512_load_si512(t.lo + 16 * r), hi = _mm512_load_si512(t.hi + 16 * r);
        const bool all = !mask && _mm512_reduce_max_epi32(lo) <= c0 &&
                         _mm512_reduce_min_epi32(hi) >= c0 + n;
        const __m512 m_old = _mm512_load_ps(t.m + 16 * r);
        __m512 mx = m_old;
        float* s = t.st + 16 * r;
        // the 16 rows' mask words, 8 in each: key j's bit of each row a lane test
        const __m512i wa = mask ? _mm512_load_si512(t.mw + 16 * r) : _mm512_setzero_si512();
        const __m512i wb = mask ? _mm512_load_si512(t.mw + 16 * r + 8) : _mm512_setzero_si512();
        for (int64_t j = 0; j < n; ++j) {
            __m512 x = _mm512_mul_ps(_mm512_load_ps(s + j * BQ), sc);
            if (bias) x = _mm512_add_ps(x, _mm512_load_ps(t.bt + j * BQ + 16 * r));
            if (!all) {
                const __m512i key = _mm512_set1_epi32(int32_t(c0 + j));
                __mmask16 seen =
                    _mm512_cmpge_epi32_mask(key, lo) & _mm512_cmplt_epi32_mask(key, hi);
                if (mask) {
                    const __m512i bit = _mm512_set1_epi64(int64_t(uint64_t(1) << j));
                    const unsigned a = _mm512_test_epi64_mask(wa, bit);
                    const unsigned b = _mm512_test_epi64_mask(wb, bit);
                    seen &= __mmask16(a | (b << 8));
                }
                x = _mm512_mask_blend_ps(seen, ninf, x);
            }
            _mm512_store_ps(s + j * BQ, x);
            mx = _mm512_max_ps(x, mx);  // a NaN score is left out here; its weight carries it
        }
        // nothing visible yet: every weight is 0 (the reference 0 keeps −inf − −inf away)
        const __m512 ref = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ), mx,
                                                _mm512_setzero_ps());
        const __m512 alpha = exp_lanes(_mm512_sub_ps(m_old, ref));  // m = −inf: 0
        _mm512_store_ps(t.alpha + 16 * r, alpha);
        _mm512_store_ps(t.m + 16 * r, mx);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = 0; p < (n + 1) / 2; ++p) {
            const __m512 a = exp_lanes(_mm512_sub_ps(_mm512_load_ps(s + 2 * p * BQ), ref));
            const __m512 b =
                2 * p + 1 < n ? exp_lanes(_mm512_sub_ps(_mm512_load_ps(s + (2 * p + 1) * BQ), ref))
                              : _mm512_setzero_ps();  // an odd tile's last key pairs with 0
            sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
            _mm512_store_si512(t.pp + p * BQ + 16 * r, pair_words(a, b));
        }
        const __m512 l = _mm512_load_ps(t.l + 16 * r);
        _mm512_store_ps(t.l + 16 * r, _mm512_fmadd_ps(l, alpha, sum));
    }
}

// The AMX road's two products (tiles_begin() done by the caller; d a multiple of 32, dv of
// 16). Both keep the layouts of the vdpbf16ps road's where they meet the softmax step: the
// scores and the weights have the item's query rows in lanes.
//
// Sᵀ (n keys x BQ rows) = K_tile · Q_blkᵀ, 16 keys at a time into t.st: A is K's 16 rows as
// they lie (32 of d's elements per tile), B the queries' pair words t.qp (16 pairs x 16 rows
// per tile), one C tile per 16 query rows. Keys past `valid` (the end of K) are read from a
// copy padded with zeros; scores of keys past n are written and not read.
#if QKV_HAS_AMX
QKV_AMX void scores_amx(const uint16_t* k, int64_t k_rs, int64_t valid, int64_t n, int64_t d,
                        Tiles& t) {
    QKV_TILE_FENCE();
    const int64_t qs = BQ * 4;  // the stride of qp's and st's rows, in bytes
    for (int64_t kb = 0; kb < n; kb += 16) {
        const uint16_t* kr = k + kb * k_rs;
        int64_t stride = k_rs * 2;
        if (kb + 16 > valid) {
            for (int64_t i = 0; i < 16; ++i) {
                if (kb + i < valid)
                    std::memcpy(t.kpad + i * d, kr + i * k_rs, size_t(d) * 2);
                else
                    std::memset(t.kpad + i * d, 0, size_t(d) * 2);
            }
            QKV_TILE_FENCE();
            kr = t.kpad;
            stride = d * 2;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t dc = 0; dc < d / 32; ++dc) {
            const uint32_t* b = t.qp + dc * 16 * BQ;
            _tile_loadd(4, kr + 32 * dc, stride);
            _tile_loadd(5, b, qs);
            _tile_loadd(6, b + 16, qs);
            _tile_loadd(7, b + 32, qs);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + 48, qs);
            _tile_dpbf16ps(3, 4, 5);
        }
        float* s = t.st + kb * BQ;
        _tile_stored(0, s, qs);
        _tile_stored(1, s + 16, qs);
        _tile_stored(2, s + 32, qs);
        _tile_stored(3, s + 48, qs);
    }
    QKV_TILE_FENCE();
}

#else
void scores_amx(const uint16_t*, int64_t, int64_t, int64_t, int64_t, Tiles&) {}
#endif

// The weights' pair words as rows for values_amx (t.pp into t.pa), the pairs past the tile's
// keys 0 in both operands. Done before the next tile's scores, so that these stores have
// reached the cache when the tiles load them (a tile load waits for vector stores in flight).
QKV_BF16 void weights_as_rows(Tiles& t, int64_t n, int64_t dvp) {
    const int64_t np = (n + 1) / 2, nkc = (n + 31) / 32;
    for (int64_t p = np; p < 16 * nkc; ++p) {
        std::memset(t.pp + p * BQ, 0, BQ * 4);
        std::memset(t.vp + p * dvp, 0, size_t(dvp) * 4);
    }
    for (int64_t kc = 0; kc < nkc; ++kc)
        for (int64_t j = 0; j < BQ; j += 16)
            transpose_words16(t.pp + kc * 16 * BQ + j, BQ, t.pa + j * (BK / 2) + 16 * kc, BK / 2);
}

// acc (BQ rows x dv, t.acc_r) = acc · alpha + P · V over the tile's n keys: A is the weights as
// rows (t.pa: 16 rows x 32 keys per tile), B the values' pair words t.vp (16 pairs of keys x
// 16 columns), C 16 rows x 16 columns of P · V, up to four at a time, into t.pv. Pairs of keys
// from the tile's (n + 1) / 2 to the next 32 keys are zero in both (weights_as_rows).
#if QKV_HAS_AMX
QKV_AMX void values_amx(Tiles& t, int64_t n, int64_t dv, int64_t dvp) {
    const int64_t nkc = (n + 31) / 32;
    QKV_TILE_FENCE();
    const int64_t os = dvp * 4, ps = BK / 2 * 4;  // pv's and vp's row stride, pa's (bytes)
    for (int64_t j = 0; j < BQ; j += 16) {
        for (int64_t c0 = 0; c0 < dv; c0 += 64) {
            const int64_t nt = std::min<int64_t>(4, (dv - c0) / 16);
            float* o = t.pv + j * dvp + c0;
            _tile_zero(0);
            if (nt > 1) _tile_zero(1);
            if (nt > 2) _tile_zero(2);
            if (nt > 3) _tile_zero(3);
            for (int64_t kc = 0; kc < nkc; ++kc) {
                const uint32_t* b = t.vp + kc * 16 * dvp + c0;
                _tile_loadd(4, t.pa + j * (BK / 2) + 16 * kc, ps);
                _tile_loadd(5, b, os);
                _tile_dpbf16ps(0, 4, 5);
                if (nt > 1) {
                    _tile_loadd(6, b + 16, os);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (nt > 2) {
                    _tile_loadd(7, b + 32, os);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if (nt > 3) {
                    _tile_loadd(5, b + 48, os);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, o, os);
            if (nt > 1) _tile_stored(1, o + 16, os);
            if (nt > 2) _tile_stored(2, o + 32, os);
            if (nt > 3) _tile_stored(3, o + 48, os);
        }
    }
    QKV_TILE_FENCE();
    // acc · alpha + P · V in vector operations (the accumulator never goes through the tiles:
    // a tile load of what vector stores had just written waited for them, 43% of this step)
    for (int64_t r = 0; r < BQ; ++r) {
        const __m512 a = _mm512_set1_ps(t.alpha[r]);
        float* o = t.acc_r + r * dvp;
        const float* x = t.pv + r * dvp;
        for (int64_t c = 0; c < dv; c += 16)
            _mm512_store_ps(o + c,
                            _mm512_fmadd_ps(_mm512_load_ps(o + c), a, _mm512_load_ps(x + c)));
    }
}
#else
void values_amx(Tiles&, int64_t, int64_t, int64_t) {}
#endif

// One work item: query rows [r0, r0 + rows) of one head of a sequence of L queries and S keys,
// with where its operands are (pointers at the item's first query row and at key 0; row
// strides in elements) and where its results go.
template <typename QT>
struct Item {
    const QT* q;  // float32 holding bfloat16 values, or bfloat16 bits
    int64_t q_rs;
    const uint16_t* k;
    int64_t k_rs;
    const uint16_t* v;
    int64_t v_rs;
    int64_t L, S, r0, rows;
    int64_t kmax;  // the keys [0, kmax) the head attends (a padding mask read as key counts)
    uint16_t* out;  // bfloat16 bits
    int64_t out_rs;
    float* lse;
    int64_t lse_s;
    const uint8_t* mask = nullptr;  // entry (row r of the item, key j) at r * m_rs + j * m_cs
    const float* bias = nullptr;
    int64_t m_rs = 0, m_cs = 0;
};

// 16 rows of 16 floats become 16 columns: x[j] lane i = x[i] lane j, in registers.
QKV_BF16 void transpose16(__m512 x[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved
        t[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // 4 x 4 blocks transposed within each 128-bit lane
        x[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        x[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        x[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        x[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 2; ++i) {  // then the 128-bit lanes, twice
        for (int k = 0; k < 4; ++k) {
            t[8 * i + k] = _mm512_shuffle_f32x4(x[8 * i + k], x[8 * i + 4 + k], 0x88);
            t[8 * i + 4 + k] = _mm512_shuffle_f32x4(x[8 * i + k], x[8 * i + 4 + k], 0xdd);
        }
    }
    for (int k = 0; k < 8; ++k) {
        x[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
        x[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
    }
}

// Row r's mask over keys [c0, c0 + n) (n <= BK = 64) as a word: bit j set where the row sees
// key c0 + j. Keys in a row (m_cs = 1), read 64 bytes at a time and tested at once: written
// byte by byte into the scores' layout (key j, row r at j * BQ + r), the mask of a 64 x 64
// tile took several times as long as its two AMX products.
QKV_BF16 uint64_t mask_word(const uint8_t* m, int64_t m_cs, int64_t n) {
    if (m_cs == 1) {
        const __mmask64 keys = n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1;
        const __m512i bytes = _mm512_maskz_loadu_epi8(keys, m);
        return uint64_t(_mm512_test_epi8_mask(bytes, bytes));
    }
    uint64_t w = 0;
    for (int64_t j = 0; j < n; ++j)
        if (m[j * m_cs]) w |= uint64_t(1) << j;
    return w;
}

// The mask and bias of keys [c0, c0 + n) for the item's rows into t.mw (a word per row) and
// t.bt (the scores' layout: key j, row r at j * BQ + r, transposed 16 x 16 at a time where a
// row's keys lie together); rows past the item's are hidden.
template <typename QT>
QKV_BF16 void mask_tile(const Item<QT>& it, Tiles& t, int64_t c0, int64_t n) {
    if (it.mask) {
        const uint64_t one = it.m_rs == 0 ? mask_word(it.mask + c0 * it.m_cs, it.m_cs, n) : 0;
        for (int64_t r = 0; r < BQ; ++r) {
            const uint8_t* m = it.mask + r * it.m_rs + c0 * it.m_cs;
            t.mw[r] = r >= it.rows ? 0 : it.m_rs == 0 ? one : mask_word(m, it.m_cs, n);
        }
    }
    if (!it.bias) return;
    if (it.m_rs == 0) {  // one row for all (a per-key bias): a fill per key
        for (int64_t j = 0; j < n; ++j) {
            float* b = t.bt + j * BQ;
            const float x = it.bias[(c0 + j) * it.m_cs];
            for (int64_t r = 0; r < BQ; ++r) b[r] = r < it.rows ? x : 0.0f;
        }
        return;
    }
    if (it.m_cs == 1) {  // keys in a row: 16 x 16 blocks transposed in registers
        for (int64_t rb = 0; rb < BQ; rb += 16) {
            for (int64_t jb = 0; jb < n; jb += 16) {
                const int64_t nj = std::min<int64_t>(16, n - jb);
                const __mmask16 keys = nj >= 16 ? __mmask16(0xffff) : __mmask16((1u << nj) - 1);
                __m512 x[16];
                for (int i = 0; i < 16; ++i) {
                    const float* b = it.bias + (rb + i) * it.m_rs + c0 + jb;
                    x[i] = rb + i < it.rows ? _mm512_maskz_loadu_ps(keys, b) : _mm512_setzero_ps();
                }
                transpose16(x);
                for (int64_t j = 0; j < nj; ++j) _mm512_store_ps(t.bt + (jb + j) * BQ + rb, x[j]);
            }
        }
        return;
    }
    for (int64_t r = 0; r < BQ; ++r) {
        const bool row = r < it.rows;
        const float* b = it.bias + r * it.m_rs + c0 * it.m_cs;
        for (int64_t j = 0; j < n; ++j) t.bt[j * BQ + r] = row ? b[j * it.m_cs] : 0.0f;
    }
}

// The visibility rule of a call, for bounds() (S set per item).
struct Rule {
    int64_t S, causal, left, right;
};

// A query row's pair words p0 .. p0 + np (np <= 16; two bfloat16 in 32 bits, the first low),
// the lanes past np 0.
QKV_BF16 QKV_INLINE __m512i row_words(const uint16_t* q, int64_t p0, int64_t np) {
    return _mm512_maskz_loadu_epi32(np >= 16 ? __mmask16(0xffff) : __mmask16((1u << np) - 1),
                                    q + 2 * p0);
}
QKV_BF16 QKV_INLINE __m512i row_words(const float* q, int64_t p0, int64_t np) {
    const int64_t nf = 2 * np;  // (bfloat16 values: exact in bfloat16)
    const __mmask16 ma = nf >= 16 ? __mmask16(0xffff) : __mmask16((1u << nf) - 1);
    const __mmask16 mb =
        nf >= 32 ? __mmask16(0xffff) : nf <= 16 ? 0 : __mmask16((1u << (nf - 16)) - 1);
    const __m512 a = _mm512_maskz_loadu_ps(ma, q + 2 * p0);
    const __m512 b = _mm512_maskz_loadu_ps(mb, q + 2 * p0 + 16);
    return (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a's words low
}

// The item's queries as pair words, qp[p * BQ + r] (rows past `rows` 0), 16 rows and 16 pairs
// at a time; writes whole blocks of 16 pairs (Tiles::qp holds them).
template <typename QT>
QKV_BF16 void pack_queries(const QT* q, int64_t q_rs, int64_t rows, int64_t pairs,
                           uint32_t* qp) {
    alignas(64) uint32_t blk[16 * 16];
    for (int64_t r0 = 0; r0 < BQ; r0 += 16)
        for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
            const int64_t np = std::min<int64_t>(16, pairs - p0);
            for (int64_t i = 0; i < 16; ++i)
                _mm512_store_si512(blk + 16 * i, r0 + i < rows
                                                     ? row_words(q + (r0 + i) * q_rs, p0, np)
                                                     : _mm512_setzero_si512());
            transpose_words16(blk, 16, qp + p0 * BQ + r0, BQ);
        }
}

// The work item's recurrence (see the top of the file); returns whether every output is
// finite.
template <typename QT>
QKV_BF16 bool forward_item(const Item<QT>& it, Rule rule, int64_t d, int64_t dv, float scale,
                           Tiles& t, int64_t dvp, bool amx) {
    const float ninf = -std::numeric_limits<float>::infinity();
    const int64_t pairs = d / 2, rows = it.rows;
    rule.S = it.S;
    for (int64_t r = 0; r < BQ; ++r) {
        int64_t lo = 0, hi = 0;  // rows past the end see nothing
        if (r < rows) {
            bounds(rule, it.S - it.L + it.r0 + r, &lo, &hi);
            hi = std::min(hi, it.kmax);  // (both stay nondecreasing in the row)
            lo = std::min(lo, hi);
        }
        t.lo[r] = int32_t(lo);
        t.hi[r] = int32_t(hi);
        t.m[r] = ninf;
        t.l[r] = 0;
    }
    pack_queries(it.q, it.q_rs, rows, pairs, t.qp);
    if (amx) {
        std::memset(t.acc_r, 0, size_t(BQ * dvp) * sizeof(float));
        tiles_begin();
    } else {
        std::memset(t.acc, 0, size_t(dv * BQ) * sizeof(float));
    }
    const int64_t klo = t.lo[0], khi = t.hi[rows - 1];  // both nondecreasing in the row
    // (the AMX road: each tile's scores made before the last tile's values, see
    // weights_as_rows)
    if (amx && klo < khi)
        scores_amx(it.k + klo * it.k_rs, it.k_rs, it.S - klo, std::min(BK, khi - klo), d, t);
    for (int64_t c0 = klo; c0 < khi; c0 += BK) {
        const int64_t n = std::min(BK, khi - c0);
        if (amx)  // (its scores are made: the tile's values packed first, see weights_as_rows)
            pack_row_pairs(it.v + c0 * it.v_rs, it.v_rs, n, dv, dvp, t.vp);
        else  // Sᵀ (n keys x BQ rows) = K_tile · Q_blkᵀ: each key's pair words broadcast from K
            dp_rows(n, t.qp, BQ, it.k + c0 * it.k_rs, it.k_rs, 2, pairs, t.st, BQ, FROM_ZERO,
                    nullptr);
        if (it.mask || it.bias) mask_tile(it, t, c0, n);
        softmax_step(t, n, c0, scale, it.bias != nullptr, it.mask != nullptr);
        if (amx) {  // acc (BQ rows x dv) = acc · alpha + P · V
            weights_as_rows(t, n, dvp);
            const int64_t c1 = c0 + BK;
            if (c1 < khi)
                scores_amx(it.k + c1 * it.k_rs, it.k_rs, it.S - c1, std::min(BK, khi - c1), d, t);
            values_amx(t, n, dv, dvp);
            continue;
        }
        pack_row_pairs(it.v + c0 * it.v_rs, it.v_rs, n, dv, dvp, t.vp);
        // accᵀ (dv x BQ) = accᵀ · alpha + Vᵀ · Pᵀ: each column's pair words broadcast from vp
        dp_rows(dv, t.pp, BQ, reinterpret_cast<const uint16_t*>(t.vp), 2, 2 * dvp, (n + 1) / 2,
                t.acc, BQ, FROM_SCALED, t.alpha);
    }
    if (amx) tiles_end();
    // set when some output is not finite (an integer flag: a float sum of o · 0 chained one
    // dependent addition per output element)
    int32_t bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t* out = it.out + r * it.out_rs;
        const float li = t.l[r];
        if (li == 0.0f) {  // no visible key: 0 and −inf, never NaN
            for (int64_t c = 0; c < dv; ++c) out[c] = 0;
            if (it.lse) it.lse[r * it.lse_s] = ninf;
            continue;
        }
        const float inv = 1.0f / li;
        if (amx) {  // (the accumulator's rows: 16 columns at a time)
            const __m512 vi = _mm512_set1_ps(inv);
            const __m512 big = _mm512_set1_ps(std::numeric_limits<float>::max());
            for (int64_t c = 0; c < dv; c += 16) {
                const __mmask16 m =
                    dv - c >= 16 ? __mmask16(0xffff) : __mmask16((1u << (dv - c)) - 1);
                const __m512 o = _mm512_mul_ps(_mm512_load_ps(t.acc_r + r * dvp + c), vi);
                bad |= int32_t(_mm512_mask_cmp_ps_mask(m, _mm512_abs_ps(o), big, _CMP_LE_OQ) != m);
                _mm256_mask_storeu_epi16(out + c, m, (__m256i)_mm512_cvtneps_pbh(o));
            }
        } else {
            for (int64_t c = 0; c < dv; ++c) {
                const float o = t.acc[c * BQ + r] * inv;
                out[c] = uint16_t(bf16_bits(o));
                bad |= int32_t(!(std::fabs(o) <= std::numeric_limits<float>::max()));
            }
        }
        if (it.lse) it.lse[r * it.lse_s] = t.m[r] + std::log(li);  // (NULL: not asked for)
    }
    return !bad;
}

template <typename Args>
Rule rule_of(const Args& a) {
    return Rule{0, a.causal, a.left, a.right};
}

// Whether a call takes the AMX road: asked for (isa 0 or AMX_ISA; BF16_ISA keeps vdpbf16ps),
// run by this CPU, and head sizes its tiles divide (d by 32, dv by 16).
inline bool amx_fits(int64_t isa, int64_t d, int64_t dv) {
    return (isa == 0 || isa >= AMX_ISA) && d % 32 == 0 && dv % 16 == 0 && cpu_has_amx();
}

// QT: q's element, float (bfloat16 values) or uint16_t (bfloat16 bits; its offsets and row
// stride in those elements)
template <typename QT>
int run_bf16(const qkv_prefill_args& a) {
    const int64_t nqb = (a.L + BQ - 1) / BQ, ntasks = a.nb * nqb;
    const int64_t dvp = (a.dv + 31) / 32 * 32;
    const bool amx = amx_fits(a.isa, a.d, a.dv);
    int bad = 0;
    const int status = for_tasks<Tiles>(
        ntasks, a.threads, a.parallel, [&](Tiles& t) { return t.make(a.d, a.dv, dvp); },
        [&](Tiles& t, int64_t task) {
        // latest query blocks first: under causal they cost the most
        const int64_t qb = nqb - 1 - task / a.nb, h = task % a.nb;
        Item<QT> it;
        it.r0 = qb * BQ;
        it.rows = std::min(BQ, a.L - it.r0);
        it.q = static_cast<const QT*>(a.q) + a.q_off[h] + it.r0 * a.q_rs;
        it.q_rs = a.q_rs;
        it.k = static_cast<const uint16_t*>(a.k) + a.k_off[h];
        it.k_rs = a.k_rs;
        it.v = static_cast<const uint16_t*>(a.v) + a.v_off[h];
        it.v_rs = a.v_rs;
        it.L = a.L;
        it.S = a.S;
        it.kmax = a.counts ? std::max<int64_t>(0, std::min(a.counts[h], a.S)) : a.S;
        // (abi.h: o_off, where the output rows go)
        it.out = static_cast<uint16_t*>(a.out) +
                 (a.o_off ? a.o_off[h] + it.r0 * a.o_rs : (h * a.L + it.r0) * a.dv);
        it.out_rs = a.o_off ? a.o_rs : a.dv;
        it.lse = a.lse ? static_cast<float*>(a.lse) + h * a.L + it.r0 : nullptr;
        it.lse_s = 1;
        const int64_t moff = a.m_off ? a.m_off[h] + it.r0 * a.m_rs : 0;
        it.mask = a.mask ? a.mask + moff : nullptr;
        it.bias = a.bias ? static_cast<const float*>(a.bias) + moff : nullptr;
        it.m_rs = a.m_rs;
        it.m_cs = a.m_cs;
        if (!forward_item(it, rule_of(a), a.d, a.dv, float(a.scale), t, dvp, amx))
            __atomic_store_n(&bad, 1, __ATOMIC_RELAXED);
    });
    return status ? status : (bad ? 3 : 0);
}

// The packed varlen walk (forward.cpp's run_varlen, same layout): tasks (sequence, query head,
// query block), costliest first, read straight from the packed bfloat16 arrays.
int run_varlen_bf16(const qkv_varlen_args& a) {
    std::vector<VarlenTask> tasks;
    if (!varlen_tasks(a, BQ, tasks)) return 1;
    const int64_t H = a.heads, dv = a.dv, dvp = (dv + 31) / 32 * 32;
    const bool amx = amx_fits(a.isa, a.d, dv);
    const int64_t ntasks = int64_t(tasks.size()) * H;
    const uint16_t* Q = static_cast<const uint16_t*>(a.q);
    return for_tasks<Tiles>(
        ntasks, a.threads, a.parallel, [&](Tiles& t) { return t.make(a.d, dv, dvp); },
        [&](Tiles& t, int64_t n) {
        const VarlenTask& task = tasks[size_t(n / H)];
        const int64_t h = n % H, q0 = a.cq[task.b], k0 = a.ck[task.b];
        Item<uint16_t> it;
        it.L = a.cq[task.b + 1] - q0;
        it.S = a.ck[task.b + 1] - k0;
        it.kmax = it.S;
        it.r0 = task.r0;
        it.rows = std::min(BQ, it.L - task.r0);
        it.q = Q + (q0 + task.r0) * a.q_ts + h * a.q_hs;
        it.q_rs = a.q_ts;
        it.k = static_cast<const uint16_t*>(a.k) + k0 * a.k_ts + (h / a.group) * a.k_hs;
        it.k_rs = a.k_ts;
        it.v = static_cast<const uint16_t*>(a.v) + k0 * a.v_ts + (h / a.group) * a.v_hs;
        it.v_rs = a.v_ts;
        it.out = static_cast<uint16_t*>(a.out) + ((q0 + task.r0) * H + h) * dv;
        it.out_rs = H * dv;
        it.lse = static_cast<float*>(a.lse) + (q0 + task.r0) * H + h;
        it.lse_s = H;
        if (!forward_item(it, rule_of(a), a.d, dv, float(a.scale), t, dvp, amx) && a.bad)
            __atomic_store_n(a.bad + task.b, uint8_t(1), __ATOMIC_RELAXED);
    });
}

#endif  // QKV_X86

// Whether the bfloat16 prefill refuses a's fields (status 2): sizes out of range, an odd d,
// a mask or bias without offsets, both at once, 2^31 keys or more, pages, stacked rows.
inline bool bad_prefill_args(const qkv_prefill_args* a) {
    return !a || a->L < 1 || a->S < 0 || a->d < 2 || a->d % 2 || a->dv < 1 ||
           ((a->mask || a->bias) && !a->m_off) || (a->mask && a->bias) ||
           a->S >= (int64_t(1) << 31) || a->pages || a->per_pos > 1;
}

}  // namespace

extern "C" {

// Whether this CPU (and this build) runs qkv_prefill_bf16: AVX-512 with AVX512_BF16.
int qkv_bf16_products(void) {
    return QKV_ON_BF16(1) == 1;
}

// Whether this CPU (and its OS, and this build) runs the bfloat16 prefill's AMX road.
int qkv_amx_tiles(void) {
    return QKV_ON_BF16(cpu_has_amx() ? 1 : 0) == 1;
}

// q float32 (bfloat16 values), k, v and out bfloat16 (uint16 bits), lse float32, a bias float32;
// the fields as for qkv_prefill_f32 (offsets and strides in elements of each operand's own
// type; gemm and the block sizes unused). 0 done; 3 some output is not finite (the caller's
// general path applies its rules); 1 no memory; 2 bad arguments, or a CPU without AVX512_BF16.
int qkv_prefill_bf16(const qkv_prefill_args* a) {
    if (bad_prefill_args(a)) return 2;
    return QKV_ON_BF16(run_bf16<float>(*a));
}

// qkv_prefill_bf16 on q given as bfloat16 (uint16 bits; its offsets and row stride in those
// elements), as the packed walk takes it: the same bits as q widened to float32, read without
// the widened copy (a short bfloat16 call on NumPy arrays or tensors spent as long widening q
// and allocating the copy as in the kernel).
int qkv_prefill_bf16io(const qkv_prefill_args* a) {
    if (bad_prefill_args(a)) return 2;
    return QKV_ON_BF16(run_bf16<uint16_t>(*a));
}

// q, k, v and out bfloat16 (uint16 bits) in the packed layout of qkv_varlen_f32; lse float32
// (the caller's zeros and -inf stand in rows of sequences not listed or without keys); gemm and
// the block sizes unused. 0 done; 1 no memory; 2 bad arguments, or a CPU without AVX512_BF16.
int qkv_varlen_bf16(const qkv_varlen_args* a) {
    if (!a || a->nseq < 0 || a->heads < 1 || a->group < 1 || a->d < 2 || a->d % 2 || a->dv < 1)
        return 2;
    return QKV_ON_BF16(run_varlen_bf16(*a));
}

}  // extern "C"

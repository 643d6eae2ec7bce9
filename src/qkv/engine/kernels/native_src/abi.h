// The C ABI of qkv's native library: the argument structs the Python side fills
// (qkv/engine/kernels/native_lib.py mirrors each one field for field, all 8-byte fields) and
// the function pointers it hands in. Every exported function takes one struct and returns a
// status: 0 done; 1 no memory; 2 bad arguments; 3 an output is not finite (decode, and the
// float32/float64 prefill with every output written; the caller's general path applies its
// rules); 4 a mask row is not one run of keys (decode; nothing done);
// 5 a sequence's keys [lo, hi) do not lie within [0, S) (decode; nothing read or written);
// 6 a block table entry a sequence's keys need is not a page of the pool (decode; nothing read
// or written).

#pragma once

#include <cstdint>

extern "C" {

typedef void (*sgemm_t)(const char*, const char*, const int*, const int*, const int*,
                        const float*, const float*, const int*, const float*, const int*,
                        const float*, float*, const int*);
typedef void (*dgemm_t)(const char*, const char*, const int*, const int*, const int*,
                        const double*, const double*, const int*, const double*, const int*,
                        const double*, double*, const int*);

// The fields the prefill and backward structs share, in this order: q, k, v with per-head
// offsets and a row stride each ...
#define QKV_OPERAND_FIELDS \
    const void* q;         \
    const int64_t* q_off;  \
    int64_t q_rs;          \
    const void* k;         \
    const int64_t* k_off;  \
    int64_t k_rs;          \
    const void* v;         \
    const int64_t* v_off;  \
    int64_t v_rs;

// ... and, last in the prefill, varlen and backward structs, the scale and visibility rule,
// threads, clone, BLAS and tile sizes.
#define QKV_RULE_FIELDS                                                                  \
    double scale;                                                                        \
    int64_t causal;                                                                      \
    int64_t left, right;    /* window sides; -1 = unbounded */                           \
    int64_t threads;                                                                     \
    int64_t isa;            /* 0 = best available, 1 = baseline, 2 = AVX2, 3 = AVX-512; the \
                               bfloat16 kernels: 4 = vdpbf16ps, 5 = AMX tiles where present */ \
    void* gemm;             /* sgemm for float32, dgemm for float64 */                   \
    int64_t block_q, block_k;

// Everything one call needs. Offsets and strides are in elements; the last axis of q, k, v
// (and of out) is contiguous. Per query head h (the flattened batch), its queries start at
// q + q_off[h], its kv head's keys and values at k + k_off[h] and v + v_off[h], its mask or
// bias entry (row i, key j) at m_off[h] + i * m_rs + j * m_cs.
struct qkv_prefill_args {
    int64_t nb, L, S, d, dv;
    QKV_OPERAND_FIELDS
    void* out;  // (nb, L, dv) contiguous
    void* lse;  // (nb, L) contiguous, or NULL: not written (the caller reads out alone)
    const uint8_t* mask;  // bool mask (1 = may attend) or NULL
    const void* bias;     // float bias in the compute dtype or NULL
    const int64_t* m_off;
    int64_t m_rs, m_cs;
    QKV_RULE_FIELDS
    // Keys per head (nb of them): head h attends keys [0, counts[h]) only, causal and the window
    // still aligned to all S keys (a padding mask read as key counts); NULL: all S. The float32,
    // float64 and bfloat16 prefill read it.
    const int64_t* counts;
    // The float32 and float64 prefill's tile products: 0 BLAS (gemm), 1 the library's own
    // register-blocked micro-kernel in the chosen clone (tiles.h; gemm unused, may be NULL).
    int64_t products;
    // GOMP_parallel of a running OpenMP runtime whose team runs the work items (PyTorch's,
    // between whose operations a model calls this), or NULL: the library's kept threads.
    void* parallel;
    // Keys in pages (a paged cache's shared prefix, read in place): key j of every head lies in
    // page pages[j / page_size] at its row j % page_size, its K row at k + k_off[h] +
    // pages[j / page_size] * k_ps + (j % page_size) * k_rs (V likewise with v_ps, v_rs). Each
    // piece of keys is copied (or widened) into its worker's kept rows. NULL: key j at
    // k + k_off[h] + j * k_rs. Read by the float32 and float64 prefill (K/V in their dtype or
    // stored in 16 bits); the bfloat16 tile products and the io kernels refuse it (status 2).
    const int32_t* pages;
    int64_t page_size, k_ps, v_ps;
    // Query rows per position (a kv head's grouped query heads stacked under a causal rule or
    // window, position by position): row r of a head is at position r / per_pos of L / per_pos
    // (L a multiple of per_pos), which the rule reads (key counts: the head's, for all its
    // rows). 0 or 1: a row per position. Not with a mask or bias (status 2), nor by the
    // bfloat16 tile products.
    int64_t per_pos;
    // Where the output rows go: row r of head h at out + o_off[h] + r * o_rs (in elements of
    // the output's dtype), e.g. into (batch, L, heads, dv) memory, FlashAttention's and
    // transformers' layout, so that no copy has to lay it out so afterwards; with per_pos > 1,
    // row r (head r % per_pos of the stack at position r / per_pos) at out + o_off[h] +
    // (r % per_pos) * o_hs + (r / per_pos) * o_rs. NULL: out is (nb, L, dv) contiguous. lse
    // stays (nb, L) contiguous.
    const int64_t* o_off;
    int64_t o_rs, o_hs;
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
    QKV_RULE_FIELDS
    // GOMP_parallel of a running OpenMP runtime whose team runs the work items (PyTorch's,
    // between whose operations a serving model calls this), or NULL: the library's kept threads.
    void* parallel;
};

// The FlashAttention-2 backward. q, k, v as above but k_off/v_off are per kv head (nkv of
// them), q_off and m_off per query head; query head t * group + g reads kv head t. dout, lse
// (rows with no key given as +inf), delta = rowsum(dO ∘ O) and the outputs are contiguous;
// dq, dk, dv must be zeroed by the caller.
struct qkv_backward_args {
    int64_t nkv, group, L, S, d, dv;
    QKV_OPERAND_FIELDS
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
    QKV_RULE_FIELDS
    // qkv_backward_bf16 only: the forward's output (nkv * group, L, dv), bfloat16, from which
    // it takes delta itself when delta is NULL.
    const void* out;
};

// The GOMP_parallel entry of a running OpenMP runtime (libgomp's ABI, which LLVM's and Intel's
// runtimes export too): fn(data) on a team of num_threads threads, the caller one of them.
typedef void (*gomp_parallel_t)(void (*)(void*), void*, unsigned, unsigned);

// Offsets in elements; the last axis of q, k, v is contiguous. Query head h * group + g of
// sequence b reads kv head h of sequence b; its rows i < L start at
// q + b * q_bs + (h * group + g) * q_hs + i * q_ls.
// Status 0, or 3 when an output is not finite (infinite or NaN inputs, an overflow: the
// caller's general path applies its rules to those), or 4 when a mask row is not one run of
// keys (nothing is computed); 1 without memory, 2 for bad arguments; 5 and 6 (above) for keys
// outside the buffers or the pool.
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
    int64_t isa;  // as the prefill's, and 4: AVX-512 with AVX512_BF16 (vdpbf16ps scores)
    void* parallel;   // GOMP_parallel of a running OpenMP runtime, or NULL
    double softcap;    // > 0: scores become softcap * tanh(score / softcap) (Gemma 2); else 0
    // A boolean mask (1 = may attend) of one row per sequence, read instead of lo/hi: each
    // sequence's visible keys must be one run (else status 4, nothing computed); or NULL.
    const uint8_t* mask;
    int64_t mask_bs, mask_js;  // its strides in bytes: sequence, key
    // How K and V are stored: 0 in the compute dtype (that of q, out and lse); with float32
    // compute also 1 bfloat16, 2 float16, or 8-bit codes, 3 int8 and 4 float8 e4m3fn, each
    // row j of kv head h of sequence b its codes times the float32 scale
    // k_scale[b * ks_bs + h * ks_hs + j * ks_rs] (v_scale likewise). K/V strides are in
    // elements of the stored type.
    int64_t kv_format;
    const float* k_scale;
    int64_t ks_bs, ks_hs, ks_rs;
    const float* v_scale;
    int64_t vs_bs, vs_hs, vs_rs;
    // Paged K/V (FlashAttention's NHD pages, vLLM's and FlashInfer's block tables), or NULL:
    // k, v (and the scales) then hold num_blocks pages of page_size rows, and key position p
    // of sequence b is row p % page_size of page block_table[b * bt_rs + p / page_size]. The
    // *_bs strides are then those between pages, *_rs between the rows of a page, *_hs
    // between heads; S is the table's capacity (its columns times page_size). Every entry a
    // sequence's keys [lo, hi) need is checked to lie in [0, num_blocks) before anything is
    // read (else status 6).
    const int32_t* block_table;
    int64_t bt_rs, page_size, num_blocks;
    // Nonzero: the L query rows of each head are causal, bottom-right aligned on each
    // sequence's keys [lo, hi): row i sees [lo, hi - (L - 1) + i) (speculative decoding's
    // draft tokens, a chunk of a prompt against its cache). A row that sees no key gets output
    // 0 and lse -inf. 0: every row sees [lo, hi).
    int64_t causal;
    // A prior part of each row, merged into its result as one more piece of keys (a shared
    // prefix's attention in a cascade step), or NULL: row r (< group * L) of kv head h of
    // sequence b has the normalised output prior_out[b * po_bs + h * po_hs + r * dv .. + dv)
    // and the log-sum-exp prior_lse[b * pl_bs + h * pl_hs + r], in the compute dtype (lse -inf:
    // the prior part has no key; NaN: the row becomes NaN).
    const void* prior_out;
    int64_t po_bs, po_hs;
    const void* prior_lse;
    int64_t pl_bs, pl_hs;
};

// The codes of qkv_decode_args::kv_format, and the 16-bit forms the float32 prefill, varlen
// walk and backward widen (their _bf16kv and _f16kv functions). Their source is the Python list
// qkv.numerics.STORED_FORMS: the loader compares each of its codes with qkv_kv_format_code's
// and refuses a library that disagrees.
enum qkv_kv_format : int64_t { KV_SAME = 0, KV_BF16 = 1, KV_F16 = 2, KV_INT8 = 3, KV_E4M3 = 4 };
// The decode step's opt-in fast road (precision="fast") adds KV_FAST to a form's code: int8 K
// scored against the query rows rounded to int8 (one scale per row), products in int32. No
// other form has one (the kernel refuses their codes with KV_FAST: status 2).
enum : int64_t { KV_FAST = 256 };
// The code of the stored form named name ("bfloat16", "float16", "int8", "float8_e4m3fn"; "int8
// fast": KV_INT8 | KV_FAST), or -1 for any other name.
int64_t qkv_kv_format_code(const char* name);

// A small call kept by its caller: a decode or prefill function fn (a qkv_decode_* or
// qkv_prefill_* one) on a copy of the kept arguments t with q, k, v and out (and, where not
// NULL, the prefill's key counts) set to these addresses. The caller hands over addresses
// rather than a struct of its own per call: copying and filling one through ctypes took half
// a microsecond of a 5 us call. t is only read (other threads may use it at once); its lse is
// what the call gets (NULL in a kept call: not written).
typedef int (*qkv_decode_fn)(const qkv_decode_args*);
int qkv_decode_at(qkv_decode_fn fn, const qkv_decode_args* t, const void* q, const void* k,
                  const void* v, void* out);
typedef int (*qkv_prefill_fn)(const qkv_prefill_args*);
int qkv_prefill_at(qkv_prefill_fn fn, const qkv_prefill_args* t, const void* q, const void* k,
                   const void* v, void* out, const int64_t* counts);
// The same for a call with a mask or bias: t's (whichever it holds) set to `mask`, an array of
// the layout t's m_off, m_rs and m_cs were worked out for.
int qkv_prefill_mask_at(qkv_prefill_fn fn, const qkv_prefill_args* t, const void* q,
                        const void* k, const void* v, void* out, const void* mask);

// The sizes of the structs, so the loader can check it agrees on their layout.
int64_t qkv_args_size(void);
int64_t qkv_varlen_args_size(void);
int64_t qkv_backward_args_size(void);
int64_t qkv_decode_args_size(void);
// The widest vector clone this CPU runs: 1 baseline, 2 AVX2, 3 AVX-512.
int qkv_best_isa(void);
// The float32 FMA peak micro-benchmark (bench/machine.py): `rounds` rounds of register-resident
// vector FMAs in the clone `isa` asks for (0: the widest), the FLOP done returned for the
// caller to time (-1 for a negative count).
double qkv_fma_peak(int64_t isa, int64_t rounds);

}  // extern "C"

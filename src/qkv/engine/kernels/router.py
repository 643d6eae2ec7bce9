"""Which kernel runs a checked plan: one ordered table per kind of work, each kernel with its
conditions as data, and one walk over them.

Every decision of which kernel computes a call is taken here, and only here (the kernels are
algorithms that no longer choose among themselves): :func:`forward` for the attention of a
:class:`~qkv.validate.Plan`, :func:`backward` for its gradients, :func:`packed` for a packed
varlen batch, :func:`decode_plan` for a decoding step planned once and run per layer
(:class:`qkv.DecodePlan`),
:func:`compiled_decode` for the decode kernel's compiled loop and :func:`decode_together`
for a batch of short caches. A table lists its kernels fastest first, the general NumPy
kernel last (it takes everything); the first whose conditions all hold runs.
:func:`explain` walks the same table and says, for each faster kernel, the condition that
refused it -- what :func:`qkv.route` and ``qkv info --route`` show. PyTorch's
``select_sdp_backend`` is the model: one list of back ends, each with its list of conditions.

The thresholds were measured on a 2-core machine (see ``bench/``); they only pick the faster
path, never change a result: every kernel equals :func:`qkv.reference.attention`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ...numerics import FAST_FORMS, normal_range, scale_in_range
from ...validate import Plan
from .jit import enabled as jit_enabled
from .native_lib import (
    ISAS,
    amx_tiles,
    bf16_products,
    blas_available,
    library,
    running_isa,
    switched_off,
)
from .threads import team_preferred

__all__ = [
    "BACKWARD",
    "BF16",
    "CASCADE",
    "FOR_ANY_COUNTS",
    "KEY_COUNTS",
    "MAX_GROUPS",
    "MIN_SHARED_KEYS",
    "ON_KEY_COUNTS",
    "READ_BY",
    "SHORT",
    "Route",
    "cascade",
    "choose",
    "prefix_in_place",
    "count_groups",
    "key_counts_per_row",
    "short",
    "DECODE_PLAN",
    "DECODE_STEP",
    "PREFILL",
    "COMPILED_DECODE",
    "COMPILED_TEAM",
    "DECODE_MAX_L",
    "DECODE_MIN_BYTES",
    "DENSE_MAX_SCORES",
    "DENSE_MAX_WORK",
    "FORWARD",
    "KERNELS",
    "OWN_TILES",
    "CAUSAL_ROWS_MIN_WORK",
    "PACKED",
    "TEAM_DECODE_MIN_BYTES",
    "EVERY_HEAD_MIN_BYTES",
    "Condition",
    "Kernel",
    "backward",
    "compiled_decode",
    "compiled_team",
    "decode_plan",
    "decode_together",
    "every_head",
    "explain",
    "first",
    "forward",
    "holds",
    "kv_bytes",
    "packed",
    "rows",
]

KERNELS = ("auto", "dense", "tiled", "decode")  # what ``kernel=`` may name
DENSE_MAX_SCORES = 1 << 14  # L · S per head below which materialising the scores is fastest
# ... unless the batch is large: from batch · heads · L · S · (d + dv) of this much work
# (about 2 ms), the native prefill's (head, query block) tasks on its threads beat the dense
# kernel's one NumPy thread (measured on 2 cores: B8 and B32, H8 and H12, L = S = 37..120).
DENSE_MAX_WORK = 1 << 25
# The native prefill on its own tile products (native_src/tiles.h: a register-blocked
# micro-kernel in each vector clone, no BLAS call per tile) at any size. Measured on 2 cores
# (AVX2, float32, one thread): the own products ran the tile loop 10-30% faster than BLAS's
# sgemm per tile from B1 H8 L = S = 16 d64 (short rows: BLAS's cost per call) to B1 H8 L = S
# = 512 d64 causal. Below 2^16 multiply-adds the dense kernel's few NumPy calls had cost less
# than a native call's set-up; once the plain call kept the set-up (a mask's too, per its
# layout), the own tiles ran 2-10x faster there in every clone (2-core AMX Xeon, B1-B4 H1-H4
# L = S = 9..32 d8..32, float32 and float64: plain 18-36 -> 6-12 us, causal 57-95 -> 6-13 us,
# windows 120-170 -> 60-100 us, with the lse 42-60 -> 32-50 us; a boolean mask 38-49 ->
# 10-14 us, a bias 32-43 -> 7-10 us); a call that is checked and set up again (a mask of a
# layout not kept) costs about the same on either.
# causal_rows_on_prefill's few causal rows from this much work, as measured for it
CAUSAL_ROWS_MIN_WORK = 1 << 16
DECODE_MAX_L = 8  # queries per head up to which the scores are small enough to keep whole
DECODE_MIN_BYTES = 16 << 20  # K/V bytes from which streaming them (decode) beats BLAS (dense)
# ... and where decode is compiled C++ (native_decode: measured on 2 cores, float32, grouped
# heads, it already beat BLAS at 0.5 MiB, 0.050 against 0.087 ms, and 3.6x at 2 MiB), or
# inside threads.compiled_team (between PyTorch's operations), where the compiled Numba decode
# starts its threads in C and BLAS finds the K/V out of cache: measured in a Llama-style
# model, 1 MiB of K/V per layer (prompt 1024) already ran faster streamed.
TEAM_DECODE_MIN_BYTES = 1 << 20
# K/V bytes from which the native decode step reads K/V whose rows interleave the kv heads
# (a (batch, keys, kv_heads, d) buffer seen as (batch, kv_heads, keys, d): FlashAttention's and
# qkv.attention(layout="blhd")'s layout) every head's rows at a time, as it reads a paged
# cache's page rows (one page a sequence), rather than head after head down strided rows.
# Measured on 2 cores (Zen 4, AVX-512), H32 kv8 d128, K/V read from memory (layers cycled),
# as this walk's time over the walk by heads': bfloat16 0.74-0.79 at 16.8 MB and 0.55 at
# 134 MB, float32 0.84-0.91 from 16.8 to 33.6 MB and 0.76 at 268 MB (one thread: 0.5-0.75);
# 0.98-1.01 for bfloat16 at 8.4 and 12.6 MB, and 1.16 for float32 at 8.4 MB.
EVERY_HEAD_MIN_BYTES = 12 << 20
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_STORED = ("float16", "bfloat16")  # K/V dtypes the float32 prefill reads as stored


def kv_bytes(plan: Plan) -> int:
    """The bytes of ``plan``'s K and V in its compute dtype (the decode thresholds' measure)."""
    d = plan.q.shape[-1]
    dv = 0 if plan.v is None else plan.v.shape[-1]
    return plan.k.size * (d + dv) // max(d, 1) * plan.acc_dtype.itemsize


class Ask:
    """What the conditions of a table read: the plan (or the packed arrays), the ``kernel=``
    the caller asked for, and the sizes, each computed once and only when a condition reads
    it."""

    __slots__ = (
        "_size", "base", "counts", "kernel", "kv_format", "narrow", "operands", "plan",
        "precision",
    )  # fmt: skip

    def __init__(
        self,
        plan: Any,
        kernel: str = "auto",
        narrow: bool = False,
        operands: str | None = None,
        *,
        precision: str = "exact",
        kv_format: str | None = None,
    ) -> None:
        self.plan, self.kernel, self.narrow = plan, kernel, narrow
        self.operands = operands  # why a kernel cannot read the operands as they are, or None
        # a decoding step's road (``"exact"`` or ``"fast"``) and its K/V's stored form
        self.precision, self.kv_format = precision, kv_format
        self._size = -1
        self.base: Kernel | None = None  # KEY_COUNTS: the row the unmasked twin runs on
        self.counts: np.ndarray | None = None  # KEY_COUNTS: the key count of each batch row

    @property
    def size(self) -> int:
        """:func:`kv_bytes` of the plan."""
        if self._size < 0:
            self._size = kv_bytes(self.plan)
        return self._size

    @property
    def mib(self) -> str:
        return f"{self.size / 2**20:.3g} MiB"


class Condition(NamedTuple):
    """One condition of a kernel: ``test(ask)`` holds, else ``why`` (a text, or a function of
    the ask giving one) says what refused the kernel."""

    test: Callable[[Ask], bool]
    why: str | Callable[[Ask], str]

    def refusal(self, ask: Ask) -> str:
        return self.why if isinstance(self.why, str) else self.why(ask)


class Kernel(NamedTuple):
    """A row of a table: the kernel's name, the family ``kernel=`` names it by (``"dense"``,
    ``"tiled"``, ``"decode"``; the backward's and the packed walk's are their own), its
    conditions in the order they are tried, and whether it reads a plan's stored K/V in place
    (:attr:`Plan.stored`; the others run on :meth:`Plan.materialized`)."""

    name: str
    family: str
    conditions: tuple[Condition, ...]
    stored: bool = False


def _c(test: Callable[[Ask], bool], why: str | Callable[[Ask], str]) -> Condition:
    return Condition(test, why)


def _library_why(ask: Ask) -> str:
    if switched_off():
        return "switched off (QKV_NATIVE=0)"
    return library()[1] or "the native library is not built"


def _native_on(ask: Ask) -> bool:
    return not switched_off() and library()[0] is not None


def _blas_why(ask: Ask) -> str:
    return _library_why(ask) if not _native_on(ask) else blas_available()[1]


def _bf16_why(ask: Ask) -> str:
    return _library_why(ask) if not _native_on(ask) else bf16_products()[1]


# Conditions shared by several kernels, each written once.
_AUTO = _c(lambda a: a.kernel == "auto", lambda a: f"kernel={a.kernel!r} asked for")
_FEW_ROWS = _c(
    lambda a: a.plan.L <= DECODE_MAX_L,
    lambda a: f"{a.plan.L} query rows per head, more than {DECODE_MAX_L}",
)
_NATIVE = _c(_native_on, _library_why)
_NATIVE_BLAS = _c(lambda a: _native_on(a) and blas_available()[0], _blas_why)
_NATIVE_BF16 = _c(lambda a: _native_on(a) and bf16_products()[0], _bf16_why)
_F32_OR_F64 = _c(
    lambda a: a.plan.acc_dtype in (_F32, _F64),
    lambda a: f"computed in {a.plan.acc_dtype}, not float32 or float64",
)
_NOT_MODDED = _c(
    lambda a: not a.plan.modded, "a score variant (soft-capping, ALiBi, score_mod or mask_mod)"
)
_NO_TILE_VARIANT = _c(
    lambda a: a.plan.alibi is None and a.plan.score_mod is None and a.plan.mask_mod is None,
    "ALiBi, score_mod or mask_mod given (soft-capping is the one score variant it applies)",
)
_STORED_KV = _c(lambda a: a.plan.stored is not None, "K/V not stored in 16 bits")


def _plan_work(p: Plan) -> int:
    """``batch · heads · L · S · (d + dv)``: the work of a plan's two products."""
    return p.q.size // max(p.d, 1) * p.S * (p.d + p.dv)


def _batch_work(a: Ask) -> int:
    """:func:`_plan_work` of the ask's plan."""
    return _plan_work(a.plan)


def _prefill_sized(a: Ask) -> bool:
    """More query rows than a decoding step, and long rows or a large batch of short ones."""
    p = a.plan
    return p.L > DECODE_MAX_L and (p.L * p.S > DENSE_MAX_SCORES or _batch_work(a) >= DENSE_MAX_WORK)


_PREFILL_SHAPE = _c(
    lambda a: a.kernel == "tiled" if a.kernel != "auto" else _prefill_sized(a),
    lambda a: (
        f"kernel={a.kernel!r} asked for"
        if a.kernel != "auto"
        else f"not a prefill: {a.plan.L} x {a.plan.S} scores per head, a small batch"
    ),
)
_NONEMPTY = _c(
    lambda a: min(a.plan.L, a.plan.d, a.plan.dv) >= 1, "no query, an empty head or empty values"
)

# Query rows per head from which the bfloat16 prefill on AMX tiles (head sizes d a multiple of
# 32, dv of 16) takes a prompt smaller than _PREFILL_SHAPE's, which the float32 own tiles
# reading the stored K/V took; and from 16 rows, keys from which it does. Measured in one
# process, that road against the tiles (bfloat16, d64, 2 threads, 2-core AMX Xeon; B1 and B8,
# H8 kv2 and H12 kv12, causal and not; time on the tiles / time on the float32 road): L=S=16
# 1.08-1.20, 20 0.89-1.07, 24 0.83-1.01, 32 0.62-0.84, 53 0.40-0.62, 120 0.40-0.46; 16 rows
# against 36 keys 0.97-1.15, against 64 0.69-1.02, 128 0.82-0.92; 12 rows against 64 keys
# 0.83-1.15. (The decode step keeps the few causal rows its rows above take: 8 rows against
# 128 keys ran 1.2-1.6 times as long on the tiles.)
AMX_PREFILL_MIN_L = 24
AMX_PREFILL_MIN_S = 64


def _amx_prompt(a: Ask) -> bool:
    p = a.plan
    return (
        a.kernel == "auto"
        and (p.L >= AMX_PREFILL_MIN_L or (p.L >= 16 and p.S >= AMX_PREFILL_MIN_S))
        and p.d % 32 == 0
        and p.dv % 16 == 0
        and amx_tiles()[0]
    )


_BF16_PREFILL_SHAPE = _c(
    lambda a: _PREFILL_SHAPE.test(a) or _amx_prompt(a),
    lambda a: f"{_PREFILL_SHAPE.refusal(a)} (nor a prompt for AMX's tiles)",
)

# The native decode step on a plan (qkv.engine.kernels.native_decode.attend): every sequence's
# keys, or the one run of them a boolean mask row leaves, streamed once in C++.
_NO_BIAS = _c(lambda a: a.plan.bias is None, "a float mask (bias) given")
_NO_WINDOW = _c(
    lambda a: a.plan.window is None, "a window given (it reads a mask's runs of keys only)"
)
_HEADS_AXIS = _c(lambda a: a.plan.q.ndim >= 3, "no heads axis (q of rank 2)")
DECODE_STEP = (
    _NO_BIAS,
    _NO_WINDOW,
    _NO_TILE_VARIANT,
    _c(lambda a: not (a.plan.causal and a.plan.L != 1), "causal with more than one query row"),
    _c(lambda a: a.plan.mask is None or a.plan.L == 1, "a mask with more than one query row"),
    _F32_OR_F64,
    _HEADS_AXIS,
    _NONEMPTY,
    _NATIVE,
)
# Keys per query row from which the decode step takes causal rows: one, so that every row sees
# a key (a row that sees none takes the general kernels' rules). With the rows causal in the
# step itself it measured faster than the dense kernel from S = L on (2 threads, Zen 4: B1 H8
# kv2 d64 S8-48 L2-8 15-29 against 63-89 us; B8-B32, d32-128, the same or faster).
CAUSAL_ROWS_KEYS_PER_ROW = 1
# Causal query rows per head up to which a chunk against a cache (at least
# CAUSAL_CHUNK_KEYS_PER_ROW keys a row) runs on the decode step where its K/V are stored in 16
# or 8 bits or take at least CAUSAL_ROWS_MIN_BYTES (beyond DECODE_MAX_L, the decoding step's). The
# prefill kernels take a causal chunk head by head (no stacking of grouped heads under causal)
# and the bfloat16 one in work items of 64 rows, so a short chunk uses few of their lanes; the
# step takes a kv head's group · L rows together. Measured (bench/draft_rows.py, B8 H32 kv8
# S2048 d128, 2 threads, Zen 4; qkv.attention against the prefill chosen before): float32 16
# rows 37 -> 26 ms, 32 rows 58 -> 52; bfloat16 16 rows 55 -> 19, 32 rows 50 -> 39; the
# bfloat16 prefill wins from 64 rows (54 against 81 ms). With K/V in cache the float32 prefill
# wins (B1 H8 kv2 S512 d64, L16: 0.13 against 0.16 ms). A KVCache of 8-bit codes had its chunk
# widened into a float32 copy first: int8 16 rows 106 -> 34 ms, float8 853 -> 45 ms (the same
# shapes, 2 threads). Only in the AVX-512 clone: in the AVX2
# one (16 registers) the step's many rows ran slower than the prefill (the same 16-row chunk,
# QKV_NATIVE_ISA=avx2: float32 0.99x -> 1.12x SDPA's time, bfloat16 0.90x -> 1.19x).
CAUSAL_ROWS_MAX_L = 32
CAUSAL_ROWS_MIN_BYTES = 16 << 20
CAUSAL_CHUNK_KEYS_PER_ROW = 8  # (a prompt's own square causal block stays the prefill's)


def causal_chunk_fits(L: int, S: int, stored: bool, nbytes: int) -> bool:
    """Whether ``L`` causal query rows per head over ``S`` keys run on the decode step
    (:data:`CAUSAL_ROWS`, :data:`STEP_CAUSAL_ROWS`): up to :data:`DECODE_MAX_L`, or a chunk
    against a cache (:data:`CAUSAL_CHUNK_KEYS_PER_ROW` keys a row and more) of up to
    :data:`CAUSAL_ROWS_MAX_L` where the K/V are ``stored`` in 16 or 8 bits or take ``nbytes`` of
    at least :data:`CAUSAL_ROWS_MIN_BYTES`, in the AVX-512 clone."""
    return L <= DECODE_MAX_L or (
        L <= CAUSAL_ROWS_MAX_L
        and S >= CAUSAL_CHUNK_KEYS_PER_ROW * L
        and chunks_on_step(stored, nbytes)
    )


# Causal rows per kv head (group · L) from which a few causal rows or a short chunk against a
# cache run on the native prefill's own tiles, a kv head's grouped heads stacked position by
# position (qkv.engine.kernels.stacked.stacks), rather than on the decode step, whose scores
# are dot products summed across lanes, a tile of rows by keys at a time, which the narrower
# clones' 16 registers hold few of. Measured with qkv.attention, float32, 2 threads, Zen 4, on
# K/V in cache (bench/small.py's draft cells) and on K/V evicted before each call (as a
# model's layers find their cache; a Llama's draft step, bench/draft_rows.py --model): with
# the AVX2 clone forced, B1 H8 kv2 d128 S2056, 8 rows (32 a kv head) 950 -> 612 us in cache,
# 1299 -> 1057 evicted; d64 406 -> 297 and 588 -> 464; B1 H8 kv2 d64 L8 S128 60 -> 28 us; but
# 4 rows (16 a kv head) 490 -> 362 in cache and 779 -> 883 evicted, and in the model 16 rows
# 0.65-0.81 -> 0.85-1.10 ms a layer, so fewer rows keep the step. In the AVX-512 clone the
# step keeps its rows up to DECODE_MAX_L: 8 rows of d128 S2056 tie in cache (408 against 413
# us) and lose evicted (608 against 977; in the model 1.7-2.0 against 2.6-2.9 ms a step); its
# chunks, which the prefill takes below CAUSAL_ROWS_MIN_BYTES (chunks_on_step), are stacked
# (16 and 32 rows 5-9% faster). With the AVX2 clone K/V of 128 MiB gain too (bench/draft_rows.py,
# B8 H32 kv8 S2048 d128: 8 rows 29 -> 25 ms, 16 rows 53 -> 34, 32 rows 66 -> 61).
STACK_CAUSAL_MIN_ROWS = 32

# Query rows per head from which a causal prompt (or a chunk of one against its cache) runs a kv
# head's grouped heads stacked position by position in the native prefill
# (causal_prompt_stacks). Measured in one process, stacked against apart alternating (2 cores,
# float32, own tiles, medians of 5-9): AVX-512 clone, 2 threads, B1 H8 kv2 d64 L = S = 512
# 0.84-0.87x the time, 1024 0.88-0.91x, B1 H32 kv8 d128 512 0.90-0.92x, 1024 0.95-0.96x, B4
# H12 kv4 d64 512 0.90-0.92x, B1 H14 kv2 d64 512 0.83-0.87x; one thread 0.87-0.97x; AVX2 clone
# 0.90-1.00x; baseline clone 0.93-1.02x. A chunk of 512 rows against 2048 keys (H32 kv8 d128):
# 0.97-1.02x. At L = S = 256 it was 0.93-1.09x, and shorter square prompts ran 1-14% slower
# stacked (stacked.py). Sliding windows, B1 H8 kv2 d64: a window of 512 keys at L = S = 1024
# 0.90x (AVX2 0.93x), at 2048 0.81x (0.93x); windows of 128-256 keys 0.96-1.01x.
STACK_PROMPT_MIN_L = 512


def _stacks_rows(plan: Plan) -> bool:
    """Whether the clone the native kernels run gives the prefill ``plan``'s ``group · L``
    causal rows a kv head rather than the decode step: at least
    :data:`STACK_CAUSAL_MIN_ROWS`, and in the AVX-512 clone only a chunk the prefill takes
    anyway (more than :data:`DECODE_MAX_L` rows per head, K/V below
    :data:`CAUSAL_ROWS_MIN_BYTES`)."""
    if plan.group * plan.L < STACK_CAUSAL_MIN_ROWS:
        return False
    if running_isa() >= ISAS["avx512"]:
        return plan.L > DECODE_MAX_L and kv_bytes(plan) < CAUSAL_ROWS_MIN_BYTES
    return True


def _stored_rows_on_prefill(plan: Plan) -> bool:
    """K/V stored as float16 or bfloat16 (computed in float32), which the own tiles read as
    stored: in the narrower clones only (the AVX-512 step, or its bfloat16 prefill, serve
    them there)."""
    return _stored_16_bits(plan) and running_isa() < ISAS["avx512"]


def _stored_16_bits(plan: Plan) -> bool:
    """K/V stored as float16 or bfloat16 of one dtype, computed in float32 (what the own
    tiles read as stored)."""
    assert plan.stored is not None
    k, v = plan.stored
    return k.dtype.name in _STORED and v.dtype == k.dtype and plan.acc_dtype == _F32


def _plain_causal(plan: Plan, windows: bool = False) -> bool:
    """A causal ``plan`` with no mask, bias or variant, computed in float32 or float64, with a
    batch axis: what the native prefill takes stacked position by position. No window either,
    or with ``windows`` one that sees no key after its row (right side 0, causal or not)."""
    if plan.window is None:
        rule = plan.causal
    else:
        rule = windows and (plan.causal or plan.window[1] == 0)
    return (
        rule
        and plan.mask is None
        and plan.bias is None
        and not plan.modded
        and np.dtype(plan.acc_dtype) in (_F32, _F64)
        and len(plan.batch) >= 1
    )


def causal_rows_on_prefill(plan: Plan) -> bool:
    """Whether a causal ``plan``'s few rows against a cache (2 to :data:`CAUSAL_ROWS_MAX_L`
    query rows per head, :data:`CAUSAL_CHUNK_KEYS_PER_ROW` keys a row and more) run on the
    native prefill's own tiles, a kv head's ``group · L`` rows in one block (grouped heads
    stacked position by position), rather than on the decode step: as many rows as the
    running clone stacks (:func:`_stacks_rows`), K/V in the compute dtype (float32 or float64)
    or, in the narrower clones, stored in 16 bits, no window, mask, bias or variant, and
    enough work for a native call. So do :data:`FEW_KEYS_MIN_L` to :data:`DECODE_MAX_L` rows
    against at most :data:`FEW_KEYS_MAX_S` keys in every clone, K/V stored in 16 bits too, and
    against at most :data:`FEW_KEYS_STACKED_MAX_S` keys where grouped heads stack them to
    :data:`FEW_KEYS_STACKED_MIN_ROWS` rows a kv head, or 8 rows of K/V stored in 16 bits with
    keys times head size at most :data:`FEW_KEYS_16_BIT_MAX_SD`."""
    if not (_plain_causal(plan) and _plan_work(plan) >= CAUSAL_ROWS_MIN_WORK):
        return False
    if _few_keys_on_prefill(plan):
        return True
    return (
        2 <= plan.L <= CAUSAL_ROWS_MAX_L
        and plan.S >= CAUSAL_CHUNK_KEYS_PER_ROW * plan.L
        and (plan.stored is None or _stored_rows_on_prefill(plan))
        and _stacks_rows(plan)
    )


# A decoding step's causal rows against a short cache: from FEW_KEYS_MIN_L rows per head
# against at most FEW_KEYS_MAX_S keys, K/V in the compute dtype or stored in 16 bits, the
# prefill's own tiles beat the decode step in every clone (the step's work per kv head is
# sized for long rows of keys).
# Measured in one process (float32, 2 threads, 2-core AMX Xeon; B1, B8, B32, H8 kv2 and H12
# kv12, d32 and d64; time on the prefill / time on the step): AVX-512 clone, 4 rows against
# 16 keys 0.49-1.03, against 32 keys 0.58-1.03, 8 rows 0.35-0.80 and 0.50-0.78; AVX2 clone
# 0.49-0.94, 0.53-0.91, 0.40-0.76, 0.44-0.72. With 2 rows, or 64 keys and more, the step held
# (2 rows against 64 keys: 1.10-1.56). K/V stored as bfloat16 (the own tiles reading them as
# stored, AVX-512 clone): B8 and B32 0.37-0.94 (two cells of 4 rows against 32 keys 1.03 and
# 1.06); B1, 8 rows 0.71-1.15 (the smallest calls: 18-25 against 20-34 us).
FEW_KEYS_MIN_L = 4
FEW_KEYS_MAX_S = 32
# Grouped heads whose rows stack to FEW_KEYS_STACKED_MIN_ROWS a kv head and more (4 rows of 4
# query heads a kv head, 8 of 2) keep the prefill up to FEW_KEYS_STACKED_MAX_S keys, since each
# thread took a run of consecutive tasks (for_tasks). Measured in one process, the rule's two
# bounds alternated (float32 and bfloat16 K/V stored, 2 threads, 2-core AMX Xeon; B1 H8 kv2,
# B1 H12 kv3, B8 H8 kv2, B32 H8 kv2 / H12 kv3; 4 and 8 rows, 64 and 128 keys, d32 and d64;
# time with S <= 128 on the prefill / time with S <= 32): float32, AVX-512 clone 0.63-1.04
# (median 0.82), AVX2 clone 0.64-1.03 (its 8 stacked rows already took the prefill); bfloat16
# 0.41-0.88 (median 0.67). Against 256 keys the float32 cells went 0.60-1.17, and ungrouped
# heads (4 or 8 rows a block) 0.73-1.63 from 64 keys on: the step keeps those.
FEW_KEYS_STACKED_MIN_ROWS = 16
FEW_KEYS_STACKED_MAX_S = 128
# Heads alone (not stacked), 8 rows, K/V stored in 16 bits: up to S · d of
# FEW_KEYS_16_BIT_MAX_SD (64 keys of 64, 128 of 32). Measured the same way (bfloat16, B1 H8 kv8,
# B1 H12 kv12, B8 H8 kv8, B32 H12 kv12): AVX-512 clone 0.62-0.96 (the step's time), AVX2 clone
# 0.71-1.02; against 128 keys of 64, 0.99-1.02; with 4 rows the step held. In float32 the
# step held (8 rows against 64 keys of 64 and more: 1.01-1.15 on the prefill).
FEW_KEYS_16_BIT_MAX_SD = 4096


def _few_keys_on_prefill(plan: Plan) -> bool:
    return (
        FEW_KEYS_MIN_L <= plan.L <= DECODE_MAX_L
        and (
            plan.S <= FEW_KEYS_MAX_S
            or (
                plan.S <= FEW_KEYS_STACKED_MAX_S
                and plan.group * plan.L >= FEW_KEYS_STACKED_MIN_ROWS
            )
            or (
                plan.stored is not None
                and plan.L == DECODE_MAX_L
                and plan.S <= FEW_KEYS_STACKED_MAX_S
                and plan.S * plan.d <= FEW_KEYS_16_BIT_MAX_SD
            )
        )
        and (plan.stored is None or _stored_16_bits(plan))
    )


def causal_prompt_stacks(plan: Plan) -> bool:
    """Whether the native prefill runs a causal ``plan`` of at least
    :data:`STACK_PROMPT_MIN_L` query rows per head (a prompt, or a chunk of one against its
    cache) with a kv head's grouped heads stacked position by position: K/V in the compute
    dtype (float32 or float64), no mask, bias or variant; a sliding window too (its rows'
    keys still grow with the row)."""
    return (
        _plain_causal(plan, windows=True)
        and plan.group > 1
        and plan.L >= STACK_PROMPT_MIN_L
        and plan.stored is None
    )


def cache_rows_on_prefill(plan: Plan, stored: bool) -> bool:
    """Whether a contiguous cache's step of causal rows (``plan`` checked on stand-ins of its
    buffers in the compute dtype) leaves the decode step for the general road, which gives the
    prefill these rows (:func:`causal_rows_on_prefill`): a cache that holds the compute dtype
    (not ``stored`` in 16 or 8 bits, which that road would widen first). A pool of pages keeps
    its step (that road gathers its pages)."""
    return not stored and causal_rows_on_prefill(plan)


def chunks_on_step(stored: bool, nbytes: int) -> bool:
    """Whether causal chunks of more than :data:`DECODE_MAX_L` rows may run on the decode step
    at all (:func:`causal_chunk_fits`): K/V ``stored`` in 16 or 8 bits or of ``nbytes`` at
    least :data:`CAUSAL_ROWS_MIN_BYTES`, in the AVX-512 clone."""
    return (stored or nbytes >= CAUSAL_ROWS_MIN_BYTES) and running_isa() >= ISAS["avx512"]


_CAUSAL_FEW_ROWS = _c(
    lambda a: causal_chunk_fits(a.plan.L, a.plan.S, a.plan.stored is not None, a.size),
    lambda a: (
        f"{a.plan.L} query rows per head, more than {DECODE_MAX_L} (or than "
        f"{CAUSAL_ROWS_MAX_L} against {CAUSAL_CHUNK_KEYS_PER_ROW} keys a row and more, with "
        f"K/V stored in 16 or 8 bits or of {CAUSAL_ROWS_MIN_BYTES >> 20} MiB and more, in the "
        f"AVX-512 clone; {a.mib} here)"
    ),
)
# Causal plans of a few query rows on the native decode step with its rows causal
# (qkv.engine.kernels.causal_rows).
CAUSAL_ROWS = (
    _c(lambda a: a.plan.causal and a.plan.L > 1, "not causal with more than one query row"),
    _CAUSAL_FEW_ROWS,
    _c(
        lambda a: not causal_rows_on_prefill(a.plan),
        "causal rows the native prefill takes (router.causal_rows_on_prefill)",
    ),
    _c(
        lambda a: a.plan.S >= CAUSAL_ROWS_KEYS_PER_ROW * a.plan.L,
        lambda a: (
            f"{a.plan.S} keys, fewer than the {a.plan.L} query rows (a row would see none: "
            "the general kernels' rules)"
        ),
    ),
    _c(lambda a: a.plan.mask is None, "a mask given"),
    _NO_BIAS,
    _NO_WINDOW,
    _NO_TILE_VARIANT,
    _F32_OR_F64,
    _HEADS_AXIS,
    _NONEMPTY,
    _NATIVE,
)
# The fused C++ prefill (qkv.engine.kernels.native.attend): BLAS tile products.
PREFILL = (
    _F32_OR_F64,
    _NOT_MODDED,
    _c(lambda a: min(a.plan.L, a.plan.S, a.plan.dv) >= 1, "no query, key or value column"),
    _NATIVE_BLAS,
)
# The native prefill on its own tile products (qkv.engine.kernels.native, products="own"):
# what PREFILL asks but BLAS, at any size.
OWN_TILES = (
    _c(
        lambda a: a.plan.L > DECODE_MAX_L or causal_rows_on_prefill(a.plan),
        lambda a: (
            f"{a.plan.L} query rows per head, a decoding step's {DECODE_MAX_L} or fewer (and "
            "not causal rows router.causal_rows_on_prefill gives it)"
        ),
    ),
    _F32_OR_F64,
    _NOT_MODDED,
    _c(lambda a: min(a.plan.L, a.plan.S, a.plan.dv) >= 1, "no query, key or value column"),
    _NATIVE,
)
_READS_STORED = _c(
    lambda a: (
        a.plan.stored[0].dtype.name in _STORED
        and a.plan.stored[1].dtype == a.plan.stored[0].dtype
        and a.plan.acc_dtype == _F32
    ),
    "K/V not float16 or bfloat16 of one dtype computed in float32",
)
# bfloat16 tile products on vdpbf16ps (qkv.engine.kernels.native_bf16).
BF16 = (
    _STORED_KV,
    _c(lambda a: a.plan.stored[0].dtype.name == "bfloat16", "K/V not bfloat16"),
    _c(lambda a: a.plan.out_dtype.name == "bfloat16", "q is not bfloat16"),
    _c(
        lambda a: a.plan.bias is None or a.plan.bias.dtype == _F32,
        "a float mask (bias) that is not float32",
    ),
    _NOT_MODDED,
    _c(lambda a: a.plan.d % 2 == 0, lambda a: f"an odd head size d={a.plan.d}"),
    _NONEMPTY,
    _c(lambda a: a.plan.S < 2**31, "2**31 keys or more"),
    _NATIVE_BF16,
)
_SCALE_FITS = _c(
    lambda a: scale_in_range(a.plan.scale, a.plan.acc_dtype),
    lambda a: f"scale {a.plan.scale:.3g} is not a normal {a.plan.acc_dtype} number",
)


_STREAMS = _c(
    lambda a: a.size >= TEAM_DECODE_MIN_BYTES,
    lambda a: f"K/V of {a.mib}, below the {TEAM_DECODE_MIN_BYTES >> 20} MiB it wins from",
)


def _least_decode_bytes(a: Ask) -> int:
    """The K/V bytes from which the NumPy or compiled decode kernel beats the dense one."""
    fast = compiled_decode(a.plan) or (a.plan.mask is not None and a.plan.L == 1)
    return TEAM_DECODE_MIN_BYTES if fast and team_preferred() else DECODE_MIN_BYTES


# The attention of a plan, fastest first; the last row takes everything.
FORWARD: tuple[Kernel, ...] = (
    Kernel(
        "native decode, stored K/V",
        "decode",
        (
            _STORED_KV,
            _c(lambda a: a.kernel in ("auto", "decode"), lambda a: f"kernel={a.kernel!r}"),
            _FEW_ROWS,
            *DECODE_STEP,
        ),
        stored=True,
    ),
    Kernel(
        "native decode, causal rows, stored K/V",
        "decode",
        (_STORED_KV, _AUTO, *CAUSAL_ROWS),
        stored=True,
    ),
    Kernel("native bfloat16 prefill", "tiled", (_BF16_PREFILL_SHAPE, *BF16), stored=True),
    Kernel(
        "native prefill, own tiles, stored K/V",
        "tiled",
        (_STORED_KV, _AUTO, _SCALE_FITS, _READS_STORED, *OWN_TILES),
        stored=True,
    ),
    Kernel(
        "native prefill, stored K/V",
        "tiled",
        (_STORED_KV, _PREFILL_SHAPE, _SCALE_FITS, _READS_STORED, *PREFILL),
        stored=True,
    ),
    Kernel("dense (forced)", "dense", (_c(lambda a: a.kernel == "dense", "not forced"),)),
    Kernel("tiled (forced)", "tiled", (_c(lambda a: a.kernel == "tiled", "not forced"),)),
    Kernel("decode (forced)", "decode", (_c(lambda a: a.kernel == "decode", "not forced"),)),
    Kernel(
        "native decode",
        "decode",
        (
            _AUTO,
            _FEW_ROWS,
            _c(
                lambda a: a.plan.mask is None or a.size >= TEAM_DECODE_MIN_BYTES,
                lambda a: (
                    f"a boolean mask over K/V of {a.mib}, below the "
                    f"{TEAM_DECODE_MIN_BYTES >> 20} MiB from which reading its runs pays"
                ),
            ),
            *DECODE_STEP,
        ),
    ),
    Kernel("native decode, causal rows", "decode", (_AUTO, *CAUSAL_ROWS)),
    Kernel(
        "decode",
        "decode",
        (
            _AUTO,
            _FEW_ROWS,
            _c(
                lambda a: not causal_rows_on_prefill(a.plan),
                "causal rows the native prefill takes (router.causal_rows_on_prefill)",
            ),
            _STREAMS,
            _c(
                lambda a: a.size >= _least_decode_bytes(a),
                lambda a: (
                    f"K/V of {a.mib}, below the {_least_decode_bytes(a) >> 20} MiB it wins from"
                ),
            ),
        ),
    ),
    Kernel("native prefill, own tiles", "tiled", (_AUTO, *OWN_TILES)),
    Kernel(
        "dense",
        "dense",
        (
            _AUTO,
            _c(
                lambda a: a.plan.L <= DECODE_MAX_L or a.plan.L * a.plan.S <= DENSE_MAX_SCORES,
                lambda a: f"{a.plan.L} x {a.plan.S} scores per head, more than {DENSE_MAX_SCORES}",
            ),
            _c(
                lambda a: not (_prefill_sized(a) and all(c.test(a) for c in PREFILL)),
                lambda a: (
                    f"a batch of {_batch_work(a):.3g} multiply-adds, from {DENSE_MAX_WORK:.3g} "
                    "the native prefill's threads run it"
                ),
            ),
        ),
    ),
    Kernel("native prefill", "tiled", (_AUTO, *PREFILL)),
    Kernel(
        "packed walk",
        "tiled",
        (
            _AUTO,
            _c(lambda a: a.plan.mask is None, "a boolean mask given"),
            _c(lambda a: a.plan.bias is None, "a float mask (bias) given"),
            _NOT_MODDED,
            _c(lambda a: len(a.plan.batch) >= 1, "no heads axis (q of rank 2)"),
        ),
    ),
    Kernel("tiled", "tiled", ()),
)

# The gradients of a plan (qkv.attention_vjp, autograd), fastest first.
BACKWARD: tuple[Kernel, ...] = (
    Kernel(
        "native bfloat16 backward",
        "tiled",
        (
            *BF16,
            _c(lambda a: a.plan.dv % 2 == 0, lambda a: f"an odd value size dv={a.plan.dv}"),
            _c(lambda a: a.plan.S >= 1, "no key"),
        ),
        stored=True,
    ),
    Kernel(
        "native backward, stored K/V", "tiled", (_STORED_KV, _READS_STORED, *PREFILL), stored=True
    ),
    Kernel("native backward", "tiled", PREFILL),
    Kernel("tiled backward", "tiled", ()),
)


def _one_query_some(a: Ask) -> bool:
    """Whether a packed batch's ask (``plan[4]``: its sequences' ``(query rows, keys)``, or
    None) holds decoding steps: sequences of one query row and at least one key (a window,
    or causal, then leaves each such query one run of keys that ends with its last)."""
    rows = a.plan[4]
    if rows is None:
        return False
    lq, lk = rows
    return bool(((lq == 1) & (lk >= 1)).any())


# A packed varlen batch (qkv.attention_varlen); its ask's plan is ``(q, k, v, compute dtype,
# rows)``, ``rows`` the sequences' ``(query rows, keys)`` (None: not asked).
PACKED: tuple[Kernel, ...] = (
    # Sequences of one query (a server's decoding steps, alone or beside prefill chunks):
    # the native decode step for them, the packed keys one page that each reads its run of
    # (native_decode.paged_step), every head's rows at a time; the other sequences then ask
    # this table again without them. Measured on 2 cores (Zen 4), B8 H32 kv8 S4096 d128: the
    # packed walk took 33 ms in float32 and 108 ms in bfloat16 (its products made for many
    # rows, the keys packed for them per sequence), the step 11 and 5.6 ms.
    Kernel(
        "native decode step",
        "decode",
        (
            _c(_one_query_some, "no sequence of one query row and a key or more"),
            _c(
                lambda a: a.plan[3] in (_F32, _F64),
                lambda a: f"computed in {a.plan[3]}, not float32 or float64",
            ),
            _c(
                lambda a: (
                    a.plan[1].dtype == a.plan[2].dtype
                    and (
                        a.plan[1].dtype == a.plan[3]
                        or (a.plan[1].dtype.name in _STORED and a.plan[3] == _F32)
                    )
                ),
                "K/V neither of the compute dtype nor float16/bfloat16 of one dtype in float32",
            ),
            _NATIVE,
        ),
        stored=True,
    ),
    Kernel(
        "native bfloat16 packed walk",
        "tiled",
        (
            _c(
                lambda a: all(x.dtype.name == "bfloat16" for x in a.plan[:3]),
                "q, k and v not all bfloat16",
            ),
            _c(
                lambda a: a.plan[0].shape[-1] % 2 == 0 and a.plan[0].shape[-1] >= 2,
                "an odd head size",
            ),
            _c(lambda a: max(a.plan[0].shape[0], a.plan[1].shape[0]) < 2**31, "2**31 tokens"),
            _NATIVE_BF16,
        ),
        stored=True,
    ),
    Kernel(
        "native packed walk",
        "tiled",
        (
            _c(
                lambda a: a.plan[3] in (_F32, _F64),
                lambda a: f"computed in {a.plan[3]}, not float32 or float64",
            ),
            _NATIVE_BLAS,
        ),
    ),
    Kernel("packed walk", "tiled", ()),
)

# A decoding step planned once and run per layer (qkv.engine.decoding.DecodePlan: qkv.DecodePlan,
# KVCache's and PagedKVCache's steps, the transformers backend's): each sequence its own run of
# keys, a window worked out per sequence by the caller; ``narrow``: K/V stored in fewer than 32
# bits, computed in float32; ``operands``: why the native step cannot read the operands (their
# strides, a stored form it does not take, a mask row that is not one run), or None.
_DECODE_NATIVE = (
    _NO_TILE_VARIANT,
    _c(lambda a: not (a.plan.causal and a.plan.L != 1), "causal with more than one row"),
    _c(
        lambda a: a.plan.window is None or a.plan.L == 1,
        "a window with more than one query row",
    ),
    _SCALE_FITS,
    _F32_OR_F64,
    _c(
        lambda a: not a.narrow or a.plan.acc_dtype == _F32,
        lambda a: f"16- or 8-bit K/V computed in {a.plan.acc_dtype}, not float32",
    ),
    _c(lambda a: a.operands is None, lambda a: str(a.operands)),
    _NATIVE,
)

# The fast road's conditions (precision="fast": qkv.engine.kernels.decode_fast): asked for,
# and K stored as int8 (on any other form "fast" runs the exact road: its products are
# float32's already, or its codes have no integer products).
_FAST = (
    _c(lambda a: a.precision == "fast", "precision='exact' (the fast road is opted into)"),
    _c(
        lambda a: a.kv_format in FAST_FORMS,
        lambda a: (
            f"K/V stored as {a.kv_format or 'floats'}: precision='fast' rounds q only for int8 "
            "K/V (the exact road runs)"
        ),
    ),
)

DECODE_PLAN: tuple[Kernel, ...] = (
    Kernel("native decode, fast int8", "decode", (*_FAST, *_DECODE_NATIVE)),
    Kernel("native decode", "decode", _DECODE_NATIVE),
    # the fast road emulated where the native step would take it but is off or not built
    Kernel("NumPy decode, fast int8", "decode", (*_FAST, *_DECODE_NATIVE[:-1])),
    Kernel("NumPy decode", "decode", ()),
)

# What the decode kernel's compiled loop (Numba) asks of a plan, in both tables below.
_ROWS_PER_HEAD = _c(
    lambda a: a.plan.group * a.plan.L >= 2,
    "one query row per kv head (BLAS's matrix-vector product reads K/V faster)",
)
_COMPILED = (
    _NOT_MODDED,
    _F32_OR_F64,
    _c(lambda a: a.plan.d > 0 and a.plan.dv > 0, "an empty head"),
    _c(lambda a: jit_enabled(), "Numba not installed, or QKV_JIT=0"),
)

# The decode kernel's compiled loop (Numba) against its NumPy products.
COMPILED_DECODE: tuple[Kernel, ...] = (
    Kernel(
        "compiled decode",
        "decode",
        (
            _ROWS_PER_HEAD,
            _c(lambda a: a.plan.mask is None and a.plan.bias is None, "a mask given"),
            *_COMPILED,
        ),
    ),
    Kernel("NumPy decode", "decode", ()),
)


# One decoding step on the compiled kernel's own OpenMP team, between PyTorch's operations
# (decode._team_single); a boolean mask may give each sequence one run of keys.
COMPILED_TEAM: tuple[Kernel, ...] = (
    Kernel(
        "compiled decode on a team",
        "decode",
        (
            _c(lambda a: not a.plan.structured, "causal or a window given"),
            _c(
                lambda a: bool(a.plan.batch) and a.plan.L > 0 and a.plan.S > 0,
                "no heads axis, no query or no key",
            ),
            _ROWS_PER_HEAD,
            _c(lambda a: a.plan.bias is None, "a float mask (bias) given"),
            *_COMPILED,
        ),
    ),
    Kernel("decode's own threads", "decode", ()),
)


# FORWARD less the rows whose first condition refuses a plan with no stored K/V under
# "auto" (the stored and the forced rows): where the commonest calls start their walk.
_AUTO_ROWS = tuple(r for r in FORWARD if not r.stored and not r.name.endswith("(forced)"))


def _every_key_seen(a: Ask) -> bool:
    """Every query row of the plan sees every key, with no variant, no empty axis and a normal
    scale (the shorter dense road's one condition, written out: small calls pay for every
    attribute lookup; a single causal query sees all keys too)."""
    plan = a.plan
    if (
        plan.mask is not None
        or plan.bias is not None
        or plan.window is not None
        or plan.sinks is not None
        or plan.softcap is not None
        or plan.alibi is not None
        or plan.score_mod is not None
        or plan.mask_mod is not None
    ):
        return False
    q = plan.q
    if plan.k.shape[-2] == 0 or q.shape[-1] == 0 or (plan.causal and q.shape[-2] != 1):
        return False
    tiny, top = normal_range(plan.acc_dtype)
    return tiny <= plan.scale <= top


# The shorter road a chosen row tries first, by the row's name: a faster form of the same
# kernel that gives a finite result or None (then the row's kernel and the overflow retries
# run). Each with its conditions, as the rows have theirs.
SHORT: dict[str, Kernel] = {
    "dense": Kernel(
        "dense, every key seen",
        "dense",
        (_c(_every_key_seen, "a mask, a variant, an empty axis or a scale out of range"),),
    ),
    "native decode": Kernel(
        "native decode, checked finite",
        "decode",
        (_c(lambda a: a.plan.mask is None, "a mask given (the step reads its run of keys)"),),
    ),
    "native prefill, own tiles": Kernel(
        "native prefill, own tiles, checked finite", "tiled", (_SCALE_FITS,)
    ),
    "native decode, causal rows": Kernel(
        "native decode, causal rows, checked finite", "decode", ()
    ),
}


def short(row: Kernel, ask: Ask) -> str | None:
    """The name of the shorter road (:data:`SHORT`) ``row`` tries first for ``ask``, or None."""
    found = SHORT.get(row.name)
    if found is None:
        return None
    for cond in found.conditions:
        if not cond.test(ask):
            return None
    return found.name


#: Distinct non-zero key counts up to which the rows of each count run as one call.
MAX_GROUPS = 2

#: The kernels that take a plan's key counts themselves (their work items clip each batch
#: row's keys to its count).
READ_BY = (
    "native prefill, own tiles",
    "native prefill, own tiles, stored K/V",
    "native prefill",
    "native prefill, stored K/V",
    "native bfloat16 prefill",
)

# A plan whose padding mask the validation read as key counts (Plan.key_counts) may run
# without the mask: under "auto", on more than one query row (a decoding step's native kernel
# reads a mask's run of keys itself), with no variant that reads positions.
ON_KEY_COUNTS = (
    _AUTO,
    _c(lambda a: a.plan.key_counts is not None, "no padding mask read as key counts"),
    _c(lambda a: a.plan.L > 1, "one query row (the decode step reads the mask's run)"),
    _c(
        lambda a: a.plan.alibi is None and a.plan.score_mod is None and a.plan.mask_mod is None,
        "ALiBi, score_mod or mask_mod (they read positions)",
    ),
)


def key_counts_per_row(plan: Plan) -> np.ndarray:
    """The key counts of a plan, one per index of its first batch axis (or one for all)."""
    counts = plan.key_counts
    assert counts is not None
    n = plan.batch[0] if plan.batch else 1
    return np.broadcast_to(counts, (n,)) if counts.size != n else counts


def count_groups(counts: np.ndarray) -> int:
    """The distinct non-zero counts among ``counts``: the calls one per count makes."""
    found = np.unique(counts)
    return int(found.size - (found[0] == 0))


# How such a plan runs, given the row its unmasked twin runs on (Ask.base), fastest first; the
# last row reads the mask as any other plan does.
KEY_COUNTS: tuple[Kernel, ...] = (
    Kernel(
        "dense on key counts",
        "dense",
        (_c(lambda a: a.base is not None and a.base.name == "dense", "not the dense kernel"),),
    ),
    Kernel(
        "key counts read by the native prefill",
        "tiled",
        (
            _c(
                lambda a: a.base is not None and a.base.name in READ_BY,
                "the unmasked problem does not run on the native prefill",
            ),
        ),
    ),
    Kernel(
        "one call per key count",
        "tiled",
        (
            _c(
                lambda a: count_groups(_counts(a)) <= MAX_GROUPS,
                lambda a: f"more than {MAX_GROUPS} distinct key counts",
            ),
        ),
    ),
    Kernel("the mask", "tiled", ()),
)


#: The rows of :data:`KEY_COUNTS` chosen by the unmasked twin's row alone, whatever the counts
#: are: a choice of one of them may be kept for a shape and run on other counts
#: (:func:`qkv.engine.run.plain`).
FOR_ANY_COUNTS = ("dense on key counts", "key counts read by the native prefill")


def _counts(a: Ask) -> np.ndarray:
    if a.counts is None:
        a.counts = key_counts_per_row(a.plan)
    return a.counts


class Route(NamedTuple):
    """What runs a plan (:func:`choose`): the row of :data:`FORWARD`, the shorter road it
    tries first (:data:`SHORT`), and, for a plan run on its key counts, the row of
    :data:`KEY_COUNTS` and the count of each batch row (then ``row`` and ``short`` are its
    unmasked twin's); ``size`` is :func:`kv_bytes`."""

    row: Kernel
    short: str | None
    counts: str | None
    size: int
    per_row: np.ndarray | None = None


def choose(plan: Plan, kernel: str = "auto", counts: bool = True) -> Route:
    """Every decision of which kernel computes ``plan``'s attention, taken once: the row of
    :data:`FORWARD`, its shorter road, and whether the plan runs on its key counts
    (``counts=False``: on its mask, whatever it holds).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.validate import make_plan
    >>> route = choose(make_plan(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8))))
    >>> route.row.name, route.short, route.counts
    ('dense', 'dense, every key seen', None)
    """
    if counts and plan.key_counts is not None:
        ask = Ask(plan, kernel)
        if all(cond.test(ask) for cond in ON_KEY_COUNTS):
            bare = plan.but(mask=None, bias=None, key_counts=None)
            twin = Ask(bare)
            ask.base = first(rows(bare, "auto"), twin)
            road = first(KEY_COUNTS, ask)
            if road is not KEY_COUNTS[-1]:
                base = ask.base
                return Route(base, short(base, twin), road.name, twin.size, _counts(ask))
    ask = Ask(plan, kernel)
    row = first(rows(plan, kernel), ask)
    return Route(row, short(row, ask), None, ask.size)


# A paged step whose block table starts with the same pages in every row (requests forked from
# one prompt) may split there (qkv.engine.cascade): the prefix once for all requests as one
# prefill-shaped call, merged with each request's own pages by their lse. So may one sequence's
# chunk of more than DECODE_MAX_L query rows (a prompt fed a chunk at a time) at its own full
# pages that every row sees whole: read in place by the prefill, unless the decode step takes
# the chunk (causal_rows_step). Ask.plan here is (plan, ALiBi slopes, shared keys, sequences,
# precision, whether the decode step takes the rows).
MIN_SHARED_KEYS = 256
CASCADE = (
    _c(lambda a: a.plan[4] == "exact", "precision='fast' (its road reads every page itself)"),
    _c(
        lambda a: a.plan[3] >= 2 or (a.plan[0].L > DECODE_MAX_L and not a.plan[5]),
        "one sequence with rows the decode step takes (its pages read by the step)",
    ),
    _c(
        lambda a: a.plan[2] >= MIN_SHARED_KEYS,
        lambda a: f"{a.plan[2]} shared keys, fewer than {MIN_SHARED_KEYS}",
    ),
    _c(
        lambda a: a.plan[0].window is None or a.plan[0].window[0] is None,
        "a window's left side (it moves with each sequence's length)",
    ),
    _c(lambda a: a.plan[1] is None, "ALiBi (it reads positions)"),
)


# A planned step of a few causal query rows per sequence (KVCache's, the paged step's) runs
# them on the decode step with its rows causal (qkv.engine.decoding.causal_rows). Ask.plan
# here is (the checked plan, K/V stored in 16 or 8 bits, the K/V's bytes).
STEP_CAUSAL_ROWS = (
    _c(
        lambda a: a.plan[0].causal and a.plan[0].L > 1,
        "not causal with more than one query row",
    ),
    _c(
        lambda a: causal_chunk_fits(a.plan[0].L, a.plan[0].S, a.plan[1], a.plan[2]),
        lambda a: f"{a.plan[0].L} query rows per head: a chunk for the prefill kernels",
    ),
    _c(
        lambda a: a.plan[0].window is None,
        "a window given (its left side moves with each row)",
    ),
)


def causal_rows_step(plan: Plan, stored: bool = False, nbytes: int = 0) -> bool:
    """Whether a checked step of ``plan`` (K/V a cache's or a pool's, each sequence its run
    of keys; ``stored`` in 16 or 8 bits, ``nbytes`` of them) runs its causal rows as such on the
    decode step (:data:`STEP_CAUSAL_ROWS`). Whether the decode step then serves it is
    :func:`decode_plan`'s call on the unmasked plan."""
    ask = Ask((plan, stored, nbytes))
    return all(cond.test(ask) for cond in STEP_CAUSAL_ROWS)


# A paged batch of chunks (more query rows than a decoding step) with no prefix its sequences
# share runs sequence by sequence, so that each sequence's own full pages split off as a
# prefix (CASCADE). Ask.plan here is (plan, sequences, shared keys).
CHUNKS_ALONE = (
    _c(
        lambda a: a.plan[0].L > DECODE_MAX_L and not a.plan[3],
        lambda a: f"{a.plan[0].L} query rows per sequence: the decode step's",
    ),
    _c(lambda a: a.plan[1] > 1, "one sequence"),
    _c(lambda a: a.plan[2] == 0, "a prefix the sequences share (split once for all)"),
)


def chunks_alone(plan: Plan, sequences: int, shared_keys: int, steps: bool = False) -> bool:
    """Whether a checked paged call of ``sequences`` sequences sharing ``shared_keys`` keys
    runs sequence by sequence (:data:`CHUNKS_ALONE`); ``steps``: the decode step takes its
    rows (:func:`causal_rows_step`)."""
    ask = Ask((plan, sequences, shared_keys, steps))
    return all(cond.test(ask) for cond in CHUNKS_ALONE)


def cascade(
    plan: Plan, slopes: Any, shared_keys: int, sequences: int, precision: str = "exact",
    steps: bool = False,
) -> bool:  # fmt: skip
    """Whether a checked paged step on the road ``precision`` names splits at a prefix of
    ``shared_keys`` keys that its ``sequences`` all share (:data:`CASCADE`); ``steps``: the
    decode step takes its rows (:func:`causal_rows_step`)."""
    ask = Ask((plan, slopes, shared_keys, sequences, precision, steps))
    return all(cond.test(ask) for cond in CASCADE)


# The prefill kernels that read a shared prefix's pages in place, and their tile products
# (qkv.engine.kernels.native.attend_prefix_pages), and the forms of pool they read
_PAGES_IN_PLACE = {"native prefill, own tiles": "own", "native prefill": "blas"}
_PAGE_FORMS = (None, "bfloat16", "float16")


def every_head(
    kv_heads: int, k_strides: tuple[int, ...], v_strides: tuple[int, ...], nbytes: int
) -> bool:
    """Whether the native decode step reads K/V of ``kv_heads`` heads, ``(..., kv_heads, keys,
    d)`` views of these byte strides and ``nbytes`` together, every head's rows at a time (the
    paged walk, :func:`qkv.engine.kernels.native_decode.paged_step`, one page a sequence):
    where both interleave the heads within each key's row (a head's stride below a key's) and
    they hold at least :data:`EVERY_HEAD_MIN_BYTES`. The same results as the walk by heads
    (the same recurrence per head); its split of the keys among threads may differ, and with
    it the last bits."""
    return (
        kv_heads > 1
        and nbytes >= EVERY_HEAD_MIN_BYTES
        and 0 <= k_strides[-3] < k_strides[-2]
        and 0 <= v_strides[-3] < v_strides[-2]
    )


def prefix_in_place(part: Plan, form: str | None) -> str | None:
    """The tile products (``"own"`` or ``"blas"``) with which the native prefill reads a shared
    prefix's pages in place for the split step's prefix ``part`` (a checked plan on stand-ins
    of the prefix's shapes), on a pool stored as ``form`` (None: the compute dtype, or float16
    arrays); None where the prefix is gathered first: the 8-bit forms, and parts that
    :func:`forward` gives another kernel."""
    return _PAGES_IN_PLACE.get(forward(part).name) if form in _PAGE_FORMS else None


def first(table: Sequence[Kernel], ask: Ask) -> Kernel:
    """The first row of ``table`` whose conditions all hold for ``ask``."""
    for row in table:
        for cond in row.conditions:
            if not cond.test(ask):
                break
        else:
            return row
    raise AssertionError("a table's last row takes everything")


def holds(conditions: Sequence[Condition], plan: Any, kernel: str = "auto") -> bool:
    """Whether every one of ``conditions`` (a kernel's, or a group of them such as
    :data:`DECODE_STEP`) holds for ``plan``."""
    ask = Ask(plan, kernel)
    return all(cond.test(ask) for cond in conditions)


def forward(plan: Plan, kernel: str = "auto") -> Kernel:
    """The kernel that computes ``plan``'s attention (a row of :data:`FORWARD`).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.validate import make_plan
    >>> forward(make_plan(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8)))).name
    'dense'
    >>> forward(make_plan(np.ones((500, 8)), np.ones((500, 8)), np.ones((500, 8))), "dense").name
    'dense (forced)'
    """
    return first(rows(plan, kernel), Ask(plan, kernel))


def rows(plan: Plan, kernel: str) -> tuple[Kernel, ...]:
    """The rows of :data:`FORWARD` a plan's walk needs to try: all of them, or, for a plan
    with no stored K/V under ``"auto"``, those that are neither for stored K/V nor forced
    (each of those is refused by its first condition)."""
    return _AUTO_ROWS if kernel == "auto" and plan.stored is None else FORWARD


def backward(plan: Plan) -> Kernel:
    """The kernel that computes ``plan``'s gradients (a row of :data:`BACKWARD`)."""
    return first(BACKWARD, Ask(plan))


# Packed sequences of 2 to DECODE_MAX_L causal query rows (draft tokens beside decoding steps),
# and chunks as causal_chunk_fits takes them, on the decode step as causal rows
# (qkv.engine.varlen.causal_rows_steps): what the "native decode step" row asks of the arrays,
# causal with no window, and at least CAUSAL_ROWS_KEYS_PER_ROW keys a row (each sequence's:
# packed_causal_rows). Chunks of a packed batch, B8 H32 kv8 d128 against 2048 keys each, 2
# threads, against the packed walk: float32 12 / 16 / 32 rows 47 / 66 / 96 -> 30 / 37 / 68
# ms, bfloat16 57 / 61 / 68 -> 20 / 31 / 60 ms. Ask.plan here
# is (q, k, v, dtype, None, causal, window).
PACKED_CAUSAL_ROWS = (
    _c(lambda a: a.plan[5], "not causal (the rows' keys would be the same: one step)"),
    _c(lambda a: a.plan[6] is None, "a window (its left side moves with each row)"),
    *PACKED[0].conditions[1:],
)


def packed_causal_rows(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dtype: np.dtype,
    rows: tuple[np.ndarray, np.ndarray],
    causal: bool,
    window: Any,
) -> np.ndarray:
    """The sequences of a packed batch (``rows``: their query rows and keys) that the decode
    step serves as causal rows (:data:`PACKED_CAUSAL_ROWS`): their indices, none where the
    conditions do not hold."""
    lq, lk = rows
    ask = Ask((q, k, v, np.dtype(dtype), None, causal, window))
    if not all(cond.test(ask) for cond in PACKED_CAUSAL_ROWS):
        return np.zeros(0, np.int64)
    few = (lq >= 2) & (lq <= DECODE_MAX_L) & (lk >= CAUSAL_ROWS_KEYS_PER_ROW * lq)
    if chunks_on_step(k.dtype.itemsize < np.dtype(dtype).itemsize, k.nbytes + v.nbytes):
        chunk = (lq > DECODE_MAX_L) & (lq <= CAUSAL_ROWS_MAX_L)
        few |= chunk & (lk >= CAUSAL_CHUNK_KEYS_PER_ROW * lq)
    return np.flatnonzero(few)


def flash_pages(rows: int, window: Any, alibi: bool, pages_per_sequence: int) -> bool:
    """Whether a call of FlashAttention's interface on pages (a contiguous cache: one page a
    sequence, or its rows viewed as pages, :func:`cache_as_pages`) with ``rows`` query rows
    per sequence runs on the engine's paged step (:func:`qkv.engine.paged.attend_pages`,
    which reads pages in place where its kernels can): a decoding step; a few rows with no
    window; a chunk with no window on a table of several pages a sequence. Never with
    ``alibi`` (flash-attn's reaches both sides of the query: the interface's own road)."""
    if alibi:
        return False
    return rows == 1 or (window is None and (rows <= DECODE_MAX_L or pages_per_sequence > 1))


def cache_as_pages(rows: int, window: Any, alibi: bool) -> bool:
    """Whether a contiguous cache's rows are viewed as pages for a call of ``rows`` query rows
    per sequence (a chunk, whose full pages the prefill then reads in place:
    :data:`CASCADE`)."""
    return rows > DECODE_MAX_L and window is None and not alibi


def packed(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dtype: np.dtype,
    rows: tuple[np.ndarray, np.ndarray] | None = None,
) -> Kernel:
    """The kernel that walks a packed batch computed in ``dtype`` (a row of :data:`PACKED`);
    ``rows``: its sequences' query rows and keys (None: the walks alone)."""
    return first(PACKED, Ask((q, k, v, np.dtype(dtype), rows)))


def decode_plan(
    plan: Plan,
    narrow: bool,
    operands: str | None,
    *,
    precision: str = "exact",
    kv_format: str | None = None,
) -> list[tuple[str, str]]:
    """The walk of :data:`DECODE_PLAN` for a decoding step's ``plan`` (checked against
    stand-ins of the K/V shapes) on the road ``precision`` names, K/V stored as ``kv_format``
    (None: floats): ``[(kernel, why refused)..., (chosen, "")]``. An exact step's walk skips
    the fast rows (each refused by its first condition)."""
    ask = Ask(plan, narrow=narrow, operands=operands, precision=precision, kv_format=kv_format)
    said = []
    for row in DECODE_PLAN:
        if precision == "exact" and row.conditions[:1] == _FAST[:1]:
            continue
        why = _refusal(row, ask)
        said.append((row.name, why or ""))
        if why is None:
            return said
    raise AssertionError("a table's last row takes everything")


def compiled_decode(plan: Plan) -> bool:
    """Whether the decode kernel runs ``plan`` on its compiled loop (:data:`COMPILED_DECODE`)."""
    return first(COMPILED_DECODE, Ask(plan)) is COMPILED_DECODE[0]


def compiled_team(plan: Plan) -> bool:
    """Whether one decoding step may run on the compiled kernel's OpenMP team
    (:data:`COMPILED_TEAM`; the kernel still declines operands it cannot read in place)."""
    return first(COMPILED_TEAM, Ask(plan)) is COMPILED_TEAM[0]


def decode_together(plans: Sequence[Plan], kernel: str, sizes: Sequence[int]) -> bool:
    """Whether a batch of plans (a cache's runs of sequences of equal length) all run on the
    decode kernel in one parallel pass: under ``"auto"``, when every plan has few queries
    and their K/V together (``sizes``, :func:`kv_bytes`) are large enough -- a batch of
    short caches is one large memory-bound job, not many small ones. Causal rows the native
    prefill takes (:func:`causal_rows_on_prefill`) stay its."""
    return (
        kernel == "auto"
        and all(p.L <= DECODE_MAX_L for p in plans)
        and sum(sizes) >= DECODE_MIN_BYTES
        and not any(causal_rows_on_prefill(p) for p in plans)
    )


def _refusal(row: Kernel, ask: Ask) -> str | None:
    for cond in row.conditions:
        if not cond.test(ask):
            return cond.refusal(ask)
    return None


def explain(plan: Plan, kernel: str = "auto", table: str = "forward") -> list[tuple[str, str]]:
    """The walk of a table for ``plan``: ``(kernel, why refused)`` for each row tried before
    the chosen one, then ``(chosen kernel, "")``. Rows of another ``kernel=`` family than the
    one forced, and rows for stored K/V when none are stored, are left out: they were never
    candidates.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.validate import make_plan
    >>> plan = make_plan(np.ones((1, 8)), np.ones((5000, 8)), np.ones((5000, 8)), window=(2, 0))
    >>> explain(plan)[-1]
    ('dense', '')
    """
    rows = {"forward": FORWARD, "backward": BACKWARD}[table]
    ask = Ask(plan, kernel)
    said: list[tuple[str, str]] = []
    for row in rows:
        if row.stored and plan.stored is None:
            continue
        if row.name.endswith("(forced)") and kernel != row.family:
            continue
        why = _refusal(row, ask)
        if why is None:
            said.append((row.name, ""))
            return said
        if not (kernel != "auto" and why.startswith("kernel=")):
            said.append((row.name, why))
    raise AssertionError("a table's last row takes everything")

"""Native fused prefill: the tiled kernel's recurrence in C++, the softmax step fused in.

Must equal :func:`qkv.reference.attention` (it runs the same FlashAttention-2 recurrence as
:mod:`qkv.engine.kernels.tiled`, which stays the readable statement of it and the fallback).

What it is: a small C++ library built by ``pip install`` when a C++ compiler is present
(``setup.py``; without one the package installs without it). It is a plain C ABI, loaded with
:mod:`ctypes` (which releases the GIL during the call): no Python headers or binding library
at build time, one build for every Python version. The tile products go through BLAS
``sgemm``/``dgemm`` found at run time in SciPy's ``scipy.linalg.cython_blas`` (nothing is linked
at build time); the softmax step between them (mask, running max, exponentials, sums,
rescaling) runs while the score tile is in cache, in the widest vector clone the CPU supports
(AVX-512, AVX2 or the baseline, chosen at run time).

When it runs: ``kernel="auto"`` sends float32/float64 prefill (the ``"tiled"`` choice) here when
the library is built, SciPy is importable and ``QKV_NATIVE`` is not ``0`` (read on every call).
Causal, windows, boolean masks, float biases, grouped heads and sinks (added to the finished
result by the dispatcher) are covered; soft-capping, ALiBi, ``score_mod`` and ``mask_mod`` run
on the NumPy kernels. ``attention_varlen`` runs its packed batches (float32/float64, causal,
windows, grouped heads) on :func:`attend_packed`, the same fused block over (sequence, query
head, query block) tasks read straight from the packed arrays. The same library holds the
decode step (:mod:`qkv.engine.kernels.native_decode`, which needs no BLAS). :func:`info` says
what is active and why.

Threads: work items are (head, query block) pairs, each native thread taking a run of
consecutive ones first and then helping with the others' runs, as many threads as
:func:`qkv.engine.kernels.threads.default_threads`; BLAS is held to one thread meanwhile
(``threadpoolctl``), and without a way to hold it one native thread runs.

Examples
--------
>>> import numpy as np
>>> from qkv.validate import make_plan
>>> plan = make_plan(np.eye(4), np.eye(4), np.arange(8.0).reshape(4, 2), causal=True)
>>> if available()[0]:
...     out, lse = attend(plan)
... else:  # not built here: the NumPy kernel gives the same numbers
...     from qkv.engine.kernels import tiled
...     out, lse = tiled.attend(plan)
>>> out[0].tolist()
[0.0, 1.0]
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

import numpy as np

from ...validate import Plan
from .env import setting
from .native_lib import (
    ENV,
    ISA_ENV,
    ISAS,
    PREFILL_NOT_FINITE,
    BackwardArgs,
    Kept,
    PrefillArgs,
    VarlenArgs,
    address,
    amx_tiles,
    backward_operands,
    bf16_isa,
    bf16_products,
    blas_available,
    call_at,
    checked,
    gemm,
    invoke,
    isa_cap,
    kept_for_q,
    library,
    library_path,
    mask_operand,
    output_rows,
    prefill_operands,
    rows_view,
    running_isa,
    switched_off,
)
from .threads import prefill_team, rescan_blas, single_threaded_blas, workers

__all__ = [
    "BLOCK_K",
    "BLOCK_Q",
    "ISAS",
    "attend",
    "attend_packed",
    "attend_stored",
    "attend_stored_own",
    "available",
    "backward",
    "info",
    "keep",
]

# Query rows per work item and keys per score tile. Measured on 2 cores (AVX-512, OpenBLAS),
# causal B1 H8 N4096 d64 float32: 512 × 768 ran about 5% faster than 256 × 512 (fewer, larger
# BLAS calls; the products over keys a row does not see stay in the 64-key edge pieces), and
# the varlen batch of bench/varlen.py about 20% faster.
BLOCK_Q = 512
BLOCK_K = 768
# Who computes the prefill's tile products (qkv_prefill_args.products): BLAS, or the library's
# own micro-kernel (native_src/tiles.h)
PRODUCTS = {"blas": 0, "own": 1}
BWD_BLOCK_Q = 128  # the backward's tiles (it holds two of them: weights and their gradient)
BWD_BLOCK_K = 128
_ISA_NAMES = {v: k for k, v in ISAS.items()}


@functools.cache
def _gemm() -> tuple[dict[np.dtype, int] | None, str]:
    """:func:`~qkv.engine.kernels.native_lib.gemm`, and once found, the BLAS thread limit
    made to cover SciPy's own BLAS library too."""
    found = gemm()
    if found[0] is not None:
        rescan_blas()
    return found


def _blas() -> dict[np.dtype, int]:
    """The gemm pointers, raising when the native kernels cannot run (the router checked
    :func:`~qkv.engine.kernels.native_lib.blas_available`)."""
    gemm, why = _gemm()
    if gemm is None or library()[0] is None:
        raise RuntimeError(f"qkv native kernels unavailable: {why or library()[1]}")
    return gemm


_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}


def available() -> tuple[bool, str]:
    """``(True, "")`` when the native kernels run, else ``(False, why not)``."""
    return blas_available()


def info() -> dict[str, Any]:
    """Which native kernels are active and why (or why not).

    Examples
    --------
    >>> sorted(info())
    ['active', 'isa', 'kernels', 'library', 'products', 'reason']
    """
    ok, why = available()
    lib, _ = library()
    path = library_path()
    decode_ok = lib is not None and not switched_off()
    bf16, amx = bf16_products()[0], amx_tiles()[0]
    isa = None if lib is None else _ISA_NAMES.get(running_isa())
    return {
        "active": ok,
        "reason": why or f"built; {ENV} is not 0; SciPy's BLAS found",
        "library": None if path is None else path.name,
        "isa": isa,  # the vector clone that runs (capped by QKV_NATIVE_ISA)
        "products": {
            "prefill": "the library's own register-blocked tile products on float32/float64 "
            "tiles, in the clone that runs (no BLAS call per tile)",
            "varlen, backward": "BLAS sgemm/dgemm (SciPy's) on float32/float64 tiles",
            "prefill and its backward, bfloat16": (
                "vdpbf16ps (AVX512_BF16): pairs of bfloat16 products summed into float32"
                + (
                    "; the prefill's on AMX tiles (tdpbf16ps) for head sizes of multiples of "
                    "32 (values of 16)"
                    if amx
                    else ""
                )
            )
            if bf16
            else "K/V read as stored and widened to float32 a work item's keys at a time, "
            "then the float32 tile products (no AVX512_BF16 here, or a narrower clone forced)",
            "prefill, its backward and varlen, float16": "K/V read as stored and widened to "
            "float32 a work item's keys at a time, then the float32 tile products (no float16 "
            "products on x86 before AVX512_FP16)",
            "decode": "vector FMA in float32/float64; bfloat16, float16, int8 and float8 "
            "e4m3fn K/V widened to float32 in registers (the step is bound by the bytes read)"
            + (
                "; bfloat16 keys, and int8 and float8 e4m3fn codes (converted to bfloat16 "
                "exactly), against queries of bfloat16 values (head size 64 or 128) scored by "
                "vdpbf16ps (AVX512_BF16), bfloat16 keys read as stored"
                if bf16
                else ""
            ),
        },
        "kernels": {
            "prefill forward (float32, float64; causal, window, bool mask, float bias, "
            "grouped heads, sinks)": ok,
            "prefill forward and backward, bfloat16 tile products (causal, window, bool mask, "
            "float bias, grouped heads, sinks)": bf16,
            "prefill forward and backward, packed varlen walk, float16 or bfloat16 K/V read "
            "as stored (the float32 kernels' cases)": ok,
            "prefill backward (FlashAttention-2; the same cases)": ok,
            "packed varlen walk (float32, float64; causal, window, grouped heads)": ok,
            "decode step (float32, float64; K/V also stored as bfloat16, float16, int8, "
            "float8 e4m3fn; grouped heads, a run of keys per sequence; no BLAS needed)": decode_ok,
        },
    }


def _fit_rows(block_q: int, tasks: Any, threads: int) -> int:
    """``block_q``, halved (down to 64 rows) while ``tasks(block_q)`` work items would leave
    some of the ``threads`` idle (two items per thread at least)."""
    while threads > 1 and block_q > 64 and tasks(block_q) < 2 * threads:
        block_q = max(64, block_q // 2)
    return block_q


def _mask_and_rule(
    plan: Plan, threads: int, isa: str | int | None, gemm: int | None, block_q: int, block_k: int
) -> tuple[dict[str, Any], tuple[Any, Any]]:
    """The fields the prefill and the backward share after their operands: the mask or bias
    (:func:`~qkv.engine.kernels.native_lib.mask_operand`), the scale and visibility rule,
    threads, clone, BLAS and tile sizes; and the mask arrays, which the caller holds until the
    call returns (the fields point into them)."""
    masking, masks = mask_operand(plan.mask, plan.bias, plan.batch + (plan.L, plan.S))
    left, right = plan.window if plan.window is not None else (None, None)
    fields: dict[str, Any] = {
        **masking,
        "scale": plan.scale,
        "causal": int(plan.causal),
        "left": -1 if left is None else left,
        "right": -1 if right is None else right,
        "threads": threads,
        "isa": isa_cap(isa),
        "gemm": gemm,
        "block_q": block_q,
        "block_k": block_k,
    }
    return fields, masks


def attend(
    plan: Plan,
    *,
    threads: int | None = None,
    isa: str | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    counts: np.ndarray | None = None,
    products: str = "blas",
    stack: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Fused prefill: output ``(*batch, L, dv)`` and lse ``(*batch, L)``, compute dtype.

    Must equal :func:`qkv.reference.attention` on the same plan.

    Parameters
    ----------
    plan : Plan
        A checked problem the router sends here (:data:`~qkv.engine.kernels.router.FORWARD`:
        "native prefill", or "native prefill, stored K/V" with its float16 or bfloat16 K/V
        read as stored).
    threads : int, optional
        Native worker threads (default: :func:`~qkv.engine.kernels.threads.default_threads`).
    isa : {"baseline", "avx2", "avx512"}, optional
        Run this vector clone (capped at what the CPU supports); default ``QKV_NATIVE_ISA``,
        else the widest.
    block_q, block_k : int, optional
        Query rows per work item and keys per score tile.
    counts : ndarray, optional
        Keys per index of the first batch axis (a padding mask read as key counts,
        :mod:`~qkv.engine.kernels.key_counts`): row ``b`` attends keys ``[0, counts[b])``
        only, causal and the window still aligned to all ``S`` keys; the plan's mask is not
        read then (the caller passes the plan without it).
    products : {"blas", "own"}, optional
        Who computes the tile products: BLAS ``sgemm``/``dgemm`` (one call per tile), or the
        library's own register-blocked micro-kernel in the chosen vector clone
        (``native_src/tiles.h``; no BLAS needed, no cost per call: the short rows' and small
        heads' choice, :data:`~qkv.engine.kernels.router.OWN_TILES`).
    stack : bool, optional
        Run the query heads of each kv head as one block of rows (a plan with grouped heads and
        no mask or bias: :func:`qkv.engine.kernels.stacked.stacks`); under a causal rule or a
        window, position by position (the g heads' rows of a position side by side).
    """
    own = products == "own"
    gemm = None if own else _blas()[plan.acc_dtype]
    if own and library()[0] is None:
        raise RuntimeError(f"qkv native kernels unavailable: {library()[1]}")
    assert plan.v is not None  # the router asks for values
    if math.prod(plan.batch) == 0:
        shape = plan.batch + (plan.L, plan.dv)
        return np.empty(shape, plan.acc_dtype), np.empty(shape[:-1], plan.acc_dtype)
    function, k, v = _reading(plan, "prefill")
    q, cap = plan.q, isa_cap(isa)
    n, team = prefill_team(threads, own)
    rows_first = plan.rows_first
    key = None
    if counts is None and plan.mask is None and plan.bias is None:  # the struct kept by layout
        key = (
            function, q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, plan.group,
            plan.scale, plan.causal, plan.window, n, cap, gemm, block_q, block_k, own, stack,
            team, rows_first,
        )  # fmt: skip
        found = _PREFILLS.get(key)
        if found is not None:
            return found.run(q, k, v)
    call, operands = _prefill(plan, function, q, k, v, n, cap, gemm, block_q, block_k, counts,
                              own, stack, team, rows_first=rows_first)  # fmt: skip
    in_place = all(address(a) == address(b) for a, b in zip(operands, (q, k, v), strict=True))
    if key is not None and in_place:  # (no copy for BLAS): kept for the next call of this layout
        if len(_PREFILLS) >= 256:
            _PREFILLS.clear()
        _PREFILLS[key] = call
    return call.run(*operands)


def keep(
    plan: Plan, stack: bool = False, counted: bool = False, masked: bool = False,
    q_like: np.ndarray | None = None,
) -> Kept | None:  # fmt: skip
    """A plain call's prefill on the library's own tile products, kept for operands laid out
    as ``plan``'s (no mask or bias; K/V in the compute dtype or stored as float16/bfloat16):
    a function of ``(q, k, v)`` of those shapes and dtypes giving ``(out, None)``
    (the log-sum-exp is not written: its callers read the output;
    :class:`~qkv.engine.kernels.native_lib.Kept`), or None for operands of other strides, when
    another clone (``QKV_NATIVE_ISA``) or another thread team is in force, or when an output
    is not finite (the caller then takes the general road). With ``counted``, a function of
    ``(q, k, v, counts)``: ``counts`` the keys of each index of the first batch axis, as
    :func:`attend` takes them (a padding mask read as key counts).

    With ``masked``, for a plan with a boolean mask or a float bias (one of them, no key
    counts): a function of ``(q, k, v, mask)``, ``mask`` each call's own, an array of the
    layout of ``plan``'s (its shape, dtype and strides: the struct's per-head offsets were
    worked out from them), put in by the library (``qkv_prefill_mask_at``); None where the
    mask is not read in place (a copy of it was made). A masked small call had spent most of
    its time checking and setting up: B1 H8 L = S = 16 d64 with a bias, about 100 us a call.

    ``q_like``: for float16/bfloat16 operands (the kernel widens q and narrows the output),
    the caller's q, whose layout the struct is kept for where it reads it in place (a
    transposed view, as a model or ``layout="blhd"`` gives it, is then not copied at every
    call); else the layout of a contiguous q.

    :func:`qkv.engine.run.plain` keeps one per shapes (and mask layout): the call then only
    puts its addresses into the kept struct (:class:`Prefill`), where :func:`attend` looks the
    struct up by a key of every field, or builds it afresh for key counts or a mask.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.validate import make_plan
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 16, 8)).astype(np.float32) for _ in range(3))
    >>> bias = rng.standard_normal((1, 2, 16, 16)).astype(np.float32)
    >>> plan = make_plan(q, k, v, mask=bias)
    >>> kept = keep(plan, masked=True)
    >>> kept is None or bool((kept(q, k, v, bias)[0] == attend(plan, products="own")[0]).all())
    True
    """
    m = plan.mask if plan.mask is not None else plan.bias
    if (m is not None) != masked or (plan.mask is not None and plan.bias is not None):
        return None
    if library()[0] is None or (masked and (counted or plan.key_counts is not None)):
        return None
    if math.prod(plan.batch) == 0:
        return None
    k, v = _reading(plan, "prefill")[1:]
    if plan.stored is None or not np.dtype(plan.out_dtype) == k.dtype == v.dtype:  # (q widened)
        return _keep(plan, stack, counted, masked)
    return kept_for_q(
        lambda q: _keep(plan, stack, counted, masked, q), q_like, plan.q.shape, k.dtype
    )


def _keep(
    plan: Plan, stack: bool, counted: bool, masked: bool, q_as: np.ndarray | None = None
) -> Kept | None:
    """:func:`keep` (checked there) for a 16-bit q laid out as ``q_as`` (default:
    contiguous)."""
    m = plan.mask if plan.mask is not None else plan.bias
    rows = plan.batch[0] if plan.batch else 1
    function, k, v = _reading(plan, "prefill")
    q, clone = plan.q, setting(ISA_ENV)
    io = plan.stored is not None and np.dtype(plan.out_dtype) == k.dtype == v.dtype
    if io:  # q in K/V's 16-bit dtype, and the output: the kernel widens and narrows them
        function = f"qkv_prefill_f32_{_STORED[k.dtype.name]}io"
        q = np.empty(q.shape, k.dtype) if q_as is None else q_as  # (the caller's layout)
    n, team = prefill_team(None, True)
    counts = np.zeros(rows, np.int64) if counted else None
    call, operands = _prefill(plan, function, q, k, v, n, isa_cap(), None, BLOCK_Q, BLOCK_K,
                              counts, True, stack, team, k.dtype if io else None,
                              rows_first=plan.rows_first)  # fmt: skip
    if not all(address(a) == address(b) for a, b in zip(operands, (q, k, v), strict=True)):
        return None
    pointed = call.held  # (the arrays the struct points into, kept alive with it)
    if masked:  # the mask read in place (not a copy), each call's put in instead of this one's
        held = call.held[1][0]
        if held is None or m is None or address(held) != address(m):
            return None
        pointed = (call.held[0], call.held[1][1], call.held[2], call.held[3])
    args = PrefillArgs.from_buffer_copy(call.args)
    heads = args.nb // rows  # (the struct's heads per row)
    # (lse NULL: not written, its callers read the output)
    at, kept = call_at(call.call, args, masked=masked)
    rows_shape, shape, out_dtype, memory = call.rows, call.shape, call.out_dtype, call.memory

    def run(q: int, k: int, v: int, extra: Any) -> Any:
        if prefill_team(None, True) != (n, team):
            return None
        out = np.empty(rows_shape if memory is None else memory, out_dtype)
        if masked:
            status = at(q, k, v, address(out), address(extra))
        elif extra is None:
            status = at(q, k, v, address(out), None)
        else:
            per_head = np.repeat(extra.astype(np.int64, copy=False), heads)
            status = at(q, k, v, address(out), address(per_head))
        assert pointed is not None
        if status and checked(status, kept, "prefill", (PREFILL_NOT_FINITE,)):
            return None
        if memory is not None:  # (written rows first: its (*batch, L, dv) view)
            return rows_view(out, True), None
        return out.reshape(shape), None

    return Kept(run, (q, k, v), clone, io)


class Prefill:
    """One prefill call's argument struct with every field but the addresses of ``q``, ``k``,
    ``v``, ``out`` and ``lse`` filled, the arrays its fields point into (offsets, mask, key
    counts), and the library's function: :meth:`run` copies the struct, allocates the results,
    sets those addresses and calls the kernel. :func:`attend` keeps one per operand layout
    (shapes, strides, dtypes, scale, rule, threads, clone) of a call without a mask or key
    counts: a small call (a short prompt's layer) spent as long building the struct as in the
    kernel. ``dtype`` is the output's and lse's, ``narrow`` (the 16-bit ``io`` kernels'
    operand dtype) the output's where it differs; ``memory`` the shape the output is allocated
    in where the struct writes it rows first (:func:`~.native_lib.output_rows`)."""

    __slots__ = ("args", "function", "held", "own", "shape", "dtype", "out_dtype", "rows", "call",
                 "memory")  # fmt: skip

    def __init__(
        self, args: PrefillArgs, function: str, held: tuple[Any, ...], own: bool,
        shape: tuple[int, ...], rows: tuple[int, ...], dtype: np.dtype,
        narrow: np.dtype | None = None, memory: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        self.args, self.function, self.held, self.own = bytes(args), function, held, own
        self.shape, self.rows, self.dtype = shape, rows, dtype
        self.out_dtype = dtype if narrow is None else narrow
        self.call = getattr(library()[0], function)
        self.memory = memory  # the output's, rows first (output_rows); None: rows'

    def run(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(out, lse)`` for operands of the layout this struct was built for."""
        out, lse, _ = self.launch(address(q), address(k), address(v))
        assert lse is not None  # (asked for)
        return out, lse

    def launch(
        self, q: int, k: int, v: int, counts: np.ndarray | None = None, lse: bool = True
    ) -> tuple[np.ndarray, np.ndarray | None, bool]:
        """:meth:`run` on the operands' addresses, and whether every output is finite (the
        kernel checks); ``counts`` (int64, one per head of the struct, contiguous), for a
        struct built with key counts, replaces those it was built with. Without ``lse`` the
        log-sum-exp is not written (None in its place: a caller that reads the output alone).
        """
        memory = self.memory
        out = np.empty(self.rows if memory is None else memory, self.out_dtype)
        args = PrefillArgs.from_buffer_copy(self.args)  # one per call: any thread may run it
        args.q, args.k, args.v = q, k, v
        args.out = address(out)
        sums = None
        if lse:
            sums = np.empty(self.rows[:-1], dtype=self.dtype)
            args.lse = address(sums)
        if counts is not None:
            args.counts = address(counts)
        if self.own:  # (no BLAS to hold to one thread)
            status = self.call(ctypes.byref(args))
        else:
            with single_threaded_blas():
                status = self.call(ctypes.byref(args))
        finite = checked(status, args, "prefill", (PREFILL_NOT_FINITE,)) == 0
        shape = self.shape
        if memory is not None:  # (*batch, L, dv) as a view of its (*batch[:-1], L, heads, dv)
            out = rows_view(out, True)
        return out.reshape(shape), None if sums is None else sums.reshape(shape[:-1]), finite


# attend()'s structs by operand layout (see Prefill)
_PREFILLS: dict[tuple[Any, ...], Prefill] = {}


def _prefill(
    plan: Plan, function: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, n: int, cap: int,
    gemm: int | None, block_q: int, block_k: int, counts: np.ndarray | None, own: bool,
    stack: bool, team: int | None = None, narrow: np.dtype | None = None,
    pages: dict[str, Any] | None = None, rows_first: bool = False,
) -> tuple[Prefill, tuple[np.ndarray, np.ndarray, np.ndarray]]:  # fmt: skip
    """:func:`attend`'s struct for ``plan`` and its operands ``q``, ``k``, ``v`` (read in place
    where BLAS can: the operands the struct's offsets were worked out for are returned);
    ``narrow`` the output's dtype for the 16-bit ``io`` kernels; ``pages`` the struct's page
    fields (:func:`attend_prefix_pages`); ``rows_first`` the output written as
    ``(*batch[:-1], L, heads, dv)`` (:func:`~qkv.engine.kernels.native_lib.output_rows`;
    not for stacked heads, whose rows the struct takes as one head's: they are laid out
    afterwards by the caller)."""
    dt = plan.acc_dtype
    batch, L, dv, group = plan.batch, plan.L, plan.dv, plan.group
    shape = batch + (L, dv)
    per_pos = 1
    if stack and group > 1:  # the g query heads of a kv head: one (g · L)-row block
        batch, L = (*batch[:-1], batch[-1] // group), group * L
        q, group = q.reshape(batch + (L, plan.d)), 1
        if plan.causal or plan.window is not None:  # the rule's: the kernel takes the rows
            per_pos = plan.group  # position by position, the g heads' rows side by side
    nb = math.prod(batch)
    fields, arrays = prefill_operands(q, k, v, group)
    block_q = _fit_rows(block_q, lambda bq: nb * -(-L // bq), n)
    rule, masks = _mask_and_rule(plan, n, cap, gemm, block_q, block_k)
    per_head = None
    if counts is not None:  # one per head: each batch row's count over its other batch axes
        per_head = np.ascontiguousarray(np.repeat(counts, nb // counts.size), dtype=np.int64)
        rule["counts"] = address(per_head)
    rule["products"] = PRODUCTS["own" if own else "blas"]
    rule["parallel"] = team
    # (a stack's rows not position by position: not laid out rows first)
    flat_stack = L != plan.L and per_pos == 1
    memory, out_fields, out_at = output_rows(batch, L, dv, rows_first and not flat_stack, per_pos)
    args = PrefillArgs(nb=nb, L=L, S=plan.S, d=plan.d, dv=dv, **fields, **rule, **(pages or {}),
                       per_pos=per_pos, **out_fields)  # fmt: skip
    call = Prefill(args, function, (arrays[3:], masks, per_head, out_at), own, shape,
                   batch + (L, dv), dt, narrow, None if out_at is None else memory)  # fmt: skip
    return call, arrays[:3]  # type: ignore[return-value]


_STORED = {"float16": "f16", "bfloat16": "bf16"}  # K/V forms the float32 kernels read as stored


def attend_prefix_pages(
    plan: Plan, k_pages: np.ndarray, v_pages: np.ndarray, ids: np.ndarray, products: str,
    stored: str | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:  # fmt: skip
    """:func:`attend` on a plan whose keys and values ``(kv_heads, P, ·)`` are the first ``P``
    rows of pages ``ids`` of a paged pool ``(num_blocks, page_size, kv_heads, ·)``, read there
    in place (a shared prefix, :mod:`qkv.engine.cascade`): each piece of keys is gathered into
    the worker's kept rows as its products need it, with no copy of the prefix made first. The
    pool holds
    the compute dtype, or (``stored``) float16 or bfloat16 values in 16-bit elements, read as
    stored (widened as gathered). ``plan``'s K/V are stand-ins of those shapes in the compute
    dtype (nothing read); no mask, bias or key counts; ``products`` as for :func:`attend`.
    ``(out, lse)`` in the compute dtype, bits equal to :func:`attend` on the gathered prefix;
    None for pools it does not read (another dtype) or when some output is not finite (the
    caller's general road applies its rules).
    """
    dt = plan.acc_dtype
    if plan.mask is not None or plan.bias is not None:
        return None
    if stored is None and k_pages.dtype != dt or v_pages.dtype != k_pages.dtype:
        return None
    if stored is not None and (stored not in _STORED or dt != np.float32 or k_pages.itemsize != 2):
        return None
    form = _SUFFIX[dt] if stored is None else f"f32_{_STORED[stored]}kv"
    function = f"qkv_prefill_{form}"
    own = products == "own"
    gemm = None if own else _blas()[dt]
    # page 0's rows as (kv_heads, page_size, ·): each head's offset in a page row, and the row
    # stride; the page fields give the rest
    k0, v0 = np.moveaxis(k_pages[0], 1, 0), np.moveaxis(v_pages[0], 1, 0)
    held = np.ascontiguousarray(ids, dtype=np.int32)
    page_fields = {
        "pages": address(held),
        "page_size": k_pages.shape[1],
        "k_ps": k_pages.strides[0] // k_pages.itemsize,
        "v_ps": v_pages.strides[0] // v_pages.itemsize,
    }
    n, team = prefill_team(None, own)
    call, operands = _prefill(plan, function, plan.q, k0, v0, n, isa_cap(None), gemm, BLOCK_Q,
                              BLOCK_K, None, own, False, team, None, page_fields)  # fmt: skip
    if address(operands[1]) != address(k_pages) or address(operands[2]) != address(v_pages):
        return None  # (a pool whose rows the struct cannot address in place)
    q = operands[0]
    out, lse, finite = call.launch(address(q), address(k_pages), address(v_pages))
    del held
    assert lse is not None  # (asked for)
    return (out, lse) if finite else None


def _reading(plan: Plan, family: str) -> tuple[str, np.ndarray, np.ndarray]:
    """The library function of ``family`` (``"prefill"``, ``"backward"``) for ``plan`` and
    the K and V it reads: stored float16/bfloat16 ones as given (each work item widens what it
    reads), else the plan's own in the compute dtype."""
    if plan.stored is None:
        assert plan.v is not None  # the router asks for values
        return f"qkv_{family}_{_SUFFIX[plan.acc_dtype]}", plan.k, plan.v
    k, v = plan.stored_kv()
    return f"qkv_{family}_f32_{_STORED[k.dtype.name]}kv", k, v


def attend_stored(
    plan: Plan,
    *,
    threads: int | None = None,
    isa: str | None = None,
    counts: np.ndarray | None = None,
    products: str = "blas",
    stack: bool = False,
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`attend` on a plan whose float16 or bfloat16 K/V are read as stored (the router's
    "native prefill, stored K/V"): float32 output and lse;
    ``None`` when some output is not finite (the caller's general path applies its rules, on
    the widened K/V). ``counts``, ``products`` and ``stack`` as for :func:`attend`."""
    with np.errstate(over="ignore", invalid="ignore"):
        out, lse = attend(plan, threads=threads, isa=isa, counts=counts, products=products,
                          stack=stack)  # fmt: skip
    return (out, lse) if np.isfinite(out).all() else None


def attend_stored_own(
    plan: Plan, counts: np.ndarray | None = None, stack: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`attend_stored` on the library's own tile products (the router's "native
    prefill, own tiles, stored K/V")."""
    return attend_stored(plan, counts=counts, products="own", stack=stack)


def backward(
    plan: Plan,
    d_out: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    *,
    threads: int | None = None,
    isa: str | None = None,
    block_q: int = BWD_BLOCK_Q,
    block_k: int = BWD_BLOCK_K,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashAttention-2 backward: ``(dq, dk, dv)`` in the plan's shapes of q, k and v.

    Must equal :func:`qkv.engine.grad.reference_attention_vjp` (as
    :func:`qkv.engine.kernels.tiled_backward.backward`, whose recurrence it runs). ``d_out`` and
    ``out`` are ``(*batch, L, dv)``, ``lse`` is ``(*batch, L)``, all in the compute dtype; the
    weights are recomputed tile by tile from ``lse``. Work items are (kv head, key block)
    pairs; a query head's ``dq`` rows are added under a lock per query block.
    """
    gemm = _blas()
    assert plan.v is not None  # the router asks for values
    dt = plan.acc_dtype
    batch, L, S, d, dv = plan.batch, plan.L, plan.S, plan.d, plan.dv
    dq = np.zeros(plan.q.shape, dtype=dt)
    dk = np.zeros(plan.k.shape, dtype=dt)
    dvv = np.zeros(plan.v.shape, dtype=dt)
    nq = int(np.prod(batch, dtype=np.int64))
    if nq == 0 or min(L, S, dv) == 0:
        return dq, dk, dvv
    function, k, v = _reading(plan, "backward")
    fields, arrays = backward_operands(plan.q, k, v, (d_out, out, lse), dt, dt)
    rule, held = _mask_and_rule(plan, workers(threads, blas=True), isa, gemm[dt], block_q, block_k)
    args = BackwardArgs(
        group=nq // int(np.prod(plan.k.shape[:-2])), L=L, S=S, d=d, dv=dv, **fields,
        dq=address(dq), dk=address(dk), dvo=address(dvv), **rule,
    )  # fmt: skip
    with single_threaded_blas():
        invoke(function, args, "backward")
    del held, arrays  # what the call read
    return dq, dk, dvv


def _packed_operand(a: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``a (tokens, heads, ·)`` in ``dt`` as BLAS reads it: the last axis contiguous, token
    and head strides whole numbers of elements, the token stride at least a row and below
    2**31 elements (a copy where not)."""
    if a.dtype != dt:
        a = a.astype(dt)
    item = a.itemsize
    ok = (
        (a.strides[2] == item or a.shape[2] <= 1)
        and all(s >= 0 and s % item == 0 for s in a.strides[:2])
        and (a.shape[0] <= 1 or a.shape[2] * item <= a.strides[0] < item << 31)
    )
    return a if ok else np.ascontiguousarray(a)


def _stride(a: np.ndarray, axis: int, default: int) -> int:
    return a.strides[axis] // a.itemsize if a.shape[axis] > 1 else default


def attend_packed(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cq: np.ndarray,
    ck: np.ndarray,
    *,
    scale: float,
    causal: bool = False,
    window: Any = None,
    dtype: Any = None,
    seqs: np.ndarray | None = None,
    bad: set[int] | None = None,
    threads: int | None = None,
    isa: str | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    bf16: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The packed varlen walk in C++: :func:`qkv.engine.kernels.packed.attend`'s contract.

    Output ``(total_q, heads, dv)`` and lse ``(total_q, heads)`` in ``dtype`` (float32 or
    float64, the router's "native packed walk"; default that of the inputs, float16 computed in
    float32); each sequence equals :func:`qkv.reference.attention` on it alone. Work items
    are (sequence, query head, block of ``block_q`` queries), costliest first, on native
    threads, each the fused prefill's recurrence read straight from the packed arrays. No
    argument checks (as the NumPy walk). ``seqs``: the sequences to compute (default all;
    the rows of the others stay 0 and ``-inf``); ``bad``, if given, receives the sequences
    with a non-finite output, for the caller to redo. ``bf16``: bfloat16 ``q``, ``k``, ``v``
    read in place by the bfloat16 tile products (the router's "native bfloat16 packed walk").

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 7, 2, 4))       # 7 tokens, 2 heads, d = 4
    >>> cu = np.array([0, 3, 7])
    >>> if available()[0]:
    ...     out, lse = attend_packed(q, k, v, cu, cu, scale=0.5, causal=True)
    ... else:  # not built here: the NumPy walk gives the same numbers
    ...     from qkv.engine.kernels import packed
    ...     out, lse = packed.attend(q, k, v, cu, cu, scale=0.5, causal=True)
    >>> one = reference.attention(*(x[3:].transpose(1, 0, 2) for x in (q, k, v)), causal=True)
    >>> bool(np.allclose(out[3:], one.transpose(1, 0, 2)))
    True
    """
    gemm = _blas()
    dt = np.dtype(np.result_type(np.float32, q, k, v) if dtype is None else dtype)
    dt = np.dtype(np.float32) if bf16 else dt
    heads, kv_heads, dv = q.shape[1], k.shape[1], v.shape[2]
    out = np.zeros((q.shape[0], heads, dv), dtype=v.dtype if bf16 else dt)  # bfloat16: bfloat16
    lse = np.full((q.shape[0], heads), -np.inf, dtype=dt)
    cq = np.ascontiguousarray(cq, dtype=np.int64)
    ck = np.ascontiguousarray(ck, dtype=np.int64)
    chosen = np.arange(cq.size - 1) if seqs is None else np.asarray(seqs)
    chosen = np.ascontiguousarray(chosen, dtype=np.int64)
    if chosen.size == 0 or heads == 0 or dv == 0 or q.shape[0] == 0 or k.shape[0] == 0:
        return out, lse
    # float16 (or bfloat16 the tile products do not take) K/V computed in float32 are read as
    # stored, each work item widening the keys it sees; q is widened here
    stored = _STORED.get(k.dtype.name) if not bf16 and dt == np.float32 else None
    if stored is not None and v.dtype != k.dtype:
        stored = None
    q = _packed_operand(q, q.dtype if bf16 else dt)
    k, v = (_packed_operand(x, x.dtype if bf16 or stored else dt) for x in (k, v))
    left, right = window if window is not None else (None, None)
    # (on PyTorch's OpenMP team where there is one: a continuous-batching step's packed walk
    # on threads of the library's own, right after PyTorch's operations, shared the cores
    # with that team's spinning threads)
    n_workers, team = prefill_team(threads, bf16)
    lq = np.diff(cq)[chosen]
    lq = lq[lq > 0]
    block_q = _fit_rows(block_q, lambda bq: kv_heads * int(np.sum(-(-lq // bq))), n_workers)
    flags = np.zeros(cq.size - 1, dtype=np.uint8)  # set per sequence with a non-finite output
    args = VarlenArgs(
        nseq=chosen.size,
        heads=heads,
        group=heads // kv_heads,
        d=q.shape[2],
        dv=dv,
        q=address(q),
        q_ts=_stride(q, 0, heads * q.shape[2]),
        q_hs=_stride(q, 1, q.shape[2]),
        k=address(k),
        k_ts=_stride(k, 0, kv_heads * k.shape[2]),
        k_hs=_stride(k, 1, k.shape[2]),
        v=address(v),
        v_ts=_stride(v, 0, kv_heads * dv),
        v_hs=_stride(v, 1, dv),
        cq=address(cq),
        ck=address(ck),
        seqs=address(chosen),
        out=address(out),
        lse=address(lse),
        bad=address(flags),
        scale=scale,
        causal=int(causal),
        left=-1 if left is None else left,
        right=-1 if right is None else right,
        threads=n_workers,
        isa=bf16_isa() if bf16 else isa_cap(isa),
        gemm=gemm[dt],
        block_q=block_q,
        block_k=block_k,
        parallel=team,
    )
    with single_threaded_blas():
        suffix = "bf16" if bf16 else f"f32_{stored}kv" if stored else _SUFFIX[dt]
        invoke(f"qkv_varlen_{suffix}", args, "varlen")
    if bad is not None:
        bad.update(np.flatnonzero(flags).tolist())
    return out, lse

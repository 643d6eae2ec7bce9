"""Native decode: a model's decoding step in one C++ call.

Must equal :func:`qkv.reference.attention`. A decoding step is a few query rows per kv head
(``group · L``, usually ``L = 1``) against a long run of cached keys: memory-bound, so the C++
kernel (``qkv_decode_*`` in ``native_src/decode.cpp``) streams each kv head's keys and values
once, in pieces split over the threads, takes the rows' dot products while a key row is in
L1 and keeps the online softmax of the prefill kernel; the pieces are merged at the end as
:func:`qkv.merge` merges parts. It reads K and V where they are (any strides with a contiguous
last axis: a cache's buffers, a view of a prefix of them), so nothing is copied.

What it serves: float32/float64 plans with nothing restricting the keys but, for one query
(``L == 1``), a causal flag (the last query sees every key) or a boolean mask that leaves each
sequence one run of keys, the same for every head (a padded batch's real tokens): each
sequence then reads only its own run. Of the score variants it applies soft-capping (Gemma 2),
``c · tanh(s / c)`` on the scaled scores; sinks are added to the result by the dispatcher.

A step is planned once and run per layer (:class:`DecodePlan`, FlashInfer's plan/run pair as
the model): the plan checks the sizes, grouping, scale and soft-cap and holds which keys each
sequence sees (runs found by :func:`qkv.engine.kernels.decode.key_runs`, or a boolean mask row
per sequence that the C step reads as its run); :func:`step` and the transformers backend's
decoding steps run through it.

Threads: between PyTorch's operations (a model's attention layer), the work runs on the team
of PyTorch's own OpenMP runtime, whose threads have just finished PyTorch's operation and take
it at once; a second team of threads would compete with them for the cores. The runtime's
``GOMP_parallel`` is found among the libraries the process has loaded (the one in PyTorch's
package when PyTorch is imported). Without one, or in a forked child (an OpenMP team does not
survive a fork), the library's own kept threads run it (``native_src/pool.h``: started once,
they watch for work for 300 µs after each call, then sleep); a call that finds them busy with
another Python thread's call starts threads of its own.

Examples
--------
>>> import numpy as np
>>> from qkv import reference
>>> from qkv.validate import make_plan
>>> rng = np.random.default_rng(0)
>>> q = rng.standard_normal((2, 8, 1, 16))         # batch 2, 8 query heads, one token
>>> k, v = rng.standard_normal((2, 2, 2, 300, 16))  # 2 kv heads, 300 cached tokens
>>> plan = make_plan(q, k, v)
>>> if available():
...     out, lse = attend(plan)
...     assert np.allclose(out, reference.attention(q, k, v))
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ... import numerics
from ...validate import Plan, view_as
from ..quant import SCALED, storage_dtype
from . import router
from .decode import KeyRuns, plan_runs
from .env import setting
from .native_lib import (
    ISA_ENV,
    KV_FORMATS,
    DecodeArgs,
    Kept,
    address,
    call_at,
    checked,
    invoke,
    isa_cap,
    library,
    switched_off,
)
from .threads import openmp_parallel, workers

__all__ = [
    "DecodePlan",
    "Operand",
    "Prepared",
    "Template",
    "attend",
    "attend_finite",
    "attend_stored",
    "available",
    "keep",
    "launch",
    "layout",
    "openmp_parallel",
    "paged_step",
    "prepare",
    "step",
    "template",
]

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_F32, _F64 = _DTYPES
#: The suffix of the library's decode step on 16-bit q and out, per stored form.
_STORED_NAMES = {"bfloat16": "bf16", "float16": "f16"}
#: :func:`_constants`' answer: the struct's bytes, the function, out's and lse's shapes,
#: whether the step is small, lse's dtype and out's.
Constants = tuple[bytes, Any, tuple[int, ...], tuple[int, ...], bool, np.dtype, np.dtype]


class EveryHead(NamedTuple):
    """:func:`_constants`' answer for K/V whose rows interleave the kv heads, which the step
    reads every head at a time (:func:`qkv.engine.kernels.router.every_head`): the clone
    code the call asked for."""

    isa: int


def available() -> bool:
    """Whether the native decode kernel runs here (built, of this layout, not switched off)."""
    return not switched_off() and library()[0] is not None


def layout(shape: Any, strides: Any, outer: int) -> tuple[int, int, int] | None:
    """``(sequence, head, row)`` strides of an operand ``(*outer, heads, rows, last)`` given
    its ``shape`` and ``strides`` in elements, when its last axis is contiguous, no stride is
    negative and its ``outer`` leading axes collapse to one (0 for a single sequence); None
    otherwise.

    >>> layout((2, 4, 10, 8), (320, 80, 8, 1), 1)
    (320, 80, 8)
    >>> layout((2, 3, 4, 10, 8), (960, 320, 80, 8, 1), 2)   # (2, 3) collapse to 6 sequences
    (320, 80, 8)
    >>> layout((2, 4, 10, 8), (320, 80, 1, 10), 1) is None  # the last axis is not contiguous
    True
    """
    if len(shape) != outer + 3 or strides[-1] != 1 or min(strides) < 0:
        return None
    seq = 0
    prev = None
    for n, st in zip(shape[:outer], strides[:outer], strict=True):
        if n == 1:
            continue
        if prev is not None and prev != st * n:
            return None
        prev = seq = st
    return seq, strides[-3], strides[-2]


def format_code(kv_format: str | None, precision: str = "exact") -> int:
    """The kernel's ``kv_format`` code of K/V stored as ``kv_format`` (None: in the compute
    dtype) on the road ``precision`` names: the fast one's code where the form has one
    (:data:`qkv.numerics.FAST_FORMS`), else the exact one's."""
    if not kv_format:
        return numerics.SAME_CODE
    code = KV_FORMATS[kv_format]
    return code | numerics.FAST_CODE if fast_form(kv_format, precision) else code


def fast_form(kv_format: str | None, precision: str) -> bool:
    """Whether ``precision`` takes the fast road for K/V stored as ``kv_format``."""
    return precision == "fast" and kv_format in numerics.FAST_FORMS


def launch(
    f64: bool,
    sizes: tuple[int, int, int, int, int, int, int],
    q: tuple[int, tuple[int, int, int]],
    k: tuple[int, tuple[int, int, int]],
    v: tuple[int, tuple[int, int, int]],
    runs: tuple[int, int] | None,
    out: int,
    lse: int | None,
    scale: float,
    threads: int | None = None,
    isa: int = 0,
    softcap: float | None = None,
    mask: tuple[int, int, int] | None = None,
    kv_format: str | None = None,
    scales: tuple[tuple[int, tuple[int, int, int]], tuple[int, tuple[int, int, int]]] | None = None,
    pages: tuple[int, int, int, int] | None = None,
    precision: str = "exact",
    causal: bool = False,
) -> int:
    """Run the kernel on raw memory: ``sizes = (sequences, kv_heads, group, L, d, dv, S)``;
    ``q``, ``k``, ``v`` each ``(address, (sequence, head, row) strides in elements)``; ``runs``
    the addresses of the int64 ``lo`` and ``hi`` per sequence, or None (every key); ``out``
    (``(sequences, heads, L, dv)``, contiguous) and ``lse`` (or None) the addresses to write;
    ``isa`` caps the vector clone (:data:`qkv.engine.kernels.native_lib.ISAS`; 0:
    ``QKV_NATIVE_ISA``, else the widest);
    ``softcap`` (> 0) soft-caps the scaled scores, ``c · tanh(s / c)``, as qkv's ``softcap``;
    ``mask`` is ``(address, sequence stride, key stride)`` in bytes of a boolean mask row per
    sequence, read (in C) as each sequence's run of keys in place of ``runs``;
    ``kv_format`` names how K and V are stored when not in the compute dtype (a form of
    :mod:`qkv.engine.quant`, computed in float32; their strides in elements of that form), and
    ``scales`` is then, for the 8-bit forms, the ``(address, (sequence, head, row) strides)``
    of the float32 scales of K and of V; ``pages`` reads K/V (and the scales) as pages through
    a block table: ``(address of the int32 table, its row stride, page_size, num_blocks)``,
    ``k``/``v``/``scales`` then given with ``(page, head, row)`` strides and ``S`` the table's
    capacity (its columns times ``page_size``); ``precision="fast"`` takes the fast road
    of int8 K/V (:mod:`qkv.engine.kernels.decode_fast`; the exact road for any other form);
    ``causal`` makes the ``L`` rows of each head causal, bottom-right aligned on each
    sequence's keys ``[lo, hi)``: row ``i`` sees ``[lo, hi − (L − 1) + i)`` (a row that sees
    none: output 0, lse ``−inf``).

    Returns the kernel's status: 0; 3 when an output is not finite, 4 when a mask row is not
    one run of keys (then take the general path). The caller guarantees the memory matches;
    nothing is checked here but the runs of keys, which the kernel refuses (an
    :class:`~qkv.errors.InputError`, nothing read) where one reaches outside ``[0, S)``, and
    the block table's entries those keys need, refused likewise outside the pool.
    """
    team, n = openmp_parallel()
    if threads is not None:
        n = workers(threads)
    lo, hi = (None, None) if runs is None else runs
    (ks, kss), (vs, vss) = scales or ((None, (0, 0, 0)), (None, (0, 0, 0)))
    args = DecodeArgs(
        *sizes, q[0], *q[1], k[0], *k[1], v[0], *v[1], lo, hi, out, lse, scale, n,
        isa or isa_cap(),
        team, softcap or 0.0, *(mask or (None, 0, 0)),
        format_code(kv_format, precision), ks, *kss, vs, *vss,
        *(pages or (None, 0, 0, 0)), int(causal),
    )  # fmt: skip
    return invoke("qkv_decode_f64" if f64 else "qkv_decode_f32", args, "decode", allowed=(3, 4))


def attend(plan: Plan, *, threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode attention on ``plan`` (the router's "native decode"): ``(out, lse)``, compute
    dtype.

    A plan this kernel cannot read as it is (a mask of another shape than one run per
    sequence, strides over the batch that do not collapse) runs on
    :func:`qkv.engine.kernels.decode.attend` instead; so does one whose result is not finite,
    which the dispatcher then repairs or explains as for every kernel.
    """
    assert plan.v is not None  # the router checked it
    if plan.mask is None:
        plain = _attend_plain(plan, threads)
        if plain is not _UNSERVED and plain is not None:
            return plain
    from . import decode

    if plan.mask is None and plain is None:  # not finite: the NumPy kernel's rules
        return decode.attend(plan, threads=threads)
    found: tuple[KeyRuns | None, ...] = ()
    if plan.mask is not None:
        found = (plan_runs(plan),)  # read once, for this kernel and the fallback
    res = _attend(plan, plan.k, plan.v, threads, found)
    return decode.attend(plan, threads=threads, found=found) if res is None else res


_UNSERVED: Any = ()  # what _attend_plain gives for a plan it does not read as it is


def plain(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    softcap: float | None,
    threads: int | None = None,
    *,
    causal: bool = False,
) -> tuple[np.ndarray, np.ndarray] | None:
    """One step of ``q (..., heads, L, d)`` against all of ``k`` and ``v`` (``(...,
    kv_heads, S, ·)``, in the compute dtype or stored as float16/bfloat16; a view of a
    cache's first keys is read in place): ``(out, lse)`` in the compute dtype, arrays of
    their own; None where the kernel cannot read the operands as they are or a result is not
    finite. ``causal``: the ``L`` rows bottom-right causal on the ``S`` keys (:func:`launch`)."""
    found = _plain_step(q, k, v, scale, softcap, threads, causal)
    return None if found is _UNSERVED else found


def attend_finite(
    plan: Plan, *, threads: int | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`attend` for a plan with no mask, when the kernel reads it as it is and its
    result is finite (the kernel checks); else None, and the caller runs :func:`attend` with
    the overflow retries every kernel shares."""
    found = _attend_plain(plan, threads)
    return None if found is _UNSERVED else found


#: K/V bytes below which one thread runs a step: waking a second costs more than it saves.
ONE_THREAD_BYTES = 256 << 10


def _attend_plain(plan: Plan, threads: int | None) -> Any:
    """A plan with no mask in one native call: ``(out, lse)``; None when a result is not
    finite; :data:`_UNSERVED` when the kernel cannot read the operands as they are."""
    assert plan.v is not None
    return _plain_step(plan.q, plan.k, plan.v, plan.scale, plan.softcap, threads)


def _plain_step(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    softcap: float | None,
    threads: int | None,
    causal: bool = False,
) -> Any:
    """One unmasked step of ``q`` against ``k`` and ``v`` (the plan's shapes; K/V in the
    compute dtype or stored as float16/bfloat16), its rows ``causal`` or not (:func:`launch`):
    ``(out, lse)``; None when a result is not finite; :data:`_UNSERVED` when the kernel cannot
    read the operands as they are.

    The small call's road: everything the kernel takes but the five addresses (``q``, ``k``,
    ``v`` and the two results) and the threads follows from the shapes, strides, dtypes,
    scale, soft-cap and clone, so it is worked out once per such key (:func:`_constants`)
    and copied per call.
    """
    key = (
        q.dtype, k.dtype, q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, scale,
        softcap, isa_cap(), causal,
    )  # fmt: skip
    found = _constants(*key)
    if found is None:
        return _UNSERVED
    if isinstance(found, EveryHead):
        done = _every_head_step(q, k, v, scale, softcap, threads, found.isa, causal)
        if done is not None:
            return done
        found = _built(*key)  # (a refusal, or a result not finite: the walk by heads says)
        if found is None:
            return _UNSERVED
    return _run_kept(found, q, k, v, threads)


def _every_head_step(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    softcap: float | None,
    threads: int | None,
    isa: int,
    causal: bool = False,
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_plain_step` for ``(sequences, kv_heads, keys, ·)`` views ``k`` and ``v`` whose
    rows interleave the heads (:class:`EveryHead`), on the paged walk: each sequence's keys
    one page of the views as ``(sequences, keys, kv_heads, ·)`` pages. ``(out, lse)``, or None
    where that walk refuses them or a result is not finite."""
    n, S = k.shape[0], k.shape[2]
    table = np.arange(n, dtype=np.int32)[:, None]
    lo, hi = np.zeros(n, np.int64), np.full(n, S, np.int64)
    pages = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return paged_step(q, *pages, table, lo, hi, scale, threads=threads, isa=isa, softcap=softcap,
                      causal=causal)  # fmt: skip


def _run_kept(
    found: Constants,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    threads: int | None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """One step on :func:`_constants`' ``found`` arguments for operands of their layout:
    ``(out, lse)``, or None when a result is not finite."""
    done = _run_at(found, address(q), address(k), address(v), threads)
    if done is None:
        return None
    assert done[1] is not None  # (asked for)
    return done[0], done[1]


def _run_at(
    found: Constants, q: int, k: int, v: int, threads: int | None, lse: bool = True
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """:func:`_run_kept` on the operands' addresses; without ``lse`` the log-sum-exp is not
    written (None in its place: the kept road's callers read the output alone)."""
    template, function, out_shape, lse_shape, small, dtype, out_dtype = found
    out = np.empty(out_shape, dtype=out_dtype)
    args = DecodeArgs.from_buffer_copy(template)  # one per call: a call may run in any thread
    args.q, args.k, args.v = q, k, v
    args.out = address(out)
    sums = None
    if lse:
        sums = np.empty(lse_shape, dtype=dtype)
        args.lse = address(sums)
    if not small or threads is not None:  # (a small step runs on the calling thread alone)
        team, n = openmp_parallel()
        args.threads, args.parallel = n if threads is None else workers(threads), team
    status = checked(function(ctypes.byref(args)), args, "decode", (3,))
    return None if status else (out, sums)


def keep(plan: Plan, causal: bool = False) -> Kept | None:
    """A plain call's step kept for operands laid out as ``plan``'s (no mask; K/V in the
    compute dtype or stored as float16/bfloat16): a function of ``(q, k, v)`` of those shapes
    and dtypes giving ``(out, lse)``, or None for operands of other strides, when another
    clone is asked for (``QKV_NATIVE_ISA``) or when a result is not finite (the caller then
    takes the general road); None where the kernel cannot read ``plan``'s operands as they
    are. :func:`qkv.engine.run.plain` keeps one per shapes, so that a small call does no
    more than put its addresses into the kept arguments (:func:`_run_kept`). ``causal``: the
    step's rows causal (:func:`launch`; a causal plan of a few rows, every row seeing a key)."""
    if plan.mask is not None or plan.bias is not None:
        return None
    q = plan.q
    k, v = plan.stored_kv() if plan.stored is not None else (plan.k, plan.v)
    assert v is not None  # the router asks for values
    clone = setting(ISA_ENV)
    io = plan.stored is not None and np.dtype(plan.out_dtype) == k.dtype == v.dtype
    if io:  # q in K/V's 16-bit dtype, and the output: the kernel widens and narrows them
        q = np.empty(q.shape, k.dtype)  # (the layout of the q the caller gives: contiguous)
    key = (
        q.dtype, k.dtype, q.shape, q.strides, k.shape, k.strides, v.shape, v.strides,
        plan.scale, plan.softcap, isa_cap(), causal,
    )  # fmt: skip
    found = _constants(*key)
    if found is None or isinstance(found, EveryHead):  # (the latter: every call on the plan)
        return None
    kept = Kept(_kept_step(found), (q, k, v), clone, io)
    kept.grow = _grower(key, kept.like(kept.run))
    return kept


def _grower(key: tuple[Any, ...], model: Kept) -> Callable[[int], Kept | None]:
    """The ``grow`` of a kept step for operands laid out as ``model``'s (``key``: its
    :func:`_constants` key): the step kept for them with another number of keys ``S``, what
    :func:`keep` gives a plan of those shapes, its arguments derived as :func:`_constants`
    derives them on its first call (a call whose operands have other strides, such as a
    cache grown by concatenation, never makes them). ``model`` has no ``grow`` of its own,
    so that no step kept holds itself."""

    def grow(S: int) -> Kept | None:
        ks, vs = key[4], key[6]
        if len(ks) < 3 or len(vs) < 3:
            return None
        other = (*key[:4], (*ks[:-2], S, ks[-1]), key[5], (*vs[:-2], S, vs[-1]), *key[7:])
        step: Callable[..., Any] | None = None

        def run(q: int, k: int, v: int, counts: None) -> Any:
            nonlocal step
            if step is None:
                found = _constants(*other)
                if found is None or isinstance(found, EveryHead):  # (see keep)
                    step = _refused
                else:
                    step = _kept_step(found)
            return step(q, k, v, counts)

        grown = model.like(run)
        grown.grow = _grower(other, model)
        return grown

    return grow


def _refused(*_: Any) -> None:
    """A kept step for operands the kernel cannot read: the general road, every call."""
    return None


def _kept_step(found: Constants) -> Callable[..., Any]:
    """:func:`keep`'s step on :func:`_constants`' ``found`` arguments: ``step(q, k, v,
    counts)`` on the operands' addresses (``counts`` None) giving ``(out, None)``, or None
    when a result is not finite."""
    template, function, out_shape, _, small, _, out_dtype = found
    if not small:  # (a call on the team: its threads are asked for per call)

        def step(q: int, k: int, v: int, counts: None) -> Any:
            return _run_at(found, q, k, v, None, lse=False)

        return step
    # a small step runs on the calling thread: the library fills the kept arguments
    at, kept = call_at(function, DecodeArgs.from_buffer_copy(template))

    def small_step(q: int, k: int, v: int, counts: None) -> Any:
        out = np.empty(out_shape, dtype=out_dtype)
        status = at(q, k, v, address(out))
        if status:
            checked(status, kept, "decode", (3,))
            return None
        return out, None

    return small_step


def _broadcast(shape: tuple[int, ...], strides: tuple[int, ...], want: tuple[int, ...]) -> Any:
    """The strides (in bytes) of an array of ``shape`` and ``strides`` broadcast to ``want``
    (as ``np.broadcast_to`` gives them; the plan checked that it broadcasts).

    >>> _broadcast((1, 4, 8), (128, 32, 4), (3, 2, 4, 8))
    (0, 0, 32, 4)
    """
    lead = len(want) - len(shape)
    return tuple(
        0 if i < lead or (shape[i - lead] == 1 and n != 1) else strides[i - lead]
        for i, n in enumerate(want)
    )


# _constants' results by everything but the number of keys S: (the result, its bytes per key),
# at most _FAMILIES_MAX of them
_FAMILIES: dict[tuple[Any, ...], tuple[Constants, int]] = {}
_FAMILIES_MAX = 256


@functools.lru_cache(maxsize=256)
def _constants(*key: Any) -> Constants | EveryHead | None:
    """:func:`_built` on ``key`` (its arguments, in its order), from the result for the same
    operands with another number of keys where there is one: a decoding loop over a slice of
    its own buffers that grows a key a step asks for a new S every step, with the same strides.
    The number of keys enters the arguments as their field S and the choice of one thread (the
    rest depends on the shapes but S, and on the strides: see :func:`_built`), so the arguments
    are those with S set. :class:`EveryHead` where the step reads K/V every head at a time
    (:func:`_reads_every_head`)."""
    dt, kt, qs, qst, ks, kst, vs, vst, scale, softcap, isa, causal = key
    if _reads_every_head(dt, kt, qs, ks, kst, vs, vst):
        return EveryHead(isa)
    if len(ks) < 3 or len(vs) < 3:
        return _built(*key)
    family = (dt, kt, qs, qst, ks[:-2], ks[-1], kst, vs[:-2], vs[-1], vst, scale, softcap, isa,
              causal)  # fmt: skip
    known = _FAMILIES.get(family)
    S = ks[-2]
    if known is not None:
        (template, function, out_shape, lse_shape, _, dt_, out_dtype), per_key = known
        args = DecodeArgs.from_buffer_copy(template)
        args.S = S
        small = S * per_key < ONE_THREAD_BYTES
        return bytes(args), function, out_shape, lse_shape, small, dt_, out_dtype
    found = _built(*key)
    if found is not None and len(_FAMILIES) < _FAMILIES_MAX:
        n = math.prod(qs[:-3])
        _FAMILIES[family] = (found, n * ks[-3] * (qs[-1] + vs[-1]) * kt.itemsize)
    return found


def _reads_every_head(
    dt: np.dtype,
    kt: np.dtype,
    qs: tuple[int, ...],
    ks: tuple[int, ...],
    kst: tuple[int, ...],
    vs: tuple[int, ...],
    vst: tuple[int, ...],
) -> bool:
    """Whether :func:`_plain_step` runs operands of these shapes, byte strides and dtypes
    (``q`` of ``dt``, K/V of ``kt``) on the paged walk (:func:`_every_head_step`): one batch
    axis, ``q`` in a compute dtype and K/V in it or stored as float16/bfloat16, and where the
    router has K/V read every head at a time (:func:`qkv.engine.kernels.router.every_head`)."""
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4 or dt not in _DTYPES:
        return False
    if _stored_dtype(dt, kt) is None:
        return False
    nbytes = (math.prod(ks) + math.prod(vs)) * kt.itemsize
    return router.every_head(ks[1], kst, vst, nbytes)


def _built(
    dt: np.dtype,
    kt: np.dtype,
    qs: tuple[int, ...],
    qst: tuple[int, ...],
    ks: tuple[int, ...],
    kst: tuple[int, ...],
    vs: tuple[int, ...],
    vst: tuple[int, ...],
    scale: float,
    softcap: float | None,
    isa: int,
    causal: bool = False,
) -> Constants | None:
    """The decode step's arguments for operands of these shapes and byte strides (``q`` of
    compute dtype ``dt``, K/V of ``kt``: the same, or stored as float16/bfloat16 for float32;
    addresses left 0, one thread), the library's function to call, the shapes of ``out`` and
    ``lse``, whether the step is small (below :data:`ONE_THREAD_BYTES`: one thread runs it),
    lse's dtype and out's; None where the kernel cannot read the operands (:func:`layout`).

    ``q`` of a 16-bit dtype ``dt`` with K/V stored in the same one: computed in float32, the
    kernel widening ``q`` and narrowing the output into ``dt`` (lse float32), as a call on
    ``q`` widened gives them narrowed."""
    out_dtype = dt
    if dt == kt and kt.itemsize == 2 and _stored_dtype(_F32, kt):  # (16-bit q and out)
        dt = _F32
    if dt not in _DTYPES or len(qs) < 3:
        return None
    form = _stored_dtype(dt, kt)
    if form is None:
        return None
    *outer, hq, L, d = qs
    kvh, S, dv = ks[-3], ks[-2], vs[-1]
    found = []
    for shape, strides, want, item in (
        (qs, qst, qs, out_dtype.itemsize),
        (ks, kst, (*outer, kvh, S, d), kt.itemsize),
        (vs, vst, (*outer, kvh, S, dv), kt.itemsize),
    ):
        if any(st % item for st in strides):
            return None
        b = _broadcast(shape, strides, want)
        found.append(layout(want, [st // item for st in b], len(outer)))
    ql, kl, vl = found
    n = math.prod(outer)
    plan = DecodePlan.plan((n, hq, kvh, L, d, dv, S), f64=dt == _F64, scale=scale, softcap=softcap)
    lib = library()[0]
    if ql is None or kl is None or vl is None or plan is None or lib is None:
        return None
    args = DecodeArgs(
        *plan.sizes, None, *ql, None, *kl, None, *vl, None, None, None, None, plan.scale,
        1, isa, None, plan.softcap or 0.0, None, 0, 0, format_code(form or None),
    )  # fmt: skip
    args.causal = int(causal)
    function = lib.qkv_decode_f64 if plan.f64 else lib.qkv_decode_f32
    if out_dtype != dt:
        function = getattr(lib, f"qkv_decode_f32_{_STORED_NAMES[form]}io")
    small = n * kvh * S * (d + dv) * kt.itemsize < ONE_THREAD_BYTES
    return bytes(args), function, (*outer, hq, L, dv), (*outer, hq, L), small, dt, out_dtype


def _stored_dtype(dt: np.dtype, kt: np.dtype) -> str | None:
    """How K/V of dtype ``kt`` are stored for compute dtype ``dt``: ``""`` (in ``dt``),
    ``"float16"`` or ``"bfloat16"`` (for float32), or None when the kernel cannot read them."""
    if kt == dt:
        return ""
    if dt == _F32 and kt == np.float16:
        return "float16"
    if dt == _F32 and kt.name == "bfloat16":  # ml_dtypes' NumPy bfloat16
        return "bfloat16"
    return None


def attend_stored(
    plan: Plan, *, threads: int | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`attend` on a plan's stored float16/bfloat16 K/V (:attr:`Plan.stored`), read in
    place: ``(out, lse)`` in float32, or None where the kernel does not serve it (the caller
    then widens them, :meth:`Plan.materialized`, and takes the general path).
    """
    assert plan.stored is not None
    if plan.mask is None:  # the small call's road, as for K/V in the compute dtype
        k, v = plan.stored_kv()
        done = _plain_step(plan.q, k, v, plan.scale, plan.softcap, threads)
        if done is not _UNSERVED:
            return done
    found = () if plan.mask is None else (plan_runs(plan),)
    return _attend(plan, *plan.stored, threads, found)


def _attend(
    plan: Plan,
    k: np.ndarray,
    v: np.ndarray,
    threads: int | None,
    found: tuple[KeyRuns | None, ...],
) -> tuple[np.ndarray, np.ndarray] | None:
    """One step of ``plan``'s queries against ``k`` and ``v`` (broadcast to the plan's K/V
    shapes), each sequence its run of keys ``found`` in the plan's mask (``(runs,)``, from
    :func:`qkv.engine.kernels.decode.plan_runs`; ``()`` without a mask); None where not
    served."""
    lo = hi = None
    if found:
        (runs,) = found
        if runs is None:
            return None
        lo, hi = runs
    outer, kvh = plan.batch[:-1], plan.k.shape[-3]
    k = view_as(k, (*outer, kvh, plan.S, plan.d))
    v = view_as(v, (*outer, kvh, plan.S, plan.dv))
    return step(plan.q, k, v, plan.scale, lo, hi, threads=threads, softcap=plan.softcap)


Operand = tuple[int, tuple[int, int, int]]  # (address, (sequence, head, row) strides)


def _positive(x: Any) -> bool:
    """Whether ``x`` is a real number (not a bool) in ``(0, inf)``: a scale or a soft-cap."""
    ok = isinstance(x, int | float | np.floating) and not isinstance(x, bool)
    return ok and 0 < x < math.inf


@dataclass(frozen=True)
class DecodePlan:
    """A decoding step planned once and run per layer: the native step's constants, checked.

    FlashInfer's decode wrapper is the model (``plan()`` once per generation step, then
    ``run()`` for each layer): :meth:`plan` checks what every layer of a model step shares —
    the sizes and grouping, the scale and soft-cap, the dtypes, which keys each sequence sees
    — and :meth:`run` hands one layer's q, K and V to the kernel with nothing checked again.

    Attributes
    ----------
    sizes : tuple of int
        ``(sequences, kv_heads, group, L, d, dv, S)``.
    f64 : bool
        Computed in float64 (else float32).
    scale : float
        The checked scale (``1/sqrt(d)`` when none was given).
    softcap : float or None
        The checked soft-cap.
    kv_format : str or None
        How K and V are stored when not in the compute dtype (:func:`launch`).
    runs : KeyRuns or None
        Each sequence's run of keys, found in Python (:func:`qkv.engine.kernels.decode.key_runs`).
    mask : tuple of int or None
        Or a boolean row per sequence, ``(address, sequence stride, key stride)`` in bytes,
        which the kernel reads as each sequence's run (status 4 when one is not).
    threads, isa
        As :func:`launch` takes them.
    """

    sizes: tuple[int, int, int, int, int, int, int]
    f64: bool
    scale: float
    softcap: float | None = None
    kv_format: str | None = None
    runs: KeyRuns | None = None
    mask: tuple[int, int, int] | None = None
    threads: int | None = None
    isa: int = 0
    runs_at: tuple[int, int] | None = None  # the runs' addresses, taken once
    precision: str = "exact"  # "fast": the fast road of int8 K/V (launch)
    causal: bool = False  # the L rows causal, bottom-right on each sequence's keys (launch)

    @classmethod
    def plan(
        cls,
        sizes: tuple[int, int, int, int, int, int, int],
        *,
        f64: bool,
        scale: Any = None,
        softcap: Any = None,
        kv_format: str | None = None,
        runs: KeyRuns | None = None,
        mask: tuple[int, int, int] | None = None,
        threads: int | None = None,
        isa: int = 0,
        precision: str = "exact",
        causal: bool = False,
    ) -> DecodePlan | None:
        """The plan of a step of ``sizes = (sequences, heads, kv_heads, L, d, dv, S)``, or
        None where the kernel does not take it: not built here, heads not a multiple of the kv
        heads, an empty axis, a scale (None: ``1/sqrt(d)``) or soft-cap that is not a positive
        finite number (the general path then says what is wrong with it).

        >>> p = DecodePlan.plan((2, 8, 2, 1, 64, 64, 100), f64=False)
        >>> p is None or (p.sizes, p.scale) == ((2, 2, 4, 1, 64, 64, 100), 0.125)
        True
        >>> DecodePlan.plan((2, 8, 3, 1, 64, 64, 100), f64=False) is None  # 8 heads, 3 kv heads
        True
        """
        n, heads, kvh, L, d, dv, S = sizes
        if kvh < 1 or heads % kvh or min(L, d, dv) < 1:
            return None
        if scale is not None and not _positive(scale):
            return None
        if softcap is not None and not _positive(softcap):
            return None
        if not available():
            return None
        at = None if runs is None else (address(runs.lo), address(runs.hi))
        return cls(
            (n, kvh, heads // kvh, L, d, dv, S), f64,
            numerics.default_scale(d) if scale is None else float(scale),
            None if softcap is None else float(softcap), kv_format, runs, mask, threads, isa, at,
            precision, causal,
        )  # fmt: skip

    def run(
        self,
        q: Operand,
        k: Operand,
        v: Operand,
        out: int,
        lse: int | None = None,
        scales: tuple[Operand, Operand] | None = None,
    ) -> int:
        """One layer's step on raw memory (as :func:`launch` takes it; ``scales`` for the
        8-bit forms): the kernel's status, 0 when ``out`` (and ``lse``) are written, 3 when a
        result is not finite (the caller then runs its fallback kernel), 4 when a mask row is
        not one run of keys."""
        return launch(
            self.f64, self.sizes, q, k, v, self.runs_at, out, lse, self.scale,
            threads=self.threads, isa=self.isa, softcap=self.softcap, mask=self.mask,
            kv_format=self.kv_format, scales=scales, precision=self.precision, causal=self.causal,
        )  # fmt: skip


class Template:
    """A planned step's argument struct with every field but the addresses of ``q``, ``k``,
    ``v``, ``out``, ``lse`` (and of the 8-bit forms' scales) filled, and the library's
    function that runs it: :meth:`run` copies it, sets those addresses and calls the kernel.
    What :class:`qkv.engine.decoding.DecodePlan` holds per step (built by :func:`template`)."""

    __slots__ = ("args", "function", "kv_format", "threads")

    def __init__(
        self, args: bytes, function: Any, threads: int | None, kv_format: str | None = None
    ) -> None:
        self.args, self.function, self.threads = args, function, threads
        self.kv_format = kv_format  # (what the K/V are stored as, for whoever asks)

    def with_runs(self, lo: int, hi: int) -> Template:
        """This template reading each sequence's run of keys from the int64 arrays at ``lo``
        and ``hi``."""
        args = DecodeArgs.from_buffer_copy(self.args)
        args.lo, args.hi = lo, hi
        return Template(bytes(args), self.function, self.threads, self.kv_format)

    def run(
        self, q: int, k: int, v: int, out: int, lse: int, scales: tuple[int, int] | None = None,
        prior: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> int:  # fmt: skip
        """The kernel on these addresses: its status (0; 3 when a result is not finite).
        A run of keys outside the K/V (or a block table entry outside the pool) is refused
        by the kernel, :class:`~qkv.errors.InputError`, nothing read. ``prior``: a part over
        other keys merged into each row (``abi.h``'s ``prior_out``), its output ``(sequences,
        kv_heads, group · L, dv)`` and lse ``(sequences, kv_heads, group · L)`` in the compute
        dtype, each row's elements contiguous (the caller checks)."""
        args = DecodeArgs.from_buffer_copy(self.args)  # one per call: any thread may run it
        args.q, args.k, args.v, args.out, args.lse = q, k, v, out, lse
        if scales is not None:
            args.k_scale, args.v_scale = scales
        if prior is not None:
            (po, pl), n = prior, prior[0].itemsize
            args.prior_out, args.po_bs, args.po_hs = address(po), *(x // n for x in po.strides[:2])
            args.prior_lse, args.pl_bs, args.pl_hs = address(pl), *(x // n for x in pl.strides[:2])
        team, n = openmp_parallel()
        args.threads, args.parallel = (n if self.threads is None else workers(self.threads)), team
        return checked(self.function(ctypes.byref(args)), args, "decode", (3,))


def template(
    plan: DecodePlan,
    q: tuple[int, int, int],
    k: tuple[int, int, int],
    v: tuple[int, int, int],
    *,
    scales: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None,
    pages: tuple[int, int, int, int] | None = None,
) -> Template | None:
    """:class:`Template` of ``plan`` for operands of these ``(sequence, head, row)`` strides
    in elements (``(page, head, row)`` with ``pages``, as :func:`launch` takes them); None
    where the library is not loaded."""
    lib = library()[0]
    if lib is None:
        return None
    lo, hi = plan.runs_at or (None, None)
    (kss, vss) = scales or ((0, 0, 0), (0, 0, 0))
    args = DecodeArgs(
        *plan.sizes, None, *q, None, *k, None, *v, lo, hi, None, None, plan.scale, 1,
        plan.isa or isa_cap(), None, plan.softcap or 0.0, *(plan.mask or (None, 0, 0)),
        format_code(plan.kv_format, plan.precision), None, *kss,
        None, *vss, *(pages or (None, 0, 0, 0)), int(plan.causal),
    )  # fmt: skip
    function = lib.qkv_decode_f64 if plan.f64 else lib.qkv_decode_f32
    return Template(bytes(args), function, plan.threads, plan.kv_format)


def _stored_form(dt: np.dtype, k: np.ndarray, v: np.ndarray, kv_format: str | None) -> str | None:
    """How ``k`` and ``v`` are stored for compute dtype ``dt``: ``""`` (in ``dt`` itself), a
    form of :mod:`qkv.engine.quant`, or None when the kernel cannot read them."""
    if k.dtype != v.dtype:
        return None
    if kv_format is not None:
        ok = dt == _F32 and k.dtype == storage_dtype(kv_format)
        return kv_format if ok else None
    return _stored_dtype(dt, k.dtype)


def _scale_rows(s: np.ndarray | None, outer: tuple[int, ...], kvh: int, S: int) -> Any:
    """``(address, (sequence, head, row) strides)`` of float32 scales ``(*outer, kv_heads,
    S)``; None when they do not have that form."""
    if s is None or s.dtype != _F32 or s.shape != (*outer, kvh, S):
        return None
    if any(st % 4 for st in s.strides):
        return None
    found = layout((*s.shape, 1), (*(st // 4 for st in s.strides), 1), len(outer))
    return None if found is None else (address(s), found)


@dataclass(frozen=True)
class Prepared:
    """A decoding step on fixed K/V memory, planned by :func:`prepare` and run for each new
    ``q`` by :meth:`run`: nothing is derived again but the address of ``q``.

    Attributes
    ----------
    plan : DecodePlan
        The kernel's constants (sizes, scale, soft-cap, stored form, each sequence's run).
    q_shape, q_layout
        The shape and ``(sequence, head, row)`` strides (elements) of the ``q`` it was
        planned for, in the compute dtype :attr:`dtype`.
    k, v, scales
        The operands as :meth:`DecodePlan.run` takes them.
    keep : tuple
        The arrays those operands and runs address, kept alive with the step.
    """

    plan: DecodePlan
    dtype: np.dtype
    q_shape: tuple[int, ...]
    q_layout: tuple[int, int, int]
    k: Operand
    v: Operand
    scales: tuple[Operand, Operand] | None
    keep: tuple[Any, ...]

    def run(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``(out, lse)`` of ``q`` (of the shape, dtype and strides :func:`prepare` saw: the
        caller guarantees it); None when a result is not finite (see :func:`step`)."""
        *outer, hq, L, _ = self.q_shape
        out = np.empty((*outer, hq, L, self.plan.sizes[5]), dtype=self.dtype)
        lse = np.empty((*outer, hq, L), dtype=self.dtype)
        status = self.plan.run(
            (address(q), self.q_layout), self.k, self.v, address(out), address(lse),
            self.scales,
        )  # fmt: skip
        return None if status else (out, lse)


def _operand(a: np.ndarray, outer: int) -> tuple[int, int, int] | None:
    """:func:`layout` of array ``a`` (strides in bytes, each a whole number of elements)."""
    item = a.dtype.itemsize
    strides = a.strides
    for st in strides:
        if st % item:
            return None
    return layout(a.shape, [st // item for st in strides], outer)


def prepare(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    lo: np.ndarray | None = None,
    hi: np.ndarray | None = None,
    *,
    threads: int | None = None,
    isa: int = 0,
    softcap: float | None = None,
    kv_format: str | None = None,
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
    precision: str = "exact",
) -> Prepared | None:
    """One decoding step planned, not run: the :class:`Prepared` step, or None where the
    kernel does not take these arrays.

    ``q (*outer, heads, L, d)``, ``k (*outer, kv_heads, S, d)``, ``v (*outer, kv_heads, S,
    dv)``, ``q`` float32 or float64 (the compute dtype), ``heads`` a multiple of ``kv_heads``,
    each with a contiguous last axis and outer axes that collapse to one; every row of
    sequence ``b`` sees keys ``lo[b]:hi[b]`` (int64, one per sequence), or all of them. ``k``
    and ``v`` are in the compute dtype, or (float32 compute) stored in a form of
    :mod:`qkv.engine.quant` and read in place: ``float16`` and ml_dtypes' ``bfloat16`` arrays
    are recognised by their dtype; codes (``uint16`` bfloat16 bits, ``int8``, ``uint8``
    e4m3fn bits) are named by ``kv_format``, the 8-bit ones with their float32 ``k_scale``
    and ``v_scale`` of shape ``(*outer, kv_heads, S)``; ``precision="fast"`` takes the fast
    road of int8 K/V (:func:`launch`). The step is a :class:`DecodePlan` of
    these sizes; nothing else is checked: callers pass checked arrays. ``lo`` and ``hi``
    are read when the step runs (a caller may update them in place between runs, as a
    cache does its lengths).
    """
    dt = q.dtype
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim or dt not in _DTYPES:
        return None
    form = _stored_form(dt, k, v, kv_format)
    if form is None:
        return None
    *outer, hq, L, d = q.shape
    kvh, S = k.shape[-3], k.shape[-2]
    dv = v.shape[-1]
    if k.shape[-1] != d or v.shape[-2] != S:
        return None
    if tuple(k.shape[:-3]) != tuple(outer) or tuple(v.shape[:-3]) != tuple(outer):
        return None
    plan = DecodePlan.plan(
        (math.prod(outer), hq, kvh, L, d, dv, S), f64=dt == _F64, scale=scale, softcap=softcap,
        kv_format=form or None, runs=None if lo is None or hi is None else KeyRuns(lo, hi),
        threads=threads, isa=isa, precision=precision,
    )  # fmt: skip
    if plan is None:
        return None
    scales = None
    if form in SCALED:
        ks, vs = (_scale_rows(x, tuple(outer), kvh, S) for x in (k_scale, v_scale))
        if ks is None or vs is None:
            return None
        scales = (ks, vs)
    ql, kl, vl = (_operand(a, len(outer)) for a in (q, k, v))
    if ql is None or kl is None or vl is None:
        return None
    return Prepared(
        plan, dt, q.shape, ql, (address(k), kl), (address(v), vl), scales,
        (k, v, k_scale, v_scale),
    )  # fmt: skip


def step(q: np.ndarray, *args: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """One decoding step in one native call: :func:`prepare`'s step (same arguments) run on
    ``q``. ``out (*outer, heads, L, dv)`` and ``lse (*outer, heads, L)`` are new arrays in the
    compute dtype; None when the inputs do not have :func:`prepare`'s form, and when a result
    is not finite (infinite or NaN inputs, an overflow): the caller then takes the general
    path, which applies qkv's rules for those.
    """
    found = prepare(q, *args, **kwargs)
    return None if found is None else found.run(q)


def _pages(a: np.ndarray) -> tuple[int, int, int] | None:
    """``(page, head, row)`` strides in elements of pages ``(num_blocks, page_size, kv_heads,
    last)`` (scales: no last axis) whose last axis is contiguous; None otherwise."""
    item = a.dtype.itemsize
    if any(st % item or st < 0 for st in a.strides):
        return None
    st = [x // item for x in a.strides]
    if a.ndim == 4 and (st[3] != 1 and a.shape[3] > 1):
        return None
    return st[0], st[2], st[1]


def paged_step(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_table: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    scale: float,
    *,
    threads: int | None = None,
    isa: int = 0,
    softcap: float | None = None,
    kv_format: str | None = None,
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
    precision: str = "exact",
    causal: bool = False,
) -> tuple[np.ndarray, np.ndarray] | None:
    """One decoding step reading K/V pages in place through a block table: ``(out, lse)``
    in the compute dtype, or None where the kernel does not take these arrays (or a result is
    not finite: the caller then takes the general road).

    ``q (sequences, heads, L, d)`` float32 or float64 (the compute dtype); pages ``k_pages
    (num_blocks, page_size, kv_heads, d)`` and ``v_pages (..., dv)`` (FlashAttention's NHD
    layout, any strides with a contiguous last axis), stored as :func:`prepare` takes K/V
    (the 8-bit forms' scales ``(num_blocks, page_size, kv_heads)``); ``block_table
    (sequences, max_blocks)`` int32 with a contiguous last axis; every row of sequence ``b``
    sees key positions ``lo[b]:hi[b]`` (int64), position ``p`` in page
    ``block_table[b, p // page_size]`` at row ``p % page_size``. Callers pass checked arrays:
    the kernel itself refuses (:class:`~qkv.errors.InputError`, nothing read) a run past the
    table's capacity or a needed entry outside ``[0, num_blocks)``. ``causal``: the ``L``
    rows bottom-right causal on those keys (:func:`launch`).
    """
    dt = q.dtype
    if q.ndim != 4 or k_pages.ndim != 4 or v_pages.ndim != 4 or dt not in _DTYPES:
        return None
    form = _stored_form(dt, k_pages, v_pages, kv_format)
    if form is None or block_table.dtype != np.int32 or block_table.ndim != 2:
        return None
    n, hq, L, d = q.shape
    nb, ps, kvh, dv = v_pages.shape
    if k_pages.shape[:3] != (nb, ps, kvh) or k_pages.shape[3] != d or ps < 1:
        return None
    if block_table.shape[0] != n or (block_table.shape[1] > 1 and block_table.strides[1] != 4):
        return None
    S = block_table.shape[1] * ps
    plan = DecodePlan.plan(
        (n, hq, kvh, L, d, dv, S), f64=dt == _F64, scale=scale, softcap=softcap,
        kv_format=form or None, threads=threads, isa=isa, precision=precision, causal=causal,
    )  # fmt: skip
    if plan is None:
        return None
    scales = None
    if form in SCALED:
        if k_scale is None or v_scale is None:
            return None
        found = []
        for x in (k_scale, v_scale):
            if x.dtype != _F32 or x.shape != (nb, ps, kvh):
                return None
            st = _pages(x)
            if st is None:
                return None
            found.append((address(x), st))
        scales = (found[0], found[1])
    ql = _operand(q, 1)
    kl, vl = _pages(k_pages), _pages(v_pages)
    if ql is None or kl is None or vl is None:
        return None
    lo = np.ascontiguousarray(lo, dtype=np.int64)
    hi = np.ascontiguousarray(hi, dtype=np.int64)
    bt_rs = block_table.strides[0] // 4 if block_table.shape[0] > 1 else block_table.shape[1]
    out = np.empty((n, hq, L, dv), dtype=dt)
    lse = np.empty((n, hq, L), dtype=dt)
    status = launch(
        plan.f64, plan.sizes, (address(q), ql), (address(k_pages), kl),
        (address(v_pages), vl), (address(lo), address(hi)), address(out),
        address(lse), plan.scale, threads=threads, isa=isa, softcap=plan.softcap,
        kv_format=plan.kv_format, scales=scales,
        pages=(address(block_table), bt_rs, ps, nb), precision=precision, causal=causal,
    )  # fmt: skip
    return None if status else (out, lse)

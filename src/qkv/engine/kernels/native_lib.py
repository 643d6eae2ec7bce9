"""The native library's loader: its C ABI in ctypes, loaded once, and one way to call it.

The optional C++ library (``native_src/``: ``abi.h`` the argument structs, ``common.h`` what
the kernel families share, one source per family) is a plain C ABI: every exported kernel takes
one struct and returns a status. This module mirrors each struct field for field, checks on
load that the library agrees on their sizes, and :func:`invoke` is the one call site that maps a
status to an exception. The kernels' glue (:mod:`~qkv.engine.kernels.native` for prefill,
varlen and backward, :mod:`~qkv.engine.kernels.native_decode` for decode) fills the structs.

Examples
--------
>>> why = library()[1]
>>> library()[0] is not None or why.startswith(("not built", "the library"))
True
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InputError
from ...numerics import FAST_CODE, FAST_FORMS, STORED_FORMS
from .env import setting

__all__ = [
    "BUILD_NOTE",
    "ENV",
    "AMX_ISA",
    "ISAS",
    "ISA_ENV",
    "ISA_NAMES",
    "KV_FORMATS",
    "Kept",
    "PREFILL_NOT_FINITE",
    "BackwardArgs",
    "DecodeArgs",
    "PrefillArgs",
    "VarlenArgs",
    "amx_tiles",
    "bf16_isa",
    "bf16_products",
    "blas_available",
    "gemm",
    "backward_operands",
    "blas_rows",
    "build_note",
    "address",
    "head_offsets",
    "invoke",
    "isa_cap",
    "library",
    "library_path",
    "mask_operand",
    "operands",
    "prefill_operands",
    "row_stride",
    "switched_off",
    "switches",
]

ENV = "QKV_NATIVE"  # "0" switches the native kernels off (read on every call)
# Why the install built no library (setup.py writes it there: QKV_NATIVE_BUILD=0, the failure)
BUILD_NOTE = "_native_build.txt"
# "baseline", "avx2", "avx512", "avx512bf16" or "amx": the widest clone a call may run
ISA_ENV = "QKV_NATIVE_ISA"
#: The status of the float32/float64 prefill (``qkv_prefill_f32``, ``qkv_prefill_f64`` and
#: their stored-K/V forms) when some output is not finite: every output is written, and the
#: caller applies its rules.
PREFILL_NOT_FINITE = 3
ISAS = {"baseline": 1, "avx2": 2, "avx512": 3}  # the vector clones, narrowest first
# The bfloat16 kernels' codes above AVX-512 (native_src/bf16.h): AVX-512 with AVX512_BF16's
# vdpbf16ps, and with AMX's tiles (tdpbf16ps) where the CPU has them
BF16_ISA = max(ISAS.values()) + 1
AMX_ISA = BF16_ISA + 1
#: What ``QKV_NATIVE_ISA`` may name: the vector clones, and the bfloat16 kernels' two roads
#: (``avx512bf16`` keeps them on vdpbf16ps on a CPU with AMX).
ISA_NAMES = {**ISAS, "avx512bf16": BF16_ISA, "amx": AMX_ISA}
# How the decode step finds K and V stored (qkv_decode_args.kv_format; qkv.engine.quant):
# the compute dtype itself (numerics.SAME_CODE), or these forms, read in place and widened to
# float32 in registers; the codes are numerics.STORED_FORMS', checked against abi.h on load
KV_FORMATS = {f.name: f.code for f in STORED_FORMS}

_i64, _ptr, _f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double


def _ints(*names: str) -> list[tuple[str, Any]]:
    return [(name, _i64) for name in names]


# The fields abi.h's QKV_OPERAND_FIELDS and QKV_RULE_FIELDS stand for, in their order.
_OPERANDS: list[tuple[str, Any]] = [
    ("q", _ptr), ("q_off", _ptr), ("q_rs", _i64),
    ("k", _ptr), ("k_off", _ptr), ("k_rs", _i64),
    ("v", _ptr), ("v_off", _ptr), ("v_rs", _i64),
]  # fmt: skip
_RULE: list[tuple[str, Any]] = [
    ("scale", _f64), *_ints("causal", "left", "right", "threads", "isa"),
    ("gemm", _ptr), *_ints("block_q", "block_k"),
]  # fmt: skip


class PrefillArgs(ctypes.Structure):
    """``qkv_prefill_args`` of ``native_src/abi.h`` (same order, all 8-byte fields)."""

    _fields_ = [
        *_ints("nb", "L", "S", "d", "dv"),
        *_OPERANDS,
        ("out", _ptr), ("lse", _ptr),
        ("mask", _ptr), ("bias", _ptr), ("m_off", _ptr), *_ints("m_rs", "m_cs"),
        *_RULE,
        ("counts", _ptr),
        ("products", _i64),
        ("parallel", _ptr),
        ("pages", _ptr), *_ints("page_size", "k_ps", "v_ps"),
        ("per_pos", _i64),
        ("o_off", _ptr), *_ints("o_rs", "o_hs"),
    ]  # fmt: skip


class BackwardArgs(ctypes.Structure):
    """``qkv_backward_args`` of ``native_src/abi.h`` (same order, all 8-byte fields)."""

    _fields_ = [
        *_ints("nkv", "group", "L", "S", "d", "dv"),
        *_OPERANDS,
        ("dout", _ptr), ("lse", _ptr), ("delta", _ptr),
        ("dq", _ptr), ("dk", _ptr), ("dvo", _ptr),
        ("mask", _ptr), ("bias", _ptr), ("m_off", _ptr), *_ints("m_rs", "m_cs"),
        *_RULE,
        ("out", _ptr),
    ]  # fmt: skip


class VarlenArgs(ctypes.Structure):
    """``qkv_varlen_args`` of ``native_src/abi.h`` (same order, all 8-byte fields)."""

    _fields_ = [
        *_ints("nseq", "heads", "group", "d", "dv"),
        ("q", _ptr), *_ints("q_ts", "q_hs"),
        ("k", _ptr), *_ints("k_ts", "k_hs"),
        ("v", _ptr), *_ints("v_ts", "v_hs"),
        ("cq", _ptr), ("ck", _ptr), ("seqs", _ptr),
        ("out", _ptr), ("lse", _ptr), ("bad", _ptr),
        *_RULE,
        ("parallel", _ptr),
    ]  # fmt: skip


class DecodeArgs(ctypes.Structure):
    """``qkv_decode_args`` of ``native_src/abi.h`` (same order, all 8-byte fields)."""

    _fields_ = [
        *_ints("nseq", "kv_heads", "group", "L", "d", "dv", "S"),
        ("q", _ptr), *_ints("q_bs", "q_hs", "q_ls"),
        ("k", _ptr), *_ints("k_bs", "k_hs", "k_rs"),
        ("v", _ptr), *_ints("v_bs", "v_hs", "v_rs"),
        ("lo", _ptr), ("hi", _ptr),
        ("out", _ptr), ("lse", _ptr),
        ("scale", _f64), *_ints("threads", "isa"),
        ("parallel", _ptr),
        ("softcap", _f64),
        ("mask", _ptr), *_ints("mask_bs", "mask_js"),
        ("kv_format", _i64),
        ("k_scale", _ptr), *_ints("ks_bs", "ks_hs", "ks_rs"),
        ("v_scale", _ptr), *_ints("vs_bs", "vs_hs", "vs_rs"),
        ("block_table", _ptr), *_ints("bt_rs", "page_size", "num_blocks"),
        ("causal", _i64),
        ("prior_out", _ptr), *_ints("po_bs", "po_hs"),
        ("prior_lse", _ptr), *_ints("pl_bs", "pl_hs"),
    ]  # fmt: skip


# Each kernel family: the struct its functions take, the function reporting its size, and the
# functions (one per compute dtype).
_FAMILIES: tuple[tuple[type[ctypes.Structure], str, tuple[str, ...]], ...] = (
    (
        PrefillArgs,
        "qkv_args_size",
        (
            "qkv_prefill_f32",
            "qkv_prefill_f64",
            "qkv_prefill_bf16",
            "qkv_prefill_bf16io",
            "qkv_prefill_f32_bf16kv",
            "qkv_prefill_f32_f16kv",
            "qkv_prefill_f32_bf16io",
            "qkv_prefill_f32_f16io",
        ),
    ),
    (
        BackwardArgs,
        "qkv_backward_args_size",
        (
            "qkv_backward_f32",
            "qkv_backward_f64",
            "qkv_backward_bf16",
            "qkv_backward_f32_bf16kv",
            "qkv_backward_f32_f16kv",
        ),
    ),
    (
        VarlenArgs,
        "qkv_varlen_args_size",
        (
            "qkv_varlen_f32",
            "qkv_varlen_f64",
            "qkv_varlen_bf16",
            "qkv_varlen_f32_bf16kv",
            "qkv_varlen_f32_f16kv",
        ),
    ),
    (
        DecodeArgs,
        "qkv_decode_args_size",
        ("qkv_decode_f32", "qkv_decode_f64", "qkv_decode_f32_bf16io", "qkv_decode_f32_f16io"),
    ),
)


def _address_reader() -> Callable[[np.ndarray], int]:
    """How :func:`address` reads an array's data pointer: from the array object's C struct
    (NumPy's ``PyArrayObject_fields``: the pointer follows the object header), a few hundred
    nanoseconds, where ``a.ctypes.data`` builds a helper object each time (several
    microseconds: five of them were the largest cost of a small call). Checked once against
    ``ctypes.data`` on a probe array; an interpreter where that does not hold (another object
    header, an ``id`` that is not an address) keeps ``ctypes.data``."""
    probe = np.arange(4.0)[1:]
    offset = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)  # the header
    read = ctypes.c_void_p.from_address
    try:
        same = read(id(probe) + offset).value == probe.ctypes.data
    except (OSError, ValueError, OverflowError):  # pragma: no cover - not CPython
        same = False
    if same:
        return lambda a: read(id(a) + offset).value or 0
    return lambda a: a.ctypes.data  # pragma: no cover - not CPython's layout


#: ``address(a)``: the address of NumPy array ``a``'s first element (``a.ctypes.data``, read
#: quickly: :func:`_address_reader`). The caller keeps ``a`` alive while the address is used.
address: Callable[[np.ndarray], int] = _address_reader()


class Kept:
    """A call's kernel set-up kept for operands of one layout
    (:func:`qkv.engine.kernels.dispatch.keep`): called with ``(q, k, v)`` of that layout (and,
    for a padded call's, its key counts) it gives ``(out, lse)`` (``lse`` None where the road
    does not write it: the decode step's, whose callers read ``out`` alone), or None where the
    caller must take the general road (operands of other strides, another clone forced by
    ``QKV_NATIVE_ISA``, or what ``run`` itself refuses).

    :meth:`at` takes the operands' addresses and element strides instead of arrays, as a CPU
    tensor gives them (``data_ptr()``, ``stride()``) without a NumPy view of it: a small call
    on tensors spent a third of its time making the three views.

    ``run(q, k, v, counts)`` is the kernel's call on the addresses (``counts`` None, or an
    int64 array), for operands of ``arrays``' layout; ``clone`` the ``QKV_NATIVE_ISA`` it was
    set up under. ``io``: for float16/bfloat16 operands, whether ``q`` is taken, and the
    output given, in that 16-bit dtype (the kernel widens and narrows them); otherwise ``q``
    is the float32 one the caller widened, and the output float32.
    """

    __slots__ = ("clone", "elements", "grow", "io", "run", "strides")

    def __init__(
        self, run: Callable[..., Any], arrays: tuple[np.ndarray, ...], clone: str, io: bool = False
    ) -> None:
        self.run, self.clone, self.io = run, clone, io
        #: ``grow(S)``: the set-up kept for the same operands with ``S`` keys (a decoding
        #: loop over a slice of its own buffers asks for one more key each step), or None;
        #: None where the road has no such rule (:func:`qkv.engine.run.plain` then keeps the
        #: new shapes' road as for any first call)
        self.grow: Callable[[int], Kept | None] | None = None
        strides, elements = [], []
        for a in arrays:  # (plain loops: a decoding loop over a growing slice keeps one a step)
            st, item = a.strides, a.itemsize
            strides.append(st)
            elements.append(
                tuple([s // item for s in st]) if all([s % item == 0 for s in st]) else None
            )
        self.strides = tuple(strides)
        # (an array whose byte strides are not whole elements has no element strides)
        self.elements = None if None in elements else tuple(elements)

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, counts: Any = None) -> Any:
        if (q.strides, k.strides, v.strides) != self.strides or setting(ISA_ENV) != self.clone:
            return None
        return self.run(address(q), address(k), address(v), counts)

    def like(self, run: Callable[..., Any]) -> Kept:
        """A set-up for operands of this one's strides, clone and ``io``, calling ``run``."""
        other = Kept.__new__(Kept)
        other.run, other.clone, other.io, other.grow = run, self.clone, self.io, None
        other.strides, other.elements = self.strides, self.elements
        return other

    def at(self, q: int, k: int, v: int, strides: tuple[Any, ...], counts: Any = None) -> Any:
        """As a call, on the operands' addresses and their strides in elements (``strides``:
        a tuple of q's, k's and v's)."""
        if strides != self.elements or setting(ISA_ENV) != self.clone:
            return None
        return self.run(q, k, v, counts)


class EitherKept(Kept):
    """Two set-ups of one road, tried in turn: ``first`` kept for one layout of the operands,
    ``second`` for another (a 16-bit prefill's contiguous q, which any q's copy fits; a layout
    the same shapes came in before), so that a key called in several layouts keeps a road for
    each (:func:`either`). Grown to another number of keys, each grows."""

    __slots__ = ("first", "second")

    def __init__(self, first: Kept, second: Kept) -> None:
        self.first, self.second = first, second
        self.run, self.clone, self.io = first.run, first.clone, first.io
        self.strides, self.elements = first.strides, first.elements
        self.grow = None if first.grow is None and second.grow is None else self._grown

    def _grown(self, S: int) -> Kept | None:
        grow_a, grow_b = self.first.grow, self.second.grow
        return either(None if grow_a is None else grow_a(S), None if grow_b is None else grow_b(S))

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, counts: Any = None) -> Any:
        done = self.first(q, k, v, counts)
        return done if done is not None else self.second(q, k, v, counts)

    def at(self, q: int, k: int, v: int, strides: tuple[Any, ...], counts: Any = None) -> Any:
        done = self.first.at(q, k, v, strides, counts)
        return done if done is not None else self.second.at(q, k, v, strides, counts)


def either(first: Kept | None, second: Kept | None) -> Kept | None:
    """``first`` and ``second`` tried in turn (:class:`EitherKept`), or the one that is kept."""
    if first is None or second is None:
        return first if second is None else second
    return EitherKept(first, second)


def kept_for_q(
    make: Callable[[np.ndarray | None], Kept | None], q_like: np.ndarray | None,
    shape: tuple[int, ...], dtype: np.dtype,
) -> Kept | None:  # fmt: skip
    """A 16-bit prefill's set-up ``make(q)`` (``q`` the layout of q it is kept for; None: a
    contiguous q's), for the caller's ``q_like`` of ``shape`` and ``dtype`` where it is laid
    out otherwise (a model's transposed view), beside a contiguous q's, which any q's copy
    fits."""
    if q_like is not None and q_like.shape == shape and q_like.dtype == dtype:
        if not q_like.flags.c_contiguous:
            return either(make(q_like), make(None))
    return make(None)


def call_at(
    function: Any, args: DecodeArgs | PrefillArgs, masked: bool = False
) -> tuple[Callable[..., int], DecodeArgs | PrefillArgs]:
    """``(call, kept)``: ``call(q, k, v, out)`` (a prefill's also ``counts``, or None; with
    ``masked``, a prefill's mask or bias instead, ``qkv_prefill_mask_at``) gives
    the status of the library's decode or prefill ``function`` on a copy of ``kept`` with those
    addresses put in, made by the library (``qkv_decode_at``, ``qkv_prefill_at``: see
    ``abi.h``). A kept small call's road: no struct of its own per call. ``kept`` is ``args``,
    a struct the caller gives up to it (nothing else may write it); the caller holds it while
    it calls ``call`` (and passes it to :func:`checked`). Its ``lse`` (NULL in a kept call) is
    what every call gets."""
    lib = library()[0]
    at = lib.qkv_decode_at if isinstance(args, DecodeArgs) else lib.qkv_prefill_at
    if masked:
        at = lib.qkv_prefill_mask_at
    call = functools.partial(at, ctypes.cast(function, _ptr).value, ctypes.addressof(args))
    return call, args


def isa_cap(asked: str | int | None = None) -> int:
    """The clone code a call passes (0: the widest the CPU runs): ``asked`` (a name of
    :data:`ISAS` or its code), else ``QKV_NATIVE_ISA`` (read on every call; CI runs the
    suite with narrower clones forced), else 0. The library caps it at what the CPU runs."""
    if asked is None:
        asked = setting(ISA_ENV).strip() or 0
    if isinstance(asked, str):
        if asked not in ISA_NAMES:
            raise ValueError(f"{ISA_ENV}: expected one of {tuple(ISA_NAMES)}, got {asked!r}")
        return ISA_NAMES[asked]
    return int(asked)


def switched_off() -> bool:
    """Whether ``QKV_NATIVE=0`` switches the native kernels off (read on every call)."""
    return setting(ENV).strip() == "0"


def switches() -> tuple[bool, str]:
    """The settings the router's choices depend on, read on every call: whether
    ``QKV_NATIVE=0`` switches the native kernels off, and ``QKV_NATIVE_ISA`` (the clone forced:
    AMX's tiles or not choose another road). A choice kept across calls is kept per value."""
    return switched_off(), setting(ISA_ENV)


def _capsule_pointer(capsule: Any) -> int:
    """The pointer a ``PyCapsule`` holds (how Cython exports C functions)."""
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return int(api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule)))


@functools.cache
def gemm() -> tuple[dict[np.dtype, int] | None, str]:
    """``({float32: sgemm, float64: dgemm}, "")`` from SciPy, or ``(None, why not)``: the
    BLAS the prefill, varlen and backward kernels call for their tile products."""
    try:
        from scipy.linalg import cython_blas  # type: ignore[import-untyped]  # no stubs
    except ImportError:
        return None, "SciPy is not installed (its BLAS runs the tile products)"
    try:
        capi = cython_blas.__pyx_capi__
        found: dict[np.dtype, int] = {
            np.dtype(np.float32): _capsule_pointer(capi["sgemm"]),
            np.dtype(np.float64): _capsule_pointer(capi["dgemm"]),
        }
    except (AttributeError, KeyError, ValueError, TypeError) as exc:
        return None, f"SciPy's BLAS functions were not found ({exc!r})"
    return found, ""


def blas_available() -> tuple[bool, str]:
    """``(True, "")`` when the BLAS-based native kernels run (the library built and on, SciPy's
    BLAS found), else ``(False, why not)``."""
    if switched_off():
        return False, f"switched off ({ENV}=0)"
    lib, why = library()
    if lib is None:
        return False, why
    found, why = gemm()
    return found is not None, why


def running_isa() -> int:
    """The code (:data:`ISAS`) of the vector clone the library's kernels run: the widest this
    CPU runs, capped by ``QKV_NATIVE_ISA``; 0 where the library is not loaded."""
    lib = library()[0]
    if lib is None:
        return 0
    cap, best = isa_cap(), int(lib.qkv_best_isa())
    return min(best, cap) if cap else best


def bf16_products() -> tuple[bool, str]:
    """``(True, "")`` when the bfloat16 tile products (``vdpbf16ps``) run: the library built
    and on, this CPU with AVX512_BF16 and no narrower clone forced; else ``(False, why not)``."""
    if switched_off():
        return False, f"switched off ({ENV}=0)"
    lib, why = library()
    if lib is None:
        return False, why
    cap = isa_cap()
    if cap not in (0, BF16_ISA, AMX_ISA):
        name = {v: k for k, v in ISAS.items()}.get(cap, cap)
        return False, f"a narrower clone is forced ({ISA_ENV}={name})"
    if not lib.qkv_bf16_products():
        return False, "this CPU has no AVX512_BF16"
    return True, ""


def amx_tiles() -> tuple[bool, str]:
    """``(True, "")`` when the bfloat16 prefill's tile products run on AMX (``tdpbf16ps``):
    :func:`bf16_products`, this CPU with AMX-BF16 granted to the process by its OS, and
    ``QKV_NATIVE_ISA`` not naming ``avx512bf16`` or narrower; else ``(False, why not)``."""
    ok, why = bf16_products()
    if not ok:
        return False, why
    if isa_cap() == BF16_ISA:
        return False, f"vdpbf16ps is forced ({ISA_ENV}=avx512bf16)"
    if not library()[0].qkv_amx_tiles():
        return False, "this CPU (or its OS) gives no AMX-BF16"
    return True, ""


def bf16_isa() -> int:
    """The clone code the bfloat16 kernels are called with: :data:`BF16_ISA` where
    ``QKV_NATIVE_ISA`` names ``avx512bf16``, else :data:`AMX_ISA` (the library takes AMX's
    tiles where the CPU has them and the head sizes fit)."""
    return BF16_ISA if isa_cap() == BF16_ISA else AMX_ISA


def library_path() -> Path | None:
    """The built library next to this module (``_native`` plus an extension suffix)."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_native{suffix}"
        if path.is_file():
            return path
    return None


def build_note(folder: Path | None = None) -> str:
    """Why the install built no library, as its build left it in ``folder`` (next to where the
    library would be: this module's folder): ``QKV_NATIVE_BUILD=0``, or the build's failure;
    a general reason without one."""
    try:
        text = ((folder or Path(__file__).parent) / BUILD_NOTE).read_text(encoding="utf-8")
    except (OSError, UnicodeError):
        text = ""
    first = text.strip().splitlines()[0][:300] if text.strip() else ""
    return first or "no C++ compiler when qkv was installed, or the build failed"


@functools.cache
def library() -> tuple[Any, str]:
    """``(library, "")`` with every function's argument types set, or ``(None, why not)``;
    loaded once. A library whose structs differ in size from these, or whose K/V format codes
    differ from :data:`KV_FORMATS` (another version of qkv), is refused whole."""
    path = library_path()
    if path is None:
        return None, f"not built ({build_note()})"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"the library did not load: {exc}"
    try:
        for args, size, functions in _FAMILIES:
            getattr(lib, size).restype = _i64
            if getattr(lib, size)() != ctypes.sizeof(args):
                raise AttributeError(size)
            for name in functions:
                getattr(lib, name).argtypes = [ctypes.POINTER(args)]
                getattr(lib, name).restype = ctypes.c_int
        lib.qkv_prefill_not_finite_status.restype = ctypes.c_int
        if lib.qkv_prefill_not_finite_status() != PREFILL_NOT_FINITE:
            raise AttributeError("qkv_prefill_not_finite_status")
        lib.qkv_best_isa.restype = ctypes.c_int
        lib.qkv_bf16_products.restype = ctypes.c_int
        lib.qkv_amx_tiles.restype = ctypes.c_int
        lib.qkv_fma_peak.argtypes = [_i64, _i64]
        lib.qkv_fma_peak.restype = ctypes.c_double
        lib.qkv_kv_format_code.argtypes = [ctypes.c_char_p]
        lib.qkv_kv_format_code.restype = _i64
        lib.qkv_decode_at.argtypes = [_ptr] * 6
        lib.qkv_prefill_at.argtypes = [_ptr] * 7
        lib.qkv_prefill_mask_at.argtypes = [_ptr] * 7
        lib.qkv_decode_at.restype = lib.qkv_prefill_at.restype = ctypes.c_int
        lib.qkv_prefill_mask_at.restype = ctypes.c_int
    except AttributeError:
        return None, "the library is from another version of qkv (argument layout differs)"
    codes = {**KV_FORMATS, **{f"{n} fast": KV_FORMATS[n] | FAST_CODE for n in FAST_FORMS}}
    if any(lib.qkv_kv_format_code(name.encode()) != code for name, code in codes.items()):
        return None, "the library is from another version of qkv (K/V format codes differ)"
    return lib, ""


def invoke(
    function: str, args: ctypes.Structure, what: str, *, allowed: tuple[int, ...] = ()
) -> int:
    """Call the library's ``function`` on ``args`` and return its status.

    Status 0 and those in ``allowed`` are returned (the caller acts on them); 1 (no memory)
    raises :class:`MemoryError`, 5 (keys outside the buffers) and 6 (a block table entry
    outside the pool of pages) :class:`~qkv.errors.InputError`, any other
    :class:`RuntimeError`, all naming ``what``.
    """
    lib, why = library()
    if lib is None:
        raise RuntimeError(f"qkv native kernels unavailable: {why}")
    return checked(int(getattr(lib, function)(ctypes.byref(args))), args, what, allowed)


def checked(status: int, args: ctypes.Structure, what: str, allowed: tuple[int, ...] = ()) -> int:
    """A kernel's ``status`` as :func:`invoke` returns it (or raises), for a caller that
    called the library's function itself (a small call's road, which holds the function)."""
    if status == 0 or status in allowed:
        return status
    if status == 1:
        raise MemoryError(f"qkv native {what}: not enough memory for its work")
    if status == 5:
        raise InputError(
            f"lengths: qkv native {what}: a sequence's keys [lo, hi) reach outside its K/V "
            f"buffers of {getattr(args, 'S', '?')} rows; nothing was read or written"
        )
    if status == 6:
        raise InputError(
            f"block_table: qkv native {what}: an entry a sequence's keys need is not a page "
            f"of the pool of {getattr(args, 'num_blocks', '?')} blocks; nothing was read or "
            "written"
        )
    raise RuntimeError(f"qkv native {what}: bad arguments (status {status})")


def blas_rows(a: np.ndarray) -> np.ndarray:
    """``a`` itself when its rows suit BLAS (contiguous last axis, row stride a whole number
    of elements, at least the row's length and below 2**31), else a contiguous copy."""
    item = a.itemsize
    ok = (
        a.strides[-1] == item
        and all(s >= 0 and s % item == 0 for s in a.strides)
        and (a.shape[-2] <= 1 or a.shape[-1] * item <= a.strides[-2] < item << 31)
    )  # BLAS takes the row stride as a 32-bit int
    return a if ok else np.ascontiguousarray(a)


def head_offsets(a: np.ndarray) -> np.ndarray:
    """Element offset of each index over ``a``'s batch axes (all but the last two), shaped as
    those axes; strides may be 0 (broadcast axes)."""
    return _lead_offsets(a.shape, a.strides, a.itemsize)


def _lead_offsets(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> np.ndarray:
    """:func:`head_offsets` of an array of this shape, strides and item size."""
    lead = shape[: len(shape) - 2]
    off = np.zeros(lead, dtype=np.int64)
    for ax, (n, st) in enumerate(zip(lead, strides[: len(shape) - 2], strict=True)):
        dims = [1] * len(lead)
        dims[ax] = n
        off = off + (np.arange(n, dtype=np.int64) * (st // itemsize)).reshape(dims)
    return off


def mask_operand(
    mask: np.ndarray | None, bias: np.ndarray | None, rows: tuple[int, ...]
) -> tuple[dict[str, int | None], tuple[np.ndarray | None, np.ndarray | None]]:
    """The mask and bias fields of a prefill struct: the boolean ``mask`` or float ``bias``
    (at most one) broadcast to ``rows = (*batch, L, S)`` (a view where its strides allow),
    each query head's element offset, its row and key strides; and the arrays the fields
    point into, which the caller holds until the call returns (``None, None`` without one)."""
    m = mask if mask is not None else bias
    if m is None:
        return {"mask": None, "bias": None, "m_off": None, "m_rs": 0, "m_cs": 0}, (None, None)
    m = np.broadcast_to(m, rows)
    if any(s < 0 or s % m.itemsize for s in m.strides):
        m = np.ascontiguousarray(m)
    m_off = np.ascontiguousarray(head_offsets(m)).reshape(-1)
    fields: dict[str, int | None] = {
        "mask": address(m) if mask is not None else None,
        "bias": address(m) if mask is None else None,
        "m_off": address(m_off),
        "m_rs": m.strides[-2] // m.itemsize,
        "m_cs": m.strides[-1] // m.itemsize,
    }
    return fields, (m, m_off)


def output_rows(
    batch: tuple[int, ...], L: int, dv: int, rows_first: bool, per_pos: int = 1
) -> tuple[tuple[int, ...], dict[str, int], np.ndarray | None]:
    """Where a prefill writes its output: the shape to allocate, the struct's output fields and
    the array they point into (held until the call returns; None: no output fields). For the
    struct's heads ``batch`` of ``L`` rows, contiguous ``(*batch, L, dv)``; or, with
    ``rows_first`` (and a heads axis, ``batch[-1]``), laid out as ``(*batch[:-1], L, heads,
    dv)`` in memory, FlashAttention's and transformers' layout, each head's rows ``heads · dv``
    apart (read back through :func:`rows_view`): no copy then has to lay it out so (a model's
    prefill made one at every layer). ``per_pos`` > 1: each struct head is a stack of that many
    query heads, its rows taken position by position (``L / per_pos`` positions), which the
    output gives as ``per_pos`` heads."""
    if not rows_first or not batch:
        return batch + (L, dv), {"o_off": 0, "o_rs": 0, "o_hs": 0}, None
    H, n = batch[-1] * per_pos, L // per_pos  # (the query heads, the positions)
    outer = int(np.prod(batch[:-1], dtype=np.int64))
    at = np.arange(outer, dtype=np.int64)[:, None] * (n * H * dv)
    offsets = np.ascontiguousarray((at + np.arange(0, H, per_pos, dtype=np.int64) * dv).ravel())
    shape = batch[:-1] + (n, H, dv)
    return shape, {"o_off": address(offsets), "o_rs": H * dv, "o_hs": dv}, offsets


def rows_view(out: np.ndarray, rows_first: bool) -> np.ndarray:
    """The ``(*batch, L, dv)`` view of an output allocated as :func:`output_rows` says."""
    return np.swapaxes(out, -3, -2) if rows_first else out


def row_stride(a: np.ndarray) -> int:
    return a.strides[-2] // a.itemsize if a.shape[-2] > 1 else a.shape[-1]


def operands(*arrays: tuple[np.ndarray, np.ndarray]) -> dict[str, int]:
    """The q, k, v fields of an argument struct: each operand's address, per-head element
    offsets and row stride, from ``(operand, offsets)`` pairs in that order."""
    fields: dict[str, int] = {}
    for name, (a, off) in zip("qkv", arrays, strict=True):
        fields.update({name: address(a), f"{name}_off": address(off)})
        fields[f"{name}_rs"] = row_stride(a)
    return fields


def prefill_operands(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, group: int
) -> tuple[dict[str, int], tuple[np.ndarray, ...]]:
    """The q, k, v fields of a prefill struct, for ``q (*batch, L, d)`` and K/V with
    ``Hq // group`` kv heads (query head ``h`` reads kv head ``h // group``), one offset per
    query head; and the arrays the fields point into, which the caller holds until the call
    returns."""
    layout = (
        q.shape, q.strides, q.itemsize, k.shape, k.strides, k.itemsize,
        v.shape, v.strides, v.itemsize, group,
    )  # fmt: skip
    known = _LAYOUTS.get(layout)
    if known is not None:  # worked out once per layout: a small call pays for every step
        fields, offsets = known
        fields = {**fields, "q": address(q), "k": address(k), "v": address(v)}
        return fields, (q, k, v, *offsets)
    given = (q, k, v)
    q, k, v = blas_rows(q), blas_rows(k), blas_rows(v)
    batch = q.shape[:-2]
    fields = {}
    arrays: list[np.ndarray] = [q, k, v]
    for name, a, g in (("q", q, 1), ("k", k, group), ("v", v, group)):
        off, at = _offsets(a.shape, a.strides, a.itemsize, batch, g)
        arrays.append(off)
        fields.update({name: address(a), f"{name}_off": at, f"{name}_rs": row_stride(a)})
    if all(x is y for x, y in zip(given, arrays, strict=False)):  # read in place: kept
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        _LAYOUTS[layout] = (fields, tuple(arrays[3:]))
    return fields, tuple(arrays)


# prefill_operands' fields and offset arrays by the operands' layout (shapes, strides, item
# size, group), for operands BLAS reads in place
_LAYOUTS: dict[tuple[Any, ...], tuple[dict[str, int], tuple[np.ndarray, ...]]] = {}


@functools.lru_cache(maxsize=512)
def _offsets(
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    itemsize: int,
    batch: tuple[int, ...],
    group: int,
) -> tuple[np.ndarray, int]:
    """The per-query-head element offsets of an operand of this layout (:func:`head_offsets`,
    each kv head's repeated ``group`` times along the heads axis, broadcast to ``batch``),
    contiguous and read-only, and their address: worked out once per layout, as a small call
    pays for every NumPy operation."""
    off = _lead_offsets(shape, strides, itemsize)
    if group > 1:
        off = np.repeat(off, group, axis=-1)
    off = np.ascontiguousarray(np.broadcast_to(off, batch), dtype=np.int64).reshape(-1)
    off.flags.writeable = False
    return off, address(off)


def backward_operands(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    grads_in: tuple[np.ndarray, np.ndarray, np.ndarray],
    dout_dtype: np.dtype,
    dtype: np.dtype,
    *,
    delta_from_out: bool = False,
) -> tuple[dict[str, int | None], tuple[np.ndarray, ...]]:
    """The fields of a backward struct: q ``(*batch, L, d)`` (offsets per query head), K/V
    (per kv head), and from ``grads_in = (d_out, out, lse)``: ``dout`` in ``dout_dtype``,
    ``delta = rowsum(dO ∘ O)`` (with ``delta_from_out``, ``out`` instead, for the kernel to take
    delta itself: the bfloat16 one) and the lse with rows of no key as ``+inf``, in ``dtype``;
    and
    the arrays the fields point into, which the caller holds until the call returns."""
    d_out, out, lse = grads_in
    rows = q.shape[:-1]
    dout = np.ascontiguousarray(np.broadcast_to(d_out, rows + v.shape[-1:]), dtype=dout_dtype)
    if delta_from_out:
        out = np.ascontiguousarray(np.broadcast_to(out, dout.shape))
        delta = None
    else:
        out = np.broadcast_to(out, dout.shape)
        delta = np.ascontiguousarray(np.sum(dout.astype(dtype) * out, axis=-1), dtype=dtype)
    lse = np.broadcast_to(lse, rows)
    lse_safe = np.ascontiguousarray(np.where(lse == -np.inf, np.inf, lse), dtype=dtype)
    q, k, v = blas_rows(q), blas_rows(k), blas_rows(v)
    offsets = [np.ascontiguousarray(head_offsets(a)).reshape(-1) for a in (q, k, v)]
    fields = {
        **operands(*zip((q, k, v), offsets, strict=True)),
        "nkv": offsets[1].size,
        "dout": address(dout),
        "lse": address(lse_safe),
        "delta": None if delta is None else address(delta),
        "out": address(out),
    }
    return fields, (q, k, v, *offsets, dout, out, lse_safe, *([] if delta is None else [delta]))

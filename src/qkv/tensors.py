"""The tensor policy: which array types qkv takes, how it reads them, what it gives back.

One module decides this for every public function (:func:`qkv.attention` and its siblings,
:func:`qkv.attention_vjp`, :func:`qkv.merge`, :func:`qkv.attention_varlen`,
:class:`qkv.KVCache`, :mod:`qkv.distributed`):

- **NumPy arrays, lists and scalars** are read by NumPy; results are NumPy arrays.
- **PyTorch tensors on the CPU** are read as NumPy arrays *without a copy* (a contiguous
  float tensor shares its memory); ``bfloat16``, which NumPy lacks, is read as float32.
  Results come back as tensors: of the inputs' dtype (``bfloat16`` when every tensor input is),
  on the CPU. Sparse and quantized tensors, and float8 ones, are refused by name.
- **Tensors on another device** (CUDA, ``meta``...) are never copied silently. Only
  :func:`qkv.attention` takes them, and runs them on qkv's Triton kernels (:mod:`qkv.gpu`), which
  fall back to the CPU with a warning for what they do not cover. Every other function refuses
  them with :class:`qkv.InputError` naming the argument and the device.
- **Autograd**: a tensor that requires grad (with gradients enabled) gets its gradient from
  qkv's own VJPs where qkv has one (:mod:`qkv.torch_bridge`); where it has none the call is
  refused by name, never silently detached.

Importing this module does not import torch: a tensor can only exist once torch is imported,
so :func:`is_tensor` looks in ``sys.modules`` and costs nothing for NumPy users.

Examples
--------
>>> from qkv.tensors import is_tensor, want_of
>>> is_tensor([1.0, 2.0], None)
False
>>> want_of([1.0], [2.0]) is None          # NumPy in: NumPy out
True
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InputError, InputTypeError
from .validate import add_reader

__all__ = [
    "Want",
    "as_dtype",
    "give",
    "give_pair",
    "give_at",
    "give_plain",
    "is_tensor",
    "one_device",
    "read",
    "read_cpu",
    "read_at",
    "read_plain",
    "read_plain_float",
    "read_plain_mask",
    "read_shadow",
    "refuse_dtype",
    "refuse_grad",
    "survey",
    "swap_axes",
    "wants_grad",
    "want_of",
]


def _tensor_type() -> Any:
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None)


def is_tensor(*xs: Any) -> bool:
    """True when any of ``xs`` is a ``torch.Tensor``; never imports torch itself."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    tensor = torch.Tensor
    for x in xs:  # a plain loop: this runs on every call of every public function
        if isinstance(x, tensor):
            return True
    return False


def _plain_torch(q: Any, k: Any, v: Any) -> Any:
    """PyTorch's module when ``q``, ``k`` and ``v`` are all ``torch.Tensor`` itself (no
    subclass), else None (PyTorch not imported counts as not tensors)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    tensor = torch.Tensor
    if type(q) is not tensor or type(k) is not tensor or type(v) is not tensor:
        return None
    return torch


def read_plain(q: Any, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``q``, ``k``, ``v`` read as :func:`read` reads them — zero-copy NumPy views — when all
    three are plain CPU tensors (``torch.Tensor`` itself, none requiring grad, NumPy-readable
    as they are); None for anything else, which then takes the general reading (and its
    refusals by name). The commonest call on tensors, read in a few attribute lookups."""
    torch = _plain_torch(q, k, v)
    if torch is None:
        return None
    bf16 = torch.bfloat16
    if q.dtype is not bf16:  # (.numpy() refuses a tensor that requires grad, is not on the
        # CPU or strided, or is a conjugate or negative view: reading those attributes here
        # would cost as much as the call; a refusal, an exception, costs tens of µs, so the
        # one dtype NumPy lacks is asked first)
        try:
            return q.numpy(), k.numpy(), v.numpy()
        except (TypeError, RuntimeError):
            return None
    if k.dtype is not bf16 or v.dtype is not bf16:
        return None
    if q.requires_grad or k.requires_grad or v.requires_grad:
        return None
    if not (q.is_cpu and k.is_cpu and v.is_cpu) or _bfloat16() is None:
        return None
    as_numpy, i16 = _bfloat16(), torch.int16
    try:  # ml_dtypes' bfloat16 over the tensors' memory, as read() reads them
        return (
            q.view(i16).numpy().view(as_numpy),
            k.view(i16).numpy().view(as_numpy),
            v.view(i16).numpy().view(as_numpy),
        )
    except (TypeError, RuntimeError):  # conjugate or negative views, sparse...
        return None


def read_plain_float(x: Any) -> np.ndarray | None:
    """``x`` as :func:`read` reads it — a zero-copy NumPy view — when it is a plain CPU
    float16/32/64 tensor (``torch.Tensor`` itself, not requiring grad); None for anything else,
    which then takes the general reading (and its refusals by name). A decoding loop's
    per-step tensors (:class:`qkv.KVCache`'s ``append`` and ``attend``) in one call."""
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor or x.dtype is torch.bfloat16:
        return None
    try:  # (.numpy() refuses what read() refuses: grad, other devices, negative views)
        a = x.numpy()
    except (TypeError, RuntimeError):
        return None
    return a if a.dtype.kind == "f" else None


def read_at(q: Any, k: Any, v: Any) -> tuple[Any, ...] | None:
    """``q``, ``k``, ``v`` as :func:`qkv.engine.run.plain_at` takes them — their shapes, their
    NumPy dtype, their addresses and their strides in elements — when all three are plain CPU
    tensors of one dtype that :func:`read_plain` would read; None for anything else. No NumPy
    view is made (three cost about 7 µs, and a small call's kept road about 20).

    Last comes, for float16 and bfloat16, a function giving ``q`` widened to float32 (by
    PyTorch, faster than ml_dtypes) as :func:`qkv.engine.run.plain_at` asks for it: its
    address, its strides and the tensor, to be held for the call; None for the others.
    """
    torch = _plain_torch(q, k, v)
    if torch is None:
        return None
    dtype = q.dtype
    if k.dtype is not dtype or v.dtype is not dtype:
        return None
    found = _AT_DTYPES.get(dtype)
    if found is None:
        found = _at_dtype(torch, dtype)
        if found is None:
            return None
    # (what .numpy() refuses: gradients, other devices, negative views; sparse and other
    # layouts have no data pointer or strides, and raise)
    if q.requires_grad or k.requires_grad or v.requires_grad:
        return None
    if not (q.is_cpu and k.is_cpu and v.is_cpu) or q.is_neg() or k.is_neg() or v.is_neg():
        return None
    try:
        strides = (q.stride(), k.stride(), v.stride())
        return (q.shape, k.shape, v.shape, found, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                strides, None if found.itemsize > 2 else lambda: _widened(q))  # fmt: skip
    except (TypeError, RuntimeError):
        return None


def _widened(q: Any) -> tuple[int, tuple[int, ...], Any]:
    """16-bit tensor ``q`` widened to float32: its address, strides and itself."""
    wide = q.float()
    return wide.data_ptr(), wide.stride(), wide


_AT_DTYPES: dict[Any, np.dtype] = {}  # torch's floating dtypes to NumPy's, as met


def _at_dtype(torch: Any, dtype: Any) -> np.dtype | None:
    """NumPy's dtype for torch's ``dtype`` of :func:`read_at` (kept in ``_AT_DTYPES``), or
    None for the others (and for bfloat16 without ml_dtypes)."""
    if dtype is torch.bfloat16:
        found = None if _bfloat16() is None else np.dtype(_bfloat16())
    elif dtype in (torch.float16, torch.float32, torch.float64):
        found = np.dtype(str(dtype).removeprefix("torch."))
    else:
        return None
    if found is not None:
        _AT_DTYPES[dtype] = found
    return found


def give_at(result: np.ndarray, like: Any) -> Any:
    """:func:`qkv.engine.run.plain_at`'s ``result`` for :func:`read_at`'s tensors, ``like``
    one of them: a CPU tensor of their dtype (a 16-bit one's float32 output narrowed by
    PyTorch, rounding to nearest even as NumPy and ml_dtypes do; one already in their 16-bit
    dtype viewed as it is)."""
    torch = sys.modules["torch"]
    dtype = like.dtype
    if result.itemsize == 2 and dtype is torch.bfloat16:  # (ml_dtypes' bfloat16)
        return torch.from_numpy(result.view(np.int16)).view(dtype)
    out = torch.from_numpy(result)
    return out if out.dtype is dtype else out.to(dtype)


def read_plain_mask(mask: Any) -> np.ndarray | None:
    """A mask beside :func:`read_plain`'s tensors, as a zero-copy NumPy view: a plain CPU
    ``torch.bool`` tensor, or a float one (a bias: bfloat16 as ml_dtypes' bfloat16) that does
    not require grad (or a NumPy array, as it is); None for anything else, which then takes
    the general reading."""
    if type(mask) is np.ndarray:
        return mask
    torch = sys.modules.get("torch")
    if torch is None or type(mask) is not torch.Tensor:
        return None
    dtype = mask.dtype
    if dtype is torch.bfloat16 and mask.is_cpu and _bfloat16() is not None:
        try:  # (ml_dtypes' bfloat16 over the tensor's memory)
            return mask.view(torch.int16).numpy().view(_bfloat16())
        except (TypeError, RuntimeError):
            return None
    if dtype not in (torch.bool, torch.float16, torch.float32, torch.float64):
        return None
    if not mask.is_cpu:
        return None
    try:
        return mask.numpy()
    except (TypeError, RuntimeError):
        return None


def give_plain(result: np.ndarray) -> Any:
    """A result of :func:`read_plain`'s inputs, as :func:`give` gives it back: a CPU tensor
    of the same dtype (bfloat16 for ml_dtypes' bfloat16), sharing ``result``'s memory (a
    kernel's fresh output) where it can."""
    if result.flags.writeable:
        torch = sys.modules["torch"]
        if result.dtype.kind != "f":  # ml_dtypes' bfloat16 (its name is slow to read)
            return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(result)
    return give(result, _ON_CPU[False])  # pragma: no cover - kernels give writeable arrays


def _numpy_floats() -> tuple[Any, ...]:
    import torch

    return (torch.float16, torch.float32, torch.float64)


def read(x: Any, name: str) -> Any:
    """``x`` as something :func:`numpy.asarray` reads: CPU tensors as zero-copy NumPy views.

    Raises :class:`InputError` for a tensor on another device (naming the argument and the
    device: qkv never moves data between devices silently) and :class:`InputTypeError` for a
    sparse or quantized tensor. Anything that is not a tensor is returned as it is.
    """
    tensor = _tensor_type()
    if tensor is None or not isinstance(x, tensor):
        return x
    if not x.is_cpu:
        raise InputError(
            f"{name}: a tensor on device {x.device} (shape {tuple(x.shape)}); this function "
            "computes on the CPU and qkv never copies between devices silently: move it with "
            ".cpu() (only qkv.attention runs device tensors, on qkv's GPU kernels)"
        )
    if x.requires_grad:
        x = x.detach()
    if not _is_bfloat16(x):
        try:
            return x.numpy()  # zero-copy: the common case ends here
        except (TypeError, RuntimeError):
            pass
    import torch

    if x.layout != torch.strided or x.is_quantized:
        kind = "quantized" if x.is_quantized else f"{x.layout}".replace("torch.", "")
        raise InputTypeError(
            f"{name}: {kind} tensors are not supported (shape {tuple(x.shape)}, dtype "
            f"{x.dtype}); convert with .to_dense() or .dequantize() first"
        )
    if x.dtype == torch.bfloat16 and _bfloat16() is not None:
        # ml_dtypes' NumPy bfloat16 over the tensor's memory: the attention plan reads K/V in
        # place (the native decode step), everything else widens them
        return x.resolve_conj().resolve_neg().view(torch.int16).numpy().view(_bfloat16())
    if x.is_floating_point() and x.dtype not in _numpy_floats():
        refuse_dtype(x, name)
        x = x.float()  # bfloat16 (without ml_dtypes), which NumPy lacks
    try:
        return x.resolve_conj().resolve_neg().numpy()
    except (TypeError, RuntimeError) as exc:
        raise InputTypeError(
            f"{name}: a tensor NumPy cannot read (shape {tuple(x.shape)}, dtype {x.dtype}): {exc}"
        ) from None


@functools.cache
def _bfloat16() -> Any:
    """ml_dtypes' NumPy bfloat16 type, or None where ml_dtypes is not installed.

    The one place the library imports ml_dtypes (about a second, once): the first call given a
    bfloat16 CPU tensor, which is read in place as ml_dtypes' bfloat16. ``import qkv`` and calls
    on other dtypes never import it; a NumPy bfloat16 array is recognised by its dtype's name,
    without the import (its caller has imported ml_dtypes already).
    """
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes.bfloat16


#: The floating dtypes qkv takes as tensors (float8 and smaller are refused by name).
ACCEPTED = "float16, bfloat16, float32 and float64"


def refuse_dtype(x: Any, name: str) -> None:
    """Refuse a floating tensor of a dtype qkv does not compute in (float8 and the like), by
    name: it would come back as float32, not in the caller's dtype as documented."""
    import torch

    if x.is_floating_point() and x.dtype not in (*_numpy_floats(), torch.bfloat16):
        kind = "float8" if "float8" in str(x.dtype) else str(x.dtype).replace("torch.", "")
        raise InputTypeError(
            f"{name}: {kind} tensors ({x.dtype}, shape {tuple(x.shape)}) are not supported; "
            f"qkv takes {ACCEPTED} tensors: convert with .to(torch.bfloat16) or .float() first"
        )


def read_cpu(x: Any, name: str) -> Any:
    """:func:`read` for an argument already known to be on the CPU: a plain tensor's
    ``.numpy()`` first (the common case, one call), else the whole policy."""
    if not _is_bfloat16(x):  # NumPy has no bfloat16: .numpy() would raise, at a cost
        try:
            return x.numpy()
        except (AttributeError, TypeError, RuntimeError):
            pass
    return read(x, name)


def _is_bfloat16(x: Any) -> bool:
    """Whether ``x`` is a bfloat16 tensor (its ``.numpy()`` raises: a C++ exception, tens of
    microseconds per call)."""
    import torch

    return getattr(x, "dtype", None) == torch.bfloat16


def read_shadow(x: Any, name: str = "tensor") -> Any:
    """A zero-stride NumPy stand-in with a device tensor's shape, for checking shapes only.

    Floats become float32, bools bool; other dtypes keep a kind the checks refuse by name, and
    float8 is refused here (:func:`refuse_dtype`). Anything that is not a tensor is returned
    as it is.
    """
    tensor = _tensor_type()
    if tensor is None or not isinstance(x, tensor):
        return x
    import torch

    refuse_dtype(x, name)

    if x.dtype == torch.bool:
        dtype: Any = np.bool_
    elif x.is_floating_point():
        dtype = np.float32
    else:
        dtype = np.complex64 if x.is_complex() else np.int64
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(x.shape))


@dataclass(frozen=True)
class Want:
    """What a result should be given back as: a tensor (``bfloat16`` when the inputs were, else
    the dtype NumPy computed) on ``device`` (``None``: the CPU). ``None`` instead of a
    :class:`Want` means NumPy arrays."""

    bfloat16: bool
    device: Any


_ON_CPU = {False: Want(bfloat16=False, device=None), True: Want(bfloat16=True, device=None)}


def want_of(*xs: Any) -> Want | None:
    """The result type for inputs ``xs``: ``None`` (NumPy) unless one of them is a tensor.

    ``bfloat16`` is kept when every tensor among ``xs`` is ``bfloat16`` (computed in float32);
    otherwise the dtype is the one NumPy's rules gave the result.
    """
    tensor = _tensor_type()
    if tensor is None:
        return None
    tensors = [x for x in xs if isinstance(x, tensor)]
    if not tensors:
        return None
    import torch

    bf16 = all(t.dtype == torch.bfloat16 for t in tensors)
    first = tensors[0]
    return _ON_CPU[bf16] if first.is_cpu else Want(bfloat16=bf16, device=first.device)


def give(result: Any, want: Want | None, *, exact: bool = False) -> Any:
    """``result`` (an array, a tuple of them, or anything else) in the caller's type.

    Arrays become tensors sharing their memory where NumPy allows (a writeable contiguous
    array); integer and bool arrays keep their dtype; floats follow :class:`Want`, or keep the
    dtype they were computed in with ``exact`` (a log-sum-exp stays in the accumulation dtype).
    """
    if want is None:
        return result
    if isinstance(result, tuple):
        return tuple(give(r, want, exact=exact) for r in result)
    if isinstance(result, list):
        return [give(r, want, exact=exact) for r in result]
    if not isinstance(result, (np.ndarray, np.generic)):
        return result
    import torch

    t = _tensor_of(result)
    if want.bfloat16 and not exact and t.is_floating_point():
        t = t.to(torch.bfloat16)
    if want.device is not None:
        t = t.to(want.device)
    return t


def give_pair(out: Any, lse: Any, want: Want | None) -> tuple[Any, Any]:
    """``(out, lse)`` in the caller's type: ``out`` as :func:`give` makes it, the lse in the
    accumulation dtype it was computed in (``exact``)."""
    return give(out, want), give(lse, want, exact=True)


def as_dtype(a: np.ndarray, like: Any) -> Any:
    """``a`` as a tensor of ``like``'s dtype and device (gradients back to their input)."""
    return _tensor_of(a).to(dtype=like.dtype, device=like.device)


def _tensor_of(result: Any) -> Any:
    """An array as a CPU tensor, sharing its memory where NumPy allows (a writeable array,
    contiguous or with positive strides: a kernel's output written rows first is a view of
    another layout); ml_dtypes' ``bfloat16`` as torch's (the same bits)."""
    import torch

    a = np.asarray(result)
    if not (a.flags.writeable and (a.flags.c_contiguous or _shareable(a))):
        a = np.array(a, order="C")
    if a.dtype.kind == "V" and a.dtype.name == "bfloat16":  # (kind first: the name is slow)
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _shareable(a: np.ndarray) -> bool:
    """Whether ``torch.from_numpy`` shares ``a``'s memory without aliasing its elements:
    strides positive and whole elements (a broadcast's zero strides are copied)."""
    return all(s > 0 and s % a.itemsize == 0 for s in a.strides)


def swap_axes(x: Any, a: int, b: int) -> Any:
    """``x`` with axes ``a`` and ``b`` swapped, as a view: a tensor stays a tensor (in the
    autograd graph), anything else is read by NumPy."""
    if is_tensor(x):
        return x.transpose(a, b)
    return np.swapaxes(x, a, b)


def swapped_result(x: Any, a: int, b: int) -> Any:
    """A result given back in the caller's layout: ``x`` with axes ``a`` and ``b`` swapped and
    laid out contiguously in that order, as FlashAttention gives its outputs (code written for
    it calls ``.view`` on them). No copy where the kernel wrote that layout already; a tensor
    stays in the autograd graph."""
    y = swap_axes(x, a, b)
    if is_tensor(y):
        return y.contiguous()
    return np.ascontiguousarray(y)


@dataclass(frozen=True)
class Survey:
    """What the tensor policy needs to know of a call's arguments, gathered in one pass."""

    device: bool  #: a tensor lies on a device other than the CPU
    grad: tuple[str, ...]  #: the names of the tensors that require grad (gradients enabled)
    want: Want | None  #: the result type (from ``q``, ``k``, ``v``)


def survey(given: dict[str, Any]) -> Survey:
    """One pass over a call's named arguments (``q``, ``k``, ``v`` first): devices, which
    require grad, and the result type (:func:`want_of` of ``q``, ``k``, ``v``)."""
    import torch

    tensor = torch.Tensor
    device, grad, first, bf16 = False, [], None, True
    grad_on = torch.is_grad_enabled()
    for name, x in given.items():
        if not isinstance(x, tensor):
            continue
        if not x.is_cpu:
            device = True
        if grad_on and x.requires_grad:
            grad.append(name)
        if name in ("q", "k", "v"):
            first = x if first is None else first
            bf16 = bf16 and x.dtype == torch.bfloat16
    want = None
    if first is not None:
        want = _ON_CPU[bf16] if first.is_cpu else Want(bfloat16=bf16, device=first.device)
    return Survey(device, tuple(grad), want)


def wants_grad(*xs: Any) -> bool:
    """True when gradients are enabled and one of ``xs`` is a tensor that requires grad."""
    tensor = _tensor_type()
    if tensor is None:
        return False
    import torch

    return torch.is_grad_enabled() and any(isinstance(x, tensor) and x.requires_grad for x in xs)


def refuse_grad(fn: str, **named: Any) -> None:
    """Raise :class:`InputError` when one of ``named`` requires grad (with gradients enabled)
    in a function ``fn`` that has no gradient: the caller hears of it, never a silent detach."""
    if not is_tensor(*named.values()):
        return  # (NumPy arrays: nothing to ask, on every step of a decoding loop)
    for name, x in named.items():
        if wants_grad(x):
            raise InputError(
                f"{name}: requires grad (shape {tuple(x.shape)}), but {fn} gives no gradient; "
                "run it under torch.no_grad() or pass a detached tensor"
            )


# Every NumPy function of qkv that reads an argument reads tensors by this same policy.
add_reader(is_tensor, read)


def one_device(given: dict[str, Any]) -> Any:
    """The one CUDA (or CPU) device the tensors among a call's arguments ``given`` lie on;
    an :class:`InputError` naming them for another device, several, or a mix of tensors and
    arrays (checked before anything GPU-specific is imported)."""
    import torch

    tensors = [(n, t) for n, t in given.items() if isinstance(t, torch.Tensor)]
    for n, t in tensors:
        if t.device.type not in ("cuda", "cpu"):
            raise InputError(
                f"{n}: tensors on device {t.device} are not supported (shape "
                f"{tuple(t.shape)}); qkv's GPU kernels run on CUDA devices, so move them with "
                ".cuda() or .cpu()"
            )
    devices = {t.device for _, t in tensors}
    named = [(n, given.get(n)) for n in ("q", "k", "v", "mask")]
    untensored = any(
        n != "mask" and x is not None and not isinstance(x, torch.Tensor) for n, x in named
    )
    if len(devices) > 1 or untensored:
        where = ", ".join(
            f"{n} on {t.device}" if isinstance(t, torch.Tensor) else f"{n} not a tensor"
            for n, t in given.items()
            if t is not None
        )
        raise InputError(f"{', '.join(given)}: must be tensors on one device, got {where}")
    return next(iter(devices))

"""Stored forms of keys and values: bfloat16, float16 and 8-bit codes with scales.

A decoding step reads every cached key and value once, so its time is the bytes it reads.
:class:`qkv.KVCache` can store K/V in fewer bytes than float32; this module states each form
and is its reference (:func:`quantize_kv` and :func:`dequantize_kv`, plain NumPy). The native
decode kernel reads the stored form in place and widens it in registers: it must equal the
float64 reference applied to :func:`dequantize_kv`'s values, to float32 rounding.

Forms (``dtype``):

- ``"bfloat16"`` (2 bytes): float32's sign, exponent and top 7 mantissa bits, rounded to
  nearest even; held as ``uint16`` bits (no NumPy bfloat16 type is needed).
- ``"float16"`` (2 bytes): IEEE half precision, NumPy's ``float16``.
- ``"int8"`` (1 byte + 4 per row): ``x ≈ code · scale`` with ``code`` in ``[-127, 127]``
  and one float32 ``scale = max|x| / 127`` per row of ``d`` values, that is per token and kv
  head.
- ``"float8_e4m3fn"`` (1 byte + 4 per row): ``x ≈ e4m3(code) · scale`` with ``scale = max|x|
  / 448`` per row (448 is the largest e4m3fn value); codes are ``uint8`` bits (sign, 4
  exponent bits of bias 7, 3 mantissa bits), rounded to nearest even.

A row so small that ``max|x| / 127`` (or ``/ 448``) falls below float32's smallest normal value
2^-126 (``max|x|`` below about 1.5e-36 for int8, 5.3e-36 for e4m3fn) takes that quotient rounded
*up* to a multiple of 2^-149, the spacing of float32's subnormals, and at least 2^-149: such a
row is never stored as zeros (rounded to nearest it would be 0 below about 9e-44 for int8, 3e-43
for e4m3fn) and no code is clipped. Its step is then coarser than ``max|x| / 127`` by up to
2^-149, and each value is within half a step (int8) or 2^-4 of itself plus ``scale · 2^-10``
(e4m3fn, and the float32 product's own rounding, at most 2^-150), as in every row. An int8 row
whose values are all below ``127 · 2^-149`` (about 1.8e-43) is stored exactly.

Why a scale per token and head (as llama.cpp's q8_0 takes one per 32 values, and vLLM one per
tensor): an appended token is quantized once and never again, whatever comes after it; the
kernel reads one scale per key row and applies it once to that key's dot product and once to
its weight, not to each value. Its cost in error is measured on the benchmarks page.

Examples
--------
>>> import numpy as np
>>> x = np.array([[0.5, -1.0, 0.25, 2.0]], dtype=np.float32)
>>> codes, scales = quantize_kv(x, "int8")
>>> codes.tolist(), scales.tolist()
([[32, -64, 16, 127]], [0.015748031437397003])
>>> dequantize_kv(codes, scales, "int8").astype(float).round(3).tolist()
[[0.504, -1.008, 0.252, 2.0]]
>>> dequantize_kv(*quantize_kv(x, "bfloat16"), "bfloat16").tolist()
[[0.5, -1.0, 0.25, 2.0]]
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InputError, InputTypeError
from ..keywords import near_keywords
from ..numerics import STORED_FORMS
from ..validate import as_array

__all__ = [
    "FORMATS",
    "SCALED",
    "SPELLINGS",
    "check_format",
    "dequantize_kv",
    "meant",
    "quantize_kv",
    "storage_dtype",
    "storage_of",
]

FORMATS = tuple(f.name for f in STORED_FORMS)
SCALED = tuple(f.name for f in STORED_FORMS if f.scaled)  # forms with a float32 scale per row
_STORAGE: dict[str, np.dtype] = {f.name: f.storage for f in STORED_FORMS}
_E4M3_MAX = 448.0
_NORMAL = np.float32(2.0**-126)  # float32's smallest normal value
_SUBNORMAL = 2.0**-149  # and its smallest positive one, the subnormals' spacing

#: Other names for the stored forms and float dtypes (PyTorch's, JAX's, the papers'), each
#: with the name qkv takes: the hint of a refused ``dtype``.
SPELLINGS = {
    "bf16": "bfloat16",
    "brain_float16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "fp8": "float8_e4m3fn",
    "f8": "float8_e4m3fn",
    "float8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e4m3fn": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "e4m3fn": "float8_e4m3fn",
    "i8": "int8",
    "q8": "int8",
    "q8_0": "int8",
    "qint8": "int8",
    "fp32": "float32",
    "f32": "float32",
    "single": "float32",
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
}


def meant(dtype: Any, names: Sequence[str] = FORMATS) -> str | None:
    """The name in ``names`` that a refused ``dtype`` most likely means, or ``None``.

    Another library's spelling (:data:`SPELLINGS`: ``"bf16"``, ``"fp8"``, ``torch.float16``)
    or a close one (``"bfloat"``).

    >>> meant("bf16"), meant("fp8"), meant("E4M3"), meant("fp32"), meant("fp32", ("float32",))
    ('bfloat16', 'float8_e4m3fn', 'float8_e4m3fn', None, 'float32')
    """
    text = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None) or str(dtype)
    key = text.strip().lower().rsplit(".", 1)[-1].replace("-", "_")
    name = SPELLINGS.get(key, key)
    if name in names:
        return name
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.85)
    return close[0] if close else None


def check_format(dtype: Any, name: str = "dtype") -> str:
    """The name of a stored form (:data:`FORMATS`), from a string or a NumPy/ml_dtypes dtype;
    :class:`qkv.InputTypeError` naming ``name`` otherwise."""
    text = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None)
    if text is None:
        try:
            text = np.dtype(dtype).name
        except TypeError:
            text = repr(dtype)
    if text not in FORMATS:
        near = meant(dtype)
        hint = f"; did you mean {near!r}?" if near else ""
        raise InputTypeError(f"{name}: expected one of {FORMATS}, got {dtype!r}{hint}")
    return text


def storage_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype that holds the codes of a stored form."""
    return _STORAGE[check_format(dtype)]


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bits, rounded to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(x)
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def _e4m3_bits(y: np.ndarray) -> np.ndarray:
    """Values with ``|y| <= 448`` as float8 e4m3fn bits, rounded to nearest even."""
    a = np.abs(y).astype(np.float64)
    sign = (np.signbit(y).astype(np.uint8)) << np.uint8(7)
    _, e = np.frexp(a)  # a = m · 2^e, 0.5 <= m < 1
    exp = np.maximum(e - 1, -6)  # unbiased exponent, subnormals share the smallest one
    step = np.ldexp(1.0, exp - 3)  # spacing of representable values at that exponent
    q = np.rint(a / step) * step  # nearest even on ties (rint)
    _, e2 = np.frexp(q)
    normal = q >= 2.0**-6
    biased = np.where(normal, e2 - 1 + 7, 0)
    mant = np.where(normal, np.rint((q / np.ldexp(1.0, e2 - 1) - 1) * 8), np.rint(q * 2.0**9))
    bits = (biased.astype(np.uint8) << np.uint8(3)) | mant.astype(np.uint8)
    return np.where(q == 0, np.uint8(0), bits).astype(np.uint8) | sign


def _e4m3_values(bits: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bits as float32 values."""
    b = bits.astype(np.int32)
    exp, mant = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp > 0, np.ldexp(1.0 + mant / 8.0, exp - 7), np.ldexp(mant / 8.0, -6))
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


def _scales(top: np.ndarray, limit: float) -> np.ndarray:
    """``top / limit`` in float32; below float32's smallest normal (2^-126) the nearest float32
    may lie far below it (the subnormals are multiples of 2^-149) or be 0, so there it is
    rounded up to the next multiple of 2^-149: no code is clipped and no row stored as 0."""
    scales = (top / np.float32(limit)).astype(np.float32)
    tiny = (top > 0) & (scales < _NORMAL)
    if tiny.any():
        steps = np.ceil(top[tiny].astype(np.float64) / limit / _SUBNORMAL)
        scales[tiny] = (steps * _SUBNORMAL).astype(np.float32)  # exact: below 2^-126
    return scales


@near_keywords()
def quantize_kv(x: Any, dtype: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """Keys or values in a stored form: ``(codes, scales)``.

    Parameters
    ----------
    x : array_like, shape ``(..., d)``
        Finite real values (a scaled form refuses infinities and NaN: no scale holds them).
    dtype : {"bfloat16", "float16", "int8", "float8_e4m3fn"}
        The form (see the module's description).

    Returns
    -------
    codes : ndarray, shape ``(..., d)``
        ``uint16`` bits (bfloat16), ``float16``, ``int8`` codes or ``uint8`` e4m3fn bits: NumPy
        arrays whatever ``x`` was (a CPU tensor is read in place), as the cache stores them.
    scales : ndarray of float32, shape ``(...)``, or None
        One scale per row of ``d`` values for ``"int8"`` and ``"float8_e4m3fn"``; None else:
        ``max|x| / 127`` or ``/ 448`` in float32. Below float32's smallest normal value
        (2^-126) it is rounded up to a multiple of 2^-149, and a nonzero row's is at least
        2^-149, so rows of tiny subnormals keep their values rather than a zero scale; each
        value stays within half a step (``scale / 2``, int8) or 2^-4 of itself plus
        ``scale · 2^-10`` and 2^-150 (e4m3fn), and an int8 row below ``127 · 2^-149`` is
        kept exactly.

    Examples
    --------
    Subnormal values, in units of 2^-149 (float32's smallest positive value):

    >>> codes, scales = quantize_kv([[3e-45, -1e-45, 0.0]], "int8")
    >>> codes.tolist(), (dequantize_kv(codes, scales, "int8") / np.float32(2.0**-149)).tolist()
    ([[2, -1, 0]], [[2.0, -1.0, 0.0]])
    """
    form = check_format(dtype)
    a = as_array(x, "x")  # NumPy arrays, lists, CPU tensors (bfloat16 ones too)
    if a.ndim < 1:
        raise InputError(f"x: expected at least 1 dimension (..., d), got shape {a.shape}")
    a = a.astype(np.float32, copy=False)
    if form == "bfloat16":
        return _bf16_bits(a), None
    if form == "float16":
        return a.astype(np.float16), None
    if not np.isfinite(a).all():
        raise InputError(
            f"x: {form} stores finite values only (a scale per row), got infinities or NaN in "
            f"shape {a.shape}; store this cache as float32, float16 or bfloat16"
        )
    top = np.abs(a).max(axis=-1) if a.shape[-1] else np.zeros(a.shape[:-1], np.float32)
    limit = 127.0 if form == "int8" else _E4M3_MAX
    scales = _scales(top, limit)
    safe = np.where(scales > 0, scales, np.float32(1))[..., None]
    y = np.clip(a / safe, -limit, limit)
    if form == "int8":
        return np.rint(y).astype(np.int8), scales
    return _e4m3_bits(y), scales


@near_keywords()
def dequantize_kv(codes: Any, scales: Any, dtype: Any) -> np.ndarray:
    """The float32 values a stored form holds (the reference the kernel must equal).

    Examples
    --------
    >>> codes, scales = quantize_kv([[1.0, -3.0, 0.1]], "float8_e4m3fn")
    >>> codes.tolist()  # 149.3 (1 / scale) rounds to e4m3fn's 144: steps of 16 above 128
    [[113, 254, 87]]
    >>> dequantize_kv(codes, scales, "float8_e4m3fn").astype(float).round(4).tolist()
    [[0.9643, -3.0, 0.1004]]
    """
    form = check_format(dtype)
    c = np.asarray(codes)
    if c.dtype != _STORAGE[form]:
        raise InputTypeError(
            f"codes: {form} codes are {_STORAGE[form]}, got dtype {c.dtype} with shape {c.shape}"
        )
    if form == "bfloat16":
        return (c.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if form == "float16":
        return c.astype(np.float32)
    if scales is None:
        raise InputError(f"scales: {form} codes need their scales (shape {c.shape[:-1]})")
    s = np.asarray(scales, dtype=np.float32)
    if s.shape != c.shape[:-1]:
        raise InputError(
            f"scales: expected shape {c.shape[:-1]} for codes of shape {c.shape}, got {s.shape}"
        )
    vals = c.astype(np.float32) if form == "int8" else _e4m3_values(c)
    return vals * s[..., None]


_WANTED = f"dtype: expected a float dtype (float16, float32, float64) or a stored form {FORMATS}"


def storage_of(dtype: Any) -> tuple[np.dtype | str, str | None]:
    """``(dtype, form)`` of a cache's ``dtype`` argument (:class:`qkv.KVCache`,
    :class:`qkv.PagedKVCache`): a float dtype and None (or ``"float16"``, a form read in
    place), or a stored form's name twice; a refused one's message names the form or dtype it
    likely means (``"bf16"``: ``'bfloat16'``).

    >>> storage_of("int8"), storage_of(np.float16)
    (('int8', 'int8'), (dtype('float16'), 'float16'))
    """
    try:
        form = check_format(dtype)
    except InputTypeError:
        form = None  # a float dtype, or nothing qkv stores
    if form is not None and form != "float16":
        return form, form
    try:
        if dtype is None:  # np.dtype(None) would silently be float64
            raise TypeError
        dt = np.dtype(dtype)
    except TypeError:
        raise InputTypeError(f"{_WANTED}, got {dtype!r}{_hint(dtype)}") from None
    if dt not in (np.float16, np.float32, np.float64):
        # a code NumPy reads as another dtype ("f16": 16 bytes, float128) is named as given
        given = f"{dtype!r} (NumPy's {dt})" if isinstance(dtype, str) and dtype != dt.name else dt
        raise InputTypeError(f"{_WANTED}, got {given}{_hint(dtype)}")
    return dt, "float16" if dt == np.float16 else None


def _hint(dtype: Any) -> str:
    near = meant(dtype, (*FORMATS, "float32", "float64"))
    return f"; did you mean {near!r}?" if near else ""

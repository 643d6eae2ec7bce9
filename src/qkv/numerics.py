"""The numeric rules every path shares, each written once.

- :func:`acc_dtype`: the dtype a call is computed and accumulated in, from its input dtype
  (float16 and bfloat16 in float32, wider floats in themselves);
- :func:`default_scale`: the scale when none is given, ``1/sqrt(d)``;
- :data:`STORED_FORMS`: the forms K and V can be stored in (name, NumPy storage dtype, whether
  a float32 scale per row goes with the codes, and the code the native library's
  ``qkv_decode_args.kv_format`` takes). :mod:`qkv.engine.quant` and
  :mod:`qkv.engine.kernels.native_lib` derive their tables from it; the library's C enum
  (``native_src/abi.h``) is checked against it when the library loads.

The checked plan (:func:`qkv.validate.make_plan`) takes its compute dtype and default scale
from here, so every road that runs a plan (the NumPy kernels, the cache, the torch bridge, the
GPU path) follows them; varlen, softmax and the native decode step call them directly. This
module imports nothing of qkv, so every layer may import it.

Examples
--------
>>> import numpy as np
>>> acc_dtype(np.float16), acc_dtype(np.float64)
(dtype('float32'), dtype('float64'))
>>> default_scale(4)
0.5
>>> [(f.name, f.code) for f in STORED_FORMS if f.scaled]
[('int8', 3), ('float8_e4m3fn', 4)]
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numpy.typing import DTypeLike

__all__ = [
    "FAST_CODE",
    "FAST_FORMS",
    "PRECISIONS",
    "SAME_CODE",
    "STORED_FORMS",
    "StoredForm",
    "acc_dtype",
    "default_scale",
    "normal_range",
    "scale_in_range",
]

_F32 = np.dtype(np.float32)


def acc_dtype(dtype: DTypeLike) -> np.dtype:
    """The dtype a call on inputs of ``dtype`` is computed and accumulated in.

    Products and sums narrower than float32 lose too much: float16 and bfloat16 (every dtype
    of fewer than 4 bytes) are computed in float32, so products accumulate in at least float32
    and the log-sum-exp is float32 or wider. float32 and float64 are computed in themselves.

    Parameters
    ----------
    dtype : dtype_like
        The inputs' (result) dtype: a NumPy dtype or anything :class:`numpy.dtype` reads
        (ml_dtypes' ``bfloat16`` included).

    Returns
    -------
    numpy.dtype
        float32 for a dtype of fewer than 4 bytes, else ``dtype`` itself.

    Examples
    --------
    >>> import numpy as np
    >>> [str(acc_dtype(t)) for t in (np.float16, np.float32, np.float64)]
    ['float32', 'float32', 'float64']
    """
    dt = np.dtype(dtype)
    return _F32 if dt.itemsize < 4 else dt


def default_scale(d: int) -> float:
    """The scale that multiplies the scores when none is given: ``1/sqrt(d)``.

    Parameters
    ----------
    d : int
        The head size (``q.shape[-1]``), at least 1.

    Returns
    -------
    float
        ``1.0 / math.sqrt(d)`` (which is not always the same float as ``d ** -0.5``).

    Examples
    --------
    >>> default_scale(64)
    0.125
    >>> default_scale(2) == 1 / 2**0.5
    True
    """
    return 1.0 / math.sqrt(d)


def scale_in_range(scale: float, dtype: np.dtype) -> bool:
    """Whether ``scale`` is a normal number of ``dtype`` (neither subnormal nor overflowing)."""
    tiny, top = normal_range(np.dtype(dtype))
    return tiny <= scale <= top


@functools.cache
def normal_range(dtype: np.dtype) -> tuple[float, float]:
    """The smallest normal and the largest finite ``dtype`` number (looked up once per dtype:
    small calls pay for every microsecond)."""
    info = np.finfo(dtype)
    return float(info.tiny), float(info.max)


class StoredForm(NamedTuple):
    """One form K and V can be stored in (see :mod:`qkv.engine.quant` for each one's rule).

    Attributes
    ----------
    name : str
        The form's name, as ``KVCache(dtype=...)`` and ``quantize_kv`` take it.
    storage : numpy.dtype
        The NumPy dtype that holds its codes (bfloat16 as ``uint16`` bits, float8 e4m3fn as
        ``uint8`` bits).
    scaled : bool
        Whether each row of codes comes with a float32 scale (the 8-bit forms).
    code : int
        Its ``kv_format`` code in the native library's C ABI (``native_src/abi.h``).
    """

    name: str
    storage: np.dtype
    scaled: bool
    code: int


#: ``kv_format`` when K and V are in the compute dtype itself (abi.h's ``KV_SAME``).
SAME_CODE = 0

#: The decode step's ``precision`` values: ``"exact"`` (the default: every product in
#: float32 of the stored values) and ``"fast"`` (opt in: the query rows rounded to int8 before
#: their products with int8 keys, :mod:`qkv.engine.kernels.decode_fast`).
PRECISIONS = ("exact", "fast")

#: The stored forms ``precision="fast"`` changes; on the others it runs the exact road.
FAST_FORMS = ("int8",)

#: Added to a form's code on the fast road (abi.h's ``KV_FAST``).
FAST_CODE = 256

#: The stored forms of K and V, in the order they are listed to users. The C enum in
#: ``native_src/abi.h`` mirrors the codes; the loader refuses a library that disagrees.
STORED_FORMS: tuple[StoredForm, ...] = (
    StoredForm("bfloat16", np.dtype(np.uint16), False, 1),
    StoredForm("float16", np.dtype(np.float16), False, 2),
    StoredForm("int8", np.dtype(np.int8), True, 3),
    StoredForm("float8_e4m3fn", np.dtype(np.uint8), True, 4),
)

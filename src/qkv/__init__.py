"""qkv: scaled dot-product attention, ``softmax(q Kᵀ/√d) V``, on NumPy.

The definitional formula lives in :mod:`qkv.reference` (float64); the functions here are the
fast paths, tested to equal it.

Examples
--------
>>> import qkv
>>> qkv.attention([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], scale=0.5).round(4).tolist()
[2.9051, 3.9051]
"""

from __future__ import annotations

from . import (
    reference,
    render,  # noqa: F401, I001  (registers the formats Trace.render finds)
)
from ._version import __version__
from .about import info
from .engine.quant import dequantize_kv, quantize_kv
from .errors import InputError, InputTypeError
from .explanation.trace import Trace, explain
from .front import (
    KVCache,
    attention,
    attention_varlen,
    attention_vjp,
    attention_weights,
    merge,
    scores,
    softmax,
)
from .learn.widget import widget

__all__ = [
    "InputError",
    "InputTypeError",
    "KVCache",
    "Trace",
    "__version__",
    "attention",
    "attention_varlen",
    "attention_vjp",
    "attention_weights",
    "dequantize_kv",
    "explain",
    "info",
    "merge",
    "quantize_kv",
    "reference",
    "scores",
    "softmax",
    "widget",
]

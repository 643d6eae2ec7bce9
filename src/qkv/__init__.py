"""qkv: scaled dot-product attention, ``softmax(q Kᵀ/√d) V``, on NumPy.

The definitional formula lives in :mod:`qkv.reference` (float64); the functions here are the
fast paths, tested to equal it.

``import qkv`` imports NumPy and the front of the compute library only (:mod:`qkv.front` and
the checks under it). Everything else loads on first use: the NumPy kernels on the first call,
the other public names (:class:`KVCache`, :func:`explain`, :func:`info`, :func:`widget`...)
when first looked up here (the table :data:`_LAZY`), and a subpackage such as ``qkv.plot``
or ``qkv.testing`` on its first attribute access. ml_dtypes is imported only by the first call
given a bfloat16 CPU tensor (:func:`qkv.tensors.read`), to read it in place.

Examples
--------
>>> import qkv
>>> qkv.attention([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], scale=0.5).round(4).tolist()
[2.9051, 3.9051]
"""

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import InputError, InputTypeError
from .explanation import formats as _formats
from .front import attention, attention_weights, scores, softmax

if TYPE_CHECKING:  # for type checkers; at run time these come from _LAZY on first use
    from . import reference
    from .about import Route, info, route
    from .engine.decoding import DecodePlan, plan_decode
    from .engine.quant import dequantize_kv, quantize_kv
    from .explanation.trace import Trace, explain
    from .learn.widget import widget
    from .wrapped import KVCache, PagedKVCache, attention_varlen, attention_vjp, merge

__all__ = [
    "DecodePlan",
    "InputError",
    "InputTypeError",
    "KVCache",
    "PagedKVCache",
    "Route",
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
    "plan_decode",
    "quantize_kv",
    "reference",
    "route",
    "scores",
    "softmax",
    "widget",
]

#: The public names imported on first use -> their home module (the name itself: a module).
_LAZY = {
    "KVCache": "qkv.wrapped",
    "PagedKVCache": "qkv.wrapped",
    "attention_varlen": "qkv.wrapped",
    "attention_vjp": "qkv.wrapped",
    "merge": "qkv.wrapped",
    "Trace": "qkv.explanation.trace",
    "explain": "qkv.explanation.trace",
    "Route": "qkv.about",
    "info": "qkv.about",
    "route": "qkv.about",
    "DecodePlan": "qkv.engine.decoding",
    "plan_decode": "qkv.engine.decoding",
    "dequantize_kv": "qkv.engine.quant",
    "quantize_kv": "qkv.engine.quant",
    "reference": "qkv.reference",
    "widget": "qkv.learn.widget",
}


def _renderers() -> None:
    from . import render  # noqa: F401  (registers every format in qkv.explanation.formats)


# Trace.render finds the formats the render package registers; it is imported by the first one.
_formats.register_later(_renderers)


def __getattr__(name: str) -> Any:
    """A public name of :data:`_LAZY`, or a submodule (``qkv.plot``), imported on first use."""
    home = _LAZY.get(name)
    if home is not None:
        module = importlib.import_module(home)
        value = module if home == f"{__name__}.{name}" else getattr(module, name)
        globals()[name] = value  # found directly from now on
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule is there but needs a library that is not
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (:data:`__all__`) and the public submodules."""
    import pkgutil

    modules = (m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return sorted({*__all__, *modules})

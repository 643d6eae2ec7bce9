"""The NumPy engine's other public functions, under the tensor policy of :mod:`qkv.front`.

:func:`merge`, :func:`attention_vjp`, :func:`attention_varlen`, :class:`KVCache` and
:class:`PagedKVCache` are the engine's own (:mod:`qkv.engine.merge`, :mod:`~qkv.engine.grad`,
:mod:`~qkv.engine.varlen`, :mod:`~qkv.engine.cache`, :mod:`~qkv.engine.paged`) under the
same tensor policy (:mod:`qkv.tensors`): tensors in, tensors out (dtype and device of the
caller), autograd where qkv has a gradient and a refusal by name where it has none. Their
signatures and documentation are the engine's, written once there (:func:`functools.wraps`).

They live apart from :mod:`qkv.front` because wrapping them imports the engine and its kernels:
``import qkv`` imports this module on the first use of one of them (``qkv.KVCache``...), not
before.

Examples
--------
>>> import numpy as np, qkv
>>> a = qkv.attention([1.0, 0.0], [[1.0, 0.0]], [[1.0, 2.0]], return_lse=True)
>>> b = qkv.attention([1.0, 0.0], [[0.0, 1.0]], [[3.0, 4.0]], return_lse=True)
>>> out, lse = merge([a, b])
>>> bool(np.allclose(out, qkv.attention([1.0, 0.0], [[1, 0], [0, 1]], [[1, 2], [3, 4]])))
True
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import wraps
from typing import Any

import numpy as np

from . import torch_bridge
from .engine import cache, grad, paged, varlen
from .engine import merge as merging
from .keywords import near_keywords
from .tensors import (
    give,
    give_pair,
    give_plain,
    read,
    read_plain_float,
    refuse_grad,
    want_of,
    wants_grad,
)
from .validate import VARIANTS

__all__ = ["KVCache", "PagedKVCache", "attention_varlen", "attention_vjp", "merge"]


@near_keywords(VARIANTS)
@wraps(grad.attention_vjp)
def attention_vjp(q: Any, k: Any, v: Any, grad_out: Any, **options: Any) -> Any:
    # Tensors in give tensors out (each input's dtype). No autograd graph: qkv has no second
    # derivative, so a tensor that requires grad is refused by name.
    refuse_grad("attention_vjp", q=q, k=k, v=v, grad_out=grad_out)
    return give(grad.attention_vjp(q, k, v, grad_out, **options), want_of(q, k, v))


@near_keywords()
@wraps(merging.merge)
def merge(parts: Sequence[tuple[Any, Any]], *, sinks: Any = None) -> Any:
    # Tensors in give tensors out, with gradients for every part that requires grad.
    pairs = parts if isinstance(parts, (list, tuple)) else []
    flat = [x for part in pairs if isinstance(part, (list, tuple)) for x in part]
    refuse_grad("merge", sinks=sinks)
    # out follows the parts' outputs (bfloat16 in, bfloat16 out); the lse keeps its dtype
    want = want_of(*flat[::2]) or want_of(*flat, sinks)
    if any(wants_grad(x) for x in flat):
        return torch_bridge.merge_parts(parts, sinks, want)
    out, lse = merging.merge(parts, sinks=sinks)
    return give_pair(out, lse, want)


@near_keywords()
@wraps(varlen.attention_varlen)
def attention_varlen(q: Any, k: Any, v: Any, *args: Any, **options: Any) -> Any:
    # Tensors in give tensors out; qkv has no varlen gradient, so tensors that require grad
    # are refused by name (attention per sequence has one).
    refuse_grad("attention_varlen", q=q, k=k, v=v)
    return _give(varlen.attention_varlen(q, k, v, *args, **options), want_of(q, k, v))


class KVCache(cache.KVCache):
    __doc__ = cache.KVCache.__doc__

    @near_keywords()
    def append(self, k: Any, v: Any, seq: int | None = None) -> None:
        ka, va = read_plain_float(k), read_plain_float(v)  # (a decoding loop's tensors)
        if ka is not None and va is not None:
            return super().append(ka, va, seq)
        refuse_grad("KVCache.append", k=k, v=v)
        super().append(k, v, seq)

    append.__doc__ = cache.KVCache.append.__doc__

    @near_keywords(VARIANTS, like=cache.KVCache.attend)
    def attend(self, q: Any, **options: Any) -> Any:
        qa = read_plain_float(q)  # (a decoding loop's float tensor: its view, given back)
        if qa is not None:
            res = super().attend(qa, **options)
            return give_plain(res) if type(res) is np.ndarray else _give(res, want_of(q))
        refuse_grad("KVCache.attend", q=q)
        # a CPU tensor as its NumPy view, so that a decoding loop's calls run the cache's
        # planned step again as NumPy ones do (the checks read it the same way)
        return _give(super().attend(read(q, "q"), **options), want_of(q))

    attend.__doc__ = cache.KVCache.attend.__doc__


class PagedKVCache(paged.PagedKVCache):
    __doc__ = paged.PagedKVCache.__doc__

    @near_keywords()
    def append(self, seq: int, k: Any, v: Any) -> None:
        refuse_grad("PagedKVCache.append", k=k, v=v)
        super().append(seq, read(k, "k"), read(v, "v"))

    append.__doc__ = paged.PagedKVCache.append.__doc__

    @near_keywords(paged.PASSED_ON, like=paged.PagedKVCache.attend)
    def attend(self, q: Any, **options: Any) -> Any:
        refuse_grad("PagedKVCache.attend", q=q)
        return _give(super().attend(read(q, "q"), **options), want_of(q))

    attend.__doc__ = paged.PagedKVCache.attend.__doc__


def _give(res: Any, want: Any) -> Any:
    """An output, or an ``(out, lse)`` pair with the lse in its accumulation dtype."""
    return give_pair(res[0], res[1], want) if isinstance(res, tuple) else give(res, want)

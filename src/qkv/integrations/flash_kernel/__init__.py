"""qkv's FlashAttention 2 functions laid out as a local build of a ``kernels`` kernel.

The ``kernels`` package (which transformers loads flash kernels through) imports this folder's
``__init__.py`` when :func:`qkv.integrations.continuous.register` points the kernel name
``"qkv/flash"`` at it; ``metadata.json`` beside it is the build's description ``kernels`` reads.
The functions are :mod:`qkv.flash`'s own, so that transformers reads their signatures (which
keywords to pass) as they are.
"""

from qkv.flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

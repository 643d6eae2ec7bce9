"""qkv's FlashAttention 2 functions laid out as a local build of a ``kernels`` kernel.

The ``kernels`` package (which transformers loads flash kernels through) imports this folder's
``__init__.py`` when :func:`qkv.integrations.continuous.register` points the kernel name
``"qkv/flash"`` at it; ``metadata.json`` beside it is the build's description ``kernels`` reads.
The functions are :mod:`qkv.flash`'s, with their signatures (transformers reads them to choose
which keywords to pass); the varlen function is :mod:`qkv.integrations.continuous`'s, which adds
the native decode step for batches of decoding steps.
"""

from qkv.flash import flash_attn_func, flash_attn_with_kvcache
from qkv.integrations.continuous import flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

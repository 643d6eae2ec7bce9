"""Attention on the GPU: Triton kernels for CUDA tensors, with qkv's semantics.

:func:`qkv.attention` sends tensors on a GPU here by itself (through
:mod:`qkv.front`); nothing in this package is imported by ``import qkv``.

- :mod:`qkv.gpu._kernels`: the Triton kernels — prefill forward (online softmax, causal and
  window tiles outside the band skipped, only diagonal and edge tiles masked), split-K decode
  and its merge, and the FlashAttention-2 backward (``δ = rowsum(dO ∘ O)``, dk/dv, dq).
- :mod:`qkv.gpu.launch`: block sizes, grids, key splits and autotuning (on a device only).
- :mod:`qkv.gpu.api`: argument checks (by :func:`qkv.validate.make_plan`), reshaping to the
  kernels' layout, the autograd function, and the documented CPU fallback.

Needs ``triton`` and ``torch`` (the ``gpu`` extra). With ``TRITON_INTERPRET=1`` set before
Triton is first imported, Triton's interpreter runs them on CPU tensors; that is how they
are tested on machines without a GPU.
"""

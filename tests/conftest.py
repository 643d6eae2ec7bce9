"""Shared test helpers: seed cases and per-dtype tolerances."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

# The one table of tolerances: (rtol, atol) per dtype for each kind of comparison. The first row
# is a qkv fast path against the float64 reference evaluated on the same inputs; float16 is
# accumulated in float32 and rounded once at the end (half an ulp of 2**-11 relative). The other
# rows are the tighter (or differently split) bounds the kernels' own tests were written with,
# named by what they compare; none is looser than what the test asserted before.
TOLERANCES: dict[str, dict[str, tuple[float, float]]] = {
    "fast path": {"float64": (1e-10, 1e-12), "float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3)},
    "kernels": {"float64": (1e-10, 1e-10), "float32": (2e-5, 2e-5), "float16": (3e-3, 3e-3)},
    "variants": {"float64": (1e-10, 1e-12), "float32": (2e-5, 2e-5), "float16": (3e-3, 3e-3)},
    "packed walk": {"float64": (1e-12, 1e-12), "float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3)},
    "decode step": {"float64": (1e-12, 1e-12), "float32": (3e-6, 3e-6), "float16": (3e-3, 3e-3)},
    "native decode": {"float64": (1e-11, 1e-11), "float32": (3e-6, 3e-6)},
    "torch peer": {"float64": (1e-11, 1e-12), "float32": (1e-5, 1e-5)},
}


class _ByDtype(dict):
    """A mapping keyed by dtype that answers for ``np.float32`` and ``np.dtype("float32")``."""

    def __getitem__(self, key):
        return super().__getitem__(np.dtype(key))


def tol(row: str = "fast path") -> dict:
    """``{dtype: dict(rtol=..., atol=...)}`` of a row of :data:`TOLERANCES`."""
    return _ByDtype({np.dtype(n): dict(rtol=r, atol=a) for n, (r, a) in TOLERANCES[row].items()})


def bound(row: str) -> dict:
    """``{dtype: b}`` of a row of :data:`TOLERANCES` whose rtol and atol are one number ``b``."""
    out = _ByDtype()
    for n, (r, a) in TOLERANCES[row].items():
        assert r == a, f"{row}: rtol and atol differ for {n}; use tol()"
        out[np.dtype(n)] = r
    return out


TOL = tol("fast path")


DATA_CASES = Path(__file__).parent / "data" / "seed_cases.json"


def shared_cases_path() -> Path | None:
    """``shared/cases/seed_cases.json`` beside the checkout, where the project's folder has it."""
    for parent in Path(__file__).resolve().parents:
        cand = parent / "shared" / "cases" / "seed_cases.json"
        if cand.is_file():
            return cand
    return None


@pytest.fixture(scope="session")
def seed_cases() -> dict[str, dict]:
    """The seed's worked cases, keyed by id (the shared folder's, else the vendored copy)."""
    path = shared_cases_path() or DATA_CASES
    data = json.loads(path.read_text())
    return {c["id"]: c for c in data["cases"]}


@pytest.fixture(scope="session")
def case_files() -> tuple[Path | None, Path]:
    """(the shared folder's seed cases or None, the vendored copy)."""
    return shared_cases_path(), DATA_CASES

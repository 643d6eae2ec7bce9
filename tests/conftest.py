"""Shared test helpers: seed cases and per-dtype tolerances."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

# Tolerances of a qkv fast path against the float64 reference evaluated on the same inputs.
# float16 is accumulated in float32 and rounded once at the end (half an ulp of 2**-11 relative).
TOL = {
    np.dtype(np.float64): dict(rtol=1e-10, atol=1e-12),
    np.dtype(np.float32): dict(rtol=2e-5, atol=2e-5),
    np.dtype(np.float16): dict(rtol=2e-3, atol=2e-3),
}


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

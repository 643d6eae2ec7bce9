"""Shared test helpers: seed cases and the one table of tolerances."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qkv import reference
from qkv.testing import tolerance as rule


def _name(dtype: Any) -> str:
    """The dtype's name: ``np.float32``, ``np.dtype("float32")``, ``"float32"`` and
    ``torch.float32`` all read ``"float32"``."""
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    return np.dtype(dtype).name


def ulps(dtype: Any, n: float) -> float:
    """``n`` units in the last place of ``dtype`` (by name, NumPy or torch dtype): ``n ·
    eps(dtype)`` of the library's rule."""
    return n * rule.eps(_name(dtype))


def _in_ulps(**per_dtype: tuple[float, float]) -> dict[str, tuple[float, float]]:
    """A row written as ``(rtol, atol)`` in units in the last place of each dtype."""
    return {n: (ulps(n, r), ulps(n, a)) for n, (r, a) in per_dtype.items()}


# The one table of tolerances: (rtol, atol) per dtype for each kind of comparison, read through
# tol() (both numbers) or bound() (one number for rows whose rtol and atol agree).
#
# A fast path against the float64 reference on the same inputs is judged by the library's own
# rule, qkv.testing.tolerance (what `qkv conform` holds any kernel to): relative to the error a
# same-precision reference makes on that input, plus FLOOR_ULPS = 8 units in the last place.
# The rows of that kind are written in the rule's unit, eps(dtype), so they read against its
# floor ("rule floor" is that floor itself): float32's 167 ulps are about 21 floors, float16's
# 2 ulps a quarter of one (for float16 the table is the tighter bound). within_rule() applies
# the rule itself where a test holds the inputs. Each row is no looser than the literals it
# replaced: a whole number of units at most the literal (167 ulps of float32 = 1.99e-5 where
# the tests wrote 2e-5; 4500 ulps of float64 = 9.99e-13 where they wrote 1e-12).
#
# The other rows are named by what they compare: closed forms and seed values, a kernel against
# itself on other threads, gradients against finite differences, a model's float32 logits
# against transformers' own attention, numbers a page prints. Those whose bound comes from
# elsewhere than a dtype's precision (finite differences, printed decimals, whole models, the
# Triton cases that run only where triton is installed) keep their numbers in decimals.
TOLERANCES: dict[str, dict[str, tuple[float, float]]] = {
    # ----- a fast path against the float64 reference (or a peer), in units in the last place
    "fast path": _in_ulps(float64=(450_000, 4500), float32=(167, 167), float16=(2, 2)),
    "kernels": _in_ulps(float64=(450_000, 450_000), float32=(167, 167), float16=(3, 3)),
    "variants": _in_ulps(float64=(450_000, 4500), float32=(167, 167), float16=(3, 3)),
    # the packed walk against attention on each sequence alone (the same precision) ...
    "packed walk": _in_ulps(float64=(4500, 4500), float32=(167, 167), float16=(2, 2)),
    # ... and against the float64 reference: ten times that
    "packed walk, reference": _in_ulps(
        float64=(45_000, 45_000), float32=(1600, 1600), float16=(20, 20)
    ),
    "decode step": _in_ulps(float64=(4500, 4500), float32=(24, 24), float16=(3, 3)),
    "native decode": _in_ulps(float64=(45_000, 45_000), float32=(24, 24)),
    # a decoding step as the user calls it (a KV cache's attend, one query on a prefix) against
    # the prefill's row or the float64 reference on the cache's stored values
    "decoding": _in_ulps(float64=(4500, 4500), float32=(167, 167)),
    # a float64 path whose sums only run in another order than the reference's (1e-12)
    "float64 path": _in_ulps(float64=(4500, 4500)),
    # softmax over scores spread to +-150 (probabilities down to 1e-130): relative only
    "softmax": _in_ulps(float64=(4500, 0)),
    # a float32 path, values of order one: 1e-5 relative, 1e-6 absolute
    "float32 path": _in_ulps(float32=(80, 8)),
    # keys split into ranges and merged back, float32 (2e-6)
    "split keys": _in_ulps(float32=(16, 16)),
    # the rule's own floor, FLOOR_ULPS units in the last place: float32 9.5e-7, float16 2**-7
    "rule floor": _in_ulps(**{n: (rule.FLOOR_ULPS, rule.FLOOR_ULPS) for n in rule.DTYPES}),
    # a half-precision result whose error is its one rounding to the dtype: one unit
    "rounded once": _in_ulps(bfloat16=(1, 1), float16=(1, 1)),
    # half-precision fast paths on values of order one: 2**-7 for both (bfloat16's unit,
    # float16's rule floor); two units where a second rounding comes in (K/V read in their own
    # dtype by the decode step, a bfloat16 bias added to the scores)
    "half precision": _in_ulps(bfloat16=(1, 1), float16=(8, 8)),
    "two roundings": _in_ulps(bfloat16=(2, 2), float16=(2, 2)),
    # a result on inputs rounded to bfloat16 against the float32 answer on the unrounded ones
    "rounded inputs": _in_ulps(bfloat16=(6, 6)),
    # a ring of one rank against attention itself, forward and backward (20 times that)
    "ring of one": _in_ulps(float64=(4500, 4500), float32=(80, 80), float16=(2, 2)),
    "ring of one, backward": _in_ulps(
        float64=(90_000, 90_000), float32=(1600, 1600), float16=(40, 40)
    ),
    # the finite entries of a result whose inputs hold inf or NaN elsewhere (any dtype): these
    # tests are about where NaN goes, their values are held to 1e-5 relative, 1e-6 absolute
    "non-finite inputs": {"float64": (1e-5, 1e-6)},
    # gradients (attention_vjp, autograd) against the float64 reference's or PyTorch's
    "backward": _in_ulps(float64=(4500, 4500), float32=(80, 80), float16=(20, 20)),
    # a soft-cap or a bias beyond the dtype's range against the answer without it, forward
    # and backward: float32 the rule's floor, float16 one or two units
    "beyond the dtype": _in_ulps(float32=(8, 8), float16=(1, 1)),
    "beyond the dtype, backward": _in_ulps(float32=(8, 8), float16=(2, 2)),
    # the variants over empty and extreme inputs (scores near a float32 overflow, caps of 1e-3,
    # slopes of 1e30), forward (1e-9, 2e-4) and backward (1e-8, 2e-3)
    "extreme inputs": _in_ulps(float64=(4_500_000, 4_500_000), float32=(1677, 1677)),
    "extreme inputs, backward": _in_ulps(
        float64=(45_000_000, 45_000_000), float32=(16_777, 16_777)
    ),
    # autograd in the input's dtype against float64 autograd, on a squared loss
    "autograd in the dtype": _in_ulps(float32=(838, 838), float16=(102, 102), bfloat16=(12, 12)),
    # the lse, kept in float32 for half-precision inputs, against the float64 one (|lse| ~ 10)
    "float32 lse": _in_ulps(float32=(8, 83)),
    # tensors in, tensors out: qkv on tensors of each dtype against the float64 reference on
    # the same values (float32 the rule's floor, float16 three units, bfloat16 two)
    "tensor dtypes": _in_ulps(
        float64=(4500, 4500), float32=(8, 8), float16=(3, 3), bfloat16=(2, 2)
    ),
    # qkv against PyTorch's own attention (sdpa) in the same dtype
    "torch peer": _in_ulps(float64=(45_000, 4500), float32=(80, 80)),
    # the Triton kernels under Triton's interpreter (tests/gpu_interpreted_cases.py, where
    # triton is installed) against the reference: output, the float32 lse, gradients
    "triton": {"float32": (2e-5, 2e-5), "float16": (5e-3, 5e-3), "bfloat16": (3e-2, 3e-2)},
    "triton lse": {"float32": (1e-5, 1e-5)},
    "triton backward": {
        "float32": (1e-4, 1e-4),
        "float16": (2e-2, 2e-2),
        "bfloat16": (1.5e-1, 1.5e-1),
    },
    # ----- other kinds of comparison, named by what they compare -----
    # a value written out in the test or a seed case, a few float64 operations (1e-14)
    "closed form": _in_ulps(float64=(45, 45)),
    # the same one or two float64 roundings taken in another place (1e-15)
    "few roundings": _in_ulps(float64=(4, 4)),
    # the causal seed cases' printed values (1e-13 relative, 1e-15 absolute)
    "seed cases": _in_ulps(float64=(450, 4)),
    # numbers written to five decimals: half a unit of the last
    "five decimals": {"float64": (5e-6, 5e-6)},
    # analytic gradients against central finite differences of step 1e-6 (their truncation
    # and rounding errors)
    "finite differences": {"float64": (1e-6, 1e-9)},
    # one float32 kernel against itself on another team of threads, same vector clone
    "other threads": {"float32": (1e-6, 1e-7)},
    # ... and on other thread counts and vector clones (other orders of the sums): 1e-5, 1e-6
    "threads and clones": _in_ulps(float32=(80, 8)),
    # a layer's attention recomputed from the q, k, v captured from a float32 model against
    # the layer's own output: float32 rounding only (2e-6 absolute)
    "recomputed": _in_ulps(float32=(0, 16)),
    # a float32 transformers model through qkv against the same model on transformers' own
    # attention: logits (against "sdpa", against "eager"), a real model's hidden states and the
    # cosine similarities of its sentence embeddings, decoding steps' logits, gradients
    "model logits": {"float32": (0.0, 1e-4)},
    "model logits, eager": {"float32": (1e-5, 2e-5)},
    "model states": {"float32": (1e-4, 1e-4)},
    "model similarities": {"float32": (0.0, 1e-5)},
    "model steps": {"float32": (1e-5, 5e-5)},
    "model steps, half precision": {"bfloat16": (3e-2, 3e-2), "float16": (3e-3, 3e-3)},
    "model gradients": {"float32": (1e-4, 1e-6)},
    # a model's decoding steps on a cache stored in 8 bits against the same values widened
    # first (the same numbers), and against the full-precision cache (what storing costs)
    "stored cache": {"float32": (1e-5, 1e-5)},
    "quantized cache": {"float32": (0.05, 0.05)},
    # float32 numbers a page shows to 5 decimals, one row computed against all rows
    "printed": {"float32": (1e-4, 6e-6)},
}


class _ByDtype(dict):
    """A mapping keyed by dtype name that answers for NumPy, torch and named dtypes alike."""

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(_name(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(_name(key))


def tol(row: str = "fast path", dtype: Any = None) -> Any:
    """``{dtype: dict(rtol=..., atol=...)}`` of a row of :data:`TOLERANCES`, or one dtype's."""
    out = _ByDtype({n: dict(rtol=r, atol=a) for n, (r, a) in TOLERANCES[row].items()})
    return out if dtype is None else out[dtype]


def bound(row: str, dtype: Any = None) -> Any:
    """``{dtype: b}`` of a row of :data:`TOLERANCES` for the dtypes whose rtol and atol are one
    number ``b``, or one dtype's ``b``."""
    out = _ByDtype({n: r for n, (r, a) in TOLERANCES[row].items() if r == a})
    if dtype is None:
        return out
    assert dtype in out, f"{row}: no one number for {_name(dtype)}; use tol()"
    return out[dtype]


def within_rule(
    out: Any, q: Any, k: Any, v: Any, dtype: Any = None, expected: Any = None, **options: Any
) -> None:
    """Assert the library's own rule (:func:`qkv.testing.tolerance.allowed`) on one input.

    ``out`` is a fast path's result on ``q, k, v`` (values exactly representable in ``dtype``,
    by default ``q``'s) with ``options``; ``expected`` is the float64 reference, computed here
    when not given; NaN may stand only where the reference has NaN.
    """
    name = _name(dtype if dtype is not None else np.asarray(q).dtype)
    ref = reference.attention(q, k, v, **options) if expected is None else expected
    got = np.asarray(out, dtype=np.float64)
    limit = rule.allowed(q, k, v, options, name, ref)
    with np.errstate(invalid="ignore"):
        err = np.abs(got - ref)
    worst = float(np.max(err, initial=0.0, where=np.isfinite(err)))
    assert worst <= limit, f"max error {worst:.3g} over the rule's {limit:.3g} ({name})"
    assert np.array_equal(np.isnan(got), np.isnan(ref)), "NaN where the reference has none"


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

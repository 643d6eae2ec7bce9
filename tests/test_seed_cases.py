"""The worked cases of tests/data/seed_cases.json, through the fast path and the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tests.conftest import bound, tol

import qkv
from qkv import reference

PATHS = [qkv, reference]


@pytest.mark.parametrize("impl", PATHS, ids=["qkv", "reference"])
def test_scores_of_the_worked_case(seed_cases, impl):
    case = seed_cases["seed-scores"]
    q, k, d = case["q"], case["k"], case["d"]
    exp = case["expect"]
    np.testing.assert_allclose(impl.scores(q, k, scale=1.0), exp["raw_scores"])
    np.testing.assert_allclose(
        impl.scores(q, k, scale=1 / math.sqrt(d)), exp["scaled_scores_divide_by_sqrt_d"]
    )
    # Multiplying by sqrt(d) instead of dividing (a common slip): scale=2.0 for d=4.
    np.testing.assert_allclose(
        impl.scores(q, k, scale=math.sqrt(d)), exp["card_literal_multiply_by_sqrt_d"]
    )


def test_default_scale_uses_len_q_not_the_given_d(seed_cases):
    case = seed_cases["seed-scores"]
    # d = q.shape[-1] = 2 by default, which is *not* the case's d = 4.
    np.testing.assert_allclose(
        qkv.scores(case["q"], case["k"]), np.array(case["expect"]["raw_scores"]) / math.sqrt(2)
    )


@pytest.mark.parametrize("impl", PATHS, ids=["qkv", "reference"])
def test_full_worked_example(seed_cases, impl):
    case = seed_cases["seed-full"]
    scale = 1 / math.sqrt(case["d"])
    exp = case["expect"]
    np.testing.assert_allclose(impl.scores(case["q"], case["k"], scale=scale), exp["scaled_scores"])
    w = impl.attention_weights(case["q"], case["k"], scale=scale)
    np.testing.assert_allclose(w, exp["weights"], rtol=bound("closed form", np.float64))
    np.testing.assert_allclose(
        w, [1 / (1 + math.e**3), math.e**3 / (1 + math.e**3)], rtol=bound("closed form", np.float64)
    )
    out = impl.attention(case["q"], case["k"], case["v"], scale=scale)
    assert out.shape == (2,)
    np.testing.assert_allclose(out, exp["output"], rtol=bound("closed form", np.float64))


@pytest.mark.parametrize("impl", PATHS, ids=["qkv", "reference"])
@pytest.mark.parametrize("cid", ["causal-3", "causal-decode"])
def test_causal_cases(seed_cases, impl, cid):
    case = seed_cases[cid]
    exp = case["expect"]
    out = impl.attention(case["q"], case["k"], case["v"], causal=case["causal"])
    np.testing.assert_allclose(out, exp["output"], **tol("seed cases", np.float64))
    if "weights" in exp:
        w = impl.attention_weights(case["q"], case["k"], causal=True)
        np.testing.assert_allclose(w, exp["weights"], **tol("seed cases", np.float64))


def test_decode_case_equals_last_row_of_prefill(seed_cases):
    full = seed_cases["causal-3"]
    dec = seed_cases["causal-decode"]
    prefill = qkv.attention(full["q"], full["k"], full["v"], causal=True)
    decode = qkv.attention(dec["q"], dec["k"], dec["v"], causal=True)
    np.testing.assert_allclose(decode[0], prefill[2], rtol=bound("closed form", np.float64))


def test_lse_of_worked_example(seed_cases):
    case = seed_cases["seed-full"]
    _, lse = qkv.attention(case["q"], case["k"], case["v"], scale=0.5, return_lse=True)
    assert lse.shape == ()
    assert lse == pytest.approx(math.log(math.e**1 + math.e**4), rel=1e-14)


def test_vendored_cases_match_shared(case_files):
    shared, vendored = case_files
    if shared is None:
        pytest.skip(
            "compares tests/data/seed_cases.json with the project's original seed cases, which "
            "only a development checkout has (shared/cases/); the tests use tests/data's copy"
        )
    assert vendored.read_bytes() == shared.read_bytes()


def test_the_skip_without_shared_says_what_is_skipped_and_why(case_files):
    # a user's checkout has no shared/ folder: the skip must make sense to them
    with pytest.raises(pytest.skip.Exception) as info:
        test_vendored_cases_match_shared((None, case_files[1]))
    reason = str(info.value)
    assert reason.startswith("compares tests/data/seed_cases.json") and "checkout" in reason
    assert "vendored" not in reason

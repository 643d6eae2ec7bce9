"""qkv.explain: the trace's numbers are the library's, step by step, on the seed's cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound, tol

import qkv
from qkv import reference


def test_seed_worked_example_every_step(seed_cases):
    c = seed_cases["seed-full"]
    t = qkv.explain(c["q"], c["k"], c["v"], d=c["d"])
    assert t.stage == "output" and t.squeeze
    assert t.raw.tolist() == [seed_cases["seed-scores"]["expect"]["raw_scores"]]
    assert t.scale.value == 0.5 and t.scale.exact_text == "1/2"
    assert t.scale.describe() == "1/√d with d = 4 (given; len(q) = 2): 1/√4 = 1/2 = 0.5"
    assert t.scaled.tolist() == [c["expect"]["scaled_scores"]]
    assert t.dot_terms(0, 0) == "2·1 + 1·0 = 2" and t.dot_terms(0, 1) == "2·3 + 1·2 = 8"
    assert t.row_max.tolist() == [4.0]
    assert t.shifted.tolist() == [[-3.0, 0.0]]
    np.testing.assert_allclose(t.exps, [[np.exp(-3), 1.0]], rtol=bound("few roundings", np.float64))
    np.testing.assert_allclose(t.sums, [1 + np.exp(-3)], rtol=bound("few roundings", np.float64))
    np.testing.assert_allclose(
        t.weights[0], c["expect"]["weights"], rtol=bound("closed form", np.float64)
    )
    w0, w1 = c["expect"]["weights"]
    np.testing.assert_allclose(
        t.weighted[0], [[w0, 2 * w0], [3 * w1, 4 * w1]], rtol=bound("closed form", np.float64)
    )
    np.testing.assert_allclose(
        t.output[0], c["expect"]["output"], rtol=bound("closed form", np.float64)
    )
    # the output *is* qkv.attention's, bit for bit
    out = qkv.attention(c["q"], c["k"], c["v"], scale=1 / 2)
    assert np.array_equal(t.output[0], out)
    assert not t.excluded.any()


def test_multiplied_by_sqrt_d_and_raw_scores(seed_cases):
    c = seed_cases["seed-scores"]
    lit = qkv.explain(c["q"], c["k"], d=4, scale="sqrt(d)")
    assert lit.scaled.tolist() == [c["expect"]["card_literal_multiply_by_sqrt_d"]]
    assert "√4 = 2" in lit.scale.describe() and "divides" in lit.scale.note
    raw = qkv.explain(c["q"], c["k"], scale=1)
    assert raw.scaled.tolist() == [c["expect"]["raw_scores"]] and raw.scale.note is None
    assert raw.scale.describe() == "scale = 1 (given)"


def test_default_scale_uses_len_q():
    t = qkv.explain([2, 1], [[1, 0], [3, 2]])
    assert t.scale.d == 2 and not t.scale.d_given
    assert t.scale.value == pytest.approx(1 / np.sqrt(2), rel=1e-15)
    assert t.scale.describe() == "1/√d with d = 2 (len(q)): 1/√2 ≈ 0.70711"
    assert np.array_equal(t.weights[0], qkv.attention_weights([2, 1], [[1, 0], [3, 2]]))


def test_d_and_scale_are_alternatives():
    with pytest.raises(qkv.InputError, match="d, scale"):
        qkv.explain([2, 1], [[1, 0], [3, 2]], d=4, scale=0.5)
    with pytest.raises(qkv.InputError, match="d:"):
        qkv.explain([2, 1], [[1, 0], [3, 2]], d=0)
    with pytest.raises(qkv.InputError, match="scale"):
        qkv.explain([2, 1], [[1, 0], [3, 2]], scale="sqrt(d) - 2")  # < 0 at d = len(q) = 2
    with pytest.raises(qkv.InputError, match="scale"):
        qkv.explain([2, 1], [[1, 0], [3, 2]], scale=-1.0)


def test_without_v_stops_at_weights_and_stop_at_scores(seed_cases):
    t = qkv.explain([2, 1], [[1, 0], [3, 2]], d=4)
    assert t.stage == "weights" and t.output is None and t.weighted is None
    np.testing.assert_allclose(
        t.weights[0],
        seed_cases["seed-full"]["expect"]["weights"],
        rtol=bound("closed form", np.float64),
    )
    s = qkv.explain([2, 1], [[1, 0], [3, 2]], d=4, stop_at="scores")
    assert s.stage == "scores" and s.weights is None and s.scaled.tolist() == [[1.0, 4.0]]
    with pytest.raises(qkv.InputError, match="stop_at"):
        qkv.explain([2, 1], [[1, 0], [3, 2]], stop_at="everything")


@pytest.mark.parametrize("case", ["causal-3", "causal-decode"])
def test_causal_traces_mark_excluded_keys_and_match(seed_cases, case):
    c = seed_cases[case]
    t = qkv.explain(c["q"], c["k"], c["v"], causal=True)
    L, S = t.L, t.S
    for i in range(L):
        p = S - L + i
        assert t.positions[i] == p
        for j in range(S):
            assert t.excluded[i, j] == (j > p)
            assert t.reasons(i, j) == (["causal"] if j > p else [])
            if j > p:
                assert t.weights[i, j] == 0 and t.shifted[i, j] == -np.inf
                assert t.reason_text(i, j) == f"causal: key {j} is after position {p}"
    out = qkv.attention(c["q"], c["k"], c["v"], causal=True)
    assert np.array_equal(t.output, out)
    np.testing.assert_allclose(
        t.output, c["expect"]["output"], rtol=bound("closed form", np.float64)
    )
    if "weights" in c["expect"]:
        np.testing.assert_allclose(
            t.weights, c["expect"]["weights"], rtol=bound("closed form", np.float64)
        )


def test_window_and_mask_reasons():
    q = k = v = np.arange(12.0).reshape(4, 3) % 5
    mask = np.ones((4, 4), dtype=bool)
    mask[3, 2] = False
    t = qkv.explain(q, k, v, window=(1, 0), mask=mask)
    ok = np.array([[j >= i - 1 and j <= i for j in range(4)] for i in range(4)]) & mask
    assert np.array_equal(t.excluded, ~ok)
    assert t.reasons(3, 0) == ["window"] and t.reason_text(3, 0) == "window: key 0 < 3 - 1"
    assert t.reasons(0, 1) == ["window"] and t.reason_text(0, 1) == "window: key 1 > 0 + 0"
    assert t.reasons(3, 2) == ["mask"] and t.reason_text(3, 2) == "mask is False"
    ref = reference.attention(q, k, v, window=(1, 0), mask=mask)
    assert np.array_equal(t.output, qkv.attention(q, k, v, window=(1, 0), mask=mask))
    np.testing.assert_allclose(t.output, ref, rtol=bound("float64 path", np.float64))


def test_float_bias_and_empty_row():
    bias = np.array([[0.0, -np.inf], [-np.inf, -np.inf]])
    t = qkv.explain([[1, 0], [0, 1]], [[1, 0], [0, 1]], [[1, 2], [3, 4]], mask=bias)
    assert t.reasons(0, 1) == ["bias"] and t.excluded[1].all()
    assert t.weights[1].tolist() == [0.0, 0.0] and t.output[1].tolist() == [0.0, 0.0]
    assert t.lse[1] == -np.inf
    assert "may attend no key" in t.to_text()
    out = qkv.attention([[1, 0], [0, 1]], [[1, 0], [0, 1]], [[1, 2], [3, 4]], mask=bias)
    assert np.array_equal(t.output, out)


def test_batched_inputs_are_refused_with_shapes():
    with pytest.raises(qkv.InputError, match=r"one sequence.*\(2, 3, 4\)"):
        qkv.explain(np.ones((2, 3, 4)), np.ones((2, 5, 4)), np.ones((2, 5, 4)))


def test_float32_follows_the_engine():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (5, 4), (5, 2)))
    t = qkv.explain(q, k, v, causal=True)
    assert t.output.dtype == np.float32
    assert np.array_equal(t.output, qkv.attention(q, k, v, causal=True))


@settings(max_examples=40, deadline=None)
@given(
    L=st.integers(1, 4),
    S=st.integers(1, 5),
    d=st.integers(1, 4),
    causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 3)),
    seed=st.integers(0, 2**16),
)
def test_trace_equals_the_library_and_reference(L, S, d, causal, left, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(L, d)), rng.normal(size=(S, d)), rng.normal(size=(S, 3))
    window = None if left is None else (left, None)
    t = qkv.explain(q, k, v, causal=causal, window=window)
    assert np.array_equal(t.output, qkv.attention(q, k, v, causal=causal, window=window))
    np.testing.assert_allclose(
        t.output,
        reference.attention(q, k, v, causal=causal, window=window),
        atol=bound("float64 path", np.float64),
    )
    np.testing.assert_allclose(t.raw, q @ k.T, **tol("float64 path", np.float64))
    live = ~t.excluded
    # the steps are consistent with each other: exps / sum = weights
    np.testing.assert_allclose(
        t.exps / np.where(t.sums == 0, 1, t.sums)[:, None],
        t.weights,
        rtol=bound("closed form", np.float64),
    )
    assert np.all(t.shifted[live] <= 0)
    np.testing.assert_allclose(
        t.weighted.sum(axis=1), t.output, atol=bound("float64 path", np.float64)
    )


def test_large_inputs_are_summarised():
    rng = np.random.default_rng(1)
    t = qkv.explain(
        rng.normal(size=(40, 64)), rng.normal(size=(300, 64)), rng.normal(size=(300, 16))
    )
    text = t.to_text()
    assert "… 290 more keys …" in text  # the first 8 and the last 2 of 300 keys are shown
    assert "… 292 more rows …" in text  # inputs: the first 6 and last 2 rows
    assert "query rows (same steps)" in text and "(64 terms)" in text
    assert len(text.splitlines()) < 500
    assert "300 columns" in text

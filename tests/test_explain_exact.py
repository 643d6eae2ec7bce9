"""Exact mode: rationals stay exact, roots symbolic, weights in closed form (SymPy)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import bound

import qkv

sympy = pytest.importorskip("sympy", reason="exact mode needs the exact extra (sympy)")
E3 = sympy.exp(3)


def _eq(a, b) -> bool:
    return sympy.simplify(a - b) == 0


def test_seed_closed_forms():
    t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4, exact=True)
    ex = t.exact
    assert ex.scale == sympy.Rational(1, 2)
    assert ex.raw == [[2, 8]] and ex.scaled == [[1, 4]]
    assert ex.row_max == [4] and ex.shifted == [[-3, 0]]
    assert ex.exps[0][0] == sympy.exp(-3) and ex.exps[0][1] == 1
    w0, w1 = ex.weights[0]
    assert _eq(w0, 1 / (1 + E3)) and _eq(w1, E3 / (1 + E3))
    assert str(w0) == "1/(1 + exp(3))" and str(w1) == "exp(3)/(1 + exp(3))"
    assert ex.latex(w1) == r"\frac{e^{3}}{1 + e^{3}}"
    o0, o1 = ex.output[0]
    assert _eq(o0, (1 + 3 * E3) / (1 + E3)) and _eq(o1, (2 + 4 * E3) / (1 + E3))
    # each exact value agrees with the numeric trace
    np.testing.assert_allclose(
        [ex.value(w) for w in ex.weights[0]], t.weights[0], rtol=bound("closed form", np.float64)
    )
    np.testing.assert_allclose(
        [ex.value(o) for o in ex.output[0]], t.output[0], rtol=bound("closed form", np.float64)
    )
    text = t.to_text()
    assert "1/(1 + exp(3)) ≈ 0.04743" in text and "exp(3)/(1 + exp(3)) ≈ 0.95257" in text
    assert "(1 + 3*exp(3))/(1 + exp(3)) ≈ 2.90515" in text


def test_square_roots_stay_symbolic_and_floats_read_as_written():
    t = qkv.explain([[0.1, 1]], [[1, 0], [0, 1]], [[1, 0], [0, 1]], exact=True)
    ex = t.exact
    assert ex.q[0][0] == sympy.Rational(1, 10)  # 0.1 as written, not its binary value
    assert ex.scale == 1 / sympy.sqrt(2)
    assert ex.scaled[0][0] == sympy.sqrt(2) / 20
    w = ex.weights[0][1]
    assert w.has(sympy.exp) and w.has(sympy.sqrt(2))
    assert ex.value(w) == pytest.approx(t.weights[0, 1], rel=1e-14)


def test_times_sqrt_d_scale_and_causal_exact():
    t = qkv.explain([2, 1], [[1, 0], [3, 2]], d=4, scale="sqrt(d)", exact=True)
    assert t.exact.scale == 2 and t.exact.scaled == [[4, 16]]
    c = qkv.explain(
        [[1, 0], [0, 1], [1, 1]],
        [[1, 0], [0, 1], [1, 1]],
        [[1, 0], [0, 1], [2, 2]],
        causal=True,
        exact=True,
    )
    assert c.exact.logits[0][1] == -sympy.oo and c.exact.weights[0] == [1, 0, 0]
    got = np.array([[c.exact.value(x) for x in row] for row in c.exact.output])
    np.testing.assert_allclose(got, c.output, rtol=bound("closed form", np.float64))


def test_exact_refuses_huge_inputs():
    with pytest.raises(qkv.InputError, match="exact: too large"):
        qkv.explain(np.ones((100, 8)), np.ones((100, 8)), np.ones((100, 8)), exact=True)

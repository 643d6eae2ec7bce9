"""Every bad input raises InputError/InputTypeError naming the argument and the shapes."""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import tol

import qkv
from qkv import reference

Q = np.ones((2, 4))
K = np.ones((3, 4))
V = np.ones((3, 5))

# (id, call, exception type, substrings the message must contain)
CASES = [
    ("q-scalar", lambda f: f.attention(1.0, K, V), qkv.InputError, ["q", "()"]),
    ("k-1d", lambda f: f.attention(Q, np.ones(4), V), qkv.InputError, ["k", "(4,)"]),
    ("v-1d", lambda f: f.attention(Q, K, np.ones(3)), qkv.InputError, ["v", "(3,)"]),
    (
        "d-mismatch",
        lambda f: f.attention(np.ones((2, 3)), K, V),
        qkv.InputError,
        ["q", "k", "(2, 3)", "(3, 4)"],
    ),
    (
        "S-mismatch",
        lambda f: f.attention(Q, K, np.ones((4, 5))),
        qkv.InputError,
        ["k", "v", "(3, 4)", "(4, 5)"],
    ),
    (
        "heads-dont-group",
        lambda f: f.attention(np.ones((1, 3, 2, 4)), np.ones((1, 2, 3, 4)), np.ones((1, 2, 3, 5))),
        qkv.InputError,
        ["heads", "(1, 3, 2, 4)", "(1, 2, 3, 4)"],
    ),
    (
        "batch-dont-broadcast",
        lambda f: f.attention(np.ones((2, 1, 2, 4)), np.ones((3, 1, 3, 4)), np.ones((3, 1, 3, 5))),
        qkv.InputError,
        ["q, k", "(2, 1)", "(3, 1)"],
    ),
    (
        "kv-batch-dont-broadcast",
        lambda f: f.attention(Q, np.ones((2, 3, 4)), np.ones((3, 3, 5))),
        qkv.InputError,
        ["k, v", "(2,)", "(3,)"],
    ),
    (
        "mask-shape",
        lambda f: f.attention(Q, K, V, mask=np.ones((2, 4), bool)),
        qkv.InputError,
        ["mask", "(2, 4)", "(2, 3)"],
    ),
    (
        "mask-too-many-dims",
        lambda f: f.attention(Q, K, V, mask=np.ones((5, 2, 3), bool)),
        qkv.InputError,
        ["mask", "(5, 2, 3)"],
    ),
    (
        "mask-int",
        lambda f: f.attention(Q, K, V, mask=np.ones((2, 3), int)),
        qkv.InputTypeError,
        ["mask", "int"],
    ),
    ("q-strings", lambda f: f.attention([["a", "b"]], K, V), qkv.InputTypeError, ["q", "<U1"]),
    ("k-complex", lambda f: f.attention(Q, K * 1j, V), qkv.InputTypeError, ["k", "complex"]),
    (
        "v-bool",
        lambda f: f.attention(Q, K, np.ones((3, 5), bool)),
        qkv.InputTypeError,
        ["v", "bool"],
    ),
    ("q-ragged", lambda f: f.attention([[1, 2], [3]], K, V), qkv.InputError, ["q", "rectangular"]),
    ("scale-zero", lambda f: f.attention(Q, K, V, scale=0), qkv.InputError, ["scale", "0"]),
    ("scale-negative", lambda f: f.attention(Q, K, V, scale=-1.0), qkv.InputError, ["scale"]),
    (
        "scale-nan",
        lambda f: f.attention(Q, K, V, scale=float("nan")),
        qkv.InputError,
        ["scale", "nan"],
    ),
    (
        "scale-inf",
        lambda f: f.attention(Q, K, V, scale=float("inf")),
        qkv.InputError,
        ["scale", "inf"],
    ),
    ("scale-string", lambda f: f.attention(Q, K, V, scale="1"), qkv.InputTypeError, ["scale"]),
    ("scale-bool", lambda f: f.attention(Q, K, V, scale=True), qkv.InputTypeError, ["scale"]),
    ("window-shape", lambda f: f.attention(Q, K, V, window=3), qkv.InputTypeError, ["window"]),
    (
        "window-negative",
        lambda f: f.attention(Q, K, V, window=(-1, 0)),
        qkv.InputError,
        ["window", "left"],
    ),
    (
        "window-float",
        lambda f: f.attention(Q, K, V, window=(1.5, 0)),
        qkv.InputTypeError,
        ["window"],
    ),
    (
        "causal-not-bool",
        lambda f: f.attention(Q, K, V, causal="yes"),
        qkv.InputTypeError,
        ["causal"],
    ),
    (
        "d-zero",
        lambda f: f.attention(np.ones((2, 0)), np.ones((3, 0)), V),
        qkv.InputError,
        ["d", "(2, 0)"],
    ),
]


@pytest.mark.parametrize("impl", [qkv, reference], ids=["qkv", "reference"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(impl, case):
    _, call, exc, needles = case
    with pytest.raises(exc) as info:
        call(impl)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    # The project's exceptions are also the built-in ones.
    assert isinstance(info.value, ValueError)
    if exc is qkv.InputTypeError:
        assert isinstance(info.value, TypeError)


def test_check_finite_is_opt_in():
    q = np.array([[np.nan, 0.0], [1.0, 0.0]])
    k = np.ones((3, 2))
    v = np.ones((3, 2))
    out = qkv.attention(q, k, v)  # NaN propagates to the row it touches only
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
    with pytest.raises(qkv.InputError, match=r"q: contains NaN.*\(2, 2\)"):
        qkv.attention(q, k, v, check_finite=True)


def test_softmax_bad_axis():
    with pytest.raises(qkv.InputError, match="axis"):
        qkv.softmax(np.ones((2, 3)), axis=2)
    with pytest.raises(qkv.InputTypeError, match="x"):
        qkv.softmax(["a"])


# Inputs at the edges: a scale beyond float range, no keys, a ragged mask, a non-integer axis.
@pytest.mark.parametrize(
    "call, exc, needle",
    [
        (
            lambda: qkv.attention(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 2)), scale=10**400),
            qkv.InputError,
            "scale",
        ),
        (
            lambda: qkv.attention(np.ones((4, 2, 8)), np.ones((0, 3, 8)), np.ones((0, 3, 2))),
            qkv.InputError,
            "(4,)",
        ),
        (
            lambda: qkv.attention(
                np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), mask=[[True], [False, True]]
            ),
            qkv.InputError,
            "mask",
        ),
        (lambda: qkv.softmax([1, 2], axis="0"), qkv.InputTypeError, "axis"),
        (lambda: qkv.softmax([1, 2], axis=0.5), qkv.InputTypeError, "axis"),
    ],
)
def test_bad_input_gets_the_project_exceptions(call, exc, needle):
    with pytest.raises(exc) as info:
        call()
    assert needle in str(info.value)


@pytest.mark.parametrize("fn", [qkv.scores, qkv.reference.scores])
def test_a_scale_given_as_text_is_answered_with_the_standard_scale(fn):
    # the suggestion must not be the slip the project teaches against (multiplying by sqrt(d))
    with pytest.raises(qkv.InputTypeError) as info:
        fn([2, 1], [[1, 0], [3, 2]], scale="1/sqrt(d)")
    text = str(info.value)
    assert "1 / math.sqrt(d)" in text and "multiplies" in text
    assert "(e.g. math.sqrt(d))" not in text


def test_arrays_laid_out_batch_length_heads_get_the_layout_keyword():
    # (batch, L, heads, d) with 6 query heads and 2 kv heads, L = 4 and S = 6: read as qkv's
    # (batch, heads, L, d) they are 4 query heads against 6 kv heads
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, 6, 8)), *rng.standard_normal((2, 2, 6, 2, 8))
    with pytest.raises(qkv.InputError) as info:
        qkv.attention(q, k, v)
    text = str(info.value)
    assert "4 query heads cannot share 6 kv heads" in text
    # the hint names the other reading as a possibility, it does not assert it
    assert "if these arrays are laid out (batch, L, heads, d)" in text
    assert "layout='blhd'" in text and "these shapes fit" not in text
    # the keyword it names is the one that works: equal to the reference
    out = qkv.attention(q, k, v, layout="blhd")
    want = qkv.reference.attention(q.swapaxes(-3, -2), k.swapaxes(-3, -2), v.swapaxes(-3, -2))
    np.testing.assert_allclose(out, want.swapaxes(-3, -2), **tol("float64 path", np.float64))


def test_no_layout_hint_when_the_other_layout_does_not_fit_either():
    with pytest.raises(qkv.InputError) as info:
        qkv.attention(np.ones((3, 2, 5)), np.ones((2, 3, 5)), np.ones((2, 3, 5)))
    assert "swapaxes" not in str(info.value)

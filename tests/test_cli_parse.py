"""Parsing command-line values: matrices, windows and scale expressions (safe, never eval)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import InputError
from qkv.cli import main, parse
from qkv.cli.parse import matrix
from qkv.explanation.scale import parse_scale

small = st.integers(-50, 50)
shapes = st.tuples(st.integers(1, 4), st.integers(1, 4))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), shape=shapes)
def test_matrix_forms_round_trip(data, shape):
    a = np.array(
        data.draw(
            st.lists(
                st.lists(small, min_size=shape[1], max_size=shape[1]),
                min_size=shape[0],
                max_size=shape[0],
            )
        ),
        dtype=float,
    )
    inline = ";".join(",".join(str(int(x)) for x in row) for row in a)
    spaced = "; ".join(" ".join(str(int(x)) for x in row) for row in a)
    for text in (inline, spaced, json.dumps(a.tolist())):
        got = parse.matrix(text, "--k", min_ndim=2)
        assert np.array_equal(got, a), text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789.,; []-+eE\nnaifxd", max_size=30))
def test_matrix_garbage_is_an_input_error_or_a_matrix(text):
    try:
        a = parse.matrix(text, "--q")
    except InputError as exc:
        assert str(exc).startswith("--q:") and "\n" not in str(exc)
        return
    assert a.dtype == np.float64 and np.all(np.isfinite(a)) and 1 <= a.ndim <= 2


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="d sqrt()+-*/^.0123456789e_", max_size=24))
def test_scale_expressions_only_raise_input_errors(text):
    try:
        e = parse_scale(text)
        v = e.value(4)
    except InputError:
        return
    assert math.isfinite(v) and v > 0


@pytest.mark.parametrize(
    "text, d, value, formula",
    [
        ("1/sqrt(d)", 4, 0.5, "1/√d"),
        ("sqrt(d)", 4, 2.0, "√d"),
        ("1", 4, 1.0, "1"),
        ("d**-0.5", 16, 0.25, "d^(-0.5)"),
        ("d^-0.5", 16, 0.25, "d^(-0.5)"),
        ("2*sqrt(d)/3", 9, 2.0, "2·√d/3"),
        ("1/(d+1)", 3, 0.25, "1/(d+1)"),
    ],
)
def test_scale_expressions(text, d, value, formula):
    e = parse_scale(text)
    assert e.value(d) == pytest.approx(value, rel=1e-15)
    assert e.formula() == formula


@pytest.mark.parametrize(
    "text", ["__import__('os')", "d.real", "exp(d)", "1/", "sqrt d", "", "d**", "1e9999", "x" * 101]
)
def test_bad_scale_expressions(text):
    with pytest.raises(InputError, match="scale"):
        parse_scale(text).value(4)


def test_no_huge_exact_powers():
    sympy = pytest.importorskip("sympy")
    e = parse_scale("(1+1e-15)**1e15")
    assert isinstance(e.sympy(4), sympy.Float) and e.exact(4) is None


@pytest.mark.parametrize(
    "text, want", [("2,0", (2, 0)), (",3", (None, 3)), ("none,1", (None, 1)), ("4,", (4, None))]
)
def test_window(text, want):
    assert parse.window(text) == want


@pytest.mark.parametrize("text", ["1", "a,b", "-1,0", "1,2,3"])
def test_bad_window(text):
    with pytest.raises(InputError, match="--window"):
        parse.window(text)


def test_pickled_npy_is_refused_and_never_loaded(tmp_path):
    path = tmp_path / "evil.npy"
    np.save(path, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InputError, match="pickled"):
        parse.matrix(f"@{path}", "--k")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2,,1", "--q: row 1 has an empty entry 2 (two commas in a row); write a number"),
        ("2,1;", "--q: ends with ';' and no row after it (stray semicolon?)"),
        (",2", "--q: row 1 starts with a comma; write a number between commas"),
        ("2,1,", "--q: row 1 ends with a comma; write a number between commas"),
        ("1,0;;3,2", "--q: row 2 is empty"),
        ("1,0; ,3", "--q: row 2 starts with a comma"),
    ],
)
def test_malformed_inline_matrices_are_refused(text, message, capsys):
    """Issue 21, item 5: a stray comma or semicolon is a typo, not a smaller matrix."""
    with pytest.raises(InputError, match="^" + re.escape(message)):
        matrix(text, "--q")
    assert main(["scores", "--q", text, "--k", "1,0;3,2", "--d", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qkv scores: error: " + message)


def test_well_formed_separators_still_read():
    assert matrix("2, 1 ; 3 ,4", "--k").tolist() == [[2, 1], [3, 4]]
    assert matrix("2 1", "--q").tolist() == [2, 1]
    assert matrix(" 2,1 ", "--q").tolist() == [2, 1]

"""qkv exercise --practice: every listed slip is named from a scripted wrong answer.

The wrong answers are written out by hand from the exercise's numbers (seed 7: q = [3, 3],
K = [[2, 2], [0, 3], [3, 1]], V = [[1, 2], [1, 2], [0, 1]], d = 4), not taken from the code
that diagnoses them.
"""

from __future__ import annotations

import io
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.conftest import bound

from qkv import InputError, reference
from qkv.cli import main
from qkv.explanation.exercise import make_exercise
from qkv.explanation.practice import SLIPS, Practice


def _softmax(s):
    e = np.exp(np.asarray(s, float) - max(s))
    return e / e.sum()


RAW = [12, 9, 12]
# (step, answer, slip) — each answer is what a learner making that slip would write
SCRIPTED = [
    ("scaled", RAW, "forgot to scale"),
    ("scaled", [24, 18, 24], "multiplied by √d"),
    ("scaled", [x / math.sqrt(2) for x in RAW], "used len(q) for d"),
    ("exps", [math.exp(6), math.exp(4.5), math.exp(6)], "forgot to subtract the max"),
    ("exps", [1, math.exp(-3), 1], "forgot to scale"),
    ("weights", [1, 1, 1], "summed the wrong axis"),  # one query: each column sums to itself
    ("weights", _softmax([24, 18, 24]).round(4), "multiplied by √d"),
    ("output", _softmax([12, 9, 12]) @ np.array([[1, 2], [1, 2], [0, 1]]), "forgot to scale"),
]


@pytest.fixture(scope="module")
def seven():
    ex = make_exercise(seed=7)
    assert ex.q.tolist() == [[3, 3]] and ex.k.tolist() == [[2, 2], [0, 3], [3, 1]] and ex.d == 4
    return Practice(ex)


@pytest.mark.parametrize(("step", "answer", "slip"), SCRIPTED)
def test_each_slip_is_named(seven, step, answer, slip):
    fb = seven.check(step, answer)
    assert not fb.correct and fb.slip == slip


def test_every_listed_slip_is_covered_and_right_answers_pass(seven):
    assert {s for _, _, s in SCRIPTED} == set(SLIPS)
    w = reference.attention_weights([3, 3], [[2, 2], [0, 3], [3, 1]], scale=0.5)
    right = {
        "raw": RAW,
        "scaled": [6, 4.5, 6],
        "exps": [1, math.exp(-1.5), 1],
        "weights": w.round(3),
        "output": (w @ [[1, 2], [1, 2], [0, 1]]).round(3),
    }
    for step, answer in right.items():
        assert seven.check(step, answer).correct, step
    fb = seven.check("weights", [0.4, 0.2])
    assert not fb.correct and fb.message == "expected 3 numbers, got 2"
    assert seven.check("raw", [12, 9, 13]).slip is None  # wrong, but no known slip


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 3), st.integers(1, 4), st.booleans())
def test_the_librarys_own_answers_are_right_for_any_seed(seed, queries, keys, causal):
    p = Practice(make_exercise(seed, queries=queries, keys=keys, causal=causal))
    assert p.exercise == make_exercise(seed, queries=queries, keys=keys, causal=causal)
    for s in p.steps:
        assert p.check(s.key, np.round(s.expected, 4)).correct


def _answers(rows):
    return "".join(" ".join(f"{x:.6g}" for x in np.ravel(r)) + "\n" for r in rows)


def test_cli_reads_answers_from_a_file_and_names_the_slips(tmp_path, capsys):
    path = tmp_path / "answers.txt"
    exps = [math.exp(6), math.exp(4.5), math.exp(6)]
    path.write_text(
        _answers([RAW, [24, 18, 24], RAW, exps])
        + "1, exp(-1.5), 1\n"  # the exponentials, right at the second try
        + _answers([[1, 1, 1], [1, 1, 1], [0.55, 1.55]]),
        encoding="utf-8",
    )
    assert main(["exercise", "--seed", "7", "--practice", "--answers", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("Step ") == 5 and "Check your work" not in out
    # each slip named once, then what to do: not the slip said twice in other words
    line = "not quite (slip: multiplied by √d): standard attention divides by √d (multiplies by"
    assert line in out and "this multiplies by √d" not in out
    assert "(slip: forgot to scale)" in out and "(slip: forgot to subtract the max)" in out
    assert "slip: summed the wrong axis" in out and "try again (1 try left)" in out
    assert out.count("worked step:") == 2  # scaled and weights: two misses each
    assert "  k1: 9 × 0.5 = 4.5" in out  # the scaled step, worked, after the second miss
    assert "k1: exp(4.5 − 6)" not in out  # the exponentials were right at the second try
    assert out.rstrip().endswith("3 of 5 steps right (1 at the second try).")


def test_cli_reads_stdin_same_seed_same_problem(monkeypatch, capsys):
    outs = []
    for _ in range(2):
        monkeypatch.setattr("sys.stdin", io.StringIO("12 9 12\n6 4.5 6\nnot numbers\n"))
        assert main(["exercise", "--seed", "7", "--practice"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert "could not read that (entry 1: 'not' is not a number or an expression" in outs[0]
    assert "(no answer)" not in outs[0] and "worked step" not in outs[0]
    assert outs[0].rstrip().endswith("Stopped after 2 of 5 steps: 2 of 2 right.")
    assert main(["exercise", "--seed", "7", "--answers", "x.txt"]) == 2  # needs --practice
    assert main(["exercise", "--practice", "--answers", "/no/such/file"]) == 2
    assert main(["exercise", "--seed", "7", "--answers"]) == 0  # the flag still works alone


def test_practice_typos_are_asked_again_two_tries_fractions_and_ctrl_d(monkeypatch, capsys):
    """Issue 21, item 10, scripted through stdin: a typo, an empty line and too few numbers
    use no try and reveal nothing; a miss gets a second try; 9/2 and exp(-1.5) are read;
    the end of input (Ctrl-D) ends the session with its summary."""
    script = [
        "12 9 12",  # step 1, raw: right
        "",  # step 2: an empty line, asked again
        "abc",  # a typo, asked again
        "6 4.5",  # too few numbers, asked again
        "12 9 12",  # forgot to scale: first try used
        "6 9/2 6",  # a fraction: right at the second try
        "1, exp(-1.5), 1",  # step 3, an expression: right
    ]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(script) + "\n"))
    assert main(["exercise", "--seed", "7", "--practice"]) == 0
    out = capsys.readouterr().out
    steps = out.split("\nStep ")
    assert len(steps) == 5  # the intro, steps 1-3, and step 4 asked when the input ended
    scaled = steps[2]
    assert scaled.count("> ") == 5
    assert "type the numbers, or end the input (Ctrl-D) to stop" in scaled
    assert "could not read that (entry 1: 'abc' is not allowed" in scaled
    assert "expected 3 numbers, got 2; try again" in scaled
    assert (
        "not quite (slip: forgot to scale): multiply every q·k by 1/√d; try again (1 try left)"
    ) in scaled
    assert "worked step" not in out and "scale = " not in scaled  # the answer was not revealed
    assert steps[3].count("\nright\n") == 1
    assert steps[4].startswith("4 of 5: the weights") and "(end of input)" in steps[4]
    assert out.rstrip().endswith("Stopped after 3 of 5 steps: 3 of 3 right (1 at the second try).")


def test_answers_are_read_safely_and_checked_against_the_reference(seven):
    from qkv.explanation.practice import read_answer

    w = reference.attention_weights([3, 3], [[2, 2], [0, 3], [3, 1]], scale=0.5)
    fb = seven.check("weights", "1/(2+exp(-1.5)), exp(-1.5)/(2+exp(-1.5)), 1/(2 + e^-1.5)")
    assert fb.correct
    np.testing.assert_allclose(
        read_answer("1/(2+exp(-1.5)) exp(-1.5)/(2+exp(-1.5)) 1/(2 + e^-1.5)"),
        w,
        rtol=bound("few roundings", np.float64),
    )
    assert read_answer("9/2, 3 ; 1 - 2 -2").tolist() == [[4.5, 3.0], [-1.0, -2.0]]
    assert read_answer("−1.5").tolist() == [-1.5]  # the typographic minus
    for bad, message in [
        ("__import__('os')", "entry 1: \"__import__('os')\" is not allowed"),
        ("1,,2", "an empty entry between commas"),
        ("exp(1000)", "entry 1: 'exp(1000)' is not a finite number"),
        ("1 2; 3", "rows have different lengths"),
        ("  ", "no numbers given"),
    ]:
        with pytest.raises(InputError, match=re.escape(message)):
            read_answer(bad)


def test_qkv_practice_points_to_exercise_practice(capsys):
    assert main(["practice"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "qkv exercise --practice" in err

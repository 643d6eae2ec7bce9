"""qkv exercise --practice: every listed slip is named from a scripted wrong answer.

The wrong answers are written out by hand from the exercise's numbers (seed 7: q = [3, 3],
K = [[2, 2], [0, 3], [3, 1]], V = [[1, 2], [1, 2], [0, 1]], d = 4), not taken from the code
that diagnoses them.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import reference
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
    path.write_text(
        _answers(
            [RAW, [24, 18, 24], [math.exp(6), math.exp(4.5), math.exp(6)], [1, 1, 1], [0.55, 1.55]]
        ),
        encoding="utf-8",
    )
    assert main(["exercise", "--seed", "7", "--practice", "--answers", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("Step ") == 5 and "Check your work" not in out
    assert "slip: multiplied by √d" in out and "slip: forgot to subtract the max" in out
    assert "slip: summed the wrong axis" in out
    assert "k1: exp(4.5 − 6) = exp(-1.5) = 0.22313" in out  # the worked step after a slip
    assert out.rstrip().endswith("2 of 5 steps right.")  # raw and output were right


def test_cli_reads_stdin_same_seed_same_problem(monkeypatch, capsys):
    outs = []
    for _ in range(2):
        monkeypatch.setattr("sys.stdin", io.StringIO("12 9 12\n6 4.5 6\nnot numbers\n"))
        assert main(["exercise", "--seed", "7", "--practice"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert "could not read that answer" in outs[0] and outs[0].count("(no answer)") == 2
    assert outs[0].rstrip().endswith("2 of 5 steps right.")
    assert main(["exercise", "--seed", "7", "--answers", "x.txt"]) == 2  # needs --practice
    assert main(["exercise", "--practice", "--answers", "/no/such/file"]) == 2
    assert main(["exercise", "--seed", "7", "--answers"]) == 0  # the flag still works alone

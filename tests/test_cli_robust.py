"""Hostile command-line input: every problem is one line on stderr, never a traceback or a hang."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.conftest import bound

import qkv.explanation.trace as trace_module
from qkv.cli import main
from qkv.errors import InputError
from qkv.explanation import document
from qkv.explanation.scale import MAX_EXACT_BITS, parse_scale
from qkv.explanation.trace import explain, fmt

QK = ["--q", "2,1", "--k", "1,0;3,2"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, out: str, err: str, needle: str, status: int = 2) -> None:
    assert rc == status and out == "", (rc, out)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("qkv") and needle in lines[0], lines[0]


# ----- 1. scale expressions whose exact value is astronomically long -----


@pytest.mark.parametrize(
    "text, value",
    [
        ("(1.001**64)**64", (1.001**64) ** 64),
        ("(((1.0000001**64)**64)**64)**64", (((1.0000001**64) ** 64) ** 64) ** 64),
        ("(sqrt(1.001)**64)**64", (math.sqrt(1.001) ** 64) ** 64),
    ],
)
def test_nested_powers_fall_back_to_the_float(capsys, text, value):
    expr = parse_scale(text)
    assert expr.exact() is None
    assert math.isclose(expr.value(), value, rel_tol=1e-12)
    rc, out, err = run(capsys, "scores", *QK, "--scale", text)
    assert rc == 0 and err == "", err
    t = explain([2, 1], [[1, 0], [3, 2]], scale=text)
    assert t.scale.exact_text is None and len(t.scale.describe()) < 80
    assert t.scale.describe().endswith(f" ≈ {fmt(value)}")
    assert t.scaled[0, 1] == pytest.approx(8 * value, rel=1e-12)


def test_exact_scale_with_a_nested_power_stays_small(capsys):
    rc, out, err = run(
        capsys, "explain", *QK, "--v", "1,2;3,4", "--scale", "(1.01**64)**64", "--exact"
    )
    assert rc == 0 and err == "", err
    line = next(x for x in out.splitlines() if "Exact: scale" in x)
    assert len(line) < 80 and float(line.split("=")[-1]) == pytest.approx(
        (1.01**64) ** 64, rel=1e-12
    )


def test_exact_fractions_are_bounded_but_small_ones_stay_exact():
    assert str(parse_scale("1/sqrt(d)").exact(4)) == "1/2"
    assert str(parse_scale("0.5**64").exact()) == f"1/{2**64}"
    big = parse_scale("2**64 * 2**64 * 2**64 * 2**64 * 2**64")  # 321 bits
    assert 2**320 > 2**MAX_EXACT_BITS and big.exact() is None and big.value() == 2.0**320


def test_scale_error_mentions_d_only_when_used(capsys):
    rc, out, err = run(capsys, "scores", *QK, "--scale", "(sqrt(3)**64)**64")
    assert_one_line_error(rc, out, err, "is not a finite number > 0")
    assert "d =" not in err


# ----- 2. JSON matrices that are too large or too deep -----


@pytest.mark.parametrize(
    "q, needle",
    [
        ("[1" + "0" * 400 + ",1]", "309 or more digits"),
        ("[" + "9" * 5000 + ",1]", "thousands of digits"),
        ("[" * 5000, "nested too deeply"),
        ("[" * 5000 + "1" + "]" * 5000, "nested too deeply"),
        ("[[[[[[1]]]]]]", "expected a non-empty list"),
        ("[2,1", "not valid JSON"),
    ],
    ids=["int-401-digits", "int-5000-digits", "open-5000-deep", "5000-deep", "6-deep", "bad"],
)
def test_json_matrix_errors_are_one_line(capsys, q, needle):
    rc, out, err = run(capsys, "scores", "--q", q, "--k", "1,0;3,2")
    assert_one_line_error(rc, out, err, needle)


def test_json_file_nested_100000_deep_is_one_line(capsys, tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000)
    rc, out, err = run(capsys, "scores", "--q", f"@{path}", "--k", "1,0;3,2")
    assert_one_line_error(rc, out, err, "nested too deeply")


def test_json_large_but_finite_integers_are_read(capsys):
    rc, out, err = run(capsys, "scores", "--q", "[2, 1" + "0" * 300 + "]", "--k", "1,0;3,2")
    assert rc == 0 and err == "" and "1e+300" in out


# ----- 3. explain: a huge d, and exact mode with no keys -----


@pytest.mark.parametrize(
    "d",
    [10**400, 10**5000, 2**60, 1e300, math.nan, 0, 2.5],
    ids=["10**400", "10**5000", "2**60", "1e300", "nan", "0", "2.5"],
)
def test_explain_rejects_unusable_d_naming_it(d):
    with pytest.raises(InputError, match=r"^d: expected a positive integer up to 2\*\*53"):
        explain([2, 1], [[1, 0], [3, 2]], d=d)


def test_explain_accepts_the_largest_d():
    t = explain([2, 1], [[1, 0], [3, 2]], d=2**53)
    assert t.scale.value == pytest.approx(2.0**-26.5, rel=1e-15)
    assert t.scaled[0, 1] == pytest.approx(8 * 2.0**-26.5, rel=1e-15)


def test_cli_d_with_thousands_of_digits_is_one_line(capsys):
    rc, out, err = run(capsys, "scores", *QK, "--d", "9" * 5000)
    assert_one_line_error(rc, out, err, "--d: expected a positive integer up to 2**53")


def test_exact_trace_with_no_keys_gives_zeros():
    pytest.importorskip("sympy")
    q, k, v = np.ones((2, 4)), np.zeros((0, 4)), np.zeros((0, 2))
    t = explain(q, k, v, exact=True)
    assert t.weights.shape == (2, 0) and np.array_equal(t.output, np.zeros((2, 2)))
    assert t.exact.raw == [[], []] and t.exact.weights == [[], []]
    assert [[int(x) for x in row] for row in t.exact.output] == [[0, 0], [0, 0]]
    assert "Exact output: [0, 0]" in t.to_text() and json.loads(t.to_json())["exact"][
        "weights"
    ] == [
        [],
        [],
    ]


# ----- 5. standard output that cannot be written or cannot encode the output -----

SEED = ["--q", "2,1", "--k", "1,0;3,2", "--v", "1,2;3,4", "--d", "4"]
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _qkv(*argv: str, stdout: Any = subprocess.PIPE, **env: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run(
        [sys.executable, "-m", "qkv", *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        timeout=120,
    )


class _FullDisk(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize(
    "argv", [["explain", *SEED], ["exercise", "--seed", "1"], ["study", "training", "--steps", "1"]]
)
def test_unwritable_stdout_is_one_line_status_1(monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "stdout", _FullDisk())
    rc = main([*argv, "--no-progress"] if argv[0] == "study" else argv)
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"qkv {argv[0]}: error: cannot write to standard output: No space")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_dev_full_in_a_real_process():
    with open("/dev/full", "w") as full:
        r = _qkv("explain", *SEED, stdout=full)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "ignored" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "qkv explain: error: cannot write to standard output: No space left on device "
        "(try --output FILE)"
    ]


def test_ascii_stdout_escapes_what_it_cannot_encode():
    text = _qkv("explain", *SEED, PYTHONIOENCODING="ascii")
    assert text.returncode == 0 and text.stderr == "", text.stderr
    assert "1/\\u221ad with d = 4 (given; len(q) = 2): 1/\\u221a4 = 1/2 = 0.5" in text.stdout
    doc = _qkv("explain", *SEED, "--format", "json", PYTHONIOENCODING="ascii")
    assert doc.returncode == 0 and doc.stderr == "" and doc.stdout.isascii()
    assert json.loads(doc.stdout)["scale"]["text"] == (
        "1/√d with d = 4 (given; len(q) = 2): 1/√4 = 1/2 = 0.5"
    )


# ----- 4. memory: nothing of size L·S·dv is built, large work is refused up front -----


def test_explain_refuses_more_query_key_pairs_than_documented():
    q, v = np.ones((5000, 2)), np.ones((5000, 1000))
    with pytest.raises(InputError, match=r"^q, k: .* L·S = 5000·5000 = 25000000 is more than"):
        explain(q, q, v)
    assert trace_module.MAX_CELLS == 1 << 24


def test_weighted_values_are_computed_only_when_read(monkeypatch):
    t = explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
    w0, w1 = t.weights[0]
    expected = np.array([[1 * w0, 2 * w0], [3 * w1, 4 * w1]])
    assert "weighted" not in vars(t)  # a property, not a stored (L, S, dv) array
    np.testing.assert_allclose(t.weighted[0], expected, rtol=bound("few roundings", np.float64))
    np.testing.assert_allclose(t.weighted_row(0), expected, rtol=bound("few roundings", np.float64))
    monkeypatch.setattr(trace_module, "MAX_WEIGHTED", 3)
    with pytest.raises(InputError, match=r"L·S·dv = 1·2·2 = 4 numbers is more than 3"):
        t.weighted  # noqa: B018
    np.testing.assert_allclose(t.weighted_row(0), expected, rtol=bound("few roundings", np.float64))
    text = t.to_text()  # the renderers need no (L, S, dv) array
    assert "[2.90515, 3.90515]" in text and f"[{fmt(w1 * 3)}, {fmt(w1 * 4)}]" in text


def test_json_of_a_too_large_trace_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(document, "MAX_NUMBERS", 10)
    rc, out, err = run(capsys, "explain", *SEED, "--format", "json")
    assert_one_line_error(rc, out, err, "json: the document would hold every number")
    assert "(8 + dv) = 20 for L = 1, S = 2, dv = 2" in err


def test_memory_error_is_one_line(monkeypatch, capsys):
    def boom(**_: Any) -> None:
        raise MemoryError

    monkeypatch.setattr(sys.modules["qkv.cli.explain"], "explain", boom)
    rc, out, err = run(capsys, "explain", *SEED)
    assert_one_line_error(rc, out, err, "out of memory; try smaller inputs")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--dims", "65536", "--keys", "65536", "--samples", "2"], "(2 + 65536) · 65536"),
        (["--dims", "4", "--keys", "65536", "--samples", "16777216"], "16777216 · 65536"),
    ],
)
def test_study_scaling_refuses_work_too_large_for_memory(capsys, argv, needle):
    rc, out, err = run(capsys, "study", "scaling", *argv, "--no-progress")
    assert_one_line_error(rc, out, err, needle)


# ----- 6. scores that overflow float64 -----


@pytest.mark.parametrize("command", ["explain", "scores"])
def test_overflowing_scores_are_one_line(capsys, command):
    v = ["--v", "1,2;3,4"] if command == "explain" else []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning either
        rc, out, err = run(capsys, command, "--q", "1e300,1", "--k", "1e300,0;3,2", *v)
    assert_one_line_error(rc, out, err, "score of query row 0 and key 0 overflows float64")
    assert "(q·k = inf, scale = 0.70711)" in err and "NaN" in err


def test_overflow_from_the_scale_or_the_bias_is_refused():
    with pytest.raises(InputError, match=r"key 1 overflows float64 \(q·k = 3, scale = 1e\+308\)"):
        explain([1, 1], [[1, 0], [1, 2]], scale=1e308)
    with pytest.raises(
        InputError, match=r"^q, k, mask: the score plus bias of query row 0 and key 0"
    ):
        explain([1e154, 1], [[1e154, 0]], mask=np.array([[1e308]]), scale=1)


def test_scores_near_the_limit_still_explain_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = explain([1e154, 1], [[1e154, 0], [-1e154, 2]], [[1, 2], [3, 4]], scale=1)
    assert t.shifted[0].tolist() == [0.0, -np.inf] and t.weights[0].tolist() == [1.0, 0.0]
    assert t.output[0].tolist() == [1.0, 2.0]


# ----- issue 9: the first hour of a new user -----


def _entry_point(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real entry point, ``python -m qkv``, with this checkout's sources first."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    full = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "qkv", *argv], capture_output=True, timeout=60, env=full
    )


def test_matrices_starting_with_a_minus_sign_just_work():
    r = _entry_point(
        "explain", "--q", "-1,2", "--k", "-1,0;3,2", "--v", "-1,2;3,-4", "--format", "json"
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    import qkv

    want = qkv.reference.attention([-1, 2], [[-1, 0], [3, 2]], [[-1, 2], [3, -4]])
    np.testing.assert_allclose(
        doc["output"]["output"][0], want, rtol=bound("float64 path", np.float64)
    )
    r = _entry_point("explain", "--q", "-1,2", "--k", "1,0;3,2", "--window", "-1,0")
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert "--window: left must be an integer >= 0" in err  # read as the window's value
    r = _entry_point("scores", "--q", "-h")  # a real option is still not taken as a value
    assert r.returncode == 2 and b"--q: expected one argument" in r.stderr


def test_c_locale_output_is_escaped_not_a_traceback():
    env = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    r = _entry_point("scores", "--q", "2,1", "--k", "1,0;3,2", "--d", "4", env=env)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
    assert b"q0   1   4" in r.stdout and b"\\u00b7" in r.stdout  # · escaped as \u00b7
    r = _entry_point("scores", "--q", "2,\u22121", "--k", "1,0;3,2", "--d", "4", env=env)
    assert r.returncode == 0 and b"q0   1   2" in r.stdout, r.stderr  # 2·1-1·0=2, 2·3-1·2=4


def test_smaller_first_hour_messages(tmp_path, capsys):
    rc, out, err = run(capsys, "scores", "--q", "2,\u22121", "--k", "1,0;3,2", "--d", "4")
    assert rc == 0 and "q0   1   2" in out  # the typographic minus is a minus
    rc, out, err = run(capsys, "scores", "--q", "2,1\u20ac", "--k", "1,0")
    assert_one_line_error(rc, out, err, "holds U+20AC: write numbers in ASCII")
    rc, out, err = run(capsys, "scores", "--q", f"@{tmp_path}", "--k", "1,0")
    assert_one_line_error(rc, out, err, "it is a directory, not a file")
    (tmp_path / "q.csv").write_text("x,y\n2,1\n")
    rc, out, err = run(capsys, "scores", "--q", f"@{tmp_path / 'q.csv'}", "--k", "1,0")
    assert_one_line_error(rc, out, err, "q.csv': row 1 looks like a header ('x,y')")
    rc, out, err = run(capsys, "explain", "--q", "1", "--k", "1")
    assert rc == 0 and "S = 1 key." in out


def test_study_help_is_its_own_and_names_the_modes(capsys):
    assert main(["study", "training", "--help"]) == 0
    out = capsys.readouterr().out
    assert "qkv study training --d" in out and "qkv study scaling" not in out
    assert main(["study", "scaling", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "subset of: scaled, unscaled, times_sqrt_d" in out
    assert "seed" not in out.replace("--seed", "").replace("random seed", "")
    assert "card" not in out


def test_scale_text_in_the_library_says_where_expressions_work():
    import qkv

    with pytest.raises(qkv.InputTypeError, match="qkv.explain and the qkv command's --scale"):
        qkv.attention([1.0, 0.0], [[1.0, 0.0]], [[1.0]], scale="sqrt(d)")

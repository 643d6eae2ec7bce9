"""Issue 21, items 11 and 12: what a newcomer reads and sees in the first hour.

Install commands that work for a source install, the ring demo's help and its report without a
backward pass, "wrote FILE" after every --output, and tables on an ASCII terminal.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qkv.distributed import demo

ROOT = Path(__file__).resolve().parents[1]
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

"""Renderers: every format shows the seed; JSON round-trips; LaTeX compiles; HTML is safe."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest

import qkv
from qkv.render.as_json import decode

SEED = dict(q=[2, 1], k=[[1, 0], [3, 2]], v=[[1, 2], [3, 4]], d=4)
CAUSAL = dict(q=[[1, 0], [0, 1], [1, 1]], k=[[1, 0], [0, 1], [1, 1]], v=[[1, 0], [0, 1], [2, 2]])
NASTY = "<script>alert('x')</script> & $50 % #1 _a_ {b} ~c^ \\d | *e*"


@pytest.fixture(scope="module")
def seed():
    return qkv.explain(**SEED)


@pytest.mark.parametrize("fmt", ["text", "markdown", "latex", "html", "json"])
def test_every_format_shows_the_seed_numbers(seed, fmt):
    out = seed.render(fmt)
    numbers = ("0.04743", "0.95257", "2.90515", "3.90515")
    if fmt == "json":  # full precision
        numbers = ("0.04742587317756", "0.952574126822", "2.905148253644", "3.905148253644")
    for number in numbers:
        assert number in out, (fmt, number)
    if fmt != "json":
        assert re.search(r"1/(√|\$\\sqrt\{)4\}?\$? = 1/2", out), fmt
    assert getattr(seed, f"to_{fmt}")() == out


def test_text_tables(seed):
    text = seed.to_text()
    row0 = next(line for line in text.splitlines() if line.strip().startswith("k0   2·1"))
    assert row0.split()[-4:] == ["no", "-3", "0.04979", "0.04743"]
    assert "row max = 4; sum of exps Σ = 1.04979; log-sum-exp = 4.04859" in text
    assert "[2.90515, 3.90515]" in text


def test_json_round_trip(seed):
    doc = json.loads(seed.to_json())
    assert doc["schema"] == "qkv.trace/1" and doc["stage"] == "output"
    assert doc["scale"]["value"] == 0.5 and doc["scale"]["exact"] == "1/2"
    assert doc["scores"]["dot_terms"] == [["2·1 + 1·0 = 2", "2·3 + 1·2 = 8"]]
    for key in ("q", "k", "v"):
        assert np.array_equal(decode(doc["inputs"][key]), getattr(seed, key))
    for key in ("raw", "scaled"):
        assert np.array_equal(decode(doc["scores"][key]), getattr(seed, key))
    for key in ("logits", "row_max", "shifted", "exps", "sums", "weights", "lse"):
        assert np.array_equal(decode(doc["softmax"][key]), getattr(seed, key)), key
    assert np.array_equal(decode(doc["output"]["weighted"]), seed.weighted)
    assert np.array_equal(decode(doc["output"]["output"]), seed.output)
    assert seed.to_dict() == doc


def test_json_non_finite_and_reasons():
    t = qkv.explain(**CAUSAL, causal=True)
    doc = json.loads(t.to_json())  # strict JSON: no bare -Infinity
    assert doc["softmax"]["logits"][0][1] == "-inf"
    assert np.array_equal(decode(doc["softmax"]["logits"]), t.logits)
    assert doc["softmax"]["excluded"] == t.excluded.tolist()
    assert doc["softmax"]["reasons"][0] == [[], ["causal"], ["causal"]]
    assert doc["positions"] == [0, 1, 2] and doc["causal"] is True


def test_json_exact():
    pytest.importorskip("sympy")
    doc = json.loads(qkv.explain(**SEED, exact=True).to_json())
    w = doc["exact"]["weights"][0]
    assert [x["text"] for x in w] == ["1/(1 + exp(3))", "exp(3)/(1 + exp(3))"]
    assert w[1]["latex"] == r"\frac{e^{3}}{1 + e^{3}}"
    assert w[1]["value"] == pytest.approx(0.9525741268224334, rel=1e-15)


def _check_latex_structure(tex: str) -> None:
    assert tex.startswith("\\documentclass{article}") and tex.rstrip().endswith("\\end{document}")
    assert tex.isascii(), "pdflatex-safe: every non-ASCII character is a command"
    body = re.sub(r"\\[{}$&%#_]", "", tex)
    assert body.count("{") == body.count("}")
    begins = re.findall(r"\\begin\{(\w+)\}", tex)
    ends = re.findall(r"\\end\{(\w+)\}", tex)
    assert sorted(begins) == sorted(ends)
    assert body.count("$") % 2 == 0
    # every table row has as many cells as its tabular declares
    for spec, rows in re.findall(r"tabular\}\{(\w+)\}(.*?)\\end\{tabular", tex, flags=re.S):
        for row in re.findall(r"^(.*) \\\\$", rows, flags=re.M):
            if "multicolumn" not in row:
                assert row.replace(r"\&", "").count("&") == len(spec) - 1, row


LATEX_CASES = {
    "seed": lambda: qkv.explain(**SEED, title=NASTY),
    "causal-window": lambda: qkv.explain(**CAUSAL, causal=True, window=(1, None)),
    "times-sqrt-d": lambda: qkv.explain(
        [2, 1], [[1, 0], [3, 2]], d=4, scale="sqrt(d)", stop_at="scores"
    ),
    "large": lambda: qkv.explain(
        np.arange(60.0).reshape(12, 5) % 7, np.arange(100.0).reshape(20, 5) % 3, np.ones((20, 9))
    ),
}


TEX_ENGINES = ("pdflatex", "lualatex", "xelatex")


def _tex_engine() -> str:
    """The first TeX engine on the PATH; without one the calling test is skipped, saying why."""
    engine = next((e for e in TEX_ENGINES if shutil.which(e)), None)
    if engine is None:
        pytest.skip(f"no TeX engine on the PATH ({', '.join(TEX_ENGINES)}): LaTeX not compiled")
    return engine


def _compile(tex: str, tmp_path) -> None:
    engine = _tex_engine()
    (tmp_path / "t.tex").write_text(tex)
    run = subprocess.run(
        [engine, "-interaction=nonstopmode", "-halt-on-error", "t.tex"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-2000:]
    assert (tmp_path / "t.pdf").stat().st_size > 1000


@pytest.mark.parametrize("name", sorted(LATEX_CASES))
def test_latex_is_well_formed(name):
    _check_latex_structure(LATEX_CASES[name]().to_latex())


@pytest.mark.parametrize("name", sorted(LATEX_CASES))
def test_latex_compiles(name, tmp_path):
    _compile(LATEX_CASES[name]().to_latex(), tmp_path)


def test_latex_exact_is_well_formed_and_compiles(tmp_path):
    pytest.importorskip("sympy")
    tex = qkv.explain(**SEED, exact=True).to_latex()
    assert r"\frac{e^{3}}{1 + e^{3}}" in tex
    _check_latex_structure(tex)
    _compile(tex, tmp_path)


def test_without_tex_the_compile_test_skips_and_says_why(monkeypatch):
    """Issue 21, item 12: no TeX is a skip with its reason, not a pass."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match=r"^no TeX engine on the PATH \(pdflatex"):
        _tex_engine()


def test_html_is_self_contained_and_escaped(seed):
    page = qkv.explain(**SEED, title=NASTY).to_html()
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page and "&lt;script&gt;" in page
    assert not re.search(r"""(src|href)\s*=|url\(|@import|<link|<img|<iframe""", page, re.I)
    assert "default-src 'none'" in page
    assert page.count('<rect class="cell"') == 2 and "weight 0.95257" in page
    # all user text is escaped
    assert "alert(&#x27;x&#x27;)" in page


def test_heatmap_marks_excluded_cells():
    page = qkv.explain(**CAUSAL, causal=True).to_html()
    assert page.count("excluded (weight 0)") == 3
    assert page.count('<rect class="cell"') == 9


def test_markdown_escapes_user_text():
    md = qkv.explain(**SEED, title=NASTY).to_markdown()
    first = md.splitlines()[0]
    assert (
        first.startswith("# ") and "\\<script\\>" in first and "\\*e\\*" in first and "\\|" in first
    )
    table = [line for line in md.splitlines() if line.startswith("| k0")]
    assert len(table) == 3 and table[1].count("|") == 9


def test_jupyter_reprs(seed):
    html = seed._repr_html_()
    assert html.startswith("<style>") and "<html" not in html and "0.95257" in html
    assert seed._repr_markdown_() == seed.to_markdown()
    tex = seed._repr_latex_()
    assert (
        tex.startswith("$$") and tex.endswith("$$") and r"\begin{bmatrix}1 & 4\end{bmatrix}" in tex
    )
    assert "<qkv.Trace stage='output' L=1 S=2 d=2 dv=2 scale=0.5>" == repr(seed)


def test_unknown_format(seed):
    with pytest.raises(qkv.InputError, match="format"):
        seed.render("pdf")

"""The explore page without a browser: what it embeds is the library's, and it is safe."""

from __future__ import annotations

import json
import re

import qkv
from qkv.cli import main
from qkv.explanation.trace import fmt
from qkv.render.explore import explore_page


def _data(page: str) -> dict:
    blob = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    return json.loads(blob.group(1))


def test_embedded_numbers_are_explains_for_each_reading():
    t = qkv.explain([[1, 0], [2, 1]], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4, causal=True)
    data = _data(explore_page(t))
    assert data["initial"] == "divide" and data["row"] == 1
    for name, kw in [
        ("divide", {"d": 4}),
        ("multiply", {"d": 4, "scale": "sqrt(d)"}),
        ("none", {"scale": 1}),
    ]:
        want = qkv.explain([[1, 0], [2, 1]], [[1, 0], [3, 2]], [[1, 2], [3, 4]], causal=True, **kw)
        got = data["readings"][name]
        assert got["scaled"] == [[fmt(x) for x in r] for r in want.scaled]
        assert got["weights"] == [[fmt(x) for x in r] for r in want.weights]
        assert got["describe"] == want.scale.describe()
        assert got["colors"][0][1] == "#d9d9d9"  # q0 may not see k1 (causal)
    assert data["readings"]["multiply"]["scaled"][1] == ["4", "16"]
    assert data["readings"]["none"]["scaled"][1] == ["2", "8"]


def test_the_page_takes_its_numbers_from_the_explanation_layer(monkeypatch):
    """Issue 19: the renderer renders; the three readings come from qkv.explanation.readings."""
    from qkv.explanation import readings
    from qkv.render import explore

    assert not hasattr(explore, "explain") and not hasattr(explore, "reading_traces")
    t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4, scale="sqrt(d)")
    r = readings.scale_readings(t)
    assert r.initial == "multiply" and r.shown.scaled.tolist() == [[4.0, 16.0]]
    assert (
        r.traces["none"].weights.tolist()
        == qkv.attention_weights([[2, 1]], [[1, 0], [3, 2]], scale=1.0).tolist()
    )
    calls = []

    def counted(trace):
        calls.append(trace)
        return r

    monkeypatch.setattr(explore, "scale_readings", counted)
    data = _data(explore_page(t))
    assert calls == [t] and data["initial"] == "multiply"
    assert data["readings"]["none"]["scaled"] == [["2", "8"]]


def test_labels_are_escaped_and_cannot_close_the_script():
    t = qkv.explain([1, 0], [[1, 0], [3, 2]], d=4, key_labels=["<b>", "</script><i>"], title="<x>")
    page = explore_page(t)
    assert "<b>" not in page and "&lt;b&gt;" in page and "<x>" not in page
    assert page.count("</script>") == 2  # the data block and the script, nothing else
    assert "default-src 'none'" in page


def test_cli_writes_the_page_and_errors_are_one_line(tmp_path, capsys):
    base = ["explore", "--q", "2,1", "--k", "1,0;3,2", "--d", "4"]
    assert main(base + ["--v", "1,2;3,4", "--output", str(tmp_path / "p.html")]) == 0
    assert capsys.readouterr().err == f"wrote {tmp_path / 'p.html'}\n"  # as study says it
    assert (
        _data((tmp_path / "p.html").read_text(encoding="utf-8"))["readings"]["divide"]["output"]
        == "[2.90515, 3.90515]"
    )
    assert main(base + ["--row", "3"]) == 2
    assert main(base + ["--exact"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "qkv explore: error: --row: expected 0 to 0 (one per query row), got 3",
        "qkv explore: error: --exact: the explore page shows numbers; use qkv explain --exact",
    ]

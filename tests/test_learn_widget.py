"""qkv.widget's model state, without a browser: every step is qkv.explain's, recomputed when the
fields change; refused input keeps the last view and names the field with the library's
message."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import qkv
from qkv.explanation.display import fmt
from qkv.extras import MissingExtraError


def rows(a) -> list[list[str]]:
    a = np.asarray(a)
    return [[fmt(x) for x in r] for r in (a[:, None] if a.ndim == 1 else a)]


def test_widget_without_its_extra_says_so(monkeypatch):
    from qkv.learn import widget as module

    module._widget_class.cache_clear()
    monkeypatch.setitem(sys.modules, "anywidget", None)
    with pytest.raises(MissingExtraError) as exc:
        qkv.widget([2, 1], [[1, 0], [3, 2]], d=4)
    assert "pip install anywidget" in str(exc.value) and '".[widget]"' in str(exc.value)
    module._widget_class.cache_clear()


def test_refused_first_input_raises_the_librarys_message():
    with pytest.raises(qkv.InputError, match="k, v: number of keys S differs"):
        qkv.widget([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4], [5, 6]], d=4)


@pytest.fixture
def w():
    pytest.importorskip("anywidget", reason="qkv.widget needs the widget extra (anywidget)")
    return qkv.widget([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)


def test_state_is_explains_steps(w):
    t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
    assert w.fields["q"] == "2, 1" and w.fields["k"] == "1, 0; 3, 2" and w.fields["d"] == "4"
    for step in ("raw", "scaled", "logits", "row_max", "shifted", "exps", "sums", "weights"):
        assert w.view["shown"][step] == rows(getattr(t, step)), step
    assert w.view["shown"]["output"] == rows(t.output) == [["2.90515", "3.90515"]]
    assert w.error == {}
    assert "export default" in w._esm and "function draw" in w._esm


def test_edits_recompute_and_refusals_keep_the_last_view(w):
    w.fields = {**w.fields, "reading": "multiply"}
    slip = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4, scale="sqrt(d)")
    assert w.view["shown"]["scaled"] == [["4", "16"]] == rows(slip.scaled)
    assert w.view["shown"]["weights"] == rows(slip.weights)
    w.fields = {**w.fields, "q": "1,0; 0,1; 2,1", "k": "1,0;3,2;0,1", "v": "1;2;3"}
    w.fields = {**w.fields, "reading": "divide", "causal": True}
    t = qkv.explain([[1, 0], [0, 1], [2, 1]], [[1, 0], [3, 2], [0, 1]], [[1], [2], [3]],
                    d=4, causal=True)  # fmt: skip
    assert w.view["shown"]["weights"] == rows(t.weights)
    assert w.view["excluded"] == t.excluded.tolist()
    before = w.view
    w.fields = {**w.fields, "k": "1,0;3"}
    assert w.error == {"field": "k", "message": "k: rows have different lengths"}
    assert w.view == before  # the last good view stays
    w.fields = {**w.fields, "k": "1,0;3,2;0,1"}
    assert w.error == {} and w.view["shown"]["weights"] == rows(t.weights)


def test_arguments_as_the_page_writes_them():
    pytest.importorskip("anywidget", reason="qkv.widget needs the widget extra (anywidget)")
    w = qkv.widget(
        [[1, 0], [0, 1]],
        "1,0; 3,2; 0,1",
        [[1], [2], [3]],
        causal=True,
        align="top-left",
        mask=[True, False, True],
        window=(None, 1),
    )
    assert (w.fields["mask"], w.fields["window"], w.fields["align"]) == (
        "1, 0, 1",
        ",1",
        "top-left",
    )
    mask = np.tril(np.ones((2, 3), bool)) & np.array([True, False, True])
    t = qkv.explain([[1, 0], [0, 1]], [[1, 0], [3, 2], [0, 1]], [[1], [2], [3]], mask=mask,
                    window=(None, 1))  # fmt: skip
    assert w.view["shown"]["weights"] == rows(t.weights)

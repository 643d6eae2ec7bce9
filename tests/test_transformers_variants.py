"""The "qkv" transformers backend on models whose attention has variants, against "eager".

Tiny random-weight models built from configs in tests/_models.py (no download): Llama, Qwen2
and Qwen3 with sliding windows, Gemma 2 (logit soft-capping, alternating sliding and full
layers) and gpt-oss (attention sinks, sliding layers). The same weights run through
``attn_implementation="qkv"`` and ``"eager"``: logits equal to float32 rounding, greedy
generations identical.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._models import NAMES  # noqa: E402
from tests._models import pair as model_pair  # noqa: E402
from tests.conftest import tol  # noqa: E402

VOCAB = 96


@pytest.fixture(scope="module", params=sorted(NAMES))
def pair(request):
    _, ours, ref = model_pair(request.param, VOCAB, before_copy=_sinks_that_matter)
    return request.param, ours, ref


def _sinks_that_matter(model):
    """Learned sinks drawn large, so that they change the output."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape) * 2)


def tokens(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def test_logits_equal_eager(pair, monkeypatch):
    name, ours, ref = pair
    seen = []
    from qkv import front as qkv_front

    inner = qkv_front._run  # every checked call passes here on its way to a back end

    def spy(call):
        seen.append(sorted(k for k in ("softcap", "sinks") if getattr(call.plan, k) is not None))
        return inner(call)

    monkeypatch.setattr(qkv_front, "_run", spy)
    from qkv.engine import run as qkv_run

    # the commonest call's short roads (on arrays, and on tensors' addresses): no variant
    def spying(road):
        def plain_spy(*a):
            out = road(*a)
            if out is not None:
                seen.append([])
            return out

        return plain_spy

    for short in ("plain", "plain_at"):
        monkeypatch.setattr(qkv_run, short, spying(getattr(qkv_run, short)))
    ids = tokens(2, 11)  # longer than every sliding window
    with torch.no_grad():
        got, expect = ours(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, expect, **tol("model logits, eager", torch.float32))
    want = {"gemma2": ["softcap"], "gpt_oss": ["sinks"]}.get(name, [])
    assert seen == [want] * 2  # both layers ran through qkv, with the model's variant


def test_greedy_generate_identical(pair):
    _, ours, ref = pair
    ids = tokens(1, 6, seed=1)
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    got, expect = ours.generate(ids, **kw), ref.generate(ids, **kw)
    assert got.shape == (1, 14)
    assert got.tolist() == expect.tolist()


def test_gpt_oss_sink_gradients_equal_eager():
    _, ours, ref = model_pair("gpt_oss", VOCAB)
    ours.train()
    ref.train()
    ids = tokens(1, 9, seed=2)
    grads = []
    for model in (ours, ref):
        model.zero_grad()
        model(ids).logits.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "sinks" in n})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[1].items():
        assert g.abs().max() > 0
        torch.testing.assert_close(grads[0][n], g, **tol("model gradients", torch.float32))

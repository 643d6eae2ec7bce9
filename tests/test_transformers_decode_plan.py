"""The transformers backend's decoding step as one plan and one run per layer: the plan
(:class:`qkv.DecodePlan`) made once for the layers that share a mask (the float mask turned
into booleans once, kept on the mask itself), the native kernel run once per layer, and a
result that is not finite recomputed at once by the NumPy decode kernel, not by the native
kernel again. A prefill's mask is likewise read once per model step."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from tests.conftest import bound, tol

from qkv import reference
from qkv.masks import tail_counts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qkv.integrations.transformers as hf  # noqa: E402
from qkv import front as qkv_front  # noqa: E402
from qkv.engine import decoding  # noqa: E402
from qkv.engine.kernels import native_decode  # noqa: E402
from qkv.integrations.transformers import attention_forward  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        not native_decode.available(), reason="native kernels not built (or QKV_NATIVE=0)"
    ),
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # transformers' renames
]

RUNS = [(2, 40), (0, 25), (39, 40)]  # a padded batch: each sequence its own run of keys


class Layer(torch.nn.Module):
    is_causal = True


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mask(kind, S=40):
    keep = torch.zeros(len(RUNS), 1, 1, S, dtype=torch.bool)
    for b, (lo, hi) in enumerate(RUNS):
        keep[b, ..., lo:hi] = True
    if kind == "float":
        return keep, torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    return keep, keep


def _reference(q, k, v, keep, **kw):
    """The float64 reference, grouped heads repeated, as ``(batch, 1, heads, dv)``."""
    g = q.shape[1] // k.shape[1]
    args = [t.double().numpy() for t in (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))]
    return reference.attention(*args, mask=keep.numpy(), **kw).transpose(0, 2, 1, 3)


@pytest.fixture
def spies(monkeypatch):
    """Counts of what a step does: native launches, plans made, masks turned into booleans,
    runs on the plan's NumPy road, and the kernel= of every call that reaches qkv.attention."""
    seen = {"launch": 0, "plan": 0, "keep": 0, "numpy": 0, "kernels": []}
    launch, plan, keep, run = native_decode.Template.run, hf._plan, hf._keep, qkv_front._run
    numpy_road = decoding.DecodePlan._numpy

    def count(name, fn):
        def spy(*a, **kw):
            seen[name] += 1
            return fn(*a, **kw)

        return spy

    def run_spy(call):
        seen["kernels"].append(call.kernel)
        return run(call)

    monkeypatch.setattr(native_decode.Template, "run", count("launch", launch))
    monkeypatch.setattr(decoding.DecodePlan, "_numpy", count("numpy", numpy_road))
    monkeypatch.setattr(hf, "_plan", count("plan", plan))
    monkeypatch.setattr(hf, "_keep", count("keep", keep))
    monkeypatch.setattr(qkv_front, "_run", run_spy)
    return seen


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_layers_sharing_a_mask_share_one_plan(kind, spies):
    """Three layers of one step (one mask object, their own q, K, V): one plan, the float mask
    turned into booleans once, one native call per layer, each output equal to the
    reference."""
    keep, mask = _mask(kind)
    for layer in range(3):
        q = rand(3, 8, 1, 16, seed=3 * layer)
        k, v = rand(3, 2, 40, 16, seed=3 * layer + 1), rand(3, 2, 40, 16, seed=3 * layer + 2)
        out, _ = attention_forward(Layer(), q, k, v, mask, scaling=0.3, softcap=2.0)
        expect = _reference(q, k, v, keep, scale=0.3, softcap=2.0)
        np.testing.assert_allclose(out.numpy(), expect, **tol("torch peer", np.float32))
    assert (spies["plan"], spies["keep"], spies["launch"]) == (1, 1, 3)
    assert spies["kernels"] == []  # no call took the general road
    mask[0, ..., 2] = float("-inf") if kind == "float" else False  # changed in place: planned anew
    keep[0, ..., 2] = False  # (sequence 0 now sees keys 3:40)
    out, _ = attention_forward(Layer(), q, k, v, mask, scaling=0.3, softcap=2.0)
    assert (spies["plan"], spies["launch"]) == (2, 4)
    expect = _reference(q, k, v, keep, scale=0.3, softcap=2.0)
    np.testing.assert_allclose(out.numpy(), expect, **tol("torch peer", np.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_step_runs_the_native_kernel_once(dtype, spies):
    """A NaN query row makes the native result not finite: the step goes straight to the plan's
    NumPy decode road (once), the native kernel having run once; the NaN stays in its own
    head's row and every other row equals the reference."""
    keep, mask = _mask("bool")
    q, k, v = rand(3, 8, 1, 16, seed=1), rand(3, 2, 40, 16, seed=2), rand(3, 2, 40, 16, seed=3)
    q[1, 5, 0, 3] = float("nan")
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, _ = attention_forward(Layer(), q, k, v, mask, scaling=0.3)
    assert (spies["launch"], spies["numpy"]) == (1, 1)
    assert spies["kernels"] == []  # (not the general road)
    assert out.dtype == dtype and out.shape == (3, 1, 8, 16)
    got = out.float().numpy()
    expect = _reference(q.float(), k.float(), v.float(), keep, scale=0.3)
    assert np.isnan(got[1, 0, 5]).all() and np.isnan(expect[1, 0, 5]).all()
    row = "torch peer" if dtype == torch.float32 else "rounded once"
    np.testing.assert_allclose(got, expect, **tol(row, dtype))  # NaN where the reference's


def test_an_overflowing_step_is_repaired_by_the_fallback_kernel(spies):
    """Values so large that the kernel's sum of weighted values overflows float32 (the answer,
    their weighted mean, fits): the native kernel runs once, and the NumPy decode kernel's
    retry gives the reference's finite answer."""
    keep, mask = _mask("bool")
    q, k = rand(3, 8, 1, 16, seed=4) * 0.01, rand(3, 2, 40, 16, seed=5)
    v = 3e37 + 1e36 * rand(3, 2, 40, 16, seed=6)
    out, _ = attention_forward(Layer(), q, k, v, mask)
    assert (spies["launch"], spies["numpy"], spies["kernels"]) == (1, 1, [])
    expect = _reference(q, k, v, keep, scale=0.25)
    assert np.isfinite(out.numpy()).all()
    np.testing.assert_allclose(out.numpy(), expect, rtol=bound("torch peer", np.float32))


def test_a_model_step_is_planned_once_for_its_layers(spies):
    """A Llama-style model decoding a padded batch: one plan per step for both layers, one
    native call per layer, no call on the general road."""
    from tests._models import config

    from qkv.integrations.transformers import register

    cfg, cls = config("llama", 64)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.set_attn_implementation(register())
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    attn[0, :3] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=attn, use_cache=True)
        cache = out.past_key_values
        spies.update(plan=0, launch=0, kernels=[])
        for _ in range(3):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            attn = torch.cat([attn, torch.ones_like(nxt)], dim=1)
            out = model(nxt, attention_mask=attn, past_key_values=cache, use_cache=True)
    assert cfg.num_hidden_layers == 2
    assert spies["plan"] == 3 and spies["launch"] == 3 * 2 and spies["kernels"] == []


def test_a_mask_of_two_runs_takes_the_general_road_read_once(spies, monkeypatch):
    """A mask row with a gap: the plan reads the rows once (one key_runs call for the step),
    its router says the native step does not take it, and every layer of the step takes the
    general road (or the masked call's short road to the same plan and kernel,
    qkv.engine.run._masked), its output equal to the reference."""
    from qkv.engine import run as qkv_run
    from qkv.engine.kernels import decode

    found, masked = [], []
    key_runs = decode.key_runs
    monkeypatch.setattr(decode, "key_runs", lambda rows: found.append(rows.shape) or key_runs(rows))
    real_masked = qkv_run._masked

    def masked_spy(*a):
        out = real_masked(*a)
        if out is not None:
            masked.append("auto")
        return out

    monkeypatch.setattr(qkv_run, "_masked", masked_spy)
    keep, mask = _mask("bool")
    mask[1, ..., 10] = False
    for layer in range(2):
        q = rand(3, 8, 1, 16, seed=3 * layer)
        k, v = rand(3, 2, 40, 16, seed=3 * layer + 1), rand(3, 2, 40, 16, seed=3 * layer + 2)
        out, _ = attention_forward(Layer(), q, k, v, mask, scaling=0.3)
        expect = _reference(q, k, v, mask, scale=0.3)
        np.testing.assert_allclose(out.numpy(), expect, **tol("torch peer", np.float32))
    assert spies["plan"] == 1 and spies["launch"] == 0
    assert spies["kernels"] + masked == ["auto", "auto"]
    assert found == [(3, 40)]


def test_a_step_plan_lives_on_its_mask_and_an_unmasked_one_is_kept_by_value(spies):
    """No module-global cache keyed by object ids: a masked step's plan is kept on the mask
    (a new mask, a new plan), an unmasked step's by what it is a pure function of (two calls
    with new tensors of the same shapes share one plan)."""
    keep, mask = _mask("bool")
    q, k, v = rand(3, 8, 1, 16, seed=1), rand(3, 2, 40, 16, seed=2), rand(3, 2, 40, 16, seed=3)
    attention_forward(Layer(), q, k, v, mask, scaling=0.3)
    (version, steps), *_ = (getattr(mask, hf._ON_MASK),)
    (step,) = steps.values()
    assert version == mask._version and isinstance(step.plan, decoding.DecodePlan)
    attention_forward(Layer(), q, k, v, mask.clone(), scaling=0.3)  # a new mask: a new plan
    assert spies["plan"] == 2
    hf._UNMASKED.clear()
    for seed in range(3):
        q, k = rand(3, 8, 1, 16, seed=seed), rand(3, 2, 40, 16, seed=seed + 1)
        out, _ = attention_forward(Layer(), q, k, v, None, scaling=0.3)
        expect = _reference(q, k, v, torch.ones(1, 1, 1, 40, dtype=torch.bool), scale=0.3)
        np.testing.assert_allclose(out.numpy(), expect, **tol("torch peer", np.float32))
    assert spies["plan"] == 3 and len(hf._UNMASKED) == 1 and spies["launch"] == 5


def _bert(layers=3):
    from qkv.integrations.transformers import register

    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ref = transformers.BertModel(cfg).eval()
    ours = copy.deepcopy(ref)  # (its own config: ref stays on sdpa)
    ours.set_attn_implementation(register())
    return ref, ours


@pytest.mark.parametrize("padded", [True, False])
def test_a_prefill_reads_its_mask_once_per_model_step(padded, monkeypatch):
    """An encoder's padded batch: the mask is read once per forward pass for all three
    layers (as key counts, so every layer's call runs on them without the mask), and the
    states at the real tokens equal those of ``sdpa``. A batch without padding: read once as
    hiding nothing (no mask at all)."""
    ref, ours = _bert()
    ids = torch.randint(3, 64, (4, 11), generator=torch.Generator().manual_seed(5))
    attn = torch.ones_like(ids)
    if padded:
        attn[0, 7:] = 0
        attn[2, 4:] = 0
    reads, counts = [], []
    read, run = hf._read_prefill_mask, qkv_front._run
    monkeypatch.setattr(hf, "_read_prefill_mask", lambda m: reads.append(1) or read(m))

    def run_spy(call):
        counts.append(None if call.plan.key_counts is None else call.plan.key_counts.tolist())
        assert call.plan.mask is None or call.plan.key_counts is not None
        return run(call)

    monkeypatch.setattr(qkv_front, "_run", run_spy)
    from qkv.engine import run as qkv_run

    # the commonest call's short roads, on arrays (q, k, v, scale, causal[, mask]) and on
    # tensors' addresses (shapes, dtype, addresses, strides, widen, scale, causal[, mask]): no
    # mask, or a padding mask
    def spying(road, at):
        def plain_spy(*a):
            out = road(*a)
            if out is not None:
                mask = a[at] if len(a) > at else None
                counts.append(None if mask is None else tail_counts(mask, 2).tolist())
            return out

        return plain_spy

    for short, at in (("plain", 5), ("plain_at", 11)):
        monkeypatch.setattr(qkv_run, short, spying(getattr(qkv_run, short), at))
    with torch.no_grad():
        got = ours(ids, attention_mask=attn).last_hidden_state
        expect = ref(ids, attention_mask=attn).last_hidden_state
    assert len(reads) <= 1 and len(counts) == 3  # (no read when transformers builds no mask)
    want = [7, 11, 4, 11] if padded else None
    assert counts == [want] * 3
    real = attn.bool()
    torch.testing.assert_close(got[real], expect[real], **tol("model states", torch.float32))

"""The transformers backend's decoding step as one plan and one run per layer: the plan made
once for the layers that share a mask (the float mask turned into booleans once), the native
kernel run once per layer, and a result that is not finite recomputed at once by the NumPy
decode kernel, not by the native kernel again."""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import bound, tol

from qkv import reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qkv.integrations.transformers as hf  # noqa: E402
from qkv import front as qkv_front  # noqa: E402
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
    and the kernel= of every call that reaches qkv.attention."""
    seen = {"launch": 0, "plan": 0, "keep": 0, "kernels": []}
    launch, plan, keep, run = native_decode.launch, hf._plan, hf._keep, qkv_front._run

    def count(name, fn):
        def spy(*a, **kw):
            seen[name] += 1
            return fn(*a, **kw)

        return spy

    def run_spy(call):
        seen["kernels"].append(call.kernel)
        return run(call)

    monkeypatch.setattr(native_decode, "launch", count("launch", launch))
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
    mask[0, ..., 5] = float("-inf") if kind == "float" else False  # changed in place: planned anew
    attention_forward(Layer(), q, k, v, mask, scaling=0.3, softcap=2.0)
    assert (spies["plan"], spies["launch"]) == (2, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_step_runs_the_native_kernel_once(dtype, spies):
    """A NaN query row makes the native result not finite: the step goes straight to the NumPy
    decode kernel (one call, kernel="decode"), the native kernel having run once; the NaN
    stays in its own head's row and every other row equals the reference."""
    keep, mask = _mask("bool")
    q, k, v = rand(3, 8, 1, 16, seed=1), rand(3, 2, 40, 16, seed=2), rand(3, 2, 40, 16, seed=3)
    q[1, 5, 0, 3] = float("nan")
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, _ = attention_forward(Layer(), q, k, v, mask, scaling=0.3)
    assert spies["launch"] == 1
    assert spies["kernels"] == ["decode"]
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
    assert spies["launch"] == 1 and spies["kernels"] == ["decode"]
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


def test_a_mask_of_two_runs_takes_the_general_road_after_one_native_check(spies, monkeypatch):
    """A mask row with a gap: the native kernel says so once (status 4), the backend does not
    look for the runs again, and every layer of the step takes the general road, its output
    equal to the reference."""
    from qkv.engine.kernels import decode

    found = []
    monkeypatch.setattr(decode, "key_runs", lambda rows: found.append(rows.shape))
    keep, mask = _mask("bool")
    mask[1, ..., 10] = False
    for layer in range(2):
        q = rand(3, 8, 1, 16, seed=3 * layer)
        k, v = rand(3, 2, 40, 16, seed=3 * layer + 1), rand(3, 2, 40, 16, seed=3 * layer + 2)
        out, _ = attention_forward(Layer(), q, k, v, mask, scaling=0.3)
        expect = _reference(q, k, v, mask, scale=0.3)
        np.testing.assert_allclose(out.numpy(), expect, **tol("torch peer", np.float32))
    assert spies["launch"] == 1 and spies["kernels"] == ["auto", "auto"]
    assert found == []  # (this small step runs on the dense kernel, which reads the mask)

"""Rows of tiny subnormal keys and values in the 8-bit forms (issue 44, item 4).

A row's scale ``max|x| / 127`` (``/ 448`` for e4m3fn) in float32 underflowed to 0 below about
1e-44 (1e-42 for e4m3fn): the row was stored as zeros. Now a scale below 2^-126 is rounded up
to a multiple of 2^-149 (at least 2^-149), so such rows keep their values within each form's
stated error, and attention over them equals the reference on the dequantized values.
"""

from __future__ import annotations

import numpy as np
import pytest

import qkv
from qkv import reference

TINY = 2.0**-149  # float32's smallest positive value: the subnormals' spacing
FORMS = ["int8", "float8_e4m3fn"]
MAGNITUDES = [1e-36, 1e-38, 1e-40, 1e-41, 1e-42, 1e-43, 1e-44, 1e-45]


def tiny_rows(seed: int = 0, d: int = 16) -> np.ndarray:
    """Random rows of every magnitude in :data:`MAGNITUDES` (float32 subnormals below 1e-38),
    with a zero row and a row of one nonzero value."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(d) * m for m in MAGNITUDES for _ in range(8)]
    rows += [np.zeros(d), np.eye(d)[3] * -TINY]
    return np.asarray(rows).astype(np.float32)


def stated_error(x: np.ndarray, scales: np.ndarray, form: str) -> np.ndarray:
    """The bound ``quantize_kv`` states: half a step (int8); 2^-4 of the value plus
    ``scale · 2^-10`` and the float32 product's rounding, 2^-150, below 2^-126 (e4m3fn)."""
    s = scales.astype(np.float64)[..., None]
    if form == "int8":
        return s / 2
    return np.abs(x.astype(np.float64)) * 2.0**-4 + s * 2.0**-10 + TINY / 2


@pytest.mark.parametrize("form", FORMS)
def test_tiny_rows_survive_within_the_forms_stated_error(form):
    x = tiny_rows()
    codes, scales = qkv.quantize_kv(x, form)
    back = qkv.dequantize_kv(codes, scales, form).astype(np.float64)
    nonzero = (x != 0).any(axis=-1)
    assert ((back != 0).any(axis=-1) == nonzero).all()  # no nonzero row became zeros
    assert (scales[nonzero] >= np.float32(TINY)).all() and (scales[~nonzero] == 0).all()
    err = np.abs(back - x.astype(np.float64))
    assert (err <= stated_error(x, scales, form)).all(), err.max()
    # relative to the row's largest value, as for normal rows (a subnormal scale's step is
    # coarser than max|x| / 127 by up to 2^-149, which stays below 1/127 of max|x| here)
    top = np.abs(x.astype(np.float64)).max(axis=-1, keepdims=True)
    rel = err[nonzero] / top[nonzero]
    assert rel.max() <= (1 / 127 if form == "int8" else 2.0**-4 + 2.0**-9)


def test_int8_keeps_rows_below_127_subnormal_steps_exactly():
    x = tiny_rows()
    small = np.abs(x).max(axis=-1) < 127 * TINY
    assert small.sum() >= 16  # the rows of 1e-44 and 1e-45, and the one-value row
    back = qkv.dequantize_kv(*qkv.quantize_kv(x, "int8"), "int8")
    np.testing.assert_array_equal(back[small], x[small])


@pytest.mark.parametrize("form", FORMS)
def test_normal_rows_keep_their_scales(form):
    """The rounding up touches only scales below 2^-126: a normal row's is ``top / limit``
    rounded to nearest, as before."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((64, 16)) * 10.0 ** rng.uniform(-30, 30, (64, 1))).astype(np.float32)
    _, scales = qkv.quantize_kv(x, form)
    top = np.abs(x).max(axis=-1)
    np.testing.assert_array_equal(scales, top / np.float32(127 if form == "int8" else 448))


@pytest.mark.parametrize("form", FORMS)
def test_attention_over_a_cache_of_tiny_rows_equals_the_reference_on_its_values(form):
    rng = np.random.default_rng(3)
    S, d = len(MAGNITUDES) * 2, 8
    mags = np.repeat(MAGNITUDES, 2)[None, None, :, None]
    k = (rng.standard_normal((2, 2, S, d)) * mags).astype(np.float32)
    v = (rng.standard_normal((2, 2, S, d)) * mags).astype(np.float32)
    q = (rng.standard_normal((2, 4, 1, d)) * 1e30).astype(np.float32)
    cache = qkv.KVCache(2, 2, d, dtype=form)
    cache.append(k, v)
    out = cache.attend(q)
    for b in range(2):
        kd, vd = cache.keys(b).astype(np.float64), cache.values(b).astype(np.float64)
        assert (np.abs(vd).max(axis=-1) > 0).all()  # every stored value row kept
        want = reference.attention(q[b].astype(np.float64), kd, vd)
        assert np.abs(want).max() > 1e-42  # the output is the tiny values' mix, not zeros
        # float32 rounding: 2^-24 of the output's scale, and below 2^-126 the subnormals'
        # spacing, once per key summed
        np.testing.assert_allclose(out[b], want, rtol=2e-5, atol=S * TINY)


@pytest.mark.parametrize("form", FORMS)
def test_the_transformers_cache_quantizes_tiny_rows_as_quantize_kv_does(form):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from qkv.integrations.kv_cache import _quantize

    x = tiny_rows(seed=4)
    codes, scales = _quantize(torch.from_numpy(x), form)
    want_codes, want_scales = qkv.quantize_kv(x, form)
    np.testing.assert_array_equal(scales.numpy(), want_scales)
    got = codes.numpy() if form == "int8" else codes.view(torch.uint8).numpy()
    np.testing.assert_array_equal(got, want_codes)

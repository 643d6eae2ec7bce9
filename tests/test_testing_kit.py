"""qkv.testing: planted slips are caught and named; correct kernels pass."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import qkv  # noqa: E402
from qkv import reference  # noqa: E402
from qkv.testing import FEATURES, check_attention  # noqa: E402
from qkv.testing import strategies as qs  # noqa: E402


def _naive(
    q,
    k,
    v,
    *,
    scale=None,
    causal=False,
    mask=None,
    axis=-1,
    pairing="repeat",
    fill=-np.inf,
    top_left=False,
):
    """A straightforward NumPy attention whose options plant one slip each."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        idx = np.arange(hq) // (hq // hkv) if pairing == "repeat" else np.arange(hq) % hkv
        k, v = k[:, idx], v[:, idx]
    d = q.shape[-1]
    s = q @ np.swapaxes(k, -1, -2) * (1 / np.sqrt(d) if scale is None else scale)
    L, S = s.shape[-2:]
    ok = np.ones((L, S), dtype=bool)
    if causal:
        i, j = np.arange(L)[:, None], np.arange(S)[None, :]
        ok = j <= i if top_left else j <= i + S - L
    if mask is not None and mask.dtype == bool:
        ok = ok & mask
    elif mask is not None:
        s = s + mask
    s = np.where(ok, s, fill)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=axis, keepdims=True))
        w = e / e.sum(axis=axis, keepdims=True)
    return (w @ v).astype(np.float32)


def correct(q, k, v, *, causal=False, mask=None):
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return np.zeros(q.shape[:-1] + v.shape[-1:], dtype=np.float32)
    out = _naive(q, k, v, causal=causal, mask=mask)
    return np.where(np.isfinite(out), out, 0)  # a row with no key: 0


def times_sqrt_d(q, k, v):
    return _naive(q, k, v, scale=np.sqrt(q.shape[-1]))


def no_scale(q, k, v):
    return _naive(q, k, v, scale=1.0)


def top_left(q, k, v, *, causal=False):
    return _naive(q, k, v, causal=causal, top_left=True)


def inverted_mask(q, k, v, *, mask=None):
    return _naive(q, k, v, mask=None if mask is None else ~mask)


def wrong_axis(q, k, v):
    return _naive(q, k, v, axis=-2)


def interleaved(q, k, v):
    return _naive(q, k, v, pairing="interleave")


def nan_rows(q, k, v, *, mask=None):
    return _naive(q, k, v, mask=mask)


def mean_rows(q, k, v, *, mask=None):
    return _naive(q, k, v, mask=mask, fill=-1e9)


def ignores_scale(q, k, v, *, scale=None):
    return _naive(q, k, v)


def subtracts_bias(q, k, v, *, mask=None):
    return _naive(q, k, v, mask=None if mask is None else -mask)


def ignores_window(q, k, v, *, window=None):
    return qkv.attention(q, k, v)


def ignores_softcap(q, k, v, *, softcap=None):
    return qkv.attention(q, k, v)


SLIPPED = [
    (times_sqrt_d, "plain", "multiplied by √d"),
    (no_scale, "plain", "forgot to scale"),
    (top_left, "causal", "top-left causal"),
    (top_left, "decode", "top-left causal"),
    (inverted_mask, "mask", "mask polarity inverted"),
    (wrong_axis, "plain", "summed the wrong axis"),
    (interleaved, "gqa", "grouped heads interleaved"),
    (nan_rows, "masked_rows", "NaN for a row with no key"),
    (mean_rows, "masked_rows", "mean of values for a row with no key"),
    (ignores_scale, "scale", "explicit scale ignored"),
    (subtracts_bias, "float_mask", "float mask subtracted"),
    (ignores_window, "window", "window ignored"),
    (ignores_softcap, "softcap", "softcap ignored"),
]


@pytest.mark.parametrize(("fn", "feature", "slip"), SLIPPED, ids=[s[2] for s in SLIPPED])
def test_planted_slip_is_caught_and_named(fn, feature, slip):
    report = check_attention(fn, examples=10, features=[feature])
    assert not report
    result = report.result(feature)
    assert result.status == "fail"
    assert result.failure is not None and result.failure.slip == slip
    card = str(report)
    assert f"diagnosis: {slip}" in card and "smallest failing input" in card
    # the numbers shown are the reference's and the kernel's on the input shown
    f = result.failure
    want = reference.attention(
        f.inputs["q"],
        f.inputs["k"],
        f.inputs["v"],
        **{k: v for k, v in f.inputs.items() if k not in "qkv"},
    )
    np.testing.assert_allclose(f.expected, want)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qkv_attention_passes_with_several_seeds(seed):
    report = check_attention(
        qkv.attention, examples=4, seed=seed, supports=set(FEATURES) - {"grad"}
    )
    assert report, str(report)
    assert {r.status for r in report.results} == {"pass", "unsupported"}


def test_a_correct_naive_kernel_passes():
    report = check_attention(correct, examples=6)
    assert report, str(report)
    assert report.result("causal").status == "pass"
    assert report.result("window").status == "unsupported"


def test_top_left_declared_kernel_is_judged_by_its_convention():
    report = check_attention(top_left, examples=8, features=["causal"], causal_alignment="top-left")
    assert report, str(report)
    slipped = check_attention(
        lambda q, k, v, *, causal=False: _naive(q, k, v, causal=causal),
        examples=10,
        features=["causal"],
        causal_alignment="top-left",
    )
    assert slipped.result("causal").failure.slip == "bottom-right causal"


def test_nan_rows_declared_pass():
    assert check_attention(nan_rows, examples=6, features=["masked_rows"], masked_rows="nan")


def test_a_kernel_that_raises_is_reported():
    def broken(q, k, v):
        raise RuntimeError("no")

    report = check_attention(broken, examples=2, features=["plain"])
    assert "raised RuntimeError: no" in str(report)


def test_layout_blhd():
    def blhd(q, k, v):
        t = lambda x: np.swapaxes(x, 1, 2)  # noqa: E731
        return t(qkv.attention(t(q), t(k), t(v)))

    assert check_attention(blhd, layout="blhd", examples=4, features=["plain", "gqa"])
    # the same function declared bhld is wrong (heads and positions swapped)
    assert not check_attention(blhd, examples=10, features=["plain"])


def test_report_json_and_truthiness():
    report = check_attention(times_sqrt_d, examples=5, features=["plain", "causal"])
    data = report.to_dict()
    assert data["passed"] is False
    assert data["results"][0]["failure"]["slip"] == "multiplied by √d"
    assert data["results"][1]["status"] == "unsupported"
    import json

    json.dumps(data)


def test_bad_arguments():
    with pytest.raises(qkv.InputError, match="layout"):
        check_attention(qkv.attention, layout="lbhd")
    with pytest.raises(qkv.InputError, match="supports"):
        check_attention(qkv.attention, supports={"flash"})
    with pytest.raises(qkv.InputError, match="features"):
        check_attention(qkv.attention, features=["nope"])


def _t(x):
    return np.swapaxes(x, 0, 1)


def leaky_varlen(q, k, v, cu_q, cu_k, *, causal=False):
    """Ignores the offsets: every query attends the whole packed batch."""
    return _t(qkv.attention(_t(q), _t(k), _t(v), causal=causal))


def top_left_varlen(q, k, v, cu_q, cu_k, *, causal=False):
    parts = []
    for a, b, c, e in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True):
        tri = np.tril(np.ones((b - a, e - c), dtype=bool)) if causal else None
        parts.append(_t(qkv.attention(_t(q[a:b]), _t(k[c:e]), _t(v[c:e]), mask=tri)))
    return np.concatenate(parts)


def test_varlen_right_and_planted_slips():
    kw = dict(examples=10, features=["varlen"])
    assert check_attention(qkv.attention, varlen=qkv.attention_varlen, **kw)
    for fn, slip in ((leaky_varlen, "sequences leak into each other"),
                     (top_left_varlen, "top-left causal")):  # fmt: skip
        report = check_attention(qkv.attention, varlen=fn, **kw)
        assert report.result("varlen").failure.slip == slip, str(report)
    # without a varlen function the feature is not supported
    assert check_attention(qkv.attention, **kw).result("varlen").status == "unsupported"


# ----- the public strategies keep their promises -----


@settings(max_examples=30, deadline=None)
@given(qs.shapes(grouped=True, dv_differs=True), st.data())
def test_strategies(shape, data):
    assert shape.Hkv >= 2 and shape.Hq % shape.Hkv == 0 and shape.Hq >= 2 * shape.Hkv
    assert shape.dv != shape.d
    m = data.draw(qs.bool_masks(shape.B, shape.Hq, shape.L, shape.S))
    assert m.shape[-2:] == (shape.L, shape.S) and m.any(axis=-1).all()
    f = data.draw(qs.float_masks(shape.B, shape.Hq, shape.L, shape.S))
    assert f.dtype == np.float64 and np.all(np.abs(f) <= 8)
    assert data.draw(qs.windows()) != (None, None)
    cu = data.draw(qs.cu_seqlens())
    assert cu[0] == 0 and np.all(np.diff(cu) >= 0) and cu.dtype == np.int64
    var = data.draw(qs.variants(shape.Hq))
    assert var and set(var) <= {"softcap", "sinks", "alibi_slopes"}
    q, k, v = data.draw(qs.inputs(qs.shapes()))
    # values on the grid of sixteenths: exact in bfloat16
    assert np.array_equal(q * 16, np.round(q * 16)) and np.all(np.abs(q) <= 4)
    np.testing.assert_allclose(qkv.attention(q, k, v), reference.attention(q, k, v), atol=1e-12)

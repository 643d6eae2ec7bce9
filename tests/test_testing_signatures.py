"""qkv.testing on kernels of every legal signature, and the slips the kit itself used to make.

A correct kernel passes whatever its signature (no ``**kwargs``, positional-only, causal only,
top-left declared) and is never given a keyword it did not declare; features it only may
support (grouped heads, empty inputs, keywords through ``**kwargs``) are probed; each slip of
the catalogue is named on its minimal case, the log-sum-exp and the output's dtype included.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import numpy as np
import pytest

pytest.importorskip("hypothesis")

import qkv  # noqa: E402
from qkv import reference  # noqa: E402
from qkv.cli import main  # noqa: E402
from qkv.testing import Kernel, adapters, check_attention  # noqa: E402
from qkv.testing.tolerance import allowed, eps  # noqa: E402

# ----- small correct kernels, one per kind of signature (NumPy, in the inputs' dtype) -----


def _out(q, k, v, **options):
    return np.asarray(reference.attention(q, k, v, **options)).astype(q.dtype)


def _tri(q, k):
    return np.tril(np.ones((q.shape[-2], k.shape[-2]), dtype=bool))


def no_kwargs(q, k, v, causal=False, mask=None):
    return _out(q, k, v, causal=causal, mask=mask)


def positional_only(q, k, v, /):
    return _out(q, k, v)


def causal_positional(q, k, v, causal=False, /):  # causal is not a keyword it takes
    return _out(q, k, v, causal=causal)


def causal_only(q, k, v, causal=True):
    if not causal:
        raise NotImplementedError("this kernel computes causal attention only")
    return _out(q, k, v, causal=True)


def top_left(q, k, v, causal=False):  # PyTorch's is_causal
    return _out(q, k, v, mask=_tri(q, k) if causal else None)


def top_left_swallows(q, k, v, causal=False, **ignored):  # takes and ignores any keyword
    return top_left(q, k, v, causal=causal)


def forwards(q, k, v, **options):  # every keyword through **kwargs
    return qkv.attention(q, k, v, **options)


def learner(q, k, v, causal=False):
    """A first kernel: one head per kv head, no care for empty inputs."""
    s = q @ np.swapaxes(k, -1, -2) * q.dtype.type(1 / np.sqrt(q.shape[-1]))
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.arange(S) <= np.arange(L)[:, None] + S - L, s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    with np.errstate(invalid="ignore"):
        out = (w / w.sum(axis=-1, keepdims=True)) @ v
    return np.nan_to_num(out, nan=0.0)


CORRECT = [
    (no_kwargs, {}),
    (positional_only, {}),
    (causal_positional, {}),
    (causal_only, {"supports": ["causal"]}),
    (top_left, {"causal_alignment": "top-left"}),
    (top_left_swallows, {"causal_alignment": "top-left"}),
    (forwards, {}),
    (learner, {}),
]


@pytest.mark.parametrize(("fn", "options"), CORRECT, ids=[c[0].__name__ for c in CORRECT])
def test_a_correct_kernel_of_any_signature_passes(fn, options):
    report = check_attention(fn, examples=4, **options)
    card = str(report)
    assert report, card
    assert not report.failures and "unexpected keyword" not in card
    assert {r.status for r in report.results} <= {"pass", "unsupported", "skipped"}


def test_a_keyword_is_passed_only_when_declared():
    seen: list[str] = []

    def records(q, k, v, causal=False, **kw):
        seen.extend(kw)
        return top_left(q, k, v, causal=causal)

    report = check_attention(records, examples=4, causal_alignment="top-left")
    assert report, str(report)
    # probed once each (softcap=, sinks=, ... had no effect), never in a feature's cases
    for r in report.results:
        if r.feature in ("scale", "mask", "window", "softcap", "sinks", "alibi", "lse"):
            assert r.status == "unsupported" and "through **kwargs" in r.note, r.line()
    masked = report.result("masked_rows")
    assert masked.status == "skipped" and "top-left causal" in masked.note
    assert seen.count("window") == seen.count("softcap") == 1  # the probes alone
    positional = check_attention(causal_positional, examples=3)
    assert positional.result("causal").status == "unsupported"


@pytest.fixture
def conform_kernels(monkeypatch):
    """This module's kernels as the importable module ``conform_kernels``."""
    mod = types.ModuleType("conform_kernels")
    mod.__dict__.update({fn.__name__: fn for fn, _ in CORRECT})
    mod.__dict__.update(lse_plus=lse_plus, float64_out=float64_out)
    monkeypatch.setitem(sys.modules, "conform_kernels", mod)
    return mod


@pytest.mark.parametrize("name", ["top_left", "top_left_swallows"])
def test_conform_top_left_declared_passes(conform_kernels, capsys, name):
    argv = ["conform", f"conform_kernels:{name}", "--causal-alignment", "top-left"]
    assert main([*argv, "--examples", "4"]) == 0
    out = capsys.readouterr().out
    assert "PASS  causal [float32]" in out and "SKIP  masked_rows [float32]" in out
    assert "window = (0, 0)" not in out and "mean of values" not in out


def test_conform_causal_only_kernel_passes_on_its_declared_features(conform_kernels, capsys):
    argv = ["conform", "conform_kernels:causal_only", "--examples", "4"]
    assert main([*argv, "--supports", "causal,decode"]) == 0
    out = capsys.readouterr().out
    assert "PASS  causal" in out and "PASS  decode" in out and " --   plain" in out
    assert main(argv) == 1  # undeclared, it is asked for plain attention too


def test_top_left_checked_as_bottom_right_names_the_alignment_on_masked_rows():
    for seed in (0, 1, 2):
        report = check_attention(top_left, examples=10, seed=seed, features=["masked_rows"])
        assert report.result("masked_rows").failure.slip == "top-left causal", str(report)


def test_a_finite_fill_is_still_named_on_causal_masked_rows():
    def fills(q, k, v, causal=False):
        L, S = q.shape[-2], k.shape[-2]
        s = q @ np.swapaxes(k, -1, -2) * q.dtype.type(1 / np.sqrt(q.shape[-1]))
        if causal:
            s = np.where(np.arange(S) <= np.arange(L)[:, None] + S - L, s, q.dtype.type(-1e9))
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        return (w / w.sum(axis=-1, keepdims=True)) @ v

    report = check_attention(fills, examples=10, features=["masked_rows"])
    assert report.result("masked_rows").failure.slip == "mean of values for a row with no key"


def test_refused_grouped_heads_and_empty_inputs_are_not_supported_with_the_reason():
    report = check_attention(learner, examples=4)
    assert report, str(report)
    gqa, empty = report.result("gqa"), report.result("empty")
    assert gqa.status == empty.status == "unsupported"
    assert "4 query heads over 2 kv heads" in gqa.note and "S = 0" in empty.note
    assert "broadcast" not in str(report) and "zero-size" not in str(report)
    # the decoding cases then draw no grouped heads either
    assert report.result("decode").status == "pass"


def test_declared_grouped_heads_and_empty_inputs_that_raise_are_named():
    report = check_attention(learner, examples=4, supports=["plain", "gqa", "empty"])
    assert not report
    gqa, empty = report.result("gqa").failure, report.result("empty").failure
    assert gqa.slip == "raised on grouped heads"
    assert "query heads over" in gqa.why and "np.repeat" in gqa.why
    assert empty.slip == "raised on an empty input" and "S = 0" in empty.why
    assert "diagnosis: raised on grouped heads — asked for" in str(report)


def float64_out(q, k, v):
    return np.asarray(reference.attention(q, k, v))  # float64 whatever it is given


def test_float64_out_for_float32_in_is_named():
    report = check_attention(float64_out, examples=4, features=["plain"])
    f = report.result("plain").failure
    assert f is not None and f.slip == "wrong output dtype"
    assert "float32 inputs gave a float64 output" in f.why
    assert "output dtype float64 for float32 inputs" in str(report)
    assert check_attention(float64_out, examples=4, features=["plain"], dtypes=["float64"])


def test_a_wrong_number_is_not_hidden_behind_a_wrong_dtype():
    def both(q, k, v):
        return np.asarray(reference.attention(q, k, v, scale=1.0))  # float64, unscaled

    report = check_attention(both, examples=6, features=["plain"])
    assert report.result("plain").failure.slip == "forgot to scale"


def test_qkv_attention_variants_and_lse_through_kwargs_are_checked(capsys):
    report = check_attention(qkv.attention, examples=4, features=["softcap", "sinks", "alibi"])
    assert report and {r.status for r in report.results} == {"pass"}, str(report)
    argv = ["conform", "qkv:attention", "--examples", "3", "--features", "softcap,lse"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS  softcap [float32]" in out and "PASS  lse [float32]" in out


def test_a_variant_through_kwargs_that_acts_wrongly_fails():
    def doubles_cap(q, k, v, **kw):
        if "softcap" in kw:
            kw["softcap"] *= 2
        return qkv.attention(q, k, v, **kw)

    report = check_attention(doubles_cap, examples=6, features=["softcap", "sinks"])
    assert report.result("softcap").status == "fail"
    assert report.result("sinks").status == "pass"


def test_probe_cases_change_the_reference_by_far_more_than_the_tolerance():
    from qkv.testing.probe import probe_cases

    for feature in ("scale", "causal", "mask", "float_mask", "window", "softcap", "sinks",
                    "alibi"):  # fmt: skip
        for alignment in ("bottom-right", "top-left"):
            (case,) = probe_cases(feature, alignment)
            plain = reference.attention(case.q, case.k, case.v)
            ulp = eps("bfloat16") * max(np.max(np.abs(case.v)), 1)  # "no effect" within it
            assert np.max(np.abs(case.expected() - plain)) > 10 * ulp, feature
            assert np.max(np.abs(case.expected() - plain)) > 1e4 * allowed(
                case.q, case.k, case.v, {}, "float32"
            )


def test_a_declared_kernel_keeps_its_declaration_through_replace():
    kernel = Kernel(forwards)
    assert {"softcap", "gqa", "lse"} <= kernel.probe
    moved = dataclasses.replace(kernel, causal_alignment="top-left")
    assert moved.probe == kernel.probe and moved.supports == kernel.supports
    declared = Kernel(forwards, supports=["plain", "softcap"])
    assert declared.probe == frozenset() and declared.supports == {"plain", "softcap"}


# ----- the log-sum-exp -----


def _with_lse(change):
    def kernel(q, k, v, return_lse=False, causal=False, scale=None):
        out, lse = reference.attention(q, k, v, return_lse=True, causal=causal, scale=scale)
        if not return_lse:
            return out.astype(q.dtype)
        return out.astype(q.dtype), change(lse, q, k, scale, causal)

    return kernel


def lse_plus(q, k, v, return_lse=False):
    out, lse = reference.attention(q, k, v, return_lse=True)
    out = out.astype(q.dtype)
    return (out, (lse + 1e-3).astype(np.float32)) if return_lse else out


def _row_max(q, k, scale, causal):
    s = reference.scores(q, k, scale=scale)
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.arange(S) <= np.arange(L)[:, None] + S - L, s, -np.inf)
    return s.max(axis=-1)


LSE_SLIPS = [
    (lse_plus, "log-sum-exp off by a constant"),
    (_with_lse(lambda lse, *_: lse / np.log(2)), "log-sum-exp in base 2"),
    (_with_lse(lambda lse, *a: lse - _row_max(*a)), "log-sum-exp without the max"),
    (
        _with_lse(
            lambda lse, q, k, scale, causal: reference.attention(
                q, k, k, return_lse=True, causal=causal, scale=1.0
            )[1]
        ),
        "log-sum-exp of unscaled scores",
    ),
    (_with_lse(lambda lse, *_: lse.astype(np.float16)), "log-sum-exp in low precision"),
]


@pytest.mark.parametrize(("fn", "slip"), LSE_SLIPS, ids=[s[1] for s in LSE_SLIPS])
def test_an_lse_slip_is_named(fn, slip):
    report = check_attention(fn, examples=10, features=["plain", "lse"])
    assert report.result("plain").status == "pass"
    lse = report.result("lse")
    assert lse.status == "fail" and lse.failure.slip == slip, str(report)
    assert "return_lse = True" in str(report)
    np.testing.assert_allclose(
        lse.failure.expected,
        reference.attention(
            lse.failure.inputs["q"],
            lse.failure.inputs["k"],
            lse.failure.inputs["v"],
            return_lse=True,
            **{
                n: x
                for n, x in lse.failure.inputs.items()
                if n not in ("q", "k", "v", "return_lse")
            },
        )[1],
    )


def test_an_lse_of_the_wrong_shape_is_reported():
    def keeps_dims(q, k, v, return_lse=False):
        out, lse = reference.attention(q, k, v, return_lse=True)
        return (out.astype(q.dtype), lse[..., None]) if return_lse else out.astype(q.dtype)

    report = check_attention(keeps_dims, examples=3, features=["lse"])
    assert "log-sum-exp shape" in report.result("lse").failure.message


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_qkv_lse_passes_in_every_dtype(dtype):
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    report = check_attention(adapters.QKV_ATTENTION, examples=10, dtypes=[dtype], features=["lse"])
    assert report, str(report)


def test_a_right_lse_with_causal_passes_in_both_alignments():
    right = _with_lse(lambda lse, *_: lse)
    assert check_attention(right, examples=10, features=["lse", "causal"])


# ----- PyTorch float64 kernels are judged in float64 -----


def test_a_float64_torch_kernel_is_judged_without_rounding_to_float32():
    pytest.importorskip("torch")
    report = check_attention(
        adapters.QKV_TORCH, examples=4, dtypes=["float64"], features=["plain", "grad", "lse"]
    )
    assert report, str(report)
    assert report.result("plain").worst < 1e-12 and report.result("grad").worst < 1e-12

"""Robustness around the numbers: processes, threads, cache growth, non-finite inputs, ranges."""

from __future__ import annotations

import importlib.util
import multiprocessing
import re
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import bound, tol

import qkv
from qkv import reference

threadpoolctl = pytest.importorskip("threadpoolctl")

_spec = importlib.util.spec_from_file_location(
    "qkv_fuzz", Path(__file__).resolve().parents[1] / "scripts" / "fuzz.py"
)
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)


# ----- processes and threads -----


def _fork_child_attention(q: np.ndarray) -> np.ndarray:
    return qkv.attention(q, q, q, causal=True)


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
def test_forked_child_runs_threaded_kernels():
    """A child forked after the parent used the worker pool must not wait on dead threads."""
    q = np.random.default_rng(0).standard_normal((2, 4, 300, 32)).astype(np.float32)
    parent = qkv.attention(q, q, q, causal=True)  # starts the pool in the parent
    with multiprocessing.get_context("fork").Pool(1) as pool:
        child = pool.apply_async(_fork_child_attention, (q,)).get(timeout=60)
    ref = reference.attention(q, q, q, causal=True)
    np.testing.assert_allclose(child, ref, **tol("float32 path", np.float32))
    np.testing.assert_array_equal(child, parent)


def _blas_threads() -> list[int]:
    return [m["num_threads"] for m in threadpoolctl.threadpool_info() if m["user_api"] == "blas"]


def test_concurrent_calls_leave_blas_threads_as_found():
    """Limits are process-wide: threads racing on them must not leave BLAS at one thread."""
    before = _blas_threads()
    if not before or max(before) < 2:
        pytest.skip("BLAS already runs one thread here")
    rng = np.random.default_rng(1)
    # each thread its own inputs (short calls: many races), so a result that crossed threads
    # or a half-written one shows; every one of the 200 results is checked
    qs = [rng.standard_normal((1, 2, 40, 16)).astype(np.float32) for _ in range(8)]
    refs = [reference.attention(q, q, q, causal=True) for q in qs]
    errors: list[BaseException] = []

    def work(q: np.ndarray, ref: np.ndarray) -> None:
        try:
            for _ in range(200):
                out = qkv.attention(q, q, q, causal=True, kernel="tiled")
                np.testing.assert_allclose(out, ref, **tol("float32 path", np.float32))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=pair) for pair in zip(qs, refs, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert _blas_threads() == before


# ----- KVCache growth is all or nothing -----


def test_failed_cache_growth_leaves_cache_unchanged(monkeypatch):
    rng = np.random.default_rng(2)
    k, v = rng.standard_normal((2, 1, 2, 20, 4)).astype(np.float32)
    cache = qkv.KVCache(1, 2, 4, value_dim=4)
    cache.append(k[:, :, :16], v[:, :, :16])  # exactly the first capacity (16)
    before = (cache.lengths, cache.capacity, cache.keys(0).copy(), cache.values(0).copy())
    real_zeros = np.zeros  # the buffers grow zeroed
    calls = []

    def failing_zeros(shape, *args, **kwargs):
        calls.append(shape)
        if len(calls) == 2:  # the second buffer of the growth (k grew already, before the fix)
            raise MemoryError("simulated")
        return real_zeros(shape, *args, **kwargs)

    monkeypatch.setattr(np, "zeros", failing_zeros)
    with pytest.raises(MemoryError):
        cache.append(k[:, :, 16:], v[:, :, 16:])
    monkeypatch.undo()
    assert cache.lengths.tolist() == before[0].tolist() and cache.capacity == before[1]
    np.testing.assert_array_equal(cache.keys(0), before[2])
    np.testing.assert_array_equal(cache.values(0), before[3])
    # and it goes on working: the retried append and attention equal the reference
    cache.append(k[:, :, 16:], v[:, :, 16:])
    q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(
        cache.attend(q),
        reference.attention(q, k, v, causal=True),
        **tol("float32 path", np.float32),
    )


# ----- non-finite inputs: every kernel agrees with the reference, NaN where it has NaN -----

KERNELS = ("dense", "tiled", "decode")


def assert_same_with_nan(got: np.ndarray, ref: np.ndarray) -> None:
    """Equal values, NaN in exactly the reference's places."""
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_allclose(got, ref, **tol("non-finite inputs", np.float64), equal_nan=True)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_key_hidden_by_causal(kernel, bad):
    q, k, v = np.ones((2, 1)), np.array([[1.0], [bad]]), np.array([[1.0], [2.0]])
    with np.errstate(all="ignore"):
        ref = reference.attention(q, k, v, causal=True)
    assert ref[0, 0] == 1.0  # row 0 never sees key 1
    assert_same_with_nan(qkv.attention(q, k, v, causal=True, kernel=kernel), ref)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("window", [None, (1, 0), (0, 2)])
def test_non_finite_inputs_under_masks_match_reference(kernel, where, bad, window):
    rng = np.random.default_rng(3)
    arrays = dict(zip("qkv", rng.standard_normal((3, 2, 9, 4)), strict=True))
    arrays[where][1, 4, 2] = bad
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    with np.errstate(all="ignore"):
        ref = reference.attention(q, k, v, causal=True, window=window)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # qkv warns about nothing: NaN propagates by policy
        got = qkv.attention(q, k, v, causal=True, window=window, kernel=kernel)
    if where == "v":  # documented: a non-finite value may also reach rows that mask its key
        case = dict(q=q, k=k, v=v, scale=None, causal=True, window=window)
        with np.errstate(all="ignore"):
            skip = fuzz.without_hidden(case)  # the answer with the hidden keys left out
        differ = ~np.isclose(got, ref, **tol("non-finite inputs", np.float64), equal_nan=True)
        assert np.all(np.isnan(got[differ]) | np.isclose(got[differ], skip[differ]))
        assert differ.sum() < got.size // 4  # the rows that see the key agree
    else:
        assert_same_with_nan(got, ref)


# ----- the edges of the float ranges -----


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scale", [1e38, 1e39, 1e300])
def test_scale_beyond_float32_range_is_computed(kernel, scale):
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((3, 5, 4)).astype(np.float32)
    ref = reference.attention(q, k, v, scale=scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = qkv.attention(q, k, v, scale=scale, kernel=kernel)
        w = qkv.attention_weights(q, k, scale=scale)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref, **tol("float32 path", np.float32))
    np.testing.assert_allclose(
        w, reference.attention_weights(q, k, scale=scale), atol=bound("rule floor", np.float32)
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_large_valid_values_raise_no_warning(kernel):
    v = np.full((64, 2), 3e37, np.float32)
    q = k = np.ones((64, 2), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = qkv.attention(q, k, v, kernel=kernel)
    np.testing.assert_allclose(
        out, reference.attention(q, k, v), rtol=tol("float32 path", np.float32)["rtol"]
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_bias_beyond_compute_range_is_refused(dtype):
    q, k, v = (np.random.default_rng(s).standard_normal((2, 2)).astype(dtype) for s in range(3))
    bias = np.full((2, 2), np.finfo(np.float64).min)
    with pytest.raises(qkv.InputError, match=r"mask: float bias .* beyond the range of float32"):
        qkv.attention(q, k, v, mask=bias)
    # -inf stays the way to hide keys, and in-range biases are fine: each row then sees one key,
    # so the output is that key's value (inputs a masking bug would change, unlike all ones)
    bias = np.array([[0.0, -np.inf], [-1e30, 0.0]])
    out = qkv.attention(q, k, v, mask=bias)
    limit = bound("beyond the dtype", dtype)
    np.testing.assert_allclose(out, reference.attention(q, k, v, mask=bias), rtol=limit, atol=limit)
    np.testing.assert_allclose(out, v, rtol=limit, atol=limit)


# ----- a slice of scripts/fuzz.py: every kernel against the reference on random problems -----


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_slice(seed):
    """50 random problems per seed (shapes, masks, windows, dtypes, magnitudes, NaN/inf)."""
    assert fuzz.run(50, seed=1000 + seed) == 0


# ----- inputs that were silently accepted -----


@pytest.mark.parametrize("dtype", ["datetime64[s]", "timedelta64[ms]"])
def test_datetime_arrays_are_refused(dtype):
    x = np.arange(4).astype(dtype).reshape(2, 2)
    want = re.escape(f"q: expected real numbers, got dtype {dtype}")
    with pytest.raises(qkv.InputTypeError, match=want):
        qkv.attention(x, np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(qkv.InputTypeError, match="mask: expected bool"):
        qkv.attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), mask=x)


def test_cache_dtype_none_is_refused():
    with pytest.raises(qkv.InputTypeError, match=r"dtype: expected a float dtype .*, got None"):
        qkv.KVCache(1, 1, 4, dtype=None)


@pytest.mark.parametrize(("given", "read"), [("i4", "int32"), ("c8", "complex64")])
def test_cache_dtype_code_is_named_as_given(given, read):
    # A type code NumPy reads as another dtype ("f16" is 16 bytes: float128 where it exists):
    # the message names what was written, and what NumPy made of it
    want = re.escape(f"got '{given}' (NumPy's {read})")
    with pytest.raises(qkv.InputTypeError, match=want):
        qkv.KVCache(1, 1, 4, dtype=given)
    with pytest.raises(qkv.InputTypeError, match=want):
        qkv.PagedKVCache(4, 16, 1, 4, dtype=given)


@pytest.mark.parametrize("flag", ["return_lse", "check_finite"])
@pytest.mark.parametrize("value", ["no", 0, 1, None, [True]])
def test_flags_must_be_bool(flag, value):
    x = np.ones((2, 2))
    with pytest.raises(qkv.InputTypeError, match=f"{flag}: expected True or False"):
        qkv.attention(x, x, x, **{flag: value})
    if flag == "return_lse":
        cache = qkv.KVCache(1, 1, 2)
        with pytest.raises(qkv.InputTypeError, match="return_lse: expected True or False"):
            cache.attend(np.ones((1, 1, 1, 2)), return_lse=value)


def test_sparse_and_quantized_tensors_name_the_argument():
    torch = pytest.importorskip("torch")
    q = torch.ones(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's beta/deprecation notes
        cases = {
            "q": (q.to_sparse(), q, q, {}),
            "k": (q, q.to_sparse_csr(), q, {}),
            "v": (q, q, torch.quantize_per_tensor(q, 0.1, 0, torch.qint8), {}),
            "mask": (q, q, q, {"mask": (q > 0).to_sparse()}),
        }
    for name, (a, b, c, opts) in cases.items():
        with pytest.raises(qkv.InputTypeError, match=f"^{name}: "):
            qkv.attention(a, b, c, **opts)
    with pytest.raises(qkv.InputTypeError, match="^mask: "):  # NumPy inputs, tensor mask
        qkv.attention(q.numpy(), q.numpy(), q.numpy(), mask=(q > 0).to_sparse())


# ----- the README's plot line, then what a matplotlib user writes next -----


def test_plot_weights_shows_through_pyplot(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image
    import matplotlib.pyplot as plt

    from qkv import plot

    q = np.random.default_rng(5).standard_normal((1, 8, 16, 64)).astype(np.float32)
    k = np.random.default_rng(6).standard_normal((1, 2, 16, 64)).astype(np.float32)
    plt.close("all")
    ax = plot.weights(qkv.attention_weights(q, k, causal=True), index=(0, 0))  # README's line
    path = tmp_path / "w.png"
    plt.savefig(path)
    plt.close("all")
    img = matplotlib.image.imread(path)[..., :3]
    coloured = np.mean(np.ptp(img, axis=-1) > 0.1)  # pixels that are not grey/white
    assert ax.figure.get_size_inches()[0] > 3 and coloured > 0.2, coloured


# ----- the HTML page -----


def test_html_marks_masked_scores_and_heatmap_uses_table_digits():
    import re as _re

    from qkv.explanation.trace import fmt

    t = qkv.explain(
        [[1, 0], [0, 1], [1, 1]], [[1, 0], [0, 1], [1, 1]], [[1, 0], [0, 1], [2, 2]], causal=True
    )
    page = t.to_html()
    scaled = page[page.index("scaled scores q·kᵀ · scale") :].split("</table>")[0]
    assert "greyed: pairs the query may not see" in scaled
    masked = _re.findall(r'<td class="num masked">([^<]*)</td>', scaled)
    assert masked == [fmt(t.scaled[0, 1]), fmt(t.scaled[0, 2]), fmt(t.scaled[1, 2])]
    svg = page[page.index("<svg") : page.index("</svg>")]
    assert int(_re.search(r'class="cell" x="\d+" y="\d+" width="(\d+)"', svg).group(1)) >= 60
    shown = _re.findall(r'text-anchor="middle" fill="#(?:ffffff|1a1a1a)">([^<]*)</text>', svg)
    kept = [fmt(w) for w in t.weights[~t.excluded]]
    assert shown == kept and any(len(s) >= 6 for s in shown)  # e.g. 0.33022, as in the tables

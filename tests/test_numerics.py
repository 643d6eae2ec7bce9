"""The numeric rules of :mod:`qkv.numerics` against their definitions and their users.

Each rule is written once there; these tests check that every path that takes the decision
agrees with it: the accumulation dtype (the lse of each road is in it), the default scale
(the float64 reference's), and the stored K/V forms and their codes (quant's tables, the
native loader's and the C library's enum).
"""

from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv import numerics, reference
from qkv.engine import quant
from qkv.engine.kernels import native_lib
from qkv.explanation.scale import resolve_scale
from qkv.validate import block_plan, make_plan

ml_dtypes = pytest.importorskip("ml_dtypes")

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
ABI_H = Path(native_lib.__file__).parent / "native_src" / "abi.h"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_accumulation_dtype_is_float32_or_wider_and_never_narrows(dtype):
    acc = numerics.acc_dtype(dtype)
    assert acc == (np.float32 if dtype.itemsize < 4 else dtype)
    assert acc.itemsize >= 4 and acc.itemsize >= dtype.itemsize
    assert numerics.acc_dtype(dtype.type) == acc  # a scalar type reads as its dtype


def _qkv(dtype, shape=(2, 3, 5, 8), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_road_computes_in_the_accumulation_dtype(dtype):
    q, k, v = _qkv(dtype)
    acc = numerics.acc_dtype(dtype)
    assert make_plan(q, k, v).acc_dtype == acc
    block = block_plan(q, k, v, scale=0.5, causal=False, window=None, out_dtype=dtype)
    assert block.acc_dtype == acc
    out, lse = qkv.attention(q, k, v, return_lse=True)
    assert out.dtype == dtype and lse.dtype == acc
    # varlen: two sequences of 3 and 2 tokens, packed (total, heads, d)
    pq, pk, pv = (x[0].transpose(1, 0, 2) for x in (q, k, v))
    cu = np.array([0, 3, 5])
    _, lse = qkv.attention_varlen(pq, pk, pv, cu, cu, return_lse=True)
    assert lse.dtype == acc


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=str)
def test_the_cache_computes_in_the_accumulation_dtype(dtype):
    q, k, v = _qkv(dtype, shape=(2, 3, 4, 8))
    cache = qkv.KVCache(2, 3, 8, dtype=dtype)
    cache.append(k, v)
    out, lse = cache.attend(q[:, :, -1:], return_lse=True)
    assert lse.dtype == numerics.acc_dtype(dtype)


def test_torch_tensors_compute_in_the_accumulation_dtype():
    torch = pytest.importorskip("torch")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        q, k, v = (torch.randn(2, 5, 8).to(dtype) for _ in range(3))
        _, lse = qkv.attention(q, k, v, return_lse=True)
        want = numerics.acc_dtype(np.dtype(str(dtype).removeprefix("torch.")))
        assert str(lse.dtype) == f"torch.{want}"


def test_bfloat16_softmax_accumulates_in_float32():
    # 2000 terms of one large and many small weights: a bfloat16 sum (8 bits) of the small
    # ones would lose them; the float32 one keeps each row within float32 rounding.
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 2000)) * 3).astype(BF16)
    want = reference.softmax(x.astype(np.float64))
    got = qkv.softmax(x)
    assert np.dtype(got.dtype).itemsize >= 4
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-9)
    from qkv.engine import run  # the NumPy path itself, below the front's conversions

    np.testing.assert_allclose(run.softmax(x).astype(np.float64), want, rtol=1e-5, atol=1e-9)


def test_bfloat16_tensor_softmax_is_the_rounded_float32_one():
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 2000, generator=torch.Generator().manual_seed(2)) * 3
    xb = x.to(torch.bfloat16)
    want = torch.from_numpy(reference.softmax(xb.double().numpy())).to(torch.bfloat16)
    assert torch.equal(qkv.softmax(xb), want)  # float32 sums, one rounding at the end


@pytest.mark.parametrize("d", [1, 2, 3, 7, 8, 48, 64, 96, 100, 128, 4095])
def test_default_scale_is_the_references(d):
    e = np.zeros(d)
    e[0] = 1.0  # q = k = e: the score is the scale itself
    assert reference.scores(e, e[None]).item() == numerics.default_scale(d)
    assert numerics.default_scale(d) == 1.0 / math.sqrt(d)
    # what qkv.attention, the decode step and qkv.explain use when no scale is given
    assert make_plan(e[None], e[None], e[None]).scale == numerics.default_scale(d)
    assert resolve_scale(None, None, d).value == numerics.default_scale(d)  # d = len(q)
    assert resolve_scale(None, d, 1).value == numerics.default_scale(d)  # d given (the CLI's)


def test_stored_forms_are_quants_and_the_loaders():
    names = [f.name for f in numerics.STORED_FORMS]
    assert len(set(names)) == len(names) == 4
    assert len({f.code for f in numerics.STORED_FORMS} | {numerics.SAME_CODE}) == 5
    assert list(quant.FORMATS) == names
    assert list(quant.SCALED) == [f.name for f in numerics.STORED_FORMS if f.scaled]
    assert native_lib.KV_FORMATS == {f.name: f.code for f in numerics.STORED_FORMS}
    x = np.linspace(-2.0, 2.0, 16, dtype=np.float32).reshape(2, 8)
    for f in numerics.STORED_FORMS:
        assert quant.storage_dtype(f.name) == f.storage
        codes, scales = quant.quantize_kv(x, f.name)
        assert codes.dtype == f.storage and (scales is not None) == f.scaled
        assert f.storage.itemsize == (1 if f.scaled else 2)


def test_the_c_headers_enum_is_the_stored_forms():
    """The C enum's source is the Python list: parse it and compare (no library needed)."""
    m = re.search(r"enum qkv_kv_format : int64_t \{([^}]*)\}", ABI_H.read_text())
    assert m, "abi.h: enum qkv_kv_format not found"
    enum = {k.strip(): int(v) for k, v in (e.split("=") for e in m.group(1).split(","))}
    c_names = {"bfloat16": "KV_BF16", "float16": "KV_F16", "int8": "KV_INT8"}
    c_names["float8_e4m3fn"] = "KV_E4M3"
    assert enum.pop("KV_SAME") == numerics.SAME_CODE
    assert enum == {c_names[f.name]: f.code for f in numerics.STORED_FORMS}


_lib, _why = native_lib.library()
needs_lib = pytest.mark.skipif(_lib is None, reason=f"native library: {_why}")


@needs_lib
def test_the_library_agrees_with_the_stored_forms():
    for f in numerics.STORED_FORMS:
        assert _lib.qkv_kv_format_code(f.name.encode()) == f.code
    assert _lib.qkv_kv_format_code(b"float32") == -1
    assert _lib.qkv_kv_format_code(None) == -1


@needs_lib
def test_the_loader_refuses_a_library_whose_codes_differ(monkeypatch):
    monkeypatch.setitem(native_lib.KV_FORMATS, "int8", 9)
    lib, why = native_lib.library.__wrapped__()  # a fresh load, not the cached one
    assert lib is None and "K/V format codes differ" in why
    monkeypatch.undo()
    lib, why = native_lib.library.__wrapped__()
    assert lib is not None and why == ""
    assert isinstance(lib, ctypes.CDLL)

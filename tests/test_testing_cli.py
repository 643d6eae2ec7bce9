"""qkv.testing from outside: the qkv conform command, the pytest plugin, the adapters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv.cli import main

pytest.importorskip("hypothesis")

from qkv.testing import adapters, check_attention  # noqa: E402

SRC = str(Path(qkv.__file__).resolve().parents[1])

SLIPPED = """
import numpy as np
import qkv

def attention(q, k, v, causal=False):
    return qkv.attention(q, k, v, causal=causal, scale=np.sqrt(q.shape[-1]))

def right(q, k, v, causal=False):
    return qkv.attention(q, k, v, causal=causal)
"""


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    (tmp_path / "my_kernels.py").write_text(SLIPPED)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield
    sys.modules.pop("my_kernels", None)


def test_conform_passes_with_status_0(kernels, capsys):
    assert main(["conform", "my_kernels:right", "--examples", "3"]) == 0
    out = capsys.readouterr().out
    assert "report card: my_kernels:right" in out
    assert "PASS  causal [float32]" in out and "not supported" in out
    assert out.rstrip().splitlines()[-1].startswith("PASS:")


def test_conform_failure_names_the_slip_with_status_1(kernels, capsys):
    assert (
        main(["conform", "my_kernels:attention", "--examples", "5", "--features", "plain,causal"])
        == 1
    )
    out = capsys.readouterr().out
    assert "diagnosis: multiplied by √d" in out
    assert "expected = " in out and "obtained = " in out


def test_conform_json(kernels, capsys):
    assert (
        main(
            ["conform", "my_kernels:attention", "--examples", "5", "--features", "plain", "--json"]
        )
        == 1
    )
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is False
    assert data["results"][0]["failure"]["slip"] == "multiplied by √d"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["conform", "my_kernels"], "expected module:function"),
        (["conform", "no_such_module:f"], "cannot import"),
        (["conform", "my_kernels:missing"], "no attribute"),
        (["conform", "my_kernels:np"], "not a callable"),
        (["conform", "my_kernels:right", "--dtypes", "float8"], "dtypes"),
        (["conform", "my_kernels:right", "--supports", "flash"], "supports"),
        (["conform", "my_kernels:right", "--layout", "lbhd"], "--layout"),
        (["conform", "my_kernels:right", "--examples", "0"], "examples"),
    ],
)
def test_conform_bad_usage_is_one_line_with_status_2(kernels, capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_conform_runs_an_adapter_with_its_conventions(capsys):
    pytest.importorskip("torch")
    assert (
        main(
            [
                "conform",
                "qkv.testing.adapters:TORCH_SDPA",
                "--examples",
                "3",
                "--features",
                "causal,mask",
            ]
        )
        == 0
    )
    assert "top-left" in capsys.readouterr().out
    # the same function declared bottom-right fails, and the kit says why
    assert (
        main(
            [
                "conform",
                "qkv.testing.adapters:TORCH_SDPA",
                "--examples",
                "10",
                "--features",
                "causal",
                "--causal-alignment",
                "bottom-right",
            ]
        )
        == 1
    )
    assert "diagnosis: top-left causal" in capsys.readouterr().out


def test_torch_sdpa_card_is_clean_in_float32_and_bfloat16():
    pytest.importorskip("torch")
    report = check_attention(
        adapters.TORCH_SDPA,
        examples=3,
        dtypes=["float32", "bfloat16"],
        features=["plain", "causal", "mask", "gqa", "masked_rows", "grad"],
    )
    assert report, str(report)
    assert "top-left" in str(report)


def test_a_low_precision_slip_fails_at_float32_and_passes_at_bfloat16():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    def rounds(q, k, v):  # computes in bfloat16 whatever it is given
        out = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
        return out.to(q.dtype)

    kw = dict(arrays="torch", examples=10, features=["plain"])
    assert not check_attention(rounds, dtypes=["float32"], **kw)
    assert check_attention(rounds, dtypes=["bfloat16"], **kw)
    assert torch  # used


def test_a_wrong_gradient_is_caught():
    pytest.importorskip("torch")
    import torch.nn.functional as F

    def no_dv(q, k, v):  # right forward, no gradient for v
        return F.scaled_dot_product_attention(q, k, v.detach())

    report = check_attention(
        no_dv, arrays="torch", examples=4, features=["plain", "grad"], supports={"plain", "grad"}
    )
    assert report.result("plain").status == "pass"
    assert report.result("grad").status == "fail"
    assert "dv = [[" in str(report)
    assert report.result("grad").failure.slip == "wrong dv"


def test_flex_attention_adapter():
    pytest.importorskip("torch.nn.attention.flex_attention")
    report = check_attention(
        adapters.FLEX_ATTENTION, examples=2, features=["causal", "window", "softcap"]
    )
    assert report, str(report)


def test_a_missing_array_library_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)
    with pytest.raises(qkv.InputError, match="needs jax"):
        check_attention(adapters.JAX_DOT_PRODUCT_ATTENTION, examples=1)
    assert main(["conform", "qkv.testing.adapters:JAX_DOT_PRODUCT_ATTENTION"]) == 2
    assert "needs jax" in capsys.readouterr().err


def test_jax_adapter_or_its_reason():
    jax = pytest.importorskip("jax", reason="jax is not installed (not in the test extra)")
    report = check_attention(
        adapters.JAX_DOT_PRODUCT_ATTENTION, examples=3, features=["plain", "causal", "gqa"]
    )
    assert report, str(report)
    assert jax


def test_qkv_forced_kernels_pass():
    for kernel in (adapters.QKV_DENSE, adapters.QKV_TILED, adapters.QKV_DECODE):
        report = check_attention(kernel, examples=2, features=["causal", "window", "sinks"])
        assert report, str(report)


def test_pytest_plugin_one_test(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["qkv.testing.pytest_plugin"]\n')
    (tmp_path / "test_mine.py").write_text(
        textwrap.dedent("""
        import numpy as np
        import qkv

        def mine(q, k, v, causal=False):
            return qkv.attention(q, k, v, causal=causal)

        def slipped(q, k, v):
            return qkv.attention(q, k, v, scale=1.0)

        def test_mine(attention_conformance):
            attention_conformance(mine, features=["plain", "causal"])

        def test_slipped(attention_conformance):
            attention_conformance(slipped, features=["plain"])
    """)
    )
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--qkv-examples",
            "4",
            "-o",
            "addopts=",
            "test_mine.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "1 failed, 1 passed" in res.stdout, res.stdout + res.stderr
    assert "diagnosis: forgot to scale" in res.stdout


def test_importing_qkv_does_not_import_hypothesis():
    code = "import sys, qkv, qkv.cli; print('hypothesis' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_without_hypothesis_the_error_names_the_extra():
    code = textwrap.dedent("""
        import sys
        sys.modules["hypothesis"] = None
        try:
            import qkv.testing
        except ImportError as exc:
            print(exc)
        from qkv.cli import main
        print("status", main(["conform", "qkv:attention"]))
    """)
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert 'pip install "qkv[testing]"' in out.stdout, out.stderr
    assert "status 2" in out.stdout
    assert out.stderr.startswith("qkv conform: error: qkv.testing needs hypothesis")
    assert len(out.stderr.strip().splitlines()) == 1
    assert np  # numpy imported for the kernels above


def test_transformers_attention_functions_and_their_conventions():
    pytest.importorskip("transformers")
    sdpa = check_attention(
        adapters.TRANSFORMERS_SDPA, examples=4, features=["plain", "mask", "decode"]
    )
    assert sdpa.result("plain").status == sdpa.result("mask").status == "pass"
    # a single query with causal=True sees every key (decoding), not PyTorch's top-left
    assert sdpa.result("decode").failure.slip == "bottom-right causal"
    eager = check_attention(
        adapters.TRANSFORMERS_EAGER, examples=4, features=["gqa", "masked_rows"]
    )
    assert eager.result("gqa").status == "pass"
    # its masks hold the dtype's minimum, not -inf: a row with no key averages the values
    assert eager.result("masked_rows").failure.slip == "mean of values for a row with no key"


def test_conform_help_lists_every_feature(capsys):
    from qkv.testing import FEATURES

    assert main(["conform", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "features: " + ", ".join(FEATURES) + "." in out

"""qkv.info(), ``qkv info`` and ``qkv --version --verbose``: what this installation runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import qkv
from qkv.about import format_info
from qkv.cli import main
from qkv.engine.kernels import native, native_lib

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _python(code: str, **env: str) -> str:
    full = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full.update(env)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_info_is_plain_values_that_match_the_installation():
    report = qkv.info()
    assert report["qkv"] == qkv.__version__ and report["numpy"] == np.__version__
    assert json.loads(json.dumps(report)) == report  # plain values only
    assert report["threads"]["count"] >= 1 and "cores" in report["threads"]["rule"]
    assert report["native"] == native.info()
    assert set(report["optional"]) == {
        "scipy", "threadpoolctl", "numba", "torch", "triton", "transformers"
    }  # fmt: skip
    assert report["optional"]["torch"] is None or report["optional"]["torch"].startswith("2.")


def test_info_reports_the_callers_thread_limit():
    from qkv.engine.kernels.threads import cpu_count, limit_threads

    with limit_threads(1):
        inside = qkv.info()["threads"]
    assert inside["count"] == 1 and "limit_threads(1)" in inside["rule"]
    assert str(cpu_count()) in inside["rule"]


def test_workers_is_the_one_rule_on_thread_counts(monkeypatch):
    from qkv.engine.kernels import threads

    monkeypatch.setattr(threads, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.workers() == 8 and threads.workers(3) == 3 and threads.workers(-2) == 1
    assert threads.workers(items=3) == 3 and threads.workers(items=0) == 1
    assert threads.workers(share=3) == 2 and threads.workers(share=16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert threads.workers() == 4 and "OMP_NUM_THREADS=4" in threads.thread_rule()
    with threads.limit_threads(2):
        assert threads.workers() == 2 and threads.workers(5) == 5
    monkeypatch.setattr(threads, "blas_limitable", lambda: False)
    assert threads.workers(4, blas=True) == 1 and threads.workers(4) == 4


def test_info_follows_the_switches_in_a_fresh_process():
    code = "import json, qkv; print(json.dumps(qkv.info()))"
    off = json.loads(_python(code, QKV_NATIVE="0", QKV_JIT="0", OMP_NUM_THREADS="1"))
    assert off["native"]["active"] is False and "QKV_NATIVE=0" in off["native"]["reason"]
    assert not any(off["native"]["kernels"].values())
    assert off["jit"] == {"active": False, "reason": "switched off (QKV_JIT=0)"}
    assert off["threads"]["count"] == 1 and "OMP_NUM_THREADS=1" in off["threads"]["rule"]
    on = json.loads(_python(code, QKV_NATIVE="1"))
    built = native_lib.library()[0] is not None and native._gemm()[0] is not None
    assert on["native"]["active"] is built  # whatever this process's own QKV_NATIVE says
    assert "QKV_NATIVE=0" not in on["native"]["reason"]


def test_cli_prints_the_report(capsys):
    for argv in (["info"], ["--version", "--verbose"], ["--verbose", "--version"]):
        rc = main(argv)
        out, err = capsys.readouterr()
        assert rc == 0 and err == ""
        assert out.startswith(f"qkv: {qkv.__version__}\n")
        assert "native:\n  active: " in out and "jit:\n  active: " in out
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["qkv"] == qkv.__version__
    assert main(["--version"]) == 0  # without --verbose: the one line, as before
    assert capsys.readouterr().out.strip() == f"qkv {qkv.__version__}"


def test_cli_report_with_native_off_in_a_real_process():
    env = dict(os.environ, PYTHONPATH=SRC, QKV_NATIVE="0")
    done = subprocess.run(
        [sys.executable, "-m", "qkv", "--version", "--verbose"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0 and done.stderr == ""
    assert "  active: no\n  reason: switched off (QKV_NATIVE=0)" in done.stdout


def test_format_info_reads_missing_libraries_and_flags():
    text = format_info({"native": {"active": True, "isa": None}, "optional": {"torch": None}})
    assert text == "native:\n  active: yes\n  isa: -\noptional:\n  torch: not installed"


def test_info_route_says_what_qkv_route_says(capsys):
    import ml_dtypes  # noqa: F401  (the bfloat16 case below)

    cases = [
        (["1,8,1,16,64"], {}),
        (["1,8,1,4096,64", "--kv-heads", "2", "--window", "128,0"], {"window": (128, 0)}),
        (["1,8,512,512,64", "--causal", "--dtype", "bfloat16"], {"causal": True}),
        (["2,4,300,300,32", "--softcap", "5"], {"softcap": 5.0}),
    ]
    for argv, kw in cases:
        sizes = [int(x) for x in argv[0].split(",")]
        B, H, L, S, D = sizes
        kvh = int(argv[argv.index("--kv-heads") + 1]) if "--kv-heads" in argv else H
        dt = np.dtype(ml_dtypes.bfloat16) if "bfloat16" in argv else np.dtype(np.float32)
        q, k = np.zeros((B, H, L, D), dt), np.zeros((B, kvh, S, D), dt)
        want = qkv.route(q, k, k, **kw)
        assert main(["info", "--route", *argv]) == 0
        out = capsys.readouterr().out
        assert f"runs: {want.kernel} ({want.family})" in out
        assert all(f"not {name}: {why}" in out for name, why in want.refused)
        assert main(["info", "--json", "--route", *argv]) == 0
        said = json.loads(capsys.readouterr().out)
        assert (said["kernel"], said["refused"]) == (want.kernel, dict(want.refused))


def test_info_route_refuses_bad_sizes_in_one_line(capsys):
    for argv, said in [
        (["--route", "1,8,1"], "--route: expected B,H,L,S,D"),
        (["--route", "1,8,x,16,64"], "--route"),
        (["--route", "1,8,1,16,64", "--kv-heads", "3"], "8 query heads cannot share 3 kv heads"),
        (["--route", "1,8,1,16,64", "--window", "a,b"], "--window"),
        (["--window", "3,0"], "--window: only with --route"),
    ]:
        assert main(["info", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and "\n" not in err and "Traceback" not in err

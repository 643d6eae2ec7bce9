"""Smoke test of an installed qkv (CI runs it in a fresh virtual environment holding the wheel).

Run it from outside the checkout, with the environment's Python::

    cd /tmp && /path/to/venv/bin/python /path/to/scripts/smoke_installed.py

It fails (non-zero status, one line saying what) when qkv is imported from a source tree rather
than the installed wheel, when a file the package needs is missing from the wheel, when the
version differs between the metadata, ``qkv.__version__`` and ``qkv --version``, or when the
seed example does not give its known numbers. Needs only the wheel and NumPy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata, resources
from pathlib import Path

import numpy as np

import qkv


def _qkv(*args: str) -> str:
    exe = shutil.which("qkv", path=str(Path(sys.executable).parent))
    if exe is None:
        raise SystemExit("smoke: the qkv console script is not installed next to this Python")
    run = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise SystemExit(f"smoke: qkv {' '.join(args)} failed ({run.returncode}): {run.stderr}")
    return run.stdout


def main() -> None:
    where = Path(qkv.__file__).resolve()
    if "site-packages" not in where.parts:
        raise SystemExit(f"smoke: qkv comes from {where}, not from an installed wheel")
    if not resources.files("qkv").joinpath("py.typed").is_file():
        raise SystemExit("smoke: py.typed is missing from the installed package")
    dist = metadata.distribution("qkv")
    version = dist.version
    if qkv.__version__ != version or _qkv("--version").strip() != f"qkv {version}":
        raise SystemExit(f"smoke: versions differ: metadata {version}, qkv {qkv.__version__}")
    if not any(Path(str(f)).name == "LICENSE" for f in dist.files or []):
        raise SystemExit("smoke: the licence file is not in the wheel")

    # the seed example: raw [2, 8], scaled [1, 4], weights e^k / (e + e^4)
    out = qkv.attention([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], scale=0.5)
    w = np.exp([1.0, 4.0]) / np.exp([1.0, 4.0]).sum()
    assert np.allclose(out, w @ np.array([[1, 2], [3, 4]]), rtol=1e-12), out
    text = _qkv("explain", "--q", "2,1", "--k", "1,0;3,2", "--v", "1,2;3,4", "--d", "4")
    assert "0.95257" in text and "2.90515" in text, text
    doc = json.loads(
        _qkv(
            "scores",
            "--q",
            "2,1",
            "--k",
            "1,0;3,2",
            "--d",
            "4",
            "--scale",
            "sqrt(d)",
            "--format",
            "json",
        )
    )
    assert "16" in json.dumps(doc), doc
    exercise = _qkv("exercise", "--seed", "7", "--answers")
    assert "Exercise (seed 7)" in exercise and exercise == _qkv(
        "exercise", "--seed", "7", "--answers"
    )
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "seed.html"
        _qkv(
            "explore",
            "--q",
            "2,1",
            "--k",
            "1,0;3,2",
            "--v",
            "1,2;3,4",
            "--d",
            "4",
            "--output",
            str(page),
        )
        assert page.read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")
    for fmt in ("markdown", "latex", "html"):
        assert _qkv("explain", "--q", "2,1", "--k", "1,0;3,2", "--d", "4", "--format", fmt)
    print(f"smoke: qkv {version} from {where.parent} works")


if __name__ == "__main__":
    main()

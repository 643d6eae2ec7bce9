"""Building leaves the checkout clean (issue 33, item 9): no ``build/`` folder, which would
shadow the ``build`` package so that a later ``python -m build`` fails with "No module named
build.__main__"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_building_a_wheel_leaves_no_build_folder(tmp_path):
    pytest.importorskip("setuptools")
    tree = tmp_path / "qkv"
    tree.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    shutil.copytree(ROOT / "src", tree / "src", ignore=ignore)
    # no compiler: the optional native build is skipped at once (the install goes on without
    # it), so the test takes seconds; the build folders are made all the same
    env = {**os.environ, "CC": "false", "CXX": "false"}
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q"]
        + ["-w", str(tmp_path / "dist"), str(tree)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("qkv-*.whl")
    # no library in the wheel, and the reason the runtime gives (issue 44)
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "/_native." in n], names
    if sys.platform != "win32":  # (no native library there at all)
        note = zipfile.ZipFile(wheel).read("qkv/engine/kernels/_native_build.txt").decode()
        assert note.startswith("no C++ compiler: false"), note
    assert not (tree / "build").exists(), sorted(p.name for p in tree.iterdir())

"""``qkv info``: what this installation runs (versions, BLAS, threads, active kernels)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..about import format_info, info
from .options import add_command, emit

NAME = "info"
HELP = "versions, BLAS, threads, and which kernels (native, Numba, NumPy) are active and why"
EPILOG = """examples:
  qkv info
  qkv info --json
  QKV_NATIVE=0 qkv info

The same report is qkv.info() in Python and qkv --version --verbose here; quote it in a bug
report."""


def register(sub: Any) -> None:
    p = add_command(sub, NAME, HELP, EPILOG)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    report = info()
    emit(json.dumps(report, indent=2) + "\n" if args.json else format_info(report) + "\n", None)
    return 0

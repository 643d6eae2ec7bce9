"""``qkv info``: what this installation runs (versions, BLAS, threads, active kernels), and
with ``--route`` which kernel a call of given sizes would run (:func:`qkv.route`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from ..about import format_info, info, route
from ..checks import parse_int, parse_real
from ..errors import InputError
from . import parse
from .options import add_command, arg_type, emit

NAME = "info"
HELP = "versions, BLAS, threads, and which kernels (native, Numba, NumPy) are active and why"
EPILOG = """examples:
  qkv info
  qkv info --json
  QKV_NATIVE=0 qkv info
  qkv info --route 1,8,1,4096,64 --kv-heads 2
  qkv info --route 1,8,512,512,64 --causal --dtype bfloat16
  qkv info --route 1,8,1,4096,64 --window 128,0

The same report is qkv.info() in Python and qkv --version --verbose here; quote it in a bug
report. --route B,H,L,S,D names a call's sizes (batch, query heads, queries, keys, head size)
and prints the kernel qkv.attention would run for it and, for each faster kernel, the
condition that refused it (qkv.route in Python); nothing is computed."""

_DTYPES = ("float32", "float64", "float16", "bfloat16")


def register(sub: Any) -> None:
    p = add_command(sub, NAME, HELP, EPILOG)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--route", metavar="B,H,L,S,D", help="which kernel a call of these sizes runs")
    p.add_argument(
        "--kv-heads",
        metavar="N",
        type=arg_type(parse_int, "--kv-heads", minimum=1),
        help="key/value heads (default: H; fewer group the query heads)",
    )
    p.add_argument("--dtype", choices=_DTYPES, default="float32", help="q, k, v dtype (float32)")
    p.add_argument("--causal", action="store_true", help="causal (bottom-right aligned)")
    p.add_argument("--window", metavar="L,R", help="sliding window: keys p-L .. p+R")
    p.add_argument(
        "--softcap",
        metavar="C",
        type=arg_type(parse_real, "--softcap", positive=True),
        help="soft-capping of the scores",
    )
    p.set_defaults(run=run)


def _sizes(text: str) -> tuple[int, int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 5:
        raise InputError(f"--route: expected B,H,L,S,D (five sizes), got {text!r}")
    sizes = tuple(parse_int(p.strip(), "--route", minimum=0) for p in parts)
    return sizes  # type: ignore[return-value]


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        from ..extras import require

        return np.dtype(require("ml_dtypes", "a bfloat16 route").bfloat16)
    return np.dtype(name)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "route", None) is None:  # (qkv --version --verbose comes here too)
        for flag in ("kv_heads", "window", "softcap"):
            if getattr(args, flag, None) is not None:
                raise InputError(f"--{flag.replace('_', '-')}: only with --route B,H,L,S,D")
        report = info()
        emit(json.dumps(report, indent=2) + "\n" if args.json else format_info(report) + "\n", None)
        return 0
    B, H, L, S, D = _sizes(args.route)
    kvh = H if args.kv_heads is None else args.kv_heads
    dt = _dtype(args.dtype)
    window = None if args.window is None else parse.window(args.window)

    def stand_in(shape: tuple[int, ...]) -> np.ndarray:  # sizes only: no memory behind them
        return np.broadcast_to(np.zeros((), dt), shape)

    variants = {} if args.softcap is None else {"softcap": args.softcap}
    found = route(
        stand_in((B, H, L, D)), stand_in((B, kvh, S, D)), stand_in((B, kvh, S, D)),
        causal=args.causal, window=window, **variants,
    )  # fmt: skip
    if args.json:
        text = json.dumps(
            {"kernel": found.kernel, "family": found.family, "refused": dict(found.refused)},
            indent=2,
        )
    else:
        text = f"B{B} H{H} kv{kvh} L{L} S{S} d{D} {args.dtype}:\n{found}"
    emit(text + "\n", None)
    return 0

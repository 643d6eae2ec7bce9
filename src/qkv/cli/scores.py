"""``qkv scores``: the pre-softmax scores q·Kᵀ·scale only, and the formula used."""

from __future__ import annotations

import argparse
from typing import Any

from ..explanation.trace import explain
from .options import add_command, add_format, add_inputs, emit, trace_kwargs

NAME = "scores"
HELP = "pre-softmax scores q·Kᵀ·scale, saying which scale formula was used"
EPILOG = """examples:
  qkv scores --q "2,1" --k "1,0;3,2" --d 4                    # divides by sqrt(d): [1, 4]
  qkv scores --q "2,1" --k "1,0;3,2" --d 4 --scale "sqrt(d)"  # x sqrt(d), a common slip: [4, 16]
  qkv scores --q "2,1" --k "1,0;3,2" --scale 1                # raw dot products: [2, 8]"""


def register(sub: Any) -> None:
    p = add_command(sub, NAME, HELP, EPILOG)
    add_inputs(p, values=False, masks=False)
    add_format(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    trace = explain(**trace_kwargs(args), stop_at="scores")
    emit(trace.render(args.format), args.output, args.format)
    return 0

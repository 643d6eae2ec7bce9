"""``qkv explain``: every step of attention for the given q, K and V."""

from __future__ import annotations

import argparse
from typing import Any

from ..explanation.trace import explain
from .options import add_command, add_format, add_inputs, emit, trace_kwargs

NAME = "explain"
HELP = "show every step of softmax(q·Kᵀ·scale)·V"
EPILOG = """examples:
  qkv explain --q "2,1" --k "1,0;3,2" --v "1,2;3,4" --d 4
  qkv explain --q "1,0;0,1;1,1" --k "1,0;0,1;1,1" --v "1,0;0,1;2,2" --causal --format html
  qkv explain --q "2,1" --k "1,0;3,2" --v "1,2;3,4" --d 4 --exact
  qkv explain --q @q.npy --k @k.csv --v @v.json --window 2,0 --format json

Without --v the trace stops at the weights. --d D sets the scale to 1/sqrt(D);
--scale takes a number or an expression in d (with --d, d is that D)."""


def register(sub: Any) -> None:
    p = add_command(sub, NAME, HELP, EPILOG)
    add_inputs(p, values=True, masks=True)
    add_format(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace, stop_at: str | None = None) -> int:
    """Print the trace (``qkv scores`` stops it at the scores)."""
    trace = explain(**trace_kwargs(args), stop_at=stop_at)
    emit(trace.render(args.format), args.output, args.format)
    return 0

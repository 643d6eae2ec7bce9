"""``qkv scores``: the pre-softmax scores q·Kᵀ·scale only, and the formula used (``qkv
explain``'s trace, stopped at the scores)."""

from __future__ import annotations

from functools import partial
from typing import Any

from . import explain as explain_command
from .options import add_command, add_format, add_inputs

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
    p.set_defaults(run=partial(explain_command.run, stop_at="scores"))

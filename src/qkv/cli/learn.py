"""``qkv learn``: a live page on 127.0.0.1 — edit q, K, V, d and watch every step recomputed."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..checks import parse_int
from ..errors import InputError
from .options import add_command, arg_type

NAME = "learn"
HELP = "a live page: edit q, K, V and d and watch every step of attention recomputed"
EPILOG = """examples:
  qkv learn                      # opens the page in your browser
  qkv learn --port 8765 --no-browser

The page is served on 127.0.0.1 only (nothing leaves the machine, nothing is downloaded);
every number on it is computed by qkv as you type: scores, scaled scores, masked scores, the
maximum subtracted, exponentials, sums, weights and output, with exact values on demand
(SymPy, the exact extra). Its practice pane checks your answers and names your slips.
Ctrl-C stops the server."""


def register(sub: Any) -> None:
    p = add_command(sub, NAME, HELP, EPILOG)
    p.add_argument(
        "--port",
        metavar="N",
        type=arg_type(parse_int, "--port", minimum=0, maximum=65535),
        default=0,
        help="the port on 127.0.0.1 (default: a free one)",
    )
    p.add_argument("--no-browser", action="store_true", help="print the address; open nothing")
    p.add_argument("--verbose", action="store_true", help="log each request on standard error")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..learn.server import make_server

    try:
        server = make_server(port=args.port, quiet=not args.verbose)
    except OSError as exc:
        raise InputError(f"--port: cannot serve on 127.0.0.1:{args.port}: {exc.strerror}") from None
    url = f"http://127.0.0.1:{server.server_port}/"
    print(f"qkv learn: serving {url} (Ctrl-C stops)", file=sys.stderr, flush=True)
    if not args.no_browser:
        import webbrowser

        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0

"""The local server of ``qkv learn``: the page, and the library's answers as JSON.

Standard library only (:class:`http.server.ThreadingHTTPServer`), bound to ``127.0.0.1``:

- ``GET /`` — the page (:func:`qkv.learn.page.live_page`);
- ``POST /api/explain`` — the form's fields -> every step (:func:`qkv.learn.api.explain_fields`);
- ``POST /api/exercise`` — a practice problem (:func:`qkv.learn.exercises.exercise_fields`);
- ``POST /api/check`` — one answer checked (:func:`qkv.learn.exercises.check_fields`);
- ``POST /api/model`` — one head of a real model for one token
  (:func:`qkv.learn.model.model_fields`; the ``model`` extra).

Bad input is answered ``400`` with ``{"error": message, "field": name}`` — the library's own
message; an unexpected failure ``500`` with one line, never a stack trace.

Examples
--------
>>> import json, threading, urllib.request
>>> server = make_server(port=0)
>>> threading.Thread(target=server.serve_forever, daemon=True).start()
>>> url = f"http://127.0.0.1:{server.server_port}/api/explain"
>>> body = json.dumps({"q": "2,1", "k": "1,0;3,2", "v": "1,2;3,4", "d": "4"}).encode()
>>> with urllib.request.urlopen(urllib.request.Request(url, body)) as r:
...     json.load(r)["shown"]["output"]
[['2.90515', '3.90515']]
>>> server.shutdown(); server.server_close()
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..errors import InputError
from .api import FieldError, explain_fields, field_of, fields_of
from .exercises import check_fields, exercise_fields
from .model import model_fields
from .page import live_page

__all__ = ["MAX_BODY", "ROUTES", "make_server"]

#: The largest request body read, in bytes.
MAX_BODY = 1 << 20

#: ``POST`` paths and the function that answers each (fields in, a JSON-ready dict out).
ROUTES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "/api/explain": explain_fields,
    "/api/exercise": exercise_fields,
    "/api/check": check_fields,
    "/api/model": model_fields,
}


class _Handler(BaseHTTPRequestHandler):
    server_version = "qkv-learn"
    quiet = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        if not self.quiet:
            super().log_message(format, *args)

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, doc: dict[str, Any]) -> None:
        body = json.dumps(doc, allow_nan=False).encode("utf-8")
        self._send(status, body, "application/json; charset=utf-8")

    def do_GET(self) -> None:  # noqa: N802 - the base's name
        if self.path.split("?", 1)[0] in ("/", "/index.html"):
            self._send(200, live_page().encode("utf-8"), "text/html; charset=utf-8")
        else:
            self._json(404, {"error": f"no page at {self.path}", "field": None, "fields": []})

    def do_POST(self) -> None:  # noqa: N802 - the base's name
        route = ROUTES.get(self.path)
        if route is None:
            self._json(404, {"error": f"no endpoint at {self.path}", "field": None, "fields": []})
            return
        try:
            n = int(self.headers.get("Content-Length") or 0)
            if not 0 <= n <= MAX_BODY:
                raise InputError(f"request: the body must be 0 to {MAX_BODY} bytes, got {n}")
            try:
                fields = json.loads(self.rfile.read(n).decode("utf-8") or "{}")
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise InputError(f"request: not JSON ({exc})") from None
            if not isinstance(fields, dict):
                raise InputError("request: expected a JSON object of fields")
            self._json(200, route(fields))
        except FieldError as exc:
            named = fields_of(str(exc))
            fields = [exc.field] + [f for f in named if f != exc.field]
            self._json(400, {"error": str(exc), "field": exc.field, "fields": fields})
        except InputError as exc:
            named = fields_of(str(exc))
            self._json(400, {"error": str(exc), "field": field_of(str(exc)), "fields": named})
        except Exception as exc:  # noqa: BLE001 - the page gets one line, never a traceback
            print(f"qkv learn: {self.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            self._json(
                500,
                {
                    "error": f"qkv could not answer ({type(exc).__name__})",
                    "field": None,
                    "fields": [],
                },
            )


def make_server(
    host: str = "127.0.0.1", port: int = 0, *, quiet: bool = True
) -> ThreadingHTTPServer:
    """The server, bound and ready (``serve_forever`` runs it); ``port=0`` picks a free port,
    read back as ``server.server_port``. ``quiet=False`` logs each request on standard error."""
    handler = type("Handler", (_Handler,), {"quiet": quiet})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server

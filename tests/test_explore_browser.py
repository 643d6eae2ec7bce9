"""The explore page in a real browser: headless Chromium driven over the DevTools protocol.

The protocol runs over a pipe (``--remote-debugging-pipe``: no port, no network). The test
clicks the page's toggle buttons, hovers over a weight, reads what the page shows and compares
it with :func:`qkv.explain` computed here; it collects console messages and uncaught errors,
and takes a screenshot whose heatmap colours it checks (kept under ``$QKV_ARTIFACTS`` when set).
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv.cli import main
from qkv.explanation.trace import fmt
from qkv.render.as_html import weight_color

CHROMIUM = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
    None,
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium is not installed (CI installs Debian's chromium package)",
)

Q = "1,0;0,1;2,1"  # the last row is the seed's q = [2, 1]
K = "1,0;3,2;0,1"
V = "1,2;3,4;5,6"


class Browser:
    """Chromium with the DevTools protocol on file descriptors 3 (in) and 4 (out)."""

    def __init__(self, profile: Path, timeout: float = 60.0) -> None:
        to_child, self._w = os.pipe()
        self._r, from_child = os.pipe()

        def fds() -> None:
            os.dup2(to_child, 3)
            os.dup2(from_child, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        flags = [
            "--no-sandbox",
            "--headless",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            [CHROMIUM, *flags],
            preexec_fn=fds,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child)
        os.close(from_child)
        self.timeout, self._buf, self._n, self.events = timeout, b"", 0, []
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise EOFError("chromium closed the protocol pipe")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, page: bool = False, **params) -> dict:
        self._n += 1
        msg = {"id": self._n, "method": method, "params": params}
        if page:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            m = self._message(deadline)
            if m.get("id") == self._n:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m["result"]
            self.events.append(m)

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            for n, m in enumerate(self.events):
                if m.get("method") == method:
                    return self.events.pop(n)
            self.events.append(self._message(deadline))

    def js(self, expression: str):
        r = self.send("Runtime.evaluate", True, expression=expression, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(r["exceptionDetails"])
        return r["result"].get("value")

    def until(self, expression: str) -> None:
        deadline = time.monotonic() + 10
        while not self.js(expression):
            if time.monotonic() > deadline:
                raise TimeoutError(expression)
            time.sleep(0.05)

    def problems(self) -> list[str]:
        """Uncaught errors, console errors and warnings, and browser log errors so far."""
        out = []
        for m in self.events:
            p = m.get("params", {})
            if m.get("method") == "Runtime.exceptionThrown":
                out.append(str(p["exceptionDetails"]))
            elif m.get("method") == "Runtime.consoleAPICalled" and p["type"] != "debug":
                out.append(f"console.{p['type']}: {p['args']}")
            elif m.get("method") == "Log.entryAdded" and p["entry"]["level"] in (
                "error",
                "warning",
            ):
                out.append(str(p["entry"]))
        return out

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The page written by the CLI, open in Chromium (1100 × 900)."""
    tmp = tmp_path_factory.mktemp("explore")
    path = tmp / "explore.html"
    args = ["explore", "--q", Q, "--k", K, "--v", V, "--d", "4", "--causal"]
    assert main(args + ["--output", str(path)]) == 0
    b = Browser(tmp / "profile")
    try:
        for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
            b.send(domain, True)
        b.send(
            "Emulation.setDeviceMetricsOverride",
            True,
            width=1100,
            height=900,
            deviceScaleFactor=1,
            mobile=False,
        )
        b.send("Page.navigate", True, url=path.as_uri())
        b.wait_for("Page.loadEventFired")
        b.until("document.body.dataset.ready === '1'")
        yield b
    finally:
        b.close()


def _library(reading: str) -> qkv.Trace:
    """The same inputs through qkv.explain, one reading of the scale at a time."""
    q, k, v = [[1, 0], [0, 1], [2, 1]], [[1, 0], [3, 2], [0, 1]], [[1, 2], [3, 4], [5, 6]]
    scale = {"divide": {"d": 4}, "multiply": {"d": 4, "scale": "sqrt(d)"}, "none": {"scale": 1}}
    return qkv.explain(q, k, v, causal=True, **scale[reading])


def _shown(b: Browser, field: str) -> list[str]:
    return b.js(
        f"Array.from(document.querySelectorAll('table.steps [data-field={field}]'))"
        ".map(e => e.textContent)"
    )


@pytest.mark.parametrize(
    ("reading", "scaled"),
    [("multiply", ["4", "16", "2"]), ("none", ["2", "8", "1"]), ("divide", ["1", "4", "0.5"])],
)
def test_toggle_shows_the_librarys_numbers(page, reading, scaled):
    page.js(f"document.querySelector('.toggle button[data-reading={reading}]').click()")
    page.until(f"document.body.dataset.reading === '{reading}'")
    t = _library(reading)
    assert _shown(page, "scaled") == scaled == [fmt(x) for x in t.scaled[2]]
    assert _shown(page, "exps") == [fmt(x) for x in t.exps[2]]
    assert _shown(page, "weights") == [fmt(x) for x in t.weights[2]]
    out = page.js("document.getElementById('output').textContent")
    assert out == "[" + ", ".join(fmt(x) for x in t.output[2]) + "]"
    assert page.js("document.getElementById('describe').textContent") == t.scale.describe()
    heat = page.js(
        "Array.from(document.querySelectorAll('table.heat td.w')).map(e => e.textContent)"
    )
    expect = [
        "×" if t.excluded[i, j] else fmt(round(float(t.weights[i, j]), 3))
        for i in range(3)
        for j in range(3)
    ]
    assert heat == expect and heat.count("×") == 3  # the causal exclusions, marked
    pressed = page.js("document.querySelector('button[aria-pressed=true]').dataset.reading")
    assert pressed == reading
    assert page.problems() == []


def test_hover_highlights_key_terms_and_share(page):
    box = page.js(
        "(() => { const r = document.querySelector('table.steps td.weight[data-j=\"1\"]')"
        ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
    )
    page.send("Input.dispatchMouseEvent", True, type="mouseMoved", x=box[0], y=box[1])
    page.until("document.querySelectorAll('.hl').length > 0")
    lit = page.js("Array.from(document.querySelectorAll('.hl')).map(e => e.textContent)")
    t = _library(page.js("document.body.dataset.reading"))
    share = "[" + ", ".join(fmt(x) for x in t.weighted_row(2)[1]) + "]"
    assert "k1" in lit and "2·3 + 1·2 = 8" in lit and share in lit
    assert page.js("document.querySelectorAll('.hl:not([data-key=\"1\"])').length") == 0
    page.send("Input.dispatchMouseEvent", True, type="mouseMoved", x=5, y=5)
    page.until("document.querySelectorAll('.hl').length === 0")
    assert page.problems() == []


def test_screenshot_shows_the_heatmap(page, tmp_path):
    image = pytest.importorskip("matplotlib.image", reason="reading the PNG needs matplotlib")
    page.js("document.querySelector('.toggle button[data-reading=multiply]').click()")
    page.until("document.body.dataset.reading === 'multiply'")
    data = page.send("Page.captureScreenshot", True, format="png")["data"]
    shot = tmp_path / "explore.png"
    shot.write_bytes(base64.b64decode(data))
    if os.environ.get("QKV_ARTIFACTS"):
        Path(os.environ["QKV_ARTIFACTS"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(os.environ["QKV_ARTIFACTS"]) / "explore.png")
    rgb = np.round(image.imread(str(shot))[..., :3] * 255).astype(int)
    assert rgb.shape[:2] == (900, 1100) and rgb.std() > 20

    def area(colour: str) -> int:
        want = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
        return int((np.abs(rgb - want).max(axis=-1) <= 3).sum())

    t = _library("multiply")
    # q0 → k0 has weight 1 (the darkest blue); three excluded cells are grey; cells ~52 × 30 px
    assert area(weight_color(float(t.weights[0, 0]))) >= 2 * 40 * 20
    assert area("#d9d9d9") >= 3 * 40 * 20
    assert area(weight_color(0.5)) < 100  # a weight nowhere on the page (a few anti-aliased pixels)
    assert page.problems() == []

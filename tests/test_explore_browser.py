"""The explore page in a real browser: Chromium driven by Playwright (the system's browser).

The test clicks the page's toggle buttons, hovers over a weight, reads what the page shows and
compares it with :func:`qkv.explain` computed here; it collects console messages and uncaught
errors, and takes a screenshot whose heatmap colours it checks (kept under ``$QKV_ARTIFACTS``,
else the temporary directory's ``qkv-artifacts``).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv.cli import main
from qkv.explanation.trace import fmt
from qkv.render.as_html import weight_color

_spec = importlib.util.spec_from_file_location(
    "_qkv_pw", Path(__file__).with_name("_playwright.py")
)
pw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pw)

pytestmark = pytest.mark.skipif(pw.skip_reason() is not None, reason=str(pw.skip_reason()))

Q = "1,0;0,1;2,1"  # the last row is the seed's q = [2, 1]
K = "1,0;3,2;0,1"
V = "1,2;3,4;5,6"


class Page:
    """A Playwright page with the few verbs these tests use."""

    def __init__(self, page) -> None:
        self.page = page

    def js(self, expression: str):
        return self.page.evaluate(expression)

    def until(self, expression: str) -> None:
        self.page.wait_for_function(expression, timeout=10_000)

    def problems(self) -> list[str]:
        """Uncaught errors and every console message but debug ones, so far."""
        noisy = [m for m in self.page.messages if not m.startswith("console.debug")]
        return sorted(set(self.page.problems) | set(noisy))


@pytest.fixture(scope="module")
def explore(tmp_path_factory):
    """The page written by the CLI, open in Chromium (1100 × 900)."""
    tmp = tmp_path_factory.mktemp("explore")
    path = tmp / "explore.html"
    args = ["explore", "--q", Q, "--k", K, "--v", V, "--d", "4", "--causal"]
    assert main(args + ["--output", str(path)]) == 0
    b = pw.Browser()
    try:
        p = b.page(1100, 900)
        p.goto(path.as_uri())
        page = Page(p)
        page.until("document.body.dataset.ready === '1'")
        yield page
    finally:
        b.close()


def _library(reading: str) -> qkv.Trace:
    """The same inputs through qkv.explain, one reading of the scale at a time."""
    q, k, v = [[1, 0], [0, 1], [2, 1]], [[1, 0], [3, 2], [0, 1]], [[1, 2], [3, 4], [5, 6]]
    scale = {"divide": {"d": 4}, "multiply": {"d": 4, "scale": "sqrt(d)"}, "none": {"scale": 1}}
    return qkv.explain(q, k, v, causal=True, **scale[reading])


def _shown(b: Page, field: str) -> list[str]:
    return b.js(
        f"Array.from(document.querySelectorAll('table.steps [data-field={field}]'))"
        ".map(e => e.textContent)"
    )


@pytest.mark.parametrize(
    ("reading", "scaled"),
    [("multiply", ["4", "16", "2"]), ("none", ["2", "8", "1"]), ("divide", ["1", "4", "0.5"])],
)
def test_toggle_shows_the_librarys_numbers(explore, reading, scaled):
    page = explore
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


def test_hover_highlights_key_terms_and_share(explore):
    page = explore
    box = page.js(
        "(() => { const r = document.querySelector('table.steps td.weight[data-j=\"1\"]')"
        ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
    )
    page.page.mouse.move(box[0], box[1])
    page.until("document.querySelectorAll('.hl').length > 0")
    lit = page.js("Array.from(document.querySelectorAll('.hl')).map(e => e.textContent)")
    t = _library(page.js("document.body.dataset.reading"))
    share = "[" + ", ".join(fmt(x) for x in t.weighted_row(2)[1]) + "]"
    assert "k1" in lit and "2·3 + 1·2 = 8" in lit and share in lit
    assert page.js("document.querySelectorAll('.hl:not([data-key=\"1\"])').length") == 0
    page.page.mouse.move(5, 5)
    page.until("document.querySelectorAll('.hl').length === 0")
    assert page.problems() == []


def test_screenshot_shows_the_heatmap(explore, tmp_path):
    page = explore
    image = pytest.importorskip("matplotlib.image", reason="reading the PNG needs matplotlib")
    page.js("document.querySelector('.toggle button[data-reading=multiply]').click()")
    page.until("document.body.dataset.reading === 'multiply'")
    shot = tmp_path / "explore.png"
    page.page.screenshot(path=str(shot))
    shutil.copy(shot, pw.artifacts() / "explore.png")
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

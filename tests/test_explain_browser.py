"""The HTML page as a browser shows it: Chromium (driven by Playwright) renders the weights and
the heatmap."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv.render.as_html import weight_color

_spec = importlib.util.spec_from_file_location(
    "_qkv_pw", Path(__file__).with_name("_playwright.py")
)
pw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pw)

pytestmark = pytest.mark.skipif(pw.skip_reason() is not None, reason=str(pw.skip_reason()))


@pytest.fixture(scope="module")
def shown(tmp_path_factory):
    """The seed's trace as an HTML page, open in Chromium (1000 × 1400)."""
    t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
    path = tmp_path_factory.mktemp("page") / "seed.html"
    path.write_text(t.to_html(), encoding="utf-8")
    b = pw.Browser()
    try:
        page = b.page(1000, 1400)
        page.goto(path.as_uri())
        yield page
    finally:
        b.close()


def test_dom_shows_the_weights(shown):
    dom = shown.content()
    for text in ("0.04743", "0.95257", "2.90515", "3.90515", "1/√4 = 1/2"):
        assert text in dom
    assert "<svg" in dom and dom.count('class="cell"') == 2
    assert shown.problems == []


def test_screenshot_has_a_non_blank_heatmap(shown, tmp_path):
    image = pytest.importorskip("matplotlib.image", reason="reading the PNG needs matplotlib")
    shot = tmp_path / "shot.png"
    shown.screenshot(path=str(shot))
    px = image.imread(str(shot))[..., :3]
    rgb = np.round(px * 255).astype(int)
    assert rgb.std() > 20  # not a blank page

    def solid_rows(w: float) -> int:
        """Rows of the screenshot with a run of >= 40 pixels of the heatmap colour for ``w``."""
        want = np.array([int(weight_color(w)[i : i + 2], 16) for i in (1, 3, 5)])
        hit = np.abs(rgb - want).max(axis=-1) <= 3
        return int((hit.sum(axis=1) >= 40).sum())

    # each weight is a filled square cell (56 px), dark for 0.95257 and light for 0.04743
    assert solid_rows(0.9525741268224334) >= 40
    assert solid_rows(0.04742587317756679) >= 40
    assert solid_rows(0.5) == 0  # a colour that is not on the page

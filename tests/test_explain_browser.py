"""The HTML page as a browser shows it: headless Chromium renders the weights and the heatmap."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

import qkv
from qkv.render.as_html import weight_color

CHROMIUM = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
    None,
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium is not installed (CI installs Debian's chromium package)",
)


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
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
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    return subprocess.run(
        [CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
    path = tmp_path_factory.mktemp("page") / "seed.html"
    path.write_text(t.to_html(), encoding="utf-8")
    return path


def test_dom_shows_the_weights(page, tmp_path):
    run = _chromium(tmp_path, "--dump-dom", page.as_uri())
    assert run.returncode == 0, run.stderr[-1000:]
    dom = run.stdout
    for text in ("0.04743", "0.95257", "2.90515", "3.90515", "1/√4 = 1/2"):
        assert text in dom
    assert "<svg" in dom and dom.count('class="cell"') == 2


def test_screenshot_has_a_non_blank_heatmap(page, tmp_path):
    image = pytest.importorskip("matplotlib.image", reason="reading the PNG needs matplotlib")
    shot = tmp_path / "shot.png"
    run = _chromium(tmp_path, "--window-size=1000,1400", f"--screenshot={shot}", page.as_uri())
    assert run.returncode == 0 and shot.exists(), run.stderr[-1000:]
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

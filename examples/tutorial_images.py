"""Make the pictures of docs/tutorial.md with the commands the tutorial shows.

Needs headless Chromium on the PATH, Pillow (comes with matplotlib: ``qkv[plot]``) and, for the
real model's page, ``qkv[model]``. The documentation build runs :func:`main` (see
``docs/_ext/qkv_images.py``); by hand, from the repository root::

    python examples/tutorial_images.py            # writes docs/img/tutorial-*.png
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img"
QKV = [sys.executable, "-m", "qkv"]


def browser() -> str | None:
    """The headless browser on the PATH, or ``None``."""
    return next(
        (
            shutil.which(n)
            for n in ("chromium", "chromium-browser", "google-chrome")
            if shutil.which(n)
        ),
        None,
    )


def shot(page: Path, png: Path, size: tuple[int, int], anchor: str = "") -> None:
    """A headless Chromium screenshot of ``page`` (``anchor``: e.g. ``#reading=multiply``)."""
    chromium = browser()
    if chromium is None:
        raise RuntimeError("the tutorial's screenshots need headless Chromium on the PATH")
    flags = "--no-sandbox --headless --disable-gpu --no-first-run --hide-scrollbars"
    flags += " --disable-background-networking --disable-component-update --disable-sync"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                *flags.split(),
                f"--user-data-dir={profile}",
                f"--window-size={size[0]},{size[1]}",
                f"--screenshot={png}",
                page.as_uri() + anchor,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )


def small(png: Path, box: tuple[int, int, int, int], out: Path) -> None:
    """Crop to ``box`` and store with a 64-colour palette (a few tens of kB)."""
    Image.open(png).convert("RGB").crop(box).quantize(64).save(out, optimize=True)


def main(out: Path = OUT) -> None:
    """Write the four ``tutorial-*.png`` pictures into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        seed = tmp / "seed.html"
        subprocess.run(
            QKV
            + [
                "explore",
                "--q",
                "2,1",
                "--k",
                "1,0;3,2",
                "--v",
                "1,2;3,4",
                "--d",
                "4",
                "--output",
                str(seed),
            ],
            check=True,
        )
        shot(seed, tmp / "seed.png", (1000, 640), "#reading=multiply&hover=1")
        small(tmp / "seed.png", (0, 0, 1000, 640), out / "tutorial-explore.png")

        causal = tmp / "causal.html"
        subprocess.run(
            QKV
            + [
                "explore",
                "--q",
                "1,0;0,1;2,1",
                "--k",
                "1,0;3,2;0,1",
                "--v",
                "1,2;3,4;5,6",
                "--d",
                "4",
                "--causal",
                "--output",
                str(causal),
            ],
            check=True,
        )
        shot(causal, tmp / "causal.png", (1000, 640))
        small(tmp / "causal.png", (0, 285, 1000, 620), out / "tutorial-causal.png")

        model = tmp / "head.html"
        subprocess.run(
            QKV
            + [
                "explain-model",
                "--text",
                "The cat sat on the mat",
                "--layer",
                "2",
                "--head",
                "3",
                "--query",
                "cat",
                "--format",
                "html",
                "--output",
                str(model),
            ],
            check=True,
        )
        shot(model, tmp / "head.png", (1100, 2400))
        small(tmp / "head.png", (0, 0, 1100, 560), out / "tutorial-model-head.png")
        # from just above the heading "All 12 heads of layer 2" (the table above ends near 1720)
        small(tmp / "head.png", (0, 1728, 1100, 2400), out / "tutorial-model-grid.png")


if __name__ == "__main__":
    main()

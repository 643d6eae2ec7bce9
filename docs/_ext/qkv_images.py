"""Sphinx extension: make the learning pages' figures with qkv's own commands during the build.

- ``qkv study scaling`` and ``qkv study training`` write the plots of ``why-scale.md``;
- ``examples/tutorial_images.py`` screenshots the pages ``qkv explore`` and ``qkv
  explain-model`` write, in headless Chromium, for ``tutorial.md``.

They go to ``docs/img`` (ignored by git). Every build makes them afresh, so the site shows what
the library computes today; ``QKV_DOCS_KEEP_IMAGES=1`` reuses figures already there (for quick
rebuilds while editing text). Without Chromium or the small model of ``qkv[model]`` the
screenshots cannot be made: the build says so, and a strict build fails (without Chromium at
once, in one line that names the fix).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.util import logging

log = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
IMG = DOCS / "img"

STUDY = {
    ("scaling",): ["scaling_saturation.png", "scaling_weights.png", "scaling_gradients.png"],
    ("training",): ["training_loss.png"],
}
TUTORIAL = [
    "tutorial-explore.png",
    "tutorial-causal.png",
    "tutorial-model-head.png",
    "tutorial-model-grid.png",
]


def _present(names: list[str]) -> bool:
    return all((IMG / n).is_file() for n in names)


def _study(args: tuple[str, ...]) -> None:
    cmd = [sys.executable, "-m", "qkv", "study", *args, "--output", str(IMG), "--format", "text"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)


def _tutorial() -> None:
    spec = importlib.util.spec_from_file_location(
        "tutorial_images", ROOT / "examples" / "tutorial_images.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.browser() is None:
        raise RuntimeError("headless Chromium is not on the PATH (apt-get install chromium)")
    module.main(IMG)


#: The one line a strict build ends with when the tutorial's screenshots cannot be made.
NO_CHROMIUM = (
    "docs: the tutorial's figures need headless Chromium, which is not on the PATH: install it "
    "(apt-get install chromium) and build again"
)


def _strict(app: Sphinx) -> bool:
    """Whether warnings are errors (``-W``)."""
    return bool(getattr(app, "_fail_on_warnings", getattr(app, "warningiserror", False)))


def _chromium() -> bool:
    return any(shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome"))


def make_images(app: Sphinx) -> None:
    """Write every figure the pages show into ``docs/img``.

    A strict build without Chromium stops at once with one line naming the fix
    (:data:`NO_CHROMIUM`), not after a warning for every screenshot the pages then miss.
    """
    keep = os.environ.get("QKV_DOCS_KEEP_IMAGES") == "1"
    if not (keep and _present(TUTORIAL)) and not _chromium() and _strict(app):
        raise SystemExit(NO_CHROMIUM)  # Sphinx reports no SystemExit of its own: one line
    IMG.mkdir(exist_ok=True)
    jobs = [(f"qkv study {' '.join(a)}", lambda a=a: _study(a), n) for a, n in STUDY.items()]
    jobs.append(("examples/tutorial_images.py", _tutorial, TUTORIAL))
    for name, job, outputs in jobs:
        if keep and _present(outputs):
            continue
        start = time.perf_counter()
        try:
            job()
        except (subprocess.CalledProcessError, RuntimeError, ImportError, OSError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            tail = detail.decode(errors="replace").strip().splitlines()[-1:] if detail else []
            log.warning("figures: %s failed: %s %s", name, exc, " ".join(tail))
            continue
        log.info("figures: %s in %.1f s", name, time.perf_counter() - start)


def setup(app: Sphinx) -> dict[str, object]:
    app.connect("builder-inited", make_images)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

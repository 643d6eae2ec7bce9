"""Playwright on the system's Chromium, for the browser tests (loaded by path, not a test file).

No browser is downloaded: Playwright drives the Chromium the system installed (Debian's
``chromium`` package), launched with ``--no-sandbox``. :func:`skip_reason` says why a browser
test cannot run (Playwright or Chromium absent). :class:`Browser` opens pages that record
console messages and uncaught errors; screenshots go to :func:`artifacts` (``$QKV_ARTIFACTS``,
else a folder under the system's temporary directory).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

CHROMIUM = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
    None,
)


def skip_reason() -> str | None:
    """Why a browser test cannot run here, or ``None`` when it can."""
    if importlib.util.find_spec("playwright") is None:
        return "Playwright is not installed (pip install playwright; the test extra has it)"
    if CHROMIUM is None:
        return "Chromium is not installed (CI installs Debian's chromium package; no download)"
    return None


def artifacts() -> Path:
    """The folder screenshots are kept in (created)."""
    default = Path(tempfile.gettempdir()) / "qkv-artifacts"
    path = Path(os.environ.get("QKV_ARTIFACTS") or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


class Browser:
    """The system's Chromium under Playwright; :meth:`page` opens a recording page."""

    def __init__(self) -> None:
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        try:
            self.browser = self._pw.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"]
            )
        except Exception:
            self._pw.stop()
            raise

    def page(self, width: int = 1100, height: int = 900) -> Any:
        """A new page of ``width`` × ``height`` whose ``problems`` list collects uncaught
        errors and console errors and warnings (``messages`` keeps every console message)."""
        page = self.browser.new_page(viewport={"width": width, "height": height})
        page.problems, page.messages = [], []

        def console(m: Any) -> None:
            page.messages.append(f"console.{m.type}: {m.text}")
            if m.type in ("error", "warning"):
                page.problems.append(f"console.{m.type}: {m.text}")

        page.on("console", console)
        page.on("pageerror", lambda e: page.problems.append(f"uncaught: {e}"))
        return page

    def close(self) -> None:
        try:
            self.browser.close()
        finally:
            self._pw.stop()

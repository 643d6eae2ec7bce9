"""The built documentation site in headless Chromium, and the one version everything states.

The site is built by ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (CI's
docs step builds it, then runs this file); the browser is the system's Chromium driven by
Playwright. Without the built site, Playwright or Chromium the browser checks say why they
skip. ``QKV_DOCS_HTML`` points at another build folder.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

import qkv

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("QKV_DOCS_HTML", ROOT / "docs" / "_build" / "html"))
PAGES = ["index.html", "reference/api.html", "tutorial.html"]


def _browser_module():
    """The Playwright helpers the browser tests share (``_playwright.py``)."""
    spec = importlib.util.spec_from_file_location(
        "_qkv_pw", Path(__file__).with_name("_playwright.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_changelog_names_the_package_version():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    first = re.search(r"^## (\d+\.\d+\.\d+)", text, re.M)
    assert first is not None and first.group(1) == qkv.__version__


def test_version_has_one_source():
    """pyproject.toml reads the version from ``qkv._version`` (no second copy to drift)."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M)
    assert 'version = { attr = "qkv._version.__version__" }' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", qkv.__version__)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if not (SITE / "index.html").is_file():
        pytest.skip(
            f"the documentation is not built at {SITE} "
            "(python -m sphinx -W --keep-going -b html docs docs/_build/html)"
        )
    driver = _browser_module()
    reason = driver.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    b = driver.Browser()
    try:
        yield Site(b.page())
    finally:
        b.close()


class Site:
    """One Playwright page that loads the site's pages in turn."""

    def __init__(self, page) -> None:
        self.page = page

    def js(self, expression: str):
        return self.page.evaluate(expression)


def _open(b: Site, page: str) -> list[str]:
    """Load ``page`` of the site; the problems the browser reported while loading it."""
    b.page.problems.clear()
    b.page.messages.clear()
    b.page.goto((SITE / page).as_uri(), wait_until="load")
    b.page.wait_for_function("document.readyState === 'complete'")
    # the theme logs its colour mode with console.log: information, not a problem
    quiet = ("console.log:", "console.info:", "console.debug:")
    noisy = [m for m in b.page.messages if not m.startswith(quiet)]
    return sorted(set(b.page.problems) | set(noisy))


BROKEN_IMAGES = (
    "Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0))"
    ".map(i => i.getAttribute('src'))"
)


@pytest.mark.parametrize("page", PAGES)
def test_page_loads_without_errors_or_missing_images(site, page):
    problems = _open(site, page)
    assert problems == []
    assert site.js(BROKEN_IMAGES) == []
    assert site.js("document.title").endswith(f"qkv {qkv.__version__}")


def test_tutorial_shows_the_figures_the_build_made(site):
    assert _open(site, "tutorial.html") == []
    shown = site.js(
        "Array.from(document.querySelectorAll('article img')).map(i => [i.getAttribute('src'),"
        " i.naturalWidth])"
    )
    names = sorted(Path(src).name for src, width in shown if width > 100)
    assert names == sorted(
        [
            "tutorial-causal.png",
            "tutorial-explore.png",
            "tutorial-model-grid.png",
            "tutorial-model-head.png",
        ]
    )


def test_api_page_documents_every_public_name(site):
    assert _open(site, "reference/api.html") == []
    ids = set(site.js("Array.from(document.querySelectorAll('dt[id]')).map(e => e.id)"))
    import qkv.distributed
    import qkv.variants

    want = {f"qkv.{n}" for n in qkv.__all__ if n not in ("reference", "__version__")}
    want |= {f"qkv.variants.{n}" for n in qkv.variants.__all__}
    want |= {f"qkv.distributed.{n}" for n in qkv.distributed.__all__}
    want |= {f"qkv.reference.{n}" for n in qkv.reference.__all__}
    want |= {"qkv.gpu.api.attention", "qkv.gpu.api.GpuFallbackWarning"}
    want |= {"qkv.integrations.transformers.register", "qkv.integrations.capture.capture"}
    assert want - ids == set()
    # the docstring's example is on the page, rendered as code
    example = site.js(
        "Array.from(document.querySelectorAll('dd pre')).map(e => e.textContent).join('\\n')"
    )
    assert ">>> " in example and "qkv.attention(" in example

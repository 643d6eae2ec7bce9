"""The built documentation site in headless Chromium, and the one version everything states.

The site is built by ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (CI's
docs step builds it, then runs this file); without the built site or without Chromium the
browser checks say why they skip. ``QKV_DOCS_HTML`` points at another build folder.
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
    """The DevTools-over-a-pipe driver of the explore page's browser test (one copy of it)."""
    spec = importlib.util.spec_from_file_location(
        "_qkv_cdp_driver", Path(__file__).with_name("test_explore_browser.py")
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
def browser(tmp_path_factory):
    if not (SITE / "index.html").is_file():
        pytest.skip(
            f"the documentation is not built at {SITE} "
            "(python -m sphinx -W --keep-going -b html docs docs/_build/html)"
        )
    driver = _browser_module()
    if driver.CHROMIUM is None:
        pytest.skip("headless Chromium is not installed (CI installs Debian's chromium package)")
    b = driver.Browser(tmp_path_factory.mktemp("docs") / "profile")
    try:
        for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
            b.send(domain, True)
        yield b
    finally:
        b.close()


def _open(b, page: str) -> list[str]:
    """Load ``page`` of the site; the problems the browser reported while loading it."""
    b.events.clear()
    b.send("Page.navigate", True, url=(SITE / page).as_uri())
    b.wait_for("Page.loadEventFired")
    b.until("document.readyState === 'complete'")
    # the theme logs its colour mode with console.log: information, not a problem
    return [p for p in b.problems() if not p.startswith(("console.log:", "console.info:"))]


BROKEN_IMAGES = (
    "Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0))"
    ".map(i => i.getAttribute('src'))"
)


@pytest.mark.parametrize("page", PAGES)
def test_page_loads_without_errors_or_missing_images(browser, page):
    problems = _open(browser, page)
    assert problems == []
    assert browser.js(BROKEN_IMAGES) == []
    assert browser.js("document.title").endswith(f"qkv {qkv.__version__}")


def test_tutorial_shows_the_figures_the_build_made(browser):
    assert _open(browser, "tutorial.html") == []
    shown = browser.js(
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


def test_api_page_documents_every_public_name(browser):
    assert _open(browser, "reference/api.html") == []
    ids = set(browser.js("Array.from(document.querySelectorAll('dt[id]')).map(e => e.id)"))
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
    example = browser.js(
        "Array.from(document.querySelectorAll('dd pre')).map(e => e.textContent).join('\\n')"
    )
    assert ">>> " in example and "qkv.attention(" in example

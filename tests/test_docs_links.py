"""The built documentation site has no broken internal link (issue 33, item 7): every ``href``
to a page of the site names a page that exists and, with a ``#fragment``, an element of that
page with that id. Sphinx's strict build does not check the anchors of raw links (the
``[docs]`` links of the highlighted source pages, the Markdown pages' own links).

Runs on a site already built (CI builds it just before)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
    python -m pytest -q tests/test_docs_links.py
"""

from __future__ import annotations

from functools import cache
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

SITE = Path(__file__).resolve().parents[1] / "docs" / "_build" / "html"


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            elif name == "href" and tag in ("a", "link"):
                self.links.append(value)


@cache
def read(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def broken_links(site: Path) -> list[str]:
    """``page: link (why)`` for every internal link of ``site`` that leads nowhere."""
    bad = []
    for page_path in sorted(site.rglob("*.html")):
        if "_static" in page_path.relative_to(site).parts:
            continue  # the theme's template macros, not pages
        for link in read(page_path).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
                continue  # external: not this check's business
            target = page_path if not parts.path else (page_path.parent / unquote(parts.path))
            target = target.resolve()
            where = f"{page_path.relative_to(site)}: {link}"
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                bad.append(f"{where} (no such file)")
                continue
            fragment = unquote(parts.fragment)
            if fragment and target.suffix == ".html" and fragment not in read(target).ids:
                bad.append(f"{where} (no element with id {fragment!r})")
    return bad


def test_every_internal_link_of_the_built_site_leads_somewhere():
    if not (SITE / "index.html").is_file():
        pytest.skip(
            "the documentation site is not built (python -m sphinx -W --keep-going -b html docs "
            "docs/_build/html builds it; CI runs this test right after)"
        )
    bad = broken_links(SITE)
    assert not bad, f"{len(bad)} broken internal links:\n" + "\n".join(bad[:40])


def test_the_check_finds_a_broken_anchor_and_a_missing_page(tmp_path):
    (tmp_path / "a.html").write_text(
        '<h1 id="top">A</h1><a href="#top">ok</a><a href="b.html#there">ok</a>'
        '<a href="b.html#gone">anchor</a><a href="c.html">page</a><a href="https://x.y/#z">ext</a>'
    )
    (tmp_path / "b.html").write_text('<p id="there">B</p><a href="a.html">ok</a>')
    read.cache_clear()
    assert broken_links(tmp_path) == [
        "a.html: b.html#gone (no element with id 'gone')",
        "a.html: c.html (no such file)",
    ]


def test_a_strict_build_without_chromium_stops_with_one_line_naming_the_fix(monkeypatch, tmp_path):
    import importlib.util
    import shutil
    from types import SimpleNamespace

    pytest.importorskip("sphinx")
    ext = SITE.parents[1] / "_ext" / "qkv_images.py"
    spec = importlib.util.spec_from_file_location("qkv_images_under_test", ext)
    images = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(images)
    monkeypatch.setattr(images, "IMG", tmp_path)  # no figures there yet
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no browser on the PATH
    monkeypatch.delenv("QKV_DOCS_KEEP_IMAGES", raising=False)
    with pytest.raises(SystemExit) as info:
        images.make_images(SimpleNamespace(_fail_on_warnings=True))
    text = str(info.value.code)
    assert "\n" not in text and "Chromium" in text and "apt-get install chromium" in text


def test_the_docs_commands_say_what_the_build_needs():
    root = SITE.parents[2]
    readme = (root / "README.md").read_text(encoding="utf-8")
    command = readme.index("python -m sphinx -W --keep-going -b html docs docs/_build/html")
    assert "Chromium" in readme[command - 300 : command]  # said next to the command
    started = (root / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert "sphinx-argparse" not in started  # not in the docs extra, not used

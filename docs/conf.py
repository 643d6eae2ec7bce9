"""Sphinx configuration of qkv's documentation site.

Build (warnings are errors)::

    python -m pip install -e ".[docs]"
    python -m sphinx -W --keep-going -b html docs docs/_build/html

The figures of the learning pages are made during the build by the library's own commands
(``docs/_ext/qkv_images.py``); they are not committed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

import qkv  # noqa: E402

project = "qkv"
author = "the qkv authors"
copyright = "the qkv authors, MIT licence"
release = qkv.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.viewcode",
    "numpydoc",
    "qkv_cli",
    "qkv_images",
    "qkv_public",
    "qkv_viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

# The README and bench/README.md link into the repository; their pages are included, not copied.
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

html_theme = "pydata_sphinx_theme"
html_title = f"qkv {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 7,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
# pydata-sphinx-theme logs a console error when it finds no stored colour mode (a first visit)
html_context = {"default_mode": "auto"}
html_static_path: list[str] = []
html_show_sourcelink = False


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


# qkv.gpu needs torch and triton, the integrations transformers: on a machine without them the
# API pages are still built from the docstrings (the imports are stood in for, nothing runs).
autodoc_mock_imports = [
    m for m in ("torch", "triton", "transformers", "mpi4py", "sympy") if _missing(m)
]
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types
autosummary_generate = False

numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
# Undocumented members are listed too, so a public method or property without a docstring fails
# the build (numpydoc's GL08); so does a docstring numpydoc cannot parse (an unknown section, a
# section out of order): numpydoc warns and -W makes it an error. A name in a module's __all__
# missing from the API page fails through _ext/qkv_public.py.
numpydoc_validation_checks = {"GL08"}
numpydoc_validation_exclude = {r"\.__\w+__$", r"\._\w+$"}

nitpicky = False
suppress_warnings = ["myst.header"]

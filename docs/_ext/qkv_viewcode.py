"""Sphinx extension: the ``[docs]`` links of the highlighted source pages lead to real anchors.

``sphinx.ext.viewcode`` links a source module's functions back to the API page under one name
per module: the name of the first documented object that led it there. ``qkv.attention_vjp``
(front's wrapper of ``qkv.engine.grad.attention_vjp``) led it to ``qkv.engine.grad`` as
``qkv``, so the module's other functions, documented as ``qkv.engine.grad.*``, were linked as
``qkv.sum_to``, ``qkv.vjp``... which do not exist. A public function of ``qkv`` that wraps a
module documented under its own name is followed to ``qkv.front``, where the wrapper is written;
``tests/test_docs_links.py`` checks every internal anchor of the built site.
"""

from __future__ import annotations

import importlib

from sphinx.application import Sphinx

#: Modules the API page documents under their own name (``.. automodule::``) whose functions
#: ``qkv`` also re-exports through a wrapper in ``qkv.front``.
OWN_NAME = ("qkv.engine.grad",)


def follow(app: Sphinx, modname: str, fullname: str) -> str | None:
    if modname != "qkv":
        return None
    try:
        obj = getattr(importlib.import_module(modname), fullname.split(".")[0])
    except (ImportError, AttributeError):
        return None
    return "qkv.front" if getattr(obj, "__module__", None) in OWN_NAME else None


def setup(app: Sphinx) -> dict[str, object]:
    app.setup_extension("sphinx.ext.viewcode")
    app.connect("viewcode-follow-imported", follow)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

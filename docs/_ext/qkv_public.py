"""Sphinx extension: a public name without an entry in the API reference fails the build.

For each module of :data:`MODULES`, every name in its ``__all__`` must be documented on the
API page (as ``module.name``, or as ``qkv.name`` for what the top-level package re-exports).
A missing one is a warning, which ``-W`` makes an error.
"""

from __future__ import annotations

import importlib

from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.ext.autodoc.mock import mock
from sphinx.util import logging

log = logging.getLogger(__name__)

MODULES = [
    "qkv",
    "qkv.flash",
    "qkv.reference",
    "qkv.variants",
    "qkv.study",
    "qkv.plot",
    "qkv.distributed",
    "qkv.integrations.transformers",
    "qkv.integrations.capture",
    "qkv.integrations.explain_model",
    "qkv.gpu.api",
]


def check(app: Sphinx, env: BuildEnvironment) -> None:
    """Warn for each public name the API reference lacks."""
    documented = set(env.get_domain("py").objects) | set(env.get_domain("py").modules)
    with mock(app.config.autodoc_mock_imports):
        for name in MODULES:
            module = importlib.import_module(name)
            for public in getattr(module, "__all__", []):
                if public == "__version__":
                    public_ok = f"{name}.__version__" in documented
                else:
                    public_ok = {f"{name}.{public}", f"qkv.{public}"} & documented
                if not public_ok:
                    log.warning(
                        "%s.%s is public (in __all__) but not in the API reference", name, public
                    )


def setup(app: Sphinx) -> dict[str, object]:
    app.connect("env-check-consistency", check)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

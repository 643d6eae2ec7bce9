"""A pytest plugin: the ``attention_conformance`` fixture and ``--qkv-examples``/``--qkv-seed``.

Enable it in a project's top-level ``conftest.py``::

    pytest_plugins = ["qkv.testing.pytest_plugin"]

and add one test::

    def test_my_attention(attention_conformance):
        attention_conformance(my_attention, supports={"causal", "mask"})

The fixture is :func:`qkv.testing.assert_attention` (the report card is the failure message),
with ``examples`` and ``seed`` defaulting to the command-line options, so a run in CI can ask
for more examples (``pytest --qkv-examples 200``) without editing the test. Without the plugin,
the same test is ``qkv.testing.assert_attention(my_attention)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["attention_conformance", "pytest_addoption"]


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("qkv", "qkv.testing: attention conformance")
    group.addoption(
        "--qkv-examples",
        type=int,
        default=25,
        help="cases per feature for the attention_conformance fixture (default 25)",
    )
    group.addoption(
        "--qkv-seed",
        type=int,
        default=0,
        help="seed for the attention_conformance fixture (default 0)",
    )


@pytest.fixture
def attention_conformance(request: Any) -> Callable[..., Any]:
    """``check(fn, **options)``: run :func:`qkv.testing.check_attention` on ``fn`` and fail the
    test with the report card unless every supported feature passes; returns the report."""
    from . import assert_attention

    def check(fn: Any, **options: Any) -> Any:
        options.setdefault("examples", request.config.getoption("--qkv-examples"))
        options.setdefault("seed", request.config.getoption("--qkv-seed"))
        return assert_attention(fn, **options)

    return check

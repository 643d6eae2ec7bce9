"""Sphinx extension: the ``qkv`` command's reference, generated from its own argument parser.

``.. qkv-cli::`` writes one section per command with exactly what ``qkv COMMAND --help`` prints
(at 100 columns), built by :func:`qkv.cli.build_parser`. The help texts are shown as literal
text, never read as reStructuredText, so a ``|`` or ``*`` in them cannot break the page.
"""

from __future__ import annotations

import argparse
import os

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


def _help(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        return parser.format_help()
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


class QkvCli(SphinxDirective):
    """``.. qkv-cli::``: the command and each subcommand with its ``--help``."""

    def run(self) -> list[nodes.Node]:
        from qkv.cli import build_parser

        parser = build_parser()
        lines = ["``qkv``", "-------", "", ".. code-block:: text", ""]
        lines += ["   " + ln for ln in _help(parser).splitlines()] + [""]
        for name, sub in _commands(parser).items():
            title = f"``qkv {name}``"
            lines += [title, "-" * len(title), "", ".. code-block:: text", ""]
            lines += ["   " + ln for ln in _help(sub).splitlines()] + [""]
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source="qkv --help"), node)
        return node.children


def setup(app: Sphinx) -> dict[str, object]:
    app.add_directive("qkv-cli", QkvCli)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

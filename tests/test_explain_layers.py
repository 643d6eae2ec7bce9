"""The learner side's layering: the explanation is data, renderers are found by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qkv
from qkv.explanation import formats
from qkv.explanation.exercise import make_exercise
from qkv.explanation.trace import SECTIONS
from qkv.render.blocks import Heading, build

EXPLANATION = Path(qkv.__file__).parent / "explanation"


def _imports(path: Path) -> list[str]:
    """Every module a file imports, written absolutely (``..render`` -> ``qkv.render``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ["qkv", "explanation"][: max(0, 2 - node.level + 1)] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.append(mod)
            out += [f"{mod}.{a.name}" for a in node.names]
    return out


@pytest.mark.parametrize("path", sorted(EXPLANATION.glob("*.py")), ids=lambda p: p.name)
def test_explanation_never_imports_render(path):
    bad = [m for m in _imports(path) if m == "qkv.render" or m.startswith("qkv.render.")]
    assert bad == []


def test_a_registered_format_is_what_trace_render_uses():
    t = qkv.explain([2, 1], [[1, 0], [3, 2]], d=4)
    formats.register("shape-only", lambda trace, **_: f"{trace.L}x{trace.S}")
    try:
        assert t.render("shape-only") == "1x2"
        assert "shape-only" in formats.known()
    finally:
        del formats._RENDERERS["trace"]["shape-only"]
    with pytest.raises(qkv.InputError, match="format: expected one of text, markdown"):
        t.render("shape-only")


def test_sections_are_chosen_by_key():
    t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
    headings = [b.text for b in build(t) if isinstance(b, Heading)]
    without = [b.text for b in build(t, skip=("scale", "results")) if isinstance(b, Heading)]
    assert "Scale" in headings and "Results" in headings
    assert without == [h for h in headings if h not in ("Scale", "Results")]
    with pytest.raises(qkv.InputError, match="unknown sections"):
        build(t, skip=("Scale",))  # a heading is not a key
    assert set(make_exercise(seed=7).hidden_sections) <= set(SECTIONS)
    problem = make_exercise(seed=7).render("text")
    assert "1/√d with" not in problem and "Use d = 4 in the scale 1/√d" in problem


def test_to_dict_is_the_json_document():
    import json

    t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
    assert json.loads(t.to_json()) == json.loads(json.dumps(t.to_dict()))

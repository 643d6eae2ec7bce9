"""An exercise as a document: the problem, its tasks and, when asked, the worked solution.

The exercise chooses which trace sections the problem leaves out by key
(:attr:`qkv.explanation.exercise.Exercise.hidden_sections`); JSON is the exercise's own dict.
"""

from __future__ import annotations

import json
from typing import Any

from .blocks import Heading, Para, build

__all__ = ["render_exercise"]


def render_exercise(
    ex: Any,
    format: str = "text",
    *,
    answers: bool = False,
    exact: bool = False,
    hint: bool = True,
) -> str:
    """The problem (and, with ``answers``, its worked solution) in ``format``; ``hint=False``
    leaves out the line naming the command that shows the answers (``qkv exercise
    --practice`` asks for them step by step instead).

    Examples
    --------
    >>> from qkv.explanation.exercise import make_exercise
    >>> text = render_exercise(make_exercise(seed=7), "text")
    >>> text.splitlines()[0], "1/√d with" in text, "qkv exercise --seed 7 --answers" in text
    ('Exercise (seed 7)', False, True)
    """
    from . import render_blocks  # the package imports this module first: look it up late

    if format == "json":
        return json.dumps(ex.to_dict(answers=answers, exact=exact), indent=1) + "\n"
    blocks = build(
        ex.trace(stop_at="inputs"),
        title=f"Exercise (seed {ex.seed})",
        skip=ex.hidden_sections,
    )
    blocks.append(Heading(2, "Tasks"))
    blocks += [Para(t) for t in ex.tasks()]
    if answers:
        blocks += build(ex.trace(exact=exact), title="Worked solution")
    elif hint:
        blocks.append(Para(f"Check your work with: {ex.command()} --answers", "note"))
    return render_blocks(blocks, format)

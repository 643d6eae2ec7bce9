"""The practice pane's answers: a problem from a seed, and each answer checked by the library.

Two kinds: ``steps`` — :func:`qkv.explanation.exercise.make_exercise`, checked step by step by
:class:`qkv.explanation.practice.Practice` (the scale slips); ``masks`` —
:func:`qkv.explanation.mask_drill.make_drill` (mask polarity, causal alignment, ``-1e9`` vs
``-inf``, a row with every key masked, the softmax's axis, the max subtraction). The server
keeps no state: each request names its problem by kind and seed.

Examples
--------
>>> doc = exercise_fields({"kind": "steps", "seed": "7"})
>>> doc["seed"], [s["key"] for s in doc["steps"]]
(7, ['raw', 'scaled', 'exps', 'weights', 'output'])
>>> r = check_fields({"kind": "steps", "seed": 7, "step": "scaled", "answer": "12 9 12"})
>>> r["correct"], r["slip"]
(False, 'forgot to scale')
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..checks import check_int, parse_int
from ..errors import InputError
from ..explanation.display import fmt
from ..explanation.exercise import LIMIT, make_exercise
from ..explanation.mask_drill import make_drill
from ..explanation.practice import TRIES, Practice
from .api import FieldError

__all__ = ["check_fields", "exercise_fields"]

KINDS = ("steps", "masks")


def _int(value: Any, name: str, field: str, **limits: Any) -> int:
    try:
        if isinstance(value, str):
            return parse_int(value, name, **limits)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"{name}: expected an integer, got {value!r}")
        return check_int(value, name, **limits)
    except InputError as exc:
        raise FieldError(field, str(exc)) from None


def _problem_key(fields: dict[str, Any]) -> tuple[str, int, int, bool]:
    kind = fields.get("kind") or "steps"
    if kind not in KINDS:
        raise FieldError("kind", f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    seed = fields.get("seed")
    if seed is None or seed == "":
        raise FieldError("seed", "seed: required (a whole number >= 0)")
    seed = _int(seed, "seed", "seed", minimum=0)
    queries = _int(fields.get("queries") or 1, "query rows", "queries", minimum=1, maximum=LIMIT)
    causal = fields.get("causal", False)
    if not isinstance(causal, bool):
        raise FieldError("causal", f"causal: expected true or false, got {causal!r}")
    return kind, seed, queries, causal


@lru_cache(maxsize=64)
def _problem(kind: str, seed: int, queries: int, causal: bool) -> Any:
    if kind == "masks":
        return make_drill(seed)
    return Practice(make_exercise(seed, queries=queries, causal=causal))


def _rows(a: Any) -> str:
    return "; ".join(", ".join(fmt(x) for x in r) for r in a)


def exercise_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The problem named by ``kind``, ``seed`` (and, for ``steps``, ``queries``, ``causal``):
    its text, line by line, and the steps to answer."""
    kind, seed, queries, causal = _problem_key(fields)
    p = _problem(kind, seed, queries, causal)
    if kind == "masks":
        lines = p.problem()
    else:
        ex = p.exercise
        lines = [
            f"Exercise (seed {seed}): q = {_rows(ex.q)}; K = {_rows(ex.k)}; V = {_rows(ex.v)}",
            *ex.tasks(),
        ]
    return {
        "kind": kind,
        "seed": seed,
        "queries": queries,
        "causal": causal,
        "problem": lines,
        "steps": [{"key": s.key, "prompt": s.prompt} for s in p.steps],
    }


def check_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """One answer checked: ``correct``, the ``slip`` (or ``None``), the ``message``, whether it
    was ``readable``, and the ``worked`` step once right or after :data:`TRIES` misses.

    Raises
    ------
    FieldError
        ``answer`` when the answer cannot be read (the reader's message), or for a bad
        problem key.
    """
    kind, seed, queries, causal = _problem_key(fields)
    p = _problem(kind, seed, queries, causal)
    step = fields.get("step")
    if not isinstance(step, str) or step not in [s.key for s in p.steps]:
        names = ", ".join(s.key for s in p.steps)
        raise FieldError("step", f"step: expected one of {names}, got {step!r}")
    answer = fields.get("answer")
    if not isinstance(answer, str) or not answer.strip():
        raise FieldError("answer", "answer: type the numbers (split by commas, rows by ;)")
    misses = _int(fields.get("misses", 0), "misses", "misses", minimum=0)
    try:
        fb = p.check(step, answer)
    except InputError as exc:
        raise FieldError("answer", f"answer: {exc}") from None
    done = fb.correct or (fb.readable and misses + 1 >= TRIES)
    return {
        "correct": fb.correct,
        "slip": fb.slip,
        "message": fb.message,
        "readable": fb.readable,
        "worked": p.step(step).worked if done else None,
    }

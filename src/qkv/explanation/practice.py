"""Practice with feedback: check a learner's answer for each step and name the likely slip.

A :class:`Practice` takes an :class:`qkv.explanation.exercise.Exercise` and asks for its
steps in turn — raw scores, scaled scores, the exponentials ``exp(s − max)``, the weights and
the output. Each answer is compared with the library's value (:func:`qkv.explain`) within a
tolerance; a wrong one is compared with what each common slip gives, computed by the same
library on the same inputs:

- *forgot to scale* — the scale left out (``scale = 1``);
- *multiplied by √d* — the scale inverted (``scale = √d``), a common misreading of the formula;
- *used len(q) for d* — ``1/√len(q)`` where ``d`` was given;
- *forgot to subtract the max* — ``exp(s)`` instead of ``exp(s − max)``;
- *summed the wrong axis* — the exponentials divided by their column sums (over queries)
  instead of the row sum (over keys).

Examples
--------
>>> from qkv.explanation.exercise import make_exercise
>>> p = Practice(make_exercise(seed=7))
>>> [s.key for s in p.steps]
['raw', 'scaled', 'exps', 'weights', 'output']
>>> step = p.step("scaled")
>>> p.check("scaled", step.expected).correct
True
>>> p.check("scaled", p.trace.raw).slip
'forgot to scale'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from .display import fmt
from .exercise import STEPS, Exercise
from .scale import read_number
from .trace import Trace, explain

__all__ = [
    "ATOL",
    "RTOL",
    "SLIPS",
    "TRIES",
    "Feedback",
    "Practice",
    "Step",
    "Summary",
    "read_answer",
    "run_session",
]

#: An answer is right when it is within ``ATOL + RTOL·|value|`` of the library's, entry by entry.
RTOL, ATOL = 1e-2, 5e-3

#: The slips diagnosed, in the order they are tried.
SLIPS = (
    "forgot to scale",
    "multiplied by √d",
    "used len(q) for d",
    "forgot to subtract the max",
    "summed the wrong axis",
)

_WHY = {
    "forgot to scale": "multiply every q·k by 1/√d",
    "multiplied by √d": "standard attention divides by √d (multiplies by 1/√d)",
    "used len(q) for d": "here d is given, and it is not the length of q",
    "forgot to subtract the max": "subtract the row's maximum before exp (the same weights "
    "in exact arithmetic, but exp overflows without it)",
    "summed the wrong axis": "each exponential was divided by its column's sum (over "
    "queries); divide by its row's sum (over the keys of that query)",
}


@dataclass
class Step:
    """One step to answer: what is asked, the library's value and the slips' values."""

    key: str
    prompt: str
    expected: np.ndarray
    worked: list[str]
    slips: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Feedback:
    """The verdict on one answer.

    ``readable`` is ``False`` when the answer could not be compared at all (too few or too many
    numbers): a session asks again without counting a try.
    """

    correct: bool
    slip: str | None
    message: str
    readable: bool = True


def _entries(part: str) -> list[str]:
    """Split a comma-free piece of a row at spaces, keeping an expression with spaces whole.

    A space separates two entries unless it sits inside parentheses, after an operator, or
    before ``* / ^ )``; a lone ``+`` or ``-`` is the operator between its neighbours. So
    ``1 -2`` is two entries and ``1 - 2`` one.
    """
    out: list[str] = []
    for tok in part.split():
        prev = out[-1] if out else ""
        joins = prev and (
            prev.count("(") > prev.count(")")
            or prev[-1] in "+-*/^(−"
            or tok[0] in "*/^)"
            or tok in ("+", "-", "−")
        )
        if joins:
            out[-1] = prev + " " + tok
        else:
            out.append(tok)
    return out


def read_rows(
    text: str,
    entries: Callable[[str, str], list[str]],
    number: Callable[[str], float],
) -> np.ndarray:
    """Rows split by ``;``, each cut into entries by ``entries(row, where)`` and each entry
    read by ``number``: a 2-D float64 array. Every slip is an :class:`~qkv.InputError` naming
    the row and entry (``where`` is ``"row n, "`` when there are several rows)."""
    rows = [r.strip() for r in text.strip().split(";")]
    if not rows[0]:
        raise InputError("no numbers given")
    out = []
    for n, row in enumerate(rows, start=1):
        where = f"row {n}, " if len(rows) > 1 else ""
        tokens = entries(row, where) if row else []
        if not tokens:
            raise InputError(f"row {n} is empty")
        values = []
        for e, tok in enumerate(tokens, start=1):
            try:
                values.append(number(tok))
            except InputError as exc:
                raise InputError(f"{where}entry {e}: {exc}") from None
        out.append(values)
    if len({len(r) for r in out}) > 1:
        raise InputError("rows have different lengths")
    return np.array(out, dtype=np.float64)


def read_answer(text: str) -> np.ndarray:
    """An answer as typed: numbers split by commas or spaces, rows of several queries by ``;``.

    Each number may be a fraction or a small expression (``9/2``, ``exp(-1.5)``, ``e^3``),
    read by :func:`qkv.explanation.scale.read_number` (never ``eval``).

    Returns
    -------
    ndarray
        1-D for one row, 2-D for several.

    Raises
    ------
    InputError
        Naming the row and entry that could not be read.

    Examples
    --------
    >>> read_answer("1, exp(-1.5), 1").round(5).tolist()
    [1.0, 0.22313, 1.0]
    >>> read_answer("9/2 3; 1 - 2, -2").tolist()
    [[4.5, 3.0], [-1.0, -2.0]]
    """

    def entries(row: str, where: str) -> list[str]:
        parts = [p.strip() for p in row.split(",")]
        if any(not p for p in parts):
            raise InputError(f"{where}an empty entry between commas")
        return [e for p in parts for e in _entries(p)]

    a = read_rows(text, entries, read_number)
    return a[0] if len(a) == 1 else a


def _close(a: np.ndarray, b: np.ndarray, nan: bool = False) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=nan))


def judge(
    a: np.ndarray,
    want: np.ndarray,
    slips: dict[str, np.ndarray],
    names: Any,
    say: Callable[[str], str],
    nan: bool = False,
) -> Feedback:
    """The feedback on answer ``a`` to a step whose value is ``want``: right, the first slip
    of ``names`` whose value (in ``slips``) it equals, in ``say(name)``'s words, or not quite;
    a shape that does not fit is said as such. ``nan``: NaN answers equal NaN values."""
    if a.shape != want.shape and a.size == want.size:
        a = a.reshape(want.shape)  # one query: a row or a flat list
    if a.shape != want.shape:
        rows, cols = want.shape
        what = f"{cols} numbers" if rows == 1 else f"{rows} rows of {cols} numbers"
        return Feedback(False, None, f"expected {what}, got {a.size}", readable=False)
    if _close(a, want, nan):
        return Feedback(True, None, "right")
    for name in names:
        cand = slips.get(name)
        if cand is not None and not _close(cand, want, nan) and _close(a, cand, nan):
            return Feedback(False, name, say(name))
    return Feedback(False, None, "not quite")


class Practice:
    """The steps of an exercise, each checked against the library and the common slips."""

    def __init__(self, exercise: Exercise) -> None:
        self.exercise = exercise
        self.trace: Trace = exercise.trace()
        ex, t = exercise, self.trace
        # an exercise's trace runs to the output: every step is set
        assert t.excluded is not None and t.logits is not None and t.exps is not None
        assert t.raw is not None and t.scaled is not None
        assert t.weights is not None and t.output is not None
        q = ex.q[0] if ex.q.shape[0] == 1 else ex.q
        args = (q, ex.k, ex.v)
        slip_traces = {
            "forgot to scale": explain(*args, scale=1, causal=ex.causal),
            "multiplied by √d": explain(*args, d=ex.d, scale="sqrt(d)", causal=ex.causal),
        }
        if ex.q.shape[1] != ex.d:
            slip_traces["used len(q) for d"] = explain(*args, causal=ex.causal)
        unshifted = np.where(t.excluded, 0.0, np.exp(np.where(t.excluded, 0.0, t.logits)))
        with np.errstate(invalid="ignore", divide="ignore"):
            wrong_axis = t.exps / t.exps.sum(axis=0, keepdims=True)

        def slips(name: str) -> dict[str, np.ndarray]:
            return {k: getattr(s, name) for k, s in slip_traces.items()}

        self.steps = [
            Step("raw", "the raw dot products q·k, one per key", t.raw, self._worked_raw()),
            Step(
                "scaled",
                "the scaled scores q·k · 1/√d",
                t.scaled,
                self._worked_scaled(),
                slips("scaled"),
            ),
            Step(
                "exps",
                "the exponentials exp(s − max) (0 for an excluded key)",
                t.exps,
                self._worked_exps(),
                {**slips("exps"), "forgot to subtract the max": unshifted},
            ),
            Step(
                "weights",
                "the weights exp / Σ exp",
                t.weights,
                self._worked_weights(),
                {**slips("weights"), "summed the wrong axis": wrong_axis},
            ),
            Step(
                "output",
                "the output Σ weight · v",
                t.output,
                self._worked_output(),
                {**slips("output"), "summed the wrong axis": wrong_axis @ ex.v},
            ),
        ]

        assert tuple(s.key for s in self.steps) == STEPS  # the exercise's numbered tasks

    def step(self, key: str) -> Step:
        """The step named ``key`` (one of ``raw, scaled, exps, weights, output``)."""
        for s in self.steps:
            if s.key == key:
                return s
        raise InputError(f"step: expected one of {', '.join(s.key for s in self.steps)}")

    def check(self, key: str, answer: Any) -> Feedback:
        """Compare ``answer`` with step ``key``'s value; on a miss, name the likely slip.

        ``answer`` is numbers, or text as typed (read by :func:`read_answer`).
        """
        s = self.step(key)
        if isinstance(answer, str):
            answer = read_answer(answer)
        a = np.asarray(answer, dtype=float)
        return judge(a, s.expected, s.slips, SLIPS, lambda n: f"not quite (slip: {n}): {_WHY[n]}")

    # ----- the worked steps, one line per query row and key -----
    def _rows(self) -> list[tuple[int, str]]:
        t = self.trace
        return [(i, "" if t.L == 1 else f"query row {i}: ") for i in range(t.L)]

    def _worked_raw(self) -> list[str]:
        t = self.trace
        return [f"{p}k{j}: {t.dot_terms(i, j)}" for i, p in self._rows() for j in range(t.S)]

    def _worked_scaled(self) -> list[str]:
        t = self.trace
        assert t.raw is not None and t.scaled is not None  # the trace runs to the output
        head = [f"scale = {t.scale.describe()}"]
        return head + [
            f"{p}k{j}: {fmt(t.raw[i, j])} × {fmt(t.scale.value)} = {fmt(t.scaled[i, j])}"
            for i, p in self._rows()
            for j in range(t.S)
        ]

    def _worked_exps(self) -> list[str]:
        t, out = self.trace, []
        # the trace runs to the output: every step is set
        assert t.row_max is not None and t.excluded is not None and t.scaled is not None
        assert t.shifted is not None and t.exps is not None
        for i, p in self._rows():
            out.append(f"{p}max = {fmt(t.row_max[i])}")
            for j in range(t.S):
                if t.excluded[i, j]:
                    out.append(f"{p}k{j}: excluded ({t.reason_text(i, j)}) → 0")
                else:
                    out.append(
                        f"{p}k{j}: exp({fmt(t.scaled[i, j])} − {fmt(t.row_max[i])}) = "
                        f"exp({fmt(t.shifted[i, j])}) = {fmt(t.exps[i, j])}"
                    )
        return out

    def _worked_weights(self) -> list[str]:
        t, out = self.trace, []
        # the trace runs to the output: every step is set
        assert t.exps is not None and t.sums is not None and t.weights is not None
        for i, p in self._rows():
            out.append(f"{p}Σ = " + " + ".join(fmt(x) for x in t.exps[i]) + f" = {fmt(t.sums[i])}")
            out += [
                f"{p}k{j}: {fmt(t.exps[i, j])} / {fmt(t.sums[i])} = {fmt(t.weights[i, j])}"
                for j in range(t.S)
            ]
        return out

    def _worked_output(self) -> list[str]:
        t = self.trace
        # the trace runs to the output: every step is set
        assert t.weights is not None and t.v is not None and t.output is not None

        def vec(v: np.ndarray) -> str:
            return "[" + ", ".join(fmt(x) for x in v) + "]"

        return [
            f"{p}"
            + " + ".join(f"{fmt(t.weights[i, j])}·{vec(t.v[j])}" for j in range(t.S))
            + f" = {vec(t.output[i])}"
            for i, p in self._rows()
        ]


#: Tries per step before the worked step is shown.
TRIES = 2

#: How a session says answers may be written.
HOW_TO_ANSWER = (
    "Answer each step with its numbers, split by commas or spaces (rows of several queries\n"
    'by ";"); fractions and expressions such as 9/2 or exp(-1.5) are fine. You have '
    f"{TRIES} tries\nper step. End of input (Ctrl-D) stops the session."
)


@dataclass
class Summary:
    """How a practice session went.

    Attributes
    ----------
    steps : int
        Steps in the exercise.
    done : int
        Steps finished: right, or out of tries.
    right : int
        Steps answered right (at any try).
    second_try : int
        Of those, the steps right only at a later try.
    stopped : bool
        Whether the input ended before the last step.
    """

    steps: int
    done: int = 0
    right: int = 0
    second_try: int = 0
    stopped: bool = False

    def text(self) -> str:
        """One line: ``3 of 5 steps right (1 at the second try).``"""
        later = f" ({self.second_try} at the second try)" if self.second_try else ""
        if not self.stopped:
            return f"{self.right} of {self.steps} steps right{later}."
        return (
            f"Stopped after {self.done} of {self.steps} steps: "
            f"{self.right} of {self.done} right{later}."
        )


def run_session(
    practice: Practice,
    ask: Callable[[str], str | None],
    say: Callable[[str], None],
    *,
    tries: int = TRIES,
) -> Summary:
    """Ask for each step in turn, check each answer, and say right or which slip.

    Parameters
    ----------
    practice : Practice
    ask : callable
        ``ask(prompt)`` shows ``prompt`` and returns the line typed, or ``None`` at the end of
        the input, which ends the session (with its summary, like the last step).
    say : callable
        Shows text (each message ends with a newline).
    tries : int
        Tries per step. An answer that cannot be read, or has the wrong count of numbers, is
        asked again without using a try; a wrong one gets the feedback (the slip, if it is a
        known one) and another try; after the last, the worked step is shown.

    Returns
    -------
    Summary

    Examples
    --------
    >>> from qkv.explanation.exercise import make_exercise
    >>> lines = iter(["12 9 12", "abc", "12, 9, 12", "6 9/2 6"])
    >>> out = []
    >>> s = run_session(Practice(make_exercise(seed=7)), lambda p: next(lines, None), out.append)
    >>> s.text()
    'Stopped after 2 of 5 steps: 2 of 2 right (1 at the second try).'
    >>> print("".join(m for m in out if m.startswith(("not quite", "could not"))))
    could not read that (entry 1: 'abc' is not allowed (numbers, e, sqrt( ), exp( ), log( ),
    + - * / ** only)); try again
    not quite (slip: forgot to scale): multiply every q·k by 1/√d; try again (1 try left)
    """
    summary = Summary(len(practice.steps))
    for n, step in enumerate(practice.steps, 1):
        say(f"\nStep {n} of {summary.steps}: {step.prompt}\n")
        left = tries
        while True:
            line = ask("> ")
            if line is None:
                summary.stopped = True
                say("\n(end of input)\n")
                return summary
            if not line.strip():
                say("type the numbers, or end the input (Ctrl-D) to stop\n")
                continue
            try:
                fb = practice.check(step.key, line)
            except InputError as exc:
                say(f"could not read that ({exc}); try again\n")
                continue
            if not fb.readable:
                say(f"{fb.message}; try again\n")
                continue
            if fb.correct:
                summary.right += 1
                summary.second_try += left < tries
                say("right\n")
                break
            left -= 1
            more = f"; try again ({left} {'try' if left == 1 else 'tries'} left)" if left else ""
            say(f"{fb.message}{more}\n")
            if not left:
                say("worked step:\n" + "\n".join("  " + w for w in step.worked) + "\n")
                break
        summary.done += 1
    return summary

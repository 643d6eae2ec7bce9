"""Practice problems: small integer inputs and a worked solution.

The same seed always gives the same problem. The scale uses a ``d`` that is a perfect square
(so ``1/√d`` is a simple fraction) and, as in the worked example, need not be ``len(q)``.

Examples
--------
>>> ex = make_exercise(seed=7)
>>> ex == make_exercise(seed=7), ex.q.shape, ex.k.shape, ex.d
(True, (1, 2), (3, 2), 4)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..checks import check_int
from .formats import renderer
from .trace import Trace, explain

__all__ = ["STEPS", "Exercise", "make_exercise"]

LIMIT = 12  # largest queries / keys / dim an exercise may have

#: The steps an exercise asks for, in order: its numbered tasks, and the answers a practice
#: session (:class:`qkv.explanation.practice.Practice`) checks.
STEPS = ("raw", "scaled", "exps", "weights", "output")


@dataclass(frozen=True, eq=False)
class Exercise:
    """A generated problem: inputs, the ``d`` of the scale, and whether it is causal."""

    seed: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    d: int
    causal: bool

    #: The trace sections (:data:`qkv.explanation.trace.SECTIONS`) the problem leaves out: the
    #: scale is the learner's to work out from ``d`` (the tasks say which ``d``).
    hidden_sections: ClassVar[tuple[str, ...]] = ("scale",)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Exercise)
            and (self.seed, self.d, self.causal) == (other.seed, other.d, other.causal)
            and all(
                np.array_equal(a, b) for a, b in zip(self.arrays(), other.arrays(), strict=True)
            )
        )

    __hash__ = None  # type: ignore[assignment]

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.q, self.k, self.v

    def trace(self, *, exact: bool = False, stop_at: str | None = None) -> Trace:
        """The worked solution (or, with ``stop_at="inputs"``, only the problem's data)."""
        q = self.q[0] if self.q.shape[0] == 1 else self.q
        return explain(
            q,
            self.k,
            self.v,
            d=self.d,
            causal=self.causal,
            exact=exact,
            stop_at=stop_at,
            title=f"Exercise (seed {self.seed})",
        )

    def tasks(self) -> list[str]:
        """What the learner is asked to compute: a note on ``d`` (and on causal attention),
        then one numbered task per step of :data:`STEPS`, the steps a practice session asks
        for (``qkv exercise --practice``: "Step 1 of 5")."""
        L = self.q.shape[0]
        who = "the query q" if L == 1 else f"each of the {L} query rows"
        dim = self.q.shape[1]
        given = f"d is given: it is not len(q) = {dim}" if dim != self.d else "here d = len(q)"
        out = [f"Use d = {self.d} in the scale 1/√d ({given})."]
        if self.causal:
            out.append(
                "Causal attention (bottom-right aligned): query row i sits at position "
                "S − L + i and sees only keys j ≤ its position; the others are excluded."
            )
        excluded = " (0 for an excluded key)" if self.causal else ""
        tasks = {
            "raw": f"For {who}, compute the raw dot products q·k with every key.",
            "scaled": "Scale them by 1/√d to get the pre-softmax scores.",
            "exps": f"Subtract the row maximum and exponentiate: exp(s − max){excluded}.",
            "weights": "Divide each exponential by the sum of its row: the weights.",
            "output": "Multiply each value row by its weight and add them up: the output.",
        }
        return out + [f"{n}. {tasks[key]}" for n, key in enumerate(STEPS, start=1)]

    def command(self) -> str:
        """The ``qkv exercise`` command line that gives this problem again."""
        L, S = self.q.shape[0], self.k.shape[0]
        cmd = f"qkv exercise --seed {self.seed}"
        if L != 1:
            cmd += f" --queries {L}"
        if S != 3:
            cmd += f" --keys {S}"
        if self.q.shape[1] != 2:
            cmd += f" --dim {self.q.shape[1]}"
        return cmd + (" --causal" if self.causal else "")

    def to_dict(self, *, answers: bool = False, exact: bool = False) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema": "qkv.exercise/1",
            "seed": self.seed,
            "problem": {
                "q": self.q.tolist() if self.q.shape[0] > 1 else self.q[0].tolist(),
                "k": self.k.tolist(),
                "v": self.v.tolist(),
                "d": self.d,
                "causal": self.causal,
                "tasks": self.tasks(),
            },
            "answers": None,
        }
        if answers:
            doc["answers"] = self.trace(exact=exact).to_dict()
        return doc

    def render(
        self, format: str = "text", *, answers: bool = False, exact: bool = False, hint: bool = True
    ) -> str:
        """The problem (and, with ``answers``, its worked solution) in ``format``; ``hint=False``
        leaves out the line naming the command that shows the answers."""
        return renderer(format, what="exercise")(self, answers=answers, exact=exact, hint=hint)


def make_exercise(
    seed: int | None = None,
    *,
    queries: int = 1,
    keys: int = 3,
    dim: int = 2,
    causal: bool = False,
) -> Exercise:
    """A practice problem with small integer inputs, reproducible by ``seed``.

    Parameters
    ----------
    seed : int, optional
        The problem's number; ``None`` draws one (the exercise records it).
    queries, keys, dim : int
        ``L``, ``S`` and the vector size (1 to 12). Values have the same size as keys.
    causal : bool
        Ask for causal attention.

    Returns
    -------
    Exercise
    """
    queries, keys, dim = (
        check_int(n, name, minimum=1, maximum=LIMIT)
        for name, n in (("queries", queries), ("keys", keys), ("dim", dim))
    )
    if seed is None:
        seed = int(np.random.default_rng().integers(0, 1_000_000))
    seed = check_int(seed, "seed", minimum=0)
    rng = np.random.default_rng([int(seed), queries, keys, dim, int(causal)])
    q = rng.integers(0, 4, size=(queries, dim)).astype(np.float64)
    k = rng.integers(0, 4, size=(keys, dim)).astype(np.float64)
    v = rng.integers(0, 5, size=(keys, dim)).astype(np.float64)
    d = math.isqrt(dim - 1) + 1
    return Exercise(seed=int(seed), q=q, k=k, v=v, d=d * d, causal=bool(causal))

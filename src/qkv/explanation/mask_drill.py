"""A drill on masks and the softmax, with the slips people make there diagnosed.

:func:`make_drill` gives three small parts from a seed, each answered with the weights:

- ``mask`` — scores and a boolean mask (1 = may attend) in which one row masks every key;
- ``causal`` — scores of 2 queries against 4 keys, causal (qkv's bottom-right alignment);
- ``float16`` — one row of large scores, computed in float16.

Each answer is compared with the library's weights (:func:`qkv.explain` on the scores, with
identity keys and scale 1, so the scores pass through unchanged) and, on a miss, with what each
slip gives:

- *mask polarity* — the mask read the wrong way round (1 taken to mean "hide");
- *-1e9 instead of -inf* — masked scores replaced by ``-1e9``: a row that masks every key
  gets uniform weights, not zeros;
- *a row with every key masked* — ``0/0``: NaN where qkv (like FlashAttention) gives 0;
- *top-left causal* — row ``i`` sees keys ``j <= i`` (PyTorch's ``is_causal=True``) instead of
  ``j <= S - L + i``;
- *softmax over the wrong axis* — normalised down the columns (over queries);
- *skipped the max subtraction* — ``exp(s)`` overflows in float16 (above about 11.09), and
  ``inf / inf`` is NaN.

Answers are numbers split by commas or spaces, rows by ``;``; ``nan`` and ``inf`` may be
written (a slip's answer often holds them).

Examples
--------
>>> drill = make_drill(7)
>>> [s.key for s in drill.steps]
['mask', 'causal', 'float16']
>>> drill.check("mask", drill.step("mask").expected).correct
True
>>> drill.check("float16", "nan, 0, 0").slip
'skipped the max subtraction'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..front import softmax
from .display import fmt
from .practice import Feedback, Step, judge, read_rows
from .scale import read_number
from .trace import explain

__all__ = ["DRILL_SLIPS", "MaskDrill", "make_drill", "read_drill_answer"]

#: The slips the drill diagnoses, in the order they are tried.
DRILL_SLIPS = (
    "mask polarity",
    "-1e9 instead of -inf",
    "a row with every key masked",
    "top-left causal",
    "softmax over the wrong axis",
    "skipped the max subtraction",
)

_WHY = {
    "mask polarity": "the mask is read the wrong way round: in qkv's boolean mask 1 (True) "
    "means the key may be attended, 0 that it is hidden",
    "-1e9 instead of -inf": "with -1e9 for a masked score, a row that masks every key gets "
    "uniform weights; with -inf it attends nothing, and qkv gives its weights (and output) 0",
    "a row with every key masked": "softmax of a row of -inf is 0/0 = NaN; qkv (like "
    "FlashAttention) gives such a row weight 0 and output 0",
    "top-left causal": "this is top-left causal (row i sees keys j ≤ i); qkv's causal is "
    "bottom-right aligned: row i of L sits at position S − L + i and sees keys j ≤ S − L + i",
    "softmax over the wrong axis": "each exponential was divided by its column's sum (over "
    "queries); the softmax runs along each row (over the keys of that query)",
    "skipped the max subtraction": "exp(s) overflows float16 above about 11.09, and inf / inf is "
    "NaN; subtract the row's maximum first (same weights, no overflow)",
}


def read_drill_answer(text: str) -> np.ndarray:
    """Numbers split by commas or spaces, rows by ``;``: a 2-D array (``nan``, ``inf`` allowed).

    >>> read_drill_answer("nan, 0 1/2; 1 0 0").tolist()
    [[nan, 0.0, 0.5], [1.0, 0.0, 0.0]]
    """
    return read_rows(
        str(text), lambda row, where: [e for e in re.split(r"[,\s]+", row) if e], _drill_number
    )


def _drill_number(tok: str) -> float:
    """A number of a drill answer: as in practice, or ``nan`` and ``±inf`` spelt out."""
    if tok.lower() in ("nan", "inf", "+inf", "-inf", "−inf"):
        return float(tok.lower().replace("−", "-"))
    return read_number(tok)


def _softmax_of(scores: np.ndarray, **masks: object) -> tuple[np.ndarray, np.ndarray]:
    """The library's masked scores and weights for ``scores`` themselves (identity keys, scale
    1, so the scores pass through unchanged)."""
    t = explain(scores, np.eye(scores.shape[1]), scale=1, **masks)  # type: ignore[arg-type]
    assert t.weights is not None and t.logits is not None  # a trace without v runs to weights
    return t.logits, t.weights


def _weights(scores: np.ndarray, **masks: object) -> np.ndarray:
    return _softmax_of(scores, **masks)[1]


def _wrong_axis(logits: np.ndarray) -> np.ndarray:
    """The softmax down the columns (over queries), by the library's softmax; an empty column
    gives 0."""
    return np.asarray(softmax(logits, axis=0))


def _rows(a: np.ndarray) -> str:
    return "; ".join(", ".join(fmt(x) for x in r) for r in a)


@dataclass
class MaskDrill:
    """The three parts of a drill (see the module), each a
    :class:`~qkv.explanation.practice.Step`."""

    seed: int
    scores: dict[str, np.ndarray]
    mask: np.ndarray
    steps: list[Step]

    def step(self, key: str) -> Step:
        """The part named ``key`` (``mask``, ``causal`` or ``float16``)."""
        for s in self.steps:
            if s.key == key:
                return s
        raise InputError(f"step: expected one of {', '.join(s.key for s in self.steps)}")

    def problem(self) -> list[str]:
        """The problem in words, one line per part."""
        m, c, f = self.scores["mask"], self.scores["causal"], self.scores["float16"]
        return [
            f"Drill (seed {self.seed}). Give the attention weights of each part, row by row "
            "(rows split by ;).",
            f"mask: scores {_rows(m)}; boolean mask {_rows(self.mask.astype(int))} "
            "(1 = may attend).",
            f"causal: {c.shape[0]} queries against {c.shape[1]} keys, scores {_rows(c)}; causal "
            "as qkv aligns it.",
            f"float16: scores {_rows(f)}, every step in float16.",
        ]

    def check(self, key: str, answer: object) -> Feedback:
        """Compare ``answer`` (text or numbers) with part ``key``; on a miss, name the slip."""
        s = self.step(key)
        a = read_drill_answer(answer) if isinstance(answer, str) else np.asarray(answer, float)
        return judge(a, s.expected, s.slips, DRILL_SLIPS, lambda n: f"not quite: {_WHY[n]}", True)


def _masks(rng: np.random.Generator, L: int, S: int) -> np.ndarray:
    """Rows that each attend some keys and hide others; the last row hides every key."""
    m = np.zeros((L, S), dtype=bool)
    for i in range(L - 1):
        while not (0 < m[i].sum() < S):
            m[i] = rng.integers(0, 2, size=S).astype(bool)
    return m


def make_drill(seed: int) -> MaskDrill:
    """The drill numbered ``seed`` (the same seed, the same numbers)."""
    from ..checks import check_int

    seed = check_int(seed, "seed", minimum=0)
    rng = np.random.default_rng([seed, 32])
    ms = rng.integers(0, 5, size=(3, 3)).astype(np.float64)
    mask = _masks(rng, 3, 3)
    cs = rng.integers(0, 5, size=(2, 4)).astype(np.float64)
    cs[0, 0] += 1  # keep the two readings of causal apart in row 0
    fs = np.array([[12.0, 11.0, float(rng.integers(0, 6))]])

    logits, w = _softmax_of(ms, mask=mask)
    replaced = np.where(mask, ms, -1e9)  # masked_fill(-1e9): the row of -1e9 is uniform
    nan_row = w.copy()
    nan_row[~mask.any(axis=1)] = np.nan
    mask_step = Step(
        "mask",
        "weights with the mask (rows split by ;)",
        w,
        [
            f"row {i}: softmax over the keys the mask allows → {_rows(w[i : i + 1])}"
            for i in range(3)
        ]
        + ["a row that may attend no key gets weight 0 everywhere (qkv's rule; output 0)"],
        {
            "mask polarity": _weights(ms, mask=~mask),
            "-1e9 instead of -inf": _weights(replaced),
            "a row with every key masked": nan_row,
            "softmax over the wrong axis": _wrong_axis(logits),
        },
    )
    clogits, wc = _softmax_of(cs, causal=True)
    L, S = cs.shape
    top_left = np.arange(S)[None, :] <= np.arange(L)[:, None]
    causal_step = Step(
        "causal",
        f"weights, causal ({L} queries, {S} keys)",
        wc,
        [
            f"row {i} sits at position {S - L + i} and sees keys 0 … {S - L + i} → "
            f"{_rows(wc[i : i + 1])}"
            for i in range(L)
        ],
        {
            "top-left causal": _weights(cs, mask=top_left),
            "softmax over the wrong axis": _wrong_axis(clogits),
        },
    )
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(fs.astype(np.float16))
        skipped = (e / e.sum(axis=-1, keepdims=True)).astype(np.float64)
    wf = _weights(fs.astype(np.float16)).astype(np.float64)
    f16_step = Step(
        "float16",
        "weights in float16",
        wf,
        [
            f"max = {fmt(fs.max())}; exp(s − max) = "
            + ", ".join(fmt(np.exp(x - fs.max())) for x in fs[0])
            + f" → weights {_rows(wf)}",
            "exp(12) = 162755 is more than float16's largest number, 65504",
        ],
        {"skipped the max subtraction": skipped},
    )
    return MaskDrill(
        seed, {"mask": ms, "causal": cs, "float16": fs}, mask, [mask_step, causal_step, f16_step]
    )

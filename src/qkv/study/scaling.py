"""Monte Carlo study of the ``1/√d`` scaling: score spread, saturation and vanishing gradients.

For each feature size ``d``, queries and keys are drawn from ``N(0, I_d)``. A raw score ``q·k``
then has mean 0 and standard deviation exactly ``√d``, so the scores that reach the softmax have
standard deviation ``scale·√d``:

=========  ===========  ==================================
mode       scale        score std (theory)
=========  ===========  ==================================
scaled     ``1/√d``     1, whatever ``d`` is
unscaled   ``1``        ``√d``
times_sqrt_d ``√d``     ``d`` (multiplying by √d instead of dividing, a common slip)
=========  ===========  ==================================

``"card"`` is accepted as an alias of ``"times_sqrt_d"`` (scripts written before the rename).

Each query row attends ``keys`` keys; rows come in sets of up to 64 queries that share one set of
keys, values and upstream gradients (as the rows of one attention call do), and the standard
errors are computed from the per-set means, so they stay honest despite the sharing. All three
modes see the same random numbers.

Reported per ``(d, mode)`` (see :class:`ScalingRow`): the measured score std, the mean largest
weight, the mean entropy of the weights (nats and as a fraction of ``log keys``), the mean
Frobenius norm of the softmax Jacobian ``diag(p) − p pᵀ`` and the mean norm of the gradient that
reaches ``q`` through :func:`qkv.attention_vjp`, with values and upstream gradients drawn from
``N(0, I_16)`` independently of ``d``.

Examples
--------
>>> from qkv.study import scaling_study
>>> study = scaling_study(dims=[4, 256], keys=16, samples=128, seed=0)
>>> [(r.d, r.mode, round(r.score_std_theory, 1)) for r in study.rows[:3]]
[(4, 'scaled', 1.0), (4, 'unscaled', 2.0), (4, 'times_sqrt_d', 4.0)]
>>> row = study.row(256, "unscaled")
>>> row.mean_max_weight > 0.6 > study.row(256, "scaled").mean_max_weight
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..checks import check_int
from ..engine.grad import attention_vjp
from ..engine.run import softmax
from ..errors import InputError, InputTypeError
from ..keywords import near_keywords

__all__ = [
    "DEFAULT_DIMS",
    "MODES",
    "ScalingRow",
    "ScalingStudy",
    "mode_scale",
    "scaling_study",
    "softmax_jacobian_norm",
]

MODES: tuple[str, ...] = ("scaled", "unscaled", "times_sqrt_d")
ALIASES = {"card": "times_sqrt_d"}  # other accepted names of a mode


def mode_name(mode: str) -> str:
    """The mode's name, with an alias (:data:`ALIASES`) replaced by the name it stands for."""
    return ALIASES.get(mode, mode) if isinstance(mode, str) else mode


DEFAULT_DIMS: tuple[int, ...] = tuple(2**i for i in range(2, 13))  # 4 … 4096
VALUE_DIM = 16
QUERIES_PER_SET = 64
_CHUNK_ELEMS = 1 << 22  # numbers per chunk of random draws, to bound memory at large d


def mode_scale(mode: str, d: int) -> float:
    """The multiplier of ``q·k`` in each mode.

    Examples
    --------
    >>> [mode_scale(m, 4) for m in MODES]
    [0.5, 1.0, 2.0]
    """
    mode = mode_name(mode)
    if mode == "scaled":
        return 1.0 / math.sqrt(d)
    if mode == "unscaled":
        return 1.0
    if mode == "times_sqrt_d":
        return math.sqrt(d)
    raise InputError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")


def softmax_jacobian_norm(p: np.ndarray) -> np.ndarray:
    """Frobenius norm of ``diag(p) − p pᵀ`` for each row ``p`` of weights (last axis).

    ``‖J‖² = Σ_i p_i² (1 − p_i)² + Σ_i p_i² Σ_{j≠i} p_j²``; it is 0 for a one-hot row and largest
    for a flat one. For the largest weight, ``1 − p_i`` and ``Σ_{j≠i} p_j²`` are summed from the
    other weights, so a nearly one-hot row keeps its small norm to full relative precision.

    Examples
    --------
    >>> softmax_jacobian_norm(np.array([[1.0, 0.0], [0.5, 0.5]])).tolist()
    [0.0, 0.5]
    """
    p = np.asarray(p, dtype=np.float64)
    top = np.argmax(p, axis=-1)[..., None]
    others = p.copy()
    np.put_along_axis(others, top, 0.0, axis=-1)
    one_minus = 1.0 - p
    np.put_along_axis(one_minus, top, np.sum(others, axis=-1, keepdims=True), axis=-1)
    sq = p * p
    rest_sq = np.sum(sq, axis=-1, keepdims=True) - sq
    np.put_along_axis(rest_sq, top, np.sum(others * others, axis=-1, keepdims=True), axis=-1)
    return np.sqrt(np.sum(sq * one_minus**2 + sq * rest_sq, axis=-1))


def _entropy(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return -np.sum(t, axis=-1)


@dataclass(frozen=True)
class ScalingRow:
    """One ``(d, mode)`` cell of the study.

    Attributes
    ----------
    d, mode, scale, keys, samples
        The setting: feature size, mode name, multiplier of ``q·k``, keys per query, query rows.
    score_std, score_std_theory
        Measured standard deviation of the scores fed to the softmax, and ``scale·√d``.
    mean_max_weight, max_weight_se
        Mean of the largest attention weight of a row (1 = one-hot), with its standard error.
    entropy, entropy_se, entropy_fraction
        Mean entropy of a row's weights in nats, its standard error, and ``entropy / log keys``
        (1 = uniform, 0 = one-hot).
    jacobian_norm, jacobian_median
        Mean and median over rows of the Frobenius norm of the softmax Jacobian
        ``diag(p) − p pᵀ``.
    grad_q_norm, grad_q_median
        Mean and median norm of ``∂(g·out)/∂q`` from :func:`qkv.attention_vjp` (values and
        ``g`` ~ N(0, I)). When the softmax saturates the two part ways: most rows get almost
        nothing while the few rows with a near tie get a large gradient, which holds up the mean.
    """

    d: int
    mode: str
    scale: float
    keys: int
    samples: int
    score_std: float
    score_std_theory: float
    mean_max_weight: float
    max_weight_se: float
    entropy: float
    entropy_se: float
    entropy_fraction: float
    jacobian_norm: float
    jacobian_median: float
    grad_q_norm: float
    grad_q_median: float

    def as_dict(self) -> dict[str, Any]:
        """The row as a plain dict (one CSV or JSON record)."""
        return asdict(self)


@dataclass
class ScalingStudy:
    """Rows of the study plus the weight profiles at one ``d`` for the distribution panel.

    ``profiles[mode]`` holds the rank-ordered weights at ``panel_d`` (largest first): their mean
    and 10th/90th percentiles over the query rows, each an array of length ``keys``.
    """

    rows: list[ScalingRow]
    panel_d: int
    profiles: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)

    def row(self, d: int, mode: str) -> ScalingRow:
        """The row for ``(d, mode)``."""
        mode = mode_name(mode)
        for r in self.rows:
            if r.d == d and r.mode == mode:
                return r
        raise KeyError((d, mode))

    def to_json_dict(self) -> dict[str, Any]:
        """``{"rows": [...]}`` with plain floats, ready for :func:`json.dumps`."""
        return {"rows": [r.as_dict() for r in self.rows]}


def _check_dims(dims: Iterable[Any]) -> list[int]:
    try:
        out = [check_int(x, "dims", minimum=1, maximum=1 << 16) for x in dims]
    except TypeError:
        raise InputTypeError(f"dims: expected a sequence of integers, got {dims!r}") from None
    if not out:
        raise InputError("dims: expected at least one feature size d")
    return sorted(set(out))


class _Acc:
    """Per-set sums of the statistics of one ``(d, mode)`` cell."""

    def __init__(self) -> None:
        self.n = 0
        self.sum_s2 = 0.0
        self.count_s = 0
        self.set_max: list[float] = []
        self.set_ent: list[float] = []
        self.sum_max = self.sum_ent = 0.0
        self.jac: list[np.ndarray] = []
        self.grad: list[np.ndarray] = []

    def add(self, z: np.ndarray, p: np.ndarray, dq: np.ndarray) -> None:
        mx, ent = p.max(axis=-1), _entropy(p)  # (sets, rows)
        self.sum_s2 += float(np.sum(z * z))
        self.count_s += z.size
        self.n += mx.size
        self.set_max.extend(mx.mean(axis=-1).tolist())
        self.set_ent.extend(ent.mean(axis=-1).tolist())
        self.sum_max += float(mx.sum())
        self.sum_ent += float(ent.sum())
        self.jac.append(softmax_jacobian_norm(p).ravel())
        self.grad.append(np.linalg.norm(dq, axis=-1).ravel())


def _se(values: list[float]) -> float:
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan


#: The most numbers ``study scaling`` may hold in one array: ``(min(samples, 64) + keys) · d``
#: for the queries and keys of one set, and ``samples · keys`` for the weights it keeps.
MAX_STUDY_NUMBERS = 1 << 25


def _check_size(dims: list[int], keys: int, samples: int) -> None:
    """Refuse, before anything is allocated, a study whose arrays would not fit in memory."""
    if not dims or not (1 <= keys <= 1 << 16 and 1 <= samples <= 1 << 24):
        return  # out of range: the study itself reports these
    d = max(dims)
    per_set = (min(samples, 64) + keys) * d
    if per_set > MAX_STUDY_NUMBERS:
        raise InputError(
            f"dims, keys: one set of queries and keys needs (min(samples, 64) + keys) · d = "
            f"({min(samples, 64)} + {keys}) · {d} = {per_set} numbers, more than "
            f"{MAX_STUDY_NUMBERS} ({MAX_STUDY_NUMBERS * 8 >> 20} MiB); use a smaller d or fewer "
            "keys"
        )
    if samples * keys > MAX_STUDY_NUMBERS:
        raise InputError(
            f"samples, keys: the study keeps samples · keys = {samples} · {keys} = "
            f"{samples * keys} weights, more than {MAX_STUDY_NUMBERS}; use fewer samples or keys"
        )


@near_keywords()
def scaling_study(
    dims: Sequence[int] = DEFAULT_DIMS,
    *,
    keys: int = 64,
    samples: int = 1024,
    seed: int = 0,
    modes: Sequence[str] = MODES,
    panel_d: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> ScalingStudy:
    """Run the Monte Carlo study.

    Parameters
    ----------
    dims : sequence of int
        Feature sizes ``d`` (default 4, 8, …, 4096).
    keys : int
        Keys each query attends (default 64).
    samples : int
        Query rows per ``d`` (default 1024), in sets of up to 64 rows that share keys.
    seed : int
        Seed of :func:`numpy.random.default_rng`; the same seed gives the same table.
    modes : sequence of str
        Any of ``"scaled"`` (÷√d), ``"unscaled"`` (scale 1) and ``"times_sqrt_d"`` (×√d).
    panel_d : int, optional
        The ``d`` whose weight profiles are kept for the distribution panel; default the largest
        ``d`` ≤ 1024 in ``dims`` (else the smallest).
    progress : callable, optional
        Called with the number of query rows done after each chunk (for a progress bar).

    Returns
    -------
    ScalingStudy
        Rows ordered by ``d`` then by mode.
    """
    dims = _check_dims(dims)
    keys = check_int(keys, "keys", minimum=1, maximum=1 << 16)
    samples = check_int(samples, "samples", minimum=2, maximum=1 << 24)
    seed = check_int(seed, "seed", minimum=0)
    modes = list(dict.fromkeys(mode_name(m) for m in modes))
    for m in modes:
        mode_scale(m, 1)
    if not modes:
        raise InputError("modes: expected at least one of " + ", ".join(MODES))
    _check_size(list(dims), keys, samples)
    if panel_d is None:
        small = [d for d in dims if d <= 1024]
        panel_d = small[-1] if small else dims[0]
    elif panel_d not in dims:
        raise InputError(f"panel_d: {panel_d} is not one of dims {dims}")

    rows_per_set = min(QUERIES_PER_SET, samples)
    n_sets = math.ceil(samples / rows_per_set)
    rng = np.random.default_rng(seed)
    rows: list[ScalingRow] = []
    profiles: dict[str, dict[str, np.ndarray]] = {}
    for d in dims:
        accs = {m: _Acc() for m in modes}
        panel: dict[str, list[np.ndarray]] = {m: [] for m in modes}
        per_set = (rows_per_set + keys) * d
        chunk = max(1, min(n_sets, _CHUNK_ELEMS // per_set))
        done = 0
        while done < n_sets:
            c = min(chunk, n_sets - done)
            q = rng.standard_normal((c, rows_per_set, d))
            k = rng.standard_normal((c, keys, d))
            v = rng.standard_normal((c, keys, VALUE_DIM))
            g = rng.standard_normal((c, rows_per_set, VALUE_DIM))
            raw = q @ np.swapaxes(k, -1, -2)
            for m in modes:
                s = mode_scale(m, d)
                z = raw * s
                p = softmax(z)
                dq, _, _ = attention_vjp(q, k, v, g, scale=s)
                accs[m].add(z, p, dq)
                if d == panel_d:
                    panel[m].append(-np.sort(-p.reshape(-1, keys), axis=-1))
            done += c
            if progress is not None:
                progress(c * rows_per_set)
        n = n_sets * rows_per_set
        for m in modes:
            a = accs[m]
            s = mode_scale(m, d)
            jac, grad = np.concatenate(a.jac), np.concatenate(a.grad)
            rows.append(
                ScalingRow(
                    d=d,
                    mode=m,
                    scale=s,
                    keys=keys,
                    samples=n,
                    score_std=math.sqrt(a.sum_s2 / a.count_s),
                    score_std_theory=s * math.sqrt(d),
                    mean_max_weight=a.sum_max / a.n,
                    max_weight_se=_se(a.set_max),
                    entropy=a.sum_ent / a.n,
                    entropy_se=_se(a.set_ent),
                    entropy_fraction=(a.sum_ent / a.n) / math.log(keys) if keys > 1 else 0.0,
                    jacobian_norm=float(np.mean(jac)),
                    jacobian_median=float(np.median(jac)),
                    grad_q_norm=float(np.mean(grad)),
                    grad_q_median=float(np.median(grad)),
                )
            )
            if d == panel_d:
                w = np.concatenate(panel[m])
                profiles[m] = {
                    "mean": w.mean(axis=0),
                    "q10": np.quantile(w, 0.1, axis=0),
                    "q90": np.quantile(w, 0.9, axis=0),
                }
    params = dict(dims=dims, keys=keys, samples=n_sets * rows_per_set, seed=seed, modes=modes)
    return ScalingStudy(rows=rows, panel_d=panel_d, profiles=profiles, params=params)


def total_work(dims: Sequence[int], samples: int) -> int:
    """Query rows the study will process in all (the progress bar's total)."""
    rows_per_set = min(QUERIES_PER_SET, samples)
    return len(set(dims)) * math.ceil(samples / rows_per_set) * rows_per_set

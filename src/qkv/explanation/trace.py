"""Explain attention step by step: :func:`explain` returns a :class:`Trace` of every number.

The trace is built from the library's own pieces — :func:`qkv.validate.make_plan` checks the
arguments, :mod:`qkv.masks` says which keys each query may see, :mod:`qkv.engine.kernels.dense`
computes the raw and scaled scores, the row maxima and the weights, and the final output *is*
:func:`qkv.attention`'s. Nothing here is a second implementation that could drift.

Examples
--------
A worked example, with ``d = 4`` given (it is not ``len(q)``):

>>> import qkv
>>> t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
>>> t.scale.describe()
'1/√d with d = 4 (given; len(q) = 2): 1/√4 = 1/2 = 0.5'
>>> t.scaled.tolist(), t.weights.round(5).tolist(), t.output.round(5).tolist()
([[1.0, 4.0]], [[0.04743, 0.95257]], [[2.90515, 3.90515]])
>>> t.dot_terms(0, 1)
'2·3 + 1·2 = 8'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engine.kernels import dense, dispatch, mods
from ..errors import InputError, InputTypeError
from ..keywords import near_keywords
from ..masks import allowed, exclusion_reasons, query_positions
from ..options import Options
from ..validate import VARIANTS, Plan, as_array, check_variants, make_plan
from .display import fmt
from .document import trace_dict
from .formats import Renderable
from .scale import ScaleInfo, resolve_scale

__all__ = [
    "MAX_CELLS",
    "MAX_WEIGHTED",
    "SECTIONS",
    "STAGES",
    "ScaleInfo",
    "Trace",
    "explain",
    "fmt",
]

#: How far a trace goes, in order: inputs only, pre-softmax scores, weights, output.
STAGES = ("inputs", "scores", "weights", "output")

#: The sections of a rendered trace, in order, by stable key: the title, an overview of the
#: formula and the rules, the inputs, the scale, the weights at a glance (a heatmap), each
#: query row step by step, and the result matrices. Renderers and exercises choose sections by
#: these keys, never by their (English) headings.
SECTIONS = ("title", "overview", "inputs", "scale", "heatmap", "steps", "results")

#: The most query-key pairs ``L·S`` a trace holds: it keeps about eight ``(L, S)`` arrays of
#: every step (1 GiB at this size in float64); compute larger attention with qkv.attention.
MAX_CELLS = 1 << 24

#: The most numbers ``L·S·dv`` :attr:`Trace.weighted` builds at once (128 MiB in float64);
#: :meth:`Trace.weighted_row` gives one row's at any size.
MAX_WEIGHTED = 1 << 24


@dataclass(frozen=True, eq=False)
class Trace(Renderable):
    """Every intermediate number of one attention computation; see :func:`explain`.

    Arrays are 2-D: ``L`` query rows, ``S`` keys (a 1-D ``q`` is one row; ``squeeze`` says
    so). ``stage`` says how far the trace goes (one of :data:`STAGES`); later fields are
    ``None``.

    Attributes
    ----------
    q, k, v : ndarray
        Inputs in the compute dtype, shapes ``(L, d)``, ``(S, d)``, ``(S, dv)``.
    scale : ScaleInfo
    positions : ndarray of int, shape ``(L,)``
        Absolute position of each query row (bottom-right alignment: ``S - L + i``).
    raw : ndarray, ``(L, S)``
        Dot products ``q_i · k_j``.
    scaled : ndarray, ``(L, S)``
        ``raw · scale``, as the kernel computes it.
    bias : ndarray or None, ``(L, S)``
        A float mask added to the scaled scores.
    logits : ndarray, ``(L, S)``
        Scaled scores plus bias, ``-inf`` for excluded keys.
    excluded : ndarray of bool, ``(L, S)``
        Keys a row may not attend; :meth:`reasons` says why.
    exclusions : dict of str to ndarray of bool
        For each rule that applies (``"causal"``, ``"window"``, ``"mask"``, ``"bias"``), the
        ``(L, S)`` cells it excludes.
    row_max, shifted, exps, sums, weights, lse
        The softmax: the subtracted maximum (0 for a row that sees nothing), ``logits - max``,
        ``exp`` of that, its row sum, the weights and the log-sum-exp.
    weighted : ndarray or None, ``(L, S, dv)``
        ``weights[i, j] · v[j]``, computed when read (at most :data:`MAX_WEIGHTED` numbers;
        :meth:`weighted_row` gives one query row's at any size).
    output : ndarray or None, ``(L, dv)``
        Exactly :func:`qkv.attention`'s output (as rows).
    exact : qkv.explanation.exact.ExactSteps or None
        The same steps in exact arithmetic (``exact=True``).
    steps : dict of str to ndarray
        The variants' steps between the scaled scores and the bias, in order, each ``(L, S)``:
        ``"softcap"`` (the soft-capped score ``c · tanh(s / c)``), ``"alibi"`` (the ALiBi bias
        of each key, already added in the next step), ``"score_mod"`` (the user function's
        value). Empty without variants.
    sink, sink_share : float and ndarray ``(L,)``, or None
        The sink's logit and its share of each row's denominator, ``exp(sink − lse)``; the sums
        ``Σ`` then include ``exp(sink − max)``.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray | None
    scale: ScaleInfo
    causal: bool
    window: tuple[int | None, int | None] | None
    mask: np.ndarray | None
    bias: np.ndarray | None
    positions: np.ndarray
    stage: str
    squeeze: bool
    raw: np.ndarray | None = None
    scaled: np.ndarray | None = None
    logits: np.ndarray | None = None
    excluded: np.ndarray | None = None
    exclusions: dict[str, np.ndarray] | None = None
    row_max: np.ndarray | None = None
    shifted: np.ndarray | None = None
    exps: np.ndarray | None = None
    sums: np.ndarray | None = None
    weights: np.ndarray | None = None
    lse: np.ndarray | None = None
    output: np.ndarray | None = None
    steps: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    sink: float | None = None
    sink_share: np.ndarray | None = None
    exact: Any = None
    title: str | None = None
    key_labels: tuple[str, ...] | None = None
    query_labels: tuple[str, ...] | None = None

    # ----- shapes -----
    @property
    def L(self) -> int:
        """The number of query rows."""
        return self.q.shape[0]

    @property
    def S(self) -> int:
        """The number of keys."""
        return self.k.shape[0]

    @property
    def d(self) -> int:
        """The length of a query and key vector (``q.shape[1]``; the scale's ``d`` may differ)."""
        return self.q.shape[1]

    @property
    def dv(self) -> int:
        """The length of a value vector (0 when the trace has no ``v``)."""
        return 0 if self.v is None else self.v.shape[1]

    def reaches(self, stage: str) -> bool:
        """Whether the trace goes at least as far as ``stage``."""
        return STAGES.index(self.stage) >= STAGES.index(stage)

    # ----- the weighted values, built when read -----
    @property
    def weighted(self) -> np.ndarray | None:
        """``weights[i, j] · v[j]`` for every row and key, ``(L, S, dv)``; ``None`` before output.

        Built when read, never stored; refused (:class:`InputError`) above
        :data:`MAX_WEIGHTED` numbers: use :meth:`weighted_row` for large traces.
        """
        if self.output is None or self.v is None:
            return None
        n = self.L * self.S * self.dv
        if n > MAX_WEIGHTED:
            raise InputError(
                f"weighted: L·S·dv = {self.L}·{self.S}·{self.dv} = {n} numbers is more than "
                f"{MAX_WEIGHTED} at once; use weighted_row(i) for one query row"
            )
        assert self.weights is not None  # set whenever the output is
        return self.weights[:, :, None] * self.v[None, :, :]

    def weighted_row(self, i: int) -> np.ndarray:
        """``weights[i, j] · v[j]`` for query row ``i`` and every key ``j``, ``(S, dv)``."""
        if self.output is None or self.v is None:
            raise InputError("weighted_row: the trace does not reach the output (no v)")
        assert self.weights is not None  # set whenever the output is
        return self.weights[i][:, None] * self.v

    # ----- one query row and key, in words -----
    def key_label(self, j: int) -> str:
        """The name of key ``j``: its label, else ``"k{j}"``."""
        return f"k{j}" if self.key_labels is None else self.key_labels[j]

    def query_label(self, i: int) -> str:
        """The name of query row ``i``: its label, else ``"q{i}"``."""
        return f"q{i}" if self.query_labels is None else self.query_labels[i]

    def dot_terms(self, i: int, j: int, max_terms: int = 5) -> str:
        """The dot product ``q_i · k_j`` written out: ``"2·1 + 1·0 = 2"``.

        Long vectors show their first and last terms with a count.
        """
        assert self.raw is not None  # asked only of a trace that reaches the scores
        a, b = self.q[i], self.k[j]

        def f(x: float) -> str:
            return f"({fmt(x)})" if x < 0 else fmt(x)

        terms = [f"{f(x)}·{f(y)}" for x, y in zip(a, b, strict=True)]
        if len(terms) > max_terms:
            terms = terms[: max_terms - 2] + [f"… ({len(a)} terms)"] + terms[-1:]
        return " + ".join(terms) + f" = {fmt(self.raw[i, j])}"

    def reasons(self, i: int, j: int) -> list[str]:
        """The rules that exclude key ``j`` for query row ``i``: ``["causal"]`` and so on."""
        if self.excluded is None or not self.excluded[i, j]:
            return []
        assert self.exclusions is not None  # set together with excluded
        found = [name for name, bad in self.exclusions.items() if bad[i, j]]
        return found or ["score is -inf"]

    def reason_text(self, i: int, j: int) -> str:
        """Why key ``j`` is excluded for query row ``i``, in words (empty if it is not)."""
        p = int(self.positions[i])
        return "; ".join(_rule_in_words(r, p, j, self.window) for r in self.reasons(i, j))

    # ----- copies, data and rendering (render, to_text … come from Renderable) -----
    def replace(self, **changes: Any) -> Trace:
        """A copy with some fields changed (e.g. ``title``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The trace as plain Python objects (see ``docs/trace-schema.md``); JSON serialises it."""
        return trace_dict(self)

    def __repr__(self) -> str:
        return (
            f"<qkv.Trace stage={self.stage!r} L={self.L} S={self.S} d={self.d} dv={self.dv} "
            f"scale={fmt(self.scale.value)}{' exact' if self.exact is not None else ''}>"
        )


@near_keywords(VARIANTS)
def explain(
    q: Any,
    k: Any,
    v: Any = None,
    *,
    d: int | None = None,
    scale: float | str | None = None,
    causal: bool = False,
    mask: Any = None,
    window: Any = None,
    exact: bool = False,
    stop_at: str | None = None,
    title: str | None = None,
    key_labels: Any = None,
    query_labels: Any = None,
    **variants: Any,
) -> Trace:
    """Compute attention and record every intermediate number.

    Parameters
    ----------
    q : array_like, shape ``(L, d)`` or ``(d,)``
        Queries (one sequence; pick a head with indexing first).
    k : array_like, shape ``(S, d)``
        Keys.
    v : array_like, shape ``(S, dv)``, optional
        Values. Without ``v`` the trace stops at the weights.
    d : int, optional
        Sets the scale to ``1/√d``; it need not be ``len(q)`` (the worked example
        ``q = [2, 1]`` uses ``d = 4`` with 2-vectors). An alternative to ``scale``.
    scale : float or str, optional
        A number, or an expression in ``d`` such as ``"sqrt(d)"`` (multiplying by √d instead
        of dividing, a common slip) or ``"1/sqrt(d)"`` (the default); ``d`` is then the given
        ``d`` or ``len(q)``. Giving ``d`` with a scale that does not use ``d`` is an error.
    causal, mask, window
        As in :func:`qkv.attention` (causal is bottom-right aligned).
    exact : bool, optional
        Also compute every step exactly with SymPy (the ``exact`` extra): integers and
        rationals stay exact, square roots symbolic, weights in closed form. Float inputs are
        read as the decimals they print as (``0.1`` is ``1/10``).
    stop_at : {"inputs", "scores", "weights", "output"}, optional
        Stop the trace early (``"scores"``: pre-softmax scores only).
    **variants
        ``softcap``, ``sinks``, ``alibi_slopes``, ``score_mod``, ``mask_mod`` as in
        :func:`qkv.attention` (one head: ``sinks`` and ``alibi_slopes`` are single numbers).
        The trace shows each one's step (:attr:`Trace.steps`, :attr:`Trace.sink_share`).
    title : str, optional
        A heading for rendered output (escaped by every renderer).
    key_labels, query_labels : sequence of str, optional
        One name per key (per query row), shown by the renderers in place of ``k0, k1, …``
        (``q0, q1, …``): the tokens of a sentence, for instance.

    Returns
    -------
    Trace

    Raises
    ------
    InputError
        For bad input, naming the argument and shapes (as :func:`qkv.attention`).

    Examples
    --------
    >>> import qkv
    >>> t = qkv.explain([2, 1], [[1, 0], [3, 2]], d=4)
    >>> t.stage, t.raw.tolist(), t.scaled.tolist()
    ('weights', [[2.0, 8.0]], [[1.0, 4.0]])
    >>> t = qkv.explain([2, 1], [[1, 0], [3, 2]], d=4, softcap=2.0, sinks=0.0)
    >>> t.steps["softcap"].round(4).tolist(), t.sink_share.round(4).tolist()
    ([[0.9242, 1.9281]], [0.0962])
    >>> qkv.explain([2, 1], [[1, 0], [3, 2]], d=4, scale="sqrt(d)").scaled.tolist()
    [[4.0, 16.0]]
    >>> qkv.explain([2, 1], [[1, 0], [3, 2]], d=4, key_labels=["cat", "sat"]).key_label(1)
    'sat'
    """
    stage = _stage(stop_at, v)
    if title is not None and not isinstance(title, str):
        raise InputTypeError(f"title: expected a string, got {type(title).__name__}")
    check_variants("explain", variants)
    qa = as_array(q, "q")
    info = resolve_scale(scale, d, qa.shape[-1] if qa.ndim >= 1 else 0)
    options = Options(info.value, causal, mask, window, **variants)
    plan = make_plan(q, k, v, options, need_v=v is not None)
    _check_explainable(plan, exact, variants, qa, k, v)

    shown = _as_given(plan, mask)
    fields = _input_fields(shown, info, stage, title, key_labels, query_labels)
    if stage != "inputs":
        fields.update(_score_fields(shown, info))
    if stage in ("weights", "output"):
        fields.update(_softmax_fields(shown, fields))
    if stage == "output":
        with np.errstate(over="ignore"):  # shifts past the float range are -inf: weight 0
            out, _ = dispatch.attend(plan)  # qkv.attention's engine, on the same checked plan
        fields["output"] = out.astype(plan.out_dtype, copy=False).reshape(plan.L, plan.dv)
    trace = Trace(**fields)
    if exact:
        from .exact import exact_steps  # SymPy: imported only when asked for

        trace = trace.replace(exact=exact_steps(trace, q, k, v))
    return trace


# ----- the steps of explain, in order -----


def _stage(stop_at: str | None, v: Any) -> str:
    """How far the trace goes: ``stop_at``, else the output (with ``v``) or the weights."""
    if stop_at is not None and stop_at not in STAGES:
        raise InputError(f"stop_at: expected one of {', '.join(STAGES)}, got {stop_at!r}")
    stage = stop_at or ("output" if v is not None else "weights")
    if stage == "output" and v is None:
        raise InputError("v: required to explain the output (or stop_at='weights')")
    return stage


def _as_given(plan: Plan, mask: Any) -> Plan:
    """``plan`` with its mask in the form the caller gave it: the checked plan reads a float
    mask of only ``0`` and ``-inf`` as booleans (one plan for both forms), but a learner who
    wrote a bias sees a bias, excluded keys ``"bias is -inf"``."""
    if plan.mask is None or mask is None:
        return plan
    dt = getattr(mask, "dtype", None)
    floating = getattr(dt, "is_floating_point", None)  # a tensor's dtype
    if not isinstance(floating, bool):
        floating = (np.asarray(mask) if dt is None else np.empty(0, dt)).dtype.kind == "f"
    if not floating:
        return plan
    bias = np.where(plan.mask, 0.0, -np.inf).astype(plan.acc_dtype)
    return dataclasses.replace(plan, mask=None, bias=bias, key_counts=None)


def _check_explainable(
    plan: Plan, exact: bool, variants: dict[str, Any], qa: np.ndarray, k: Any, v: Any
) -> None:
    """A trace is of one sequence and one head, small enough to keep every step."""
    if exact and (plan.modded or plan.sinks is not None):
        raise InputError(f"exact: not available with {', '.join(sorted(variants))}")
    if plan.batch != ():
        raise InputError(
            "q, k, v: explain takes one sequence: q (L, d) or (d,), k (S, d), v (S, dv); "
            f"got q {np.shape(qa)}, k {np.shape(as_array(k, 'k'))}"
            + ("" if v is None else f", v {np.shape(as_array(v, 'v'))}")
            + " — pick one batch element and head with indexing first"
        )
    L, S = plan.L, plan.S
    if L * S > MAX_CELLS:
        raise InputError(
            f"q, k: explain keeps every step for each query-key pair, and L·S = {L}·{S} = "
            f"{L * S} is more than {MAX_CELLS}; explain fewer rows or keys (slice q and k), "
            "or compute with qkv.attention"
        )


def _input_fields(
    plan: Plan,
    info: ScaleInfo,
    stage: str,
    title: str | None,
    key_labels: Any,
    query_labels: Any,
) -> dict[str, Any]:
    """The inputs as the kernels see them (2-D, compute dtype), the masks and the labels."""
    L, S = plan.L, plan.S
    return dict(
        q=plan.q,
        k=plan.k,
        v=plan.v,
        scale=info,
        causal=plan.causal,
        window=plan.window,
        mask=None if plan.mask is None else np.broadcast_to(plan.mask, (L, S)),
        bias=None if plan.bias is None else np.broadcast_to(plan.bias, (L, S)),
        positions=query_positions(L, S),
        stage=stage,
        squeeze=plan.squeeze,
        title=title,
        key_labels=_labels(key_labels, S, "key_labels", "keys"),
        query_labels=_labels(query_labels, L, "query_labels", "query rows"),
    )


def _score_fields(plan: Plan, info: ScaleInfo) -> dict[str, Any]:
    """The raw and scaled dot products (the dense kernel's) and the variants' steps."""
    with np.errstate(over="ignore", invalid="ignore"):
        raw = dense.raw_scores(dataclasses.replace(plan, scale=1.0))
        scaled = dense.raw_scores(plan)
    _check_scores_finite(raw, scaled, info.value)
    return dict(raw=raw, scaled=scaled, steps=_variant_steps(plan, scaled))


def _softmax_fields(plan: Plan, fields: dict[str, Any]) -> dict[str, Any]:
    """The logits, which keys are excluded and why, and every step of the softmax."""
    with np.errstate(over="ignore", invalid="ignore"):
        logits = dense.logits(plan)
    if np.isnan(logits).any() or np.isposinf(logits).any():
        i, j = (int(x) for x in np.argwhere(np.isnan(logits) | np.isposinf(logits))[0])
        raise InputError(
            f"q, k, mask: the score plus bias of query row {i} and key {j} overflows "
            f"({fmt(fields['scaled'][i, j])} + bias), so attention would be NaN"
        )
    out: dict[str, Any] = {}
    m = dense.row_max(logits.copy())
    with np.errstate(over="ignore"):  # a shift past the float range is -inf: weight 0
        shifted = logits - m
        exps = np.exp(shifted)
        sums = np.sum(exps, axis=-1)
        weights, lse = dense.softmax_rows(logits.copy())
        if plan.sinks is not None:  # the sink joins every row's denominator
            sink = float(plan.sinks)
            share, lse = mods.sink_factor(plan, lse)
            weights *= share[:, None]
            sums = sums + np.exp(sink - m[:, 0])
            out.update(sink=sink, sink_share=np.exp(sink - lse))
    out.update(
        logits=logits,
        excluded=logits == -np.inf,
        exclusions=_exclusions(plan, fields["mask"], fields["bias"]),
        row_max=m[:, 0],
        shifted=shifted,
        exps=exps,
        sums=sums,
        weights=weights,
        lse=lse,
    )
    return out


def _rule_in_words(rule: str, p: int, j: int, window: Any) -> str:
    """One rule that excludes key ``j`` for the query at position ``p``, in words."""
    if rule in ("causal", "window"):  # worded by the module that owns the rule
        causal, win = rule == "causal", window if rule == "window" else None
        return "; ".join(exclusion_reasons(p, j, causal, win))
    fixed = {"mask": "mask is False", "bias": "bias is -inf", "mask_mod": "mask_mod is False"}
    return fixed.get(rule, rule)


def _labels(labels: Any, n: int, name: str, what: str) -> tuple[str, ...] | None:
    if labels is None:
        return None
    if isinstance(labels, str) or not all(isinstance(x, str) for x in labels):
        raise InputTypeError(f"{name}: expected a sequence of strings, one per {what[:-1]}")
    labels = tuple(labels)
    if len(labels) != n:
        raise InputError(f"{name}: expected {n} labels (one per {what[:-1]}), got {len(labels)}")
    return labels


def _check_scores_finite(raw: np.ndarray, scaled: np.ndarray, scale: float) -> None:
    """Refuse scores that overflow: every later step (and the output) would be NaN."""
    bad = ~np.isfinite(scaled)
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise InputError(
            f"q, k: the score of query row {i} and key {j} overflows float{scaled.itemsize * 8} "
            f"(q·k = {fmt(raw[i, j])}, scale = {fmt(scale)}), so attention would be NaN; "
            "divide q or k (or the scale) by a constant first"
        )


def _exclusions(
    plan: Plan, mask: np.ndarray | None, bias: np.ndarray | None
) -> dict[str, np.ndarray]:
    L, S = plan.L, plan.S
    parts = {}
    if plan.causal:
        seen = allowed(L, S, causal=True)
        assert seen is not None  # None only without causal and window
        parts["causal"] = ~seen
    if plan.window is not None:
        seen = allowed(L, S, window=plan.window)
        assert seen is not None  # a checked window is never (None, None)
        parts["window"] = ~seen
    if mask is not None:
        parts["mask"] = ~mask
    if bias is not None:
        parts["bias"] = bias == -np.inf
    if plan.mask_mod is not None:
        keep = plan.mask_mod(0, 0, query_positions(L, S)[:, None], np.arange(S)[None, :])
        parts["mask_mod"] = ~np.broadcast_to(np.asarray(keep, dtype=bool), (L, S))
    return parts


def _variant_steps(plan: Plan, scaled: np.ndarray) -> dict[str, np.ndarray]:
    """The soft-capped scores, the ALiBi bias per key and the score_mod's value, in order —
    each step computed by the kernels' own hook (:func:`qkv.engine.kernels.mods.apply`)."""
    steps: dict[str, np.ndarray] = {}
    p, j = query_positions(plan.L, plan.S)[:, None], np.arange(plan.S)[None, :]
    bare = dataclasses.replace(plan, alibi=None, score_mod=None, mask_mod=None)
    if plan.softcap is not None:
        steps["softcap"] = mods.apply(bare, scaled.copy(), ..., p, j)
    s = steps.get("softcap", scaled)
    if plan.alibi is not None:
        zero = np.zeros_like(scaled)
        steps["alibi"] = mods.apply(
            dataclasses.replace(bare, softcap=None, alibi=plan.alibi), zero, ..., p, j
        )
        s = s + steps["alibi"]
    if plan.score_mod is not None:
        only = dataclasses.replace(bare, softcap=None, score_mod=plan.score_mod)
        steps["score_mod"] = mods.apply(only, s.copy(), ..., p, j)
    return steps

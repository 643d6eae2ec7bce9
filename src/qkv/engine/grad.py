"""Gradients of attention: the vector-Jacobian product of :func:`qkv.attention`.

With ``Z = q kᵀ · scale + bias`` (``-inf`` where masked), ``P = softmax(Z)`` and ``O = P v``,
the gradients for an upstream gradient ``dO`` are::

    dv = Pᵀ dO
    dP = dO vᵀ
    dZ = P ∘ (dP − rowsum(dO ∘ O))      # the softmax Jacobian applied row by row
    dq = dZ k · scale
    dk = dZᵀ q · scale

Variants: with ``softcap`` the raw scaled scores ``s`` pass through ``c · tanh(s / c)``, so
``dZ`` is multiplied by ``1 − tanh²(s / c)`` before ``dq`` and ``dk``. ALiBi and ``mask_mod`` are
constants. With ``sinks`` (``P`` then sums to ``1 − P_sink`` per row, ``P_sink = exp(sink −
lse)``) the formulas above hold unchanged, and ``dsink = − Σ_rows P_sink · rowsum(dO ∘ O)``,
returned as a fourth array. A ``score_mod`` has no derivative qkv could know: the VJP refuses it.

Masked keys have ``P = 0`` and so get no gradient; a row that may attend nothing has ``P = 0``
throughout and contributes nothing. Grouped query heads add their contributions into the kv
head they share, and leading dimensions that were broadcast are summed back, so every gradient
has the shape of its input.

Versions: :func:`attention_vjp`, the fast path (the dense kernel's weights, grouped heads
served without repeating ``k`` and ``v``, compute dtype as the forward pass) — or, given the
forward pass's ``out`` and ``lse`` or a ``block`` size, the tiled FlashAttention-2 backward of
:mod:`qkv.engine.kernels.tiled_backward`, which recomputes the weights tile by tile from ``lse`` in
O(block²) extra memory; and :func:`reference_attention_vjp`, the formulas above in float64 on
weights from :mod:`qkv.reference`, kv heads repeated literally, the oracle both are tested
against.

Examples
--------
>>> import qkv
>>> q, k, v = [2.0, 1.0], [[1.0, 0.0], [3.0, 2.0]], [[1.0], [3.0]]
>>> dq, dk, dv = qkv.attention_vjp(q, k, v, [1.0], scale=1 / 2)   # d = 4
>>> dv.round(4).tolist()                       # the attention weights, seen from the values
[[0.0474], [0.9526]]
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from .. import numerics, reference
from ..checks import check_int
from ..errors import InputError
from ..keywords import near_keywords
from ..options import Options
from ..validate import VARIANTS, Plan, as_array, broadcasts_to, check_variants, make_plan
from .kernels import dense, dispatch, mods, tiled
from .kernels.blocks import heads_by_kv

__all__ = [
    "attention_vjp",
    "reference_attention_vjp",
    "scores_vjp",
    "sum_to",
    "vjp",
    "weights_vjp",
]


def sum_to(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``g`` over the dimensions that broadcasting added to an array of ``shape``."""
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(
        i for i, (n, m) in enumerate(zip(shape, g.shape, strict=True)) if n == 1 and m != 1
    )
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def _grad_out(grad_out: Any, plan: Plan) -> np.ndarray:
    """``grad_out`` checked against the output's shape, as ``(*batch, L, dv)``: in the compute
    dtype, or bfloat16 as given for a plan whose bfloat16 K/V are stored (the bfloat16
    backward reads it so)."""
    g = as_array(grad_out, "grad_out", narrow=plan.stored is not None)
    out_shape = plan.batch + ((plan.dv,) if plan.squeeze else (plan.L, plan.dv))
    assert plan.v is not None  # gradients of attention: the plan carries values
    if not broadcasts_to(g.shape, out_shape):
        raise InputError(
            f"grad_out: shape {g.shape} does not broadcast to the output's shape {out_shape} "
            f"(q {plan.q.shape}, k {plan.k.shape}, v {plan.v.shape} after broadcasting)"
        )
    if g.dtype.name != "bfloat16":
        g = g.astype(plan.acc_dtype, copy=False)
    g = np.broadcast_to(g, out_shape)
    return g[..., None, :] if plan.squeeze else g


def _finish(grads: tuple[np.ndarray, ...], plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reduce broadcast dims, restore the inputs' shapes (1-D q) and dtypes as given."""
    res = [
        sum_to(g, shape).astype(dtype, copy=False)
        for g, (dtype, shape) in zip(grads, plan.given, strict=False)
    ]
    if plan.squeeze:
        res[0] = res[0][0]
    return tuple(res)  # type: ignore[return-value]


def _qk_grads(plan: Plan, dz: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``dq, dk`` (broadcast shapes) from the gradient ``dz`` of the scaled scores."""
    g = plan.group
    dz = heads_by_kv(dz * plan.acc_dtype.type(plan.scale), g)
    dq = (dz @ plan.k).reshape(plan.q.shape)
    dk = np.swapaxes(dz, -1, -2) @ heads_by_kv(plan.q, g)
    return dq, dk


def scores_vjp(plan: Plan, grad: Any) -> tuple[np.ndarray, np.ndarray]:
    """``dq, dk`` of ``sum(scores(q, k) * grad)`` for a checked plan (shapes as given)."""
    g = _grad_like(grad, plan, plan.S)
    dq, dk = _qk_grads(plan, g)
    # _finish returns as many gradients as it is given: two here
    return cast(tuple[np.ndarray, np.ndarray], _finish((dq, dk), plan))


def weights_vjp(plan: Plan, weights: np.ndarray, grad: Any) -> tuple[np.ndarray, ...]:
    """``dq, dk`` (and ``dsinks``) of ``sum(attention_weights(q, k) * grad)``.

    ``weights`` are the forward pass's (compute dtype, ``(*batch, L, S)``, sinks included):
    with ``w`` the softmax over the keys and the sink, ``dz = w ∘ (g − rowsum(g ∘ w))`` and
    ``dsink = −(1 − rowsum(w)) · rowsum(g ∘ w)``.
    """
    g = _grad_like(grad, plan, plan.S)
    delta = np.sum(g * weights, axis=-1, keepdims=True)
    dz = weights * (g - delta)
    if plan.softcap is not None:
        dz *= mods.cap_slope(dense.raw_scores(plan), plan.softcap)
    dq, dk = _qk_grads(plan, dz)
    grads = _finish((dq, dk), plan)
    if plan.sinks is None:
        return grads
    p_sink = 1 - np.sum(weights, axis=-1)
    dsinks = -np.sum(p_sink * delta[..., 0], axis=-1)
    return (*grads, _sinks_shaped(dsinks, plan))


def _grad_like(grad: Any, plan: Plan, n: int) -> np.ndarray:
    """An upstream gradient of shape ``(*batch, L, n)`` (``(*batch, n)`` for a 1-D ``q``)."""
    g = np.asarray(grad, dtype=plan.acc_dtype)
    return g[..., None, :] if plan.squeeze else g


@near_keywords(VARIANTS)
def attention_vjp(
    q: Any,
    k: Any,
    v: Any,
    grad_out: Any,
    *,
    scale: Any = None,
    causal: bool = False,
    mask: Any = None,
    window: Any = None,
    out: Any = None,
    lse: Any = None,
    block: int | None = None,
    **variants: Any,
) -> tuple[np.ndarray, ...]:
    """Gradients of ``sum(attention(q, k, v) * grad_out)`` with respect to ``q``, ``k``, ``v``.

    Must equal :func:`reference_attention_vjp` (and the finite differences of
    :func:`qkv.reference.attention`).

    Parameters
    ----------
    q, k, v, scale, causal, mask, window
        As in :func:`qkv.attention`, with the same semantics. A float ``mask`` is a bias and
        gets no gradient.
    grad_out : array_like
        The upstream gradient, broadcastable to the output's shape ``(..., L, dv)`` (``(dv,)``
        for a 1-D ``q``).
    out, lse : array_like, optional
        The forward pass's output and log-sum-exp, as returned by
        ``qkv.attention(..., return_lse=True)``. Given together, they select the tiled backward
        (FlashAttention-2 style), which recomputes the weights tile by tile from ``lse`` and
        never holds the ``L × S`` matrix.
    block : int, optional
        Tile size (queries and keys) of the tiled backward; selects it even without ``out`` and
        ``lse``, which are then recomputed tile by tile. Default: the dense path, or 128 when
        ``out`` and ``lse`` are given.
    **variants
        ``softcap``, ``sinks``, ``alibi_slopes``, ``mask_mod`` as in :func:`qkv.attention`
        (``score_mod`` is refused: its derivative is unknown). ``out`` and ``lse`` given with
        sinks must be the forward pass's with the same sinks.

    Returns
    -------
    dq, dk, dv : ndarray
        The shapes and dtypes of ``q``, ``k`` and ``v`` as given (ints and lists give float64).
        Query heads that share a kv head add into it; broadcast dimensions are summed back.
        Keys a row may not attend get nothing from it; a row that may attend no key gives
        zeros everywhere.
    dsinks : ndarray
        Only when ``sinks`` is given: the gradient with respect to the sinks, in their shape.

    Examples
    --------
    The worked example's query against two keys with ``d = 4``: the gradient pulls ``q`` towards the
    key whose value is larger.

    >>> import qkv
    >>> q, k, v = [2.0, 1.0], [[1.0, 0.0], [3.0, 2.0]], [[1.0], [3.0]]
    >>> dq, dk, dv = qkv.attention_vjp(q, k, v, [1.0], scale=0.5)
    >>> dq.round(4).tolist(), dv.round(4).tolist()
    ([0.0904, 0.0904], [[0.0474], [0.9526]])
    """
    if variants:
        check_variants("attention_vjp", variants)
    options = Options(scale, causal, mask, window, **variants)
    plan = make_plan(q, k, v, options)
    if plan.score_mod is not None:
        raise InputError(
            "score_mod: attention_vjp cannot differentiate a user function; use the torch "
            "bridge's own autograd on PyTorch's attention, or express it with alibi_slopes/mask"
        )
    return vjp(plan, grad_out, out=out, lse=lse, block=block)


def vjp(
    plan: Plan,
    grad_out: Any,
    *,
    grad_lse: Any = None,
    out: Any = None,
    lse: Any = None,
    block: Any = None,
) -> tuple[np.ndarray, ...]:
    """:func:`attention_vjp` for a checked plan (no ``score_mod``): nothing is checked again
    but ``grad_out``, ``out``, ``lse`` and ``block``.

    ``grad_lse`` (dense path only), an upstream gradient of the log-sum-exp ``(*batch, L)``:
    ``∂lse/∂z = p``, so it joins as ``dz = p ∘ (dP − δ + g_lse)``, i.e. ``δ`` less ``g_lse``
    (how a merge of partial results passes gradients back through each part's lse).
    """
    if out is not None or lse is not None or block is not None:
        return _tiled(plan, grad_out, out, lse, block)
    plan = plan.materialized()  # the dense path reads K/V as arrays of the compute dtype
    dq, dk, dv, delta, lse_all = _guarded(
        plan, _grad_out(grad_out, plan), lambda p, g: _dense(p, g, grad_lse)
    )
    grads = _finish((dq, dk, dv), plan)
    if plan.sinks is None:
        return grads
    delta = delta.reshape(plan.batch + (plan.L,))
    return (*grads, _dsinks(plan, lse_all, delta))


def _guarded(plan: Plan, d_out: np.ndarray, run: Any) -> tuple[Any, ...]:
    """``run(plan, d_out)`` (its first three results the gradients) on the forward pass's
    overflow ladder (:func:`qkv.numerics.ladder`): in float64 when the scale is
    not a normal number of the compute dtype or the scores overflowed it; refused when they
    overflow float64 too. NaN and infinity in the inputs propagate by policy."""

    def finite(res: tuple[Any, ...]) -> bool:
        return all(np.isfinite(x).all() for x in res[:3])

    def run_on(p: Plan) -> tuple[Any, ...]:  # d_out in the plan's compute dtype
        return run(p, d_out if p is plan else d_out.astype(p.acc_dtype))

    return numerics.ladder(plan, run_on, finite, whole=plan.materialized)


def _dense(
    plan: Plan, d_out: np.ndarray, grad_lse: Any = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``(dq, dk, dv, delta, lse)`` by the dense weights: ``dq`` ``(*batch, L, d)``, ``dk``
    and ``dv`` in the kv heads' broadcast shapes, ``delta = rowsum(dO ∘ O)`` and the lse with
    the sinks (``None`` without them)."""
    g = plan.group
    d_out = heads_by_kv(d_out, g)  # (*kv_batch, g·L, dv)
    lse_all = None
    p, lse_keys = dense.softmax_rows(dense.logits(plan))  # (*batch, L, S)
    if plan.sinks is not None:
        share, lse_all = mods.sink_factor(plan, lse_keys)
        p *= share[..., None]
    p = heads_by_kv(p, g)
    qm = heads_by_kv(plan.q, g)
    dv = np.swapaxes(p, -1, -2) @ d_out
    assert plan.v is not None  # gradients of attention: the plan carries values
    dp = d_out @ np.swapaxes(plan.v, -1, -2)
    delta = np.sum(dp * p, axis=-1, keepdims=True)  # = rowsum(dO ∘ O)
    if grad_lse is not None:
        gl = np.broadcast_to(np.asarray(grad_lse, dtype=plan.acc_dtype), plan.batch + (plan.L,))
        delta = delta - heads_by_kv(gl[..., None], g)
    dz = p * (dp - delta)
    if plan.softcap is not None:
        dz *= heads_by_kv(mods.cap_slope(dense.raw_scores(plan), plan.softcap), g)
    dz *= plan.acc_dtype.type(plan.scale)
    dq = (dz @ plan.k).reshape(plan.q.shape)
    dk = np.swapaxes(dz, -1, -2) @ qm
    return dq, dk, dv, delta, lse_all


def _dsinks(plan: Plan, lse: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """``− Σ_rows exp(sink − lse) · δ``, summed back to the shape the sinks were given in."""
    assert plan.sinks is not None  # called only for a plan with sinks
    p_sink = np.exp(plan.sinks[..., None] - lse)
    return _sinks_shaped(-np.sum(p_sink * delta, axis=-1), plan)


def _sinks_shaped(g: np.ndarray, plan: Plan) -> np.ndarray:
    """A gradient over the query heads in the shape and dtype the sinks were given in."""
    dtype, shape = plan.given[3]
    if not plan.batch:
        return np.asarray(g, dtype=dtype).reshape(shape)
    return sum_to(g, shape).astype(dtype, copy=False)


def _tiled(plan: Plan, grad_out: Any, out: Any, lse: Any, block: Any) -> tuple[np.ndarray, ...]:
    """Check ``out``, ``lse`` and ``block``, then run the tiled backward."""
    if block is None:
        block = 128
    block = check_int(block, "block", minimum=1)
    d_out = _grad_out(grad_out, plan)
    if (out is None) != (lse is None):
        raise InputError("out, lse: give both (from attention(..., return_lse=True)) or neither")
    o = m = None
    if out is not None:
        o, m = as_array(out, "out", narrow=plan.stored is not None), as_array(lse, "lse")
        want_o = plan.batch + ((plan.dv,) if plan.squeeze else (plan.L, plan.dv))
        want_m = plan.batch + (() if plan.squeeze else (plan.L,))
        for name, a, want in (("out", o, want_o), ("lse", m, want_m)):
            if a.shape != want:
                raise InputError(
                    f"{name}: expected shape {want} (the forward pass's), got {a.shape}"
                )
        if o.dtype.name != "bfloat16":  # the bfloat16 backward takes delta from it as given
            o = o.astype(plan.acc_dtype, copy=False)
        m = m.astype(plan.acc_dtype, copy=False)
        if plan.squeeze:
            o, m = o[..., None, :], m[..., None]

    def run(p: Plan, g: np.ndarray) -> tuple[np.ndarray, ...]:
        """Gradients, then the ``out`` and ``lse`` they used: the caller's, or recomputed (in
        a float64 retry always: the caller's were rounded to the compute dtype)."""
        if o is not None and p is plan:
            o_, m_ = o, m
            assert m_ is not None  # out and lse are given together
        else:
            blocks = {"block_q": int(block), "block_k": int(block)}
            o_, m_ = mods.with_sinks(p, *tiled.attend(p.materialized(), **blocks))
        return (*dispatch.backward(p, g, o_, m_, int(block)), o_, m_)

    dq, dk, dv, o_used, m_used = _guarded(plan, d_out, run)
    grads = _finish((dq, dk, dv), plan)
    if plan.sinks is None:
        return grads
    delta = np.sum(d_out.astype(plan.acc_dtype) * o_used, axis=-1)
    return (*grads, _dsinks(plan, m_used, delta))


@near_keywords(VARIANTS)
def reference_attention_vjp(
    q: Any, k: Any, v: Any, grad_out: Any, **options: Any
) -> tuple[np.ndarray, ...]:
    """The vector-Jacobian product of :func:`qkv.reference.attention`, literally, in float64.

    Weights from :func:`qkv.reference.attention_weights`; kv heads repeated for grouped-query
    attention and their gradients summed back per kv head. Same arguments and returns as
    :func:`attention_vjp` (``options``: ``scale``, ``causal``, ``mask``, ``window`` and the
    variants; no ``out``, ``lse`` or ``block``), except that every result is float64.

    Examples
    --------
    >>> from qkv.engine.grad import reference_attention_vjp
    >>> dq, dk, dv = reference_attention_vjp([2, 1], [[1, 0], [3, 2]], [[1], [3]], [1], scale=0.5)
    >>> dk.round(4).tolist()
    [[-0.0904, -0.0452], [0.0904, 0.0452]]
    """
    opts = Options(**options)
    plan = make_plan(q, k, v, opts, dtype=np.float64)
    if plan.score_mod is not None:
        raise InputError("score_mod: its derivative is unknown, so there is no VJP")
    # the reference's own functions, on the checked arrays with the same options
    same = opts.replace(scale=plan.scale).keywords()
    d_out = _grad_out(grad_out, plan)
    assert plan.v is not None  # gradients of attention: the plan carries values
    kr, vr = plan.k, plan.v
    if plan.group > 1:
        kr, vr = np.repeat(kr, plan.group, axis=-3), np.repeat(vr, plan.group, axis=-3)
    w = reference.attention_weights(plan.q, kr, **same)
    dvr = np.swapaxes(w, -1, -2) @ d_out
    dp = d_out @ np.swapaxes(vr, -1, -2)
    delta = np.sum(dp * w, axis=-1, keepdims=True)  # rowsum(dO ∘ O)
    dz = w * (dp - delta) * plan.scale
    if plan.softcap is not None:  # d/ds of c · tanh(s / c)
        dz = dz * (1 - np.tanh((plan.q @ np.swapaxes(kr, -1, -2)) * plan.scale / plan.softcap) ** 2)
    dq = dz @ kr
    dkr = np.swapaxes(dz, -1, -2) @ plan.q

    def unrepeat(x: np.ndarray) -> np.ndarray:
        if plan.group == 1:
            return x
        *rest, hq, m, n = x.shape
        return x.reshape(*rest, hq // plan.group, plan.group, m, n).sum(axis=-3)

    res: tuple[np.ndarray, ...] = _finish((dq, unrepeat(dkr), unrepeat(dvr)), plan)
    res = tuple(r.astype(np.float64) for r in res)
    if plan.sinks is None:
        return res
    _, lse = reference.attention(plan.q, kr, vr, return_lse=True, **same)
    lse = lse[..., None, :] if plan.squeeze and lse.ndim == len(plan.batch) else lse
    p_sink = np.exp(plan.sinks[..., None] - lse.reshape(plan.batch + (plan.L,)))
    dsinks = -np.sum(p_sink * delta[..., 0], axis=-1)
    return (*res, sum_to(dsinks, as_array(opts.sinks, "sinks").shape).astype(np.float64))

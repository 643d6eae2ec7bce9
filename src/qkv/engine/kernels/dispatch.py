"""Run the kernel the router picks for a checked plan, or the one the caller forces.

Which kernel runs is decided in one place, :mod:`qkv.engine.kernels.router` (one ordered
table of kernels with their conditions); this module runs its choice, with the overflow
retries every kernel shares. The kernel families ``kernel=`` names:

- ``"dense"``: the whole score matrix at once; fastest while ``L · S`` is small, and for a
  few queries against a K/V small enough to sit in the caches.
- ``"decode"``: few queries against a large K/V; memory-bound, streams K and V once, splits
  the keys over the cores when batch × heads are too few.
- ``"tiled"``: online-softmax prefill over tiles; ``O(tile · S)`` extra memory.

``"auto"`` (the default) lets the router choose among them and their native versions; the
others force the family's NumPy kernel, for tests and benchmarks. Every kernel returns
``(out, lse)`` in the plan's compute dtype and equals the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ... import numerics
from ...errors import InputError, InputTypeError
from ...validate import Plan
from . import (
    causal_rows,
    decode,
    dense,
    key_counts,
    mods,
    native,
    native_bf16,
    native_decode,
    packed,
    router,
    stacked,
    tiled,
    tiled_backward,
)
from .native_lib import Kept
from .router import (
    DECODE_MAX_L,
    DECODE_MIN_BYTES,
    DENSE_MAX_SCORES,
    KERNELS,
    TEAM_DECODE_MIN_BYTES,
    kv_bytes,
)

__all__ = [
    "DECODE_MAX_L",
    "DECODE_MIN_BYTES",
    "DENSE_MAX_SCORES",
    "KERNELS",
    "TEAM_DECODE_MIN_BYTES",
    "attend",
    "attend_many",
    "backward",
    "check_kernel",
    "Choice",
    "choose",
    "keep",
    "keep_counted",
    "keep_masked",
    "kv_bytes",
    "weights",
]


def check_kernel(kernel: Any) -> str:
    """Validate a ``kernel=`` argument (one of :data:`KERNELS`)."""
    if not isinstance(kernel, str):
        raise InputTypeError(f"kernel: expected one of {KERNELS}, got {type(kernel).__name__}")
    if kernel not in KERNELS:
        raise InputError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    return kernel


Runner = Callable[[Plan], Any]


class Choice(NamedTuple):
    """The kernel a plan runs on, and the sizes it was chosen by (:func:`choose`).

    Attributes
    ----------
    name : str
        ``"dense"``, ``"tiled"`` or ``"decode"`` (the family, as ``kernel=`` names it).
    run : callable
        Computes ``(out, lse)`` of the plan (a row of the router's table that reads stored
        K/V gives None where its result is not finite: the general road then runs).
    kv_bytes : int
        The bytes of K and V in the compute dtype (:func:`kv_bytes`).
    scores : int
        ``L · S``, the scores per head.
    first : callable or None
        A shorter road tried before ``run``: it gives a finite ``(out, lse)`` or None (then
        ``run`` and the overflow retries follow). The dense kernel's for a problem whose rows
        all see every key, with no variant (:func:`dense.attend_plain`); the native decode
        step's for a plan with no mask (it checks its own result); the native prefill's on its
        own tile products where the scale is a normal number.
    kernel : str
        The router's name of the kernel (a row of :data:`~qkv.engine.kernels.router.FORWARD`).
    stored : bool
        Whether it reads the plan's stored K/V in place.
    counts : str or None
        For a plan run on its key counts, the router's road for them (a row of
        :data:`~qkv.engine.kernels.router.KEY_COUNTS`); the other fields are then its unmasked
        twin's.
    per_row : ndarray or None
        On such a road, the key count of each batch row.
    """

    name: str
    run: Runner
    kv_bytes: int
    scores: int
    first: Runner | None = None
    kernel: str = ""
    stored: bool = False
    counts: str | None = None
    per_row: np.ndarray | None = None


_new = tuple.__new__  # builds a Choice without the named tuple's keyword handling (small calls)

# Each row of the router's forward table, by name: the module and function that run it
# (looked up on each call, so that a test may stand in for a kernel).
RUNNERS: dict[str, tuple[Any, str]] = {
    "native decode, stored K/V": (native_decode, "attend_stored"),
    "native decode, causal rows, stored K/V": (causal_rows, "attend_stored"),
    "native bfloat16 prefill": (native_bf16, "attend"),
    "native prefill, own tiles, stored K/V": (stacked, "attend_stored_own"),
    "native prefill, stored K/V": (native, "attend_stored"),
    "dense (forced)": (dense, "attend"),
    "tiled (forced)": (tiled, "attend"),
    "decode (forced)": (decode, "attend"),
    "native decode": (native_decode, "attend"),
    "native decode, causal rows": (causal_rows, "attend"),
    "decode": (decode, "attend"),
    "dense": (dense, "attend"),
    "native prefill, own tiles": (stacked, "attend_own"),
    "native prefill": (stacked, "attend"),
    "packed walk": (packed, "attend_plan"),
    "tiled": (tiled, "attend"),
}
# The shorter roads of the router's SHORT table, by name.
SHORT_RUNNERS: dict[str, tuple[Any, str]] = {
    "dense, every key seen": (dense, "attend_plain_finite"),
    "native decode, checked finite": (native_decode, "attend_finite"),
    "native prefill, own tiles, checked finite": (stacked, "attend_own_finite"),
    "native decode, causal rows, checked finite": (causal_rows, "attend_finite"),
}


# The roads whose set-up a plain call keeps per shapes (qkv.engine.run.plain), by the
# router's row, with the function that builds the kept form: a function of (q, k, v) giving
# (out, lse), or None where the general road must run (other strides, another clone or thread
# team, a result not finite). The rows on K/V in the compute dtype keep their shorter road,
# which must apply; the stored rows' runners are already their shorter roads.
KEPT: dict[str, tuple[Any, str]] = {
    "native decode": (native_decode, "keep"),
    "native decode, stored K/V": (native_decode, "keep"),
    "native decode, causal rows": (causal_rows, "keep"),
    "native decode, causal rows, stored K/V": (causal_rows, "keep"),
    "native prefill, own tiles": (stacked, "keep_own"),
    "native prefill, own tiles, stored K/V": (stacked, "keep_stored"),
    "native bfloat16 prefill": (native_bf16, "keep"),
}


def keep(plan: Plan, choice: Choice, q_like: np.ndarray | None = None) -> Kept | None:
    """The kept form of ``choice`` for operands laid out as ``plan``'s (:data:`KEPT`), or
    None where its road has none. It gives the bits :func:`attend` gives on the same plan.
    ``q_like``: the caller's float16/bfloat16 q (``plan``'s is widened), whose layout a road
    that reads q in that dtype is kept for (the prefill's)."""
    found = KEPT.get(choice.kernel)
    if found is None or choice.counts is not None or (choice.first is None and not choice.stored):
        return None
    if q_like is not None and found in (KEPT["native prefill, own tiles, stored K/V"],
                                        KEPT["native bfloat16 prefill"]):  # fmt: skip
        return getattr(*found)(plan, q_like=q_like)
    return getattr(*found)(plan)


def keep_counted(plan: Plan, choice: Choice, q_like: np.ndarray | None = None) -> Kept | None:
    """The kept form of the key-count road ``choice`` (for ``plan``, a padded call's plan
    without its mask) where its road has one: a function of ``(q, k, v, counts)``
    (:func:`qkv.engine.kernels.native.keep`), ``counts`` one per index of the first batch
    axis; else None. It gives the bits :func:`attend` gives on the plan with those counts.
    ``q_like`` as for :func:`keep`."""
    if choice.counts != "key counts read by the native prefill":
        return None
    if choice.kernel == "native prefill, own tiles":
        return native.keep(plan, stack=stacked.stacks(plan), counted=True)
    if choice.kernel == "native prefill, own tiles, stored K/V":
        return native.keep(plan, counted=True, q_like=q_like)
    if choice.kernel == "native bfloat16 prefill":
        return native_bf16.keep(plan, counted=True, q_like=q_like)
    return None


def keep_masked(plan: Plan, choice: Choice, q_like: np.ndarray | None = None) -> Kept | None:
    """The kept form of ``choice`` for ``plan``, a call with a boolean mask or a float bias
    (no key counts), where its road has one: the native prefill on its own tiles or in
    bfloat16 (:func:`qkv.engine.kernels.native.keep`,
    :func:`qkv.engine.kernels.native_bf16.keep`, ``masked``), called with ``(q, k, v, mask)``; else
    None. It gives the bits :func:`attend` gives on the plan with that mask. ``q_like`` as for
    :func:`keep`."""
    if choice.counts is not None:
        return None
    if choice.kernel in ("native prefill, own tiles", "native prefill, own tiles, stored K/V"):
        return native.keep(plan, masked=True, q_like=q_like)
    if choice.kernel == "native bfloat16 prefill":
        return native_bf16.keep(plan, masked=True, q_like=q_like)
    return None


def choose(plan: Plan, kernel: str = "auto", counts: bool = True) -> Choice:
    """The kernel ``plan`` runs on: the router's choice (:func:`router.choose`), with the
    functions that run it (``counts=False``: on the plan's mask, not its key counts).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.validate import make_plan
    >>> choose(make_plan(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8)))).name
    'dense'
    >>> choose(make_plan(np.ones((1, 8)), np.ones((5000, 8)), np.ones((5000, 8)))).name
    'dense'
    >>> choose(make_plan(np.ones((1, 8)), np.ones((200_000, 8)), np.ones((200_000, 8)))).name
    'decode'
    >>> choose(make_plan(np.ones((500, 8)), np.ones((500, 8)), np.ones((500, 8)))).name
    'tiled'
    >>> choose(make_plan(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8))), "tiled").name
    'tiled'
    """
    if kernel != "auto":
        check_kernel(kernel)
    row, short, road, size, per_row = router.choose(plan, kernel, counts)
    name = row.name
    module, function = RUNNERS[name]
    first = None if short is None else getattr(*SHORT_RUNNERS[short])
    values = (row.family, getattr(module, function), size, plan.L * plan.S, first, name)
    return _new(Choice, (*values, row.stored, road, per_row))


def attend(
    plan: Plan, kernel: str = "auto", choice: Choice | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Run ``choice`` (default: what :func:`choose` decides for ``kernel``) on ``plan``:
    ``(out, lse)``, repaired or explained when not finite (:func:`numerics.ladder`).

    Sinks are added once, to the kernel's finished result (:func:`mods.with_sinks`).
    """
    out, lse = _attend(plan, kernel, choice)
    return mods.with_sinks(plan, out, lse)


def _attend(plan: Plan, kernel: str, choice: Choice | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`attend` before the sinks: the router's choice, then its shorter road, then the
    chosen kernel on the overflow ladder."""
    if choice is None:
        choice = choose(plan, kernel)
    if choice.counts is not None:
        found = _on_key_counts(plan, choice)
        if found is not None:
            return found
        choice = choose(plan, kernel, counts=False)
    if plan.stored is not None:  # float16/bfloat16 K/V as given: read in place where served
        if choice.stored:
            found = choice.run(plan)
            if found is not None:  # else (not finite) the float32 kernels apply their rules
                return found
        plan = plan.materialized()  # every other kernel reads widened K/V
        if choice.stored:
            choice = choose(plan, kernel, counts=False)
    if choice.first is not None:
        found = choice.first(plan)
        if found is not None:
            return found
    fn = choice.run
    assert plan.v is not None  # outputs: the plan carries values
    return numerics.ladder(
        plan, fn, _finite_out,
        repair=(lambda res: numerics.rescaled(fn, plan, *res)) if plan.v.size else None,
    )  # fmt: skip


def _finite_out(res: tuple[np.ndarray, np.ndarray]) -> bool:
    return bool(np.isfinite(res[0]).all())


def _on_key_counts(plan: Plan, choice: Choice) -> tuple[np.ndarray, np.ndarray] | None:
    """A plan whose padding mask was read as key counts, run without it
    (:mod:`~qkv.engine.kernels.key_counts`) on the road the router chose
    (:data:`~qkv.engine.kernels.router.KEY_COUNTS`; ``choice`` is its unmasked twin's); None
    where that road cannot serve it (the general road then reads the mask)."""
    counts = choice.per_row
    assert counts is not None  # (a key-count road carries them)
    if choice.counts == "one call per key count":  # (each count's rows: _attend, no sinks)
        return key_counts.attend_grouped(plan, counts, lambda p: _attend(p, "auto", None))
    base = key_counts.bare(plan)
    counted: Any = choice.run  # (the dense kernel's, or a runner that takes counts=)
    if choice.counts == "dense on key counts":
        counted = key_counts.attend_dense
    run = functools.partial(counted, counts=counts)
    if choice.stored:  # None (not finite): the caller's general road, on the mask
        return run(base)
    # (the shorter road reads no counts)
    return _attend(base, "auto", choice._replace(run=run, first=None, counts=None, per_row=None))


def weights(plan: Plan) -> np.ndarray:
    """The attention weights ``(*batch, L, S)`` in the compute dtype (the dense kernel's).

    As in :func:`attend`, finite inputs whose scores overflow the compute dtype are redone in
    float64, without NumPy warnings on the way.
    """
    plan = plan.materialized()  # (the dense kernel reads K/V as arrays)
    return numerics.ladder(
        plan,
        lambda p: dense.softmax_rows(dense.logits(p))[0],
        lambda w: bool(np.isfinite(w).all()),
        narrow=lambda w: w.astype(plan.acc_dtype),
    )


def attend_many(plans: list[Plan], kernel: str = "auto") -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`attend` on each of ``plans``; the decode ones run in one parallel pass.

    ``"auto"`` picks decode for every plan where the router says so
    (:func:`router.decode_together`), and otherwise chooses for each plan alone.
    """
    choices = [choose(p, kernel) for p in plans]
    if router.decode_together(plans, kernel, [c.kv_bytes for c in choices]):
        choices = [
            c._replace(name="decode", run=decode.attend, first=None, kernel="decode")
            for c in choices
        ]
    at = [i for i, c in enumerate(choices) if c.run is decode.attend]  # NumPy decode, together
    results: list[Any] = [None] * len(plans)
    if at:
        with np.errstate(over="ignore", invalid="ignore"):  # (it reads K/V widened)
            done = decode.attend_many([plans[i].materialized() for i in at])
        for i, (out, lse) in zip(at, done, strict=True):
            plan = plans[i]
            assert plan.v is not None  # outputs: the plan carries values
            if numerics.scale_fits(plan) and (np.isfinite(out).all() or not plan.v.size):
                results[i] = mods.with_sinks(plan, out, lse)
    for i, (plan, choice) in enumerate(zip(plans, choices, strict=True)):
        if results[i] is None:  # not decode, or a rare retry: run's full path
            results[i] = attend(plan, choice=choice)
    return results


def backward(
    plan: Plan, d_out: np.ndarray, out: np.ndarray, lse: np.ndarray, block: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dq, dk, dv)`` of ``plan`` on the kernel the router picks (:func:`router.backward`):
    the native backward where it serves the plan, else the NumPy one
    (:func:`tiled_backward.backward`, ``block`` its tile size).

    ``d_out`` and ``out`` are ``(*batch, L, dv)``, ``lse`` is ``(*batch, L)``; ``out`` and
    ``lse`` in the accumulation dtype (or ``out`` as the bfloat16 forward gave it).
    """
    name = router.backward(plan).name
    if name == "native bfloat16 backward":  # takes dO as given: a bfloat16 model's is rounded
        return native_bf16.backward(plan, d_out, (out, lse))
    d_out = d_out.astype(plan.acc_dtype, copy=False)
    if name == "native backward, stored K/V":  # K/V widened a key block at a time
        return native.backward(plan, d_out, out, lse)
    plan = plan.materialized()
    if name == "native backward":
        return native.backward(plan, d_out, out, lse)
    return tiled_backward.backward(plan, d_out, out, lse, block)

"""The NumPy back end of the public attention functions: run a checked call on a kernel.

:mod:`qkv.front` holds the public functions and their documentation; it builds one checked
:class:`qkv.call.Call` and sends its plan here (NumPy input, and CPU tensors read as arrays), to
:mod:`qkv.torch_bridge` (autograd) or to :mod:`qkv.gpu` (device tensors). Nothing here checks
arguments again, and nothing here knows of PyTorch.

Semantics (shapes, scale, bottom-right causal alignment, masks, windows, grouped-query heads,
dtypes) are those of :mod:`qkv.reference`, which every path here is tested to equal.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import numerics
from ..checks import check_int
from ..errors import InputError
from ..masks import tail_counts
from ..validate import Plan, as_array, broadcasts_to, plain_plan, stand_in
from .kernels import dense, dispatch, mods, router
from .kernels.native_lib import either, switches

__all__ = ["attend", "plain", "plain_at", "run", "softmax", "weights"]


def softmax(x: Any, axis: int = -1) -> np.ndarray:
    """The NumPy path of :func:`qkv.softmax` (documented there)."""
    check_int(axis, "axis")
    a = as_array(x, "x")
    if a.ndim == 0:
        raise InputError(f"x: expected at least 1 dimension, got shape {a.shape}")
    if not -a.ndim <= axis < a.ndim:
        raise InputError(f"axis: {axis} is out of range for x with shape {a.shape}")
    acc = numerics.acc_dtype(a.dtype)
    z = np.moveaxis(a.astype(acc, copy=True), axis, -1)
    w, _ = dense.softmax_rows(z)
    return np.moveaxis(w, -1, axis).astype(a.dtype, copy=False)


def run(fn: str, plan: Plan, kernel: str = "auto", return_lse: bool = False) -> Any:
    """Run a checked call of the public function ``fn`` on the NumPy kernels; NumPy results.

    ``attention`` gives ``out`` (and ``lse`` with ``return_lse``), ``attention_weights`` the
    weights, ``scores`` the scaled scores, shaped and typed as :mod:`qkv.front` documents.
    The front passes its :class:`qkv.call.Call`'s fields (nothing here knows that type).
    """
    if fn == "attention":
        out, lse = attend(plan, kernel)
        return (out, lse) if return_lse else out
    if fn == "attention_weights":
        w = weights(plan)
    else:
        w = dense.raw_scores(plan)
    w = w.astype(plan.out_dtype, copy=False)
    return w[..., 0, :] if plan.squeeze else w


def attend(plan: Plan, kernel: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` of a checked plan, in the caller's shapes (1-D ``q``) and dtype."""
    out, lse = dispatch.attend(plan, kernel)
    out = out.astype(plan.out_dtype, copy=False)
    if plan.squeeze:
        return out[..., 0, :], lse[..., 0]
    return out, lse


def weights(plan: Plan) -> np.ndarray:
    """The attention weights of a checked plan in its compute dtype, sinks included."""
    w = dispatch.weights(plan)
    if plan.sinks is not None:
        _, lse = dense.softmax_rows(dense.logits(plan))
        w *= mods.sink_factor(plan, lse)[0][..., None]
    return w


def plain(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: Any, causal: Any, mask: Any = None,
    rows_first: bool = False,
) -> Any:  # fmt: skip
    """The output of the commonest call — ``qkv.attention(q, k, v)`` on NumPy arrays of one
    dtype (float32, float64, or float16 and ml_dtypes' bfloat16, computed in float32 on K/V
    read as stored), nothing but ``scale`` and ``causal`` given — or None where it is not such
    a call (the front then builds the general :class:`qkv.call.Call`).

    The same plan and kernel as the general road, without checking or choosing again: both
    follow from the shapes, dtypes, ``scale``, ``causal`` and the native settings alone
    (:func:`~qkv.engine.kernels.native_lib.switches`), so they are worked out once per such
    key (:func:`_ready`) and the call only puts its arrays into the plan. A small call (a
    decoding step's layer) spends most of its time on this, not on its arithmetic.

    A boolean ``mask`` of the rank of ``q`` that only hides a tail of each batch row's keys
    (a tokenizer's padding, :func:`qkv.masks.tail_counts`) is read as key counts, as the
    validation reads it, and runs on the road the router keeps for such counts
    (:func:`_padded`); any other boolean mask of that rank, or a float bias (in the compute
    dtype, or narrower), on the road kept for its layout (:func:`_masked`); any other mask
    takes the general road.

    ``rows_first``: the caller gives the output back as ``(..., L, heads, dv)``
    (``layout="blhd"``, whose views ``q``, ``k``, ``v`` are): the plan asks the kernels to
    write it laid out so (:attr:`qkv.validate.Plan.rows_first`), and the roads are kept apart
    from the other layout's.
    """
    if causal is not False and causal is not True:
        return None  # (make_plan says what is wrong)
    key: tuple[Any, ...] = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, scale, causal,
                            switches(), type(scale), rows_first)  # fmt: skip
    try:
        found = _ready(*key)
    except TypeError:  # an unhashable scale: the general road says what it is
        return None
    if found is None:
        return None
    if mask is not None:
        out = _padded(q, k, v, key, found, mask)
        return out if out is not None else _masked(q, k, v, key, found, mask)
    return _unmasked(q, k, v, found)


def _unmasked(q: np.ndarray, k: np.ndarray, v: np.ndarray, found: _Ready) -> Any:
    """:func:`plain` without a mask, ``found`` its key's :func:`_ready`."""
    narrow, kept = found.narrow, found.kept
    if narrow:  # 16-bit inputs: q widened, K/V read as stored (make_plan's keep_stored)
        if kept is not None and kept.io:  # (the kernel widens q and narrows the output)
            done = _on_io(kept, q, k, v, None)
            if done is not None:
                return done[0]
        wide = q.astype(np.float32)
        if kept is not None and not kept.io:
            done = kept(wide, k, v)
            if done is not None:
                return done[0].astype(q.dtype)
        plan = Plan.trusted(q=wide, stored=(k, v), **found.fields)
    else:
        if kept is not None:
            done = kept(q, k, v)
            if done is not None:
                return done[0]
        plan = Plan.trusted(q=q, k=k, v=v, **found.fields)
    if _keeps(found, q, k, v):  # the first call of this key (of this layout of its operands)
        found.tried += 1  # keeps its road's set-up, if it has one
        found.kept = either(dispatch.keep(plan, found.choice, q if narrow else None), found.kept)
    out = dispatch.attend(plan, "auto", found.choice)[0]
    return out.astype(q.dtype) if narrow else out


def plain_at(
    qs: tuple[int, ...], ks: tuple[int, ...], vs: tuple[int, ...], dtype: np.dtype, q: int,
    k: int, v: int, strides: tuple[Any, ...], widen: Callable[[], tuple[Any, ...]] | None,
    scale: Any, causal: Any, mask: np.ndarray | None = None, rows_first: bool = False,
) -> np.ndarray | None:  # fmt: skip
    """:func:`plain` on operands given by their shapes, dtype (one for all three), addresses
    and strides in elements, as a CPU tensor gives them without a NumPy view of it: the output
    of the road kept for the key, or None where the key has no kept road yet (its first call),
    or none at all, or the operands' strides are not the kept ones (the caller then reads them
    as arrays, and calls :func:`plain`).

    For float16 and bfloat16, a kept road that takes q and gives its output in that dtype
    (the prefill's) runs on q as it is; any other is given q widened to float32, as
    :func:`plain` widens it: ``widen()`` gives that q's address, its strides and an object to
    hold while it is read, and the output is then float32 (the caller narrows it).

    A ``mask`` (a NumPy array, the tensor's view) is read as :func:`plain` reads it: a
    padding mask's key counts go to the key-count road kept for these shapes, another boolean
    mask or a bias to the road kept for its layout (:func:`_masked`), once that road is kept;
    None for any other mask. ``rows_first`` as for :func:`plain`.

    Examples
    --------
    >>> import numpy as np
    >>> q, k = np.ones((1, 2, 1, 8), np.float32), np.ones((1, 2, 16, 8), np.float32)
    >>> first = plain(q, k, k, None, False)  # keeps the road (a native one, where built)
    >>> strides = tuple(tuple(s // 4 for s in a.strides) for a in (q, k, k))
    >>> at = (q.ctypes.data, k.ctypes.data, k.ctypes.data)
    >>> out = plain_at(q.shape, k.shape, k.shape, q.dtype, *at, strides, None, None, False)
    >>> out is None or bool((out == first).all())
    True
    """
    if causal is not False and causal is not True:
        return None
    # (a tensor's shapes are torch.Size, tuples that hash and compare as theirs)
    key: tuple[Any, ...] = (qs, ks, vs, dtype, dtype, dtype, scale, causal, switches(),
                            type(scale), rows_first)  # fmt: skip
    try:
        found = _ready(*key)
    except TypeError:
        return None
    if found is None:
        return None
    kept, per_row = found.kept, None
    if mask is not None:
        read = _mask_counts(key, mask)
        if read is None:  # (no padding: a mask's kept road, its mask put in as it is)
            masked = _road_of_mask(key, found, mask)
            if masked is None or masked[0].kept is None:
                return None
            kept, per_row = masked[0].kept, masked[1]
        elif read[1] is not None:  # (else it hides nothing: no mask at all)
            kept, per_row = read[0].kept, read[1]
    if kept is None:
        return None
    if widen is not None and not kept.io:  # (the widened q held until the call returns)
        q, wide, _held = widen()
        strides = (wide, *strides[1:])
    done = kept.at(q, k, v, strides, per_row)
    return None if done is None else done[0]


#: layouts of one key's operands (their strides) that each keep a road's set-up: the same
#: shapes called as a model's transposed views and as contiguous arrays, say; past this many,
#: a call in yet another layout takes the general road
_LAYOUTS_KEPT = 4


def _keeps(holder: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> bool:
    """Whether a call that ``holder``'s kept roads did not serve keeps its road's set-up for
    its layout: the key's first call does; a call in another layout does (up to
    :data:`_LAYOUTS_KEPT`) where every operand's rows are whole, as the kernels read them in
    place (rows whose elements lie apart run on the general road, as they ran before, and
    keep its bits)."""
    if holder.tried == 0:
        return True
    if holder.tried >= _LAYOUTS_KEPT:
        return False
    return all(a.strides[-1] == a.itemsize or a.shape[-1] == 1 for a in (q, k, v))


class _Ready:
    """What :func:`plain` works out once per key (:func:`_ready`): the checked plan's fields
    but its arrays, the router's choice, whether the inputs are 16-bit (their K/V kept as
    stored) and, from the key's first call on, its road's kept set-up
    (:func:`qkv.engine.kernels.dispatch.keep`; None where the road has none)."""

    __slots__ = ("choice", "fields", "kept", "narrow", "tried")  # (tried: layouts kept so far)

    def __init__(self, fields: dict[str, Any], choice: dispatch.Choice, narrow: bool) -> None:
        self.fields, self.choice, self.narrow = fields, choice, narrow
        self.kept: Any = None
        self.tried = 0


@functools.lru_cache(maxsize=256)
def _ready(
    qs: tuple[int, ...],
    ks: tuple[int, ...],
    vs: tuple[int, ...],
    qt: np.dtype,
    kt: np.dtype,
    vt: np.dtype,
    scale: Any,
    causal: bool,
    switched: tuple[bool, str],
    scale_type: type,
    rows_first: bool,
) -> _Ready | None:
    """The checked plan's fields but its arrays, the router's choice, and whether the inputs
    are 16-bit (their K/V kept as stored), for :func:`plain`'s key (``switched``:
    ``QKV_NATIVE=0`` and ``QKV_NATIVE_ISA``, which the choice depends on; ``scale_type``:
    ``scale``'s, so that 1, 1.0 and True, equal as keys, are not one call: the cache is not
    typed, which would part a tensor's shapes, torch.Size, from the tuples they equal;
    ``rows_first``: :attr:`qkv.validate.Plan.rows_first`, the plan's and its roads'); None
    where the call is not plain (:func:`qkv.validate.plain_plan`). Worked out on stand-ins of
    the shapes (no data); a bad ``scale`` raises as the general road would. A key that differs
    from one answered before in the number of keys alone is worked out from that answer
    (:func:`_grown`)."""
    key = (qs, ks, vs, qt, kt, vt, scale, causal, switched, scale_type, rows_first)
    family = _family(key)
    known = _FAMILIES.get(family) if family is not None else None
    ready = None if known is None else _grown(known, key)
    if ready is None:
        q, k, v = stand_in(qt, qs), stand_in(kt, ks), stand_in(vt, vs)
        plan = plain_plan(q, k, v, scale, causal, keep_stored=True)
        if plan is None:
            return None
        if rows_first:
            plan = plan.but(rows_first=True)
        narrow = plan.stored is not None  # (its k and v are stand-ins already: kept)
        arrays = ("q", "stored") if narrow else ("q", "k", "v")
        fields = {n: x for n, x in plan.__dict__.items() if n not in arrays}
        ready = _Ready(fields, dispatch.choose(plan), narrow)
    if family is not None:
        if len(_FAMILIES) >= 256 and family not in _FAMILIES:
            _FAMILIES.clear()
        _FAMILIES[family] = ready
    return ready


# _ready's latest answer per key without the number of keys (see _grown)
_FAMILIES: dict[tuple[Any, ...], _Ready] = {}


def forget() -> None:
    """Forget every plan and road the plain call kept (:func:`_ready`, its answers by
    number of keys, :func:`_counted`, :func:`_mask_road`): the next call of any key is its
    first."""
    _ready.cache_clear()
    _FAMILIES.clear()
    _counted.cache_clear()
    _mask_road.cache_clear()


def _family(key: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """:func:`_ready`'s ``key`` without the number of keys S (K's and V's next-to-last
    sizes), or None where K or V has fewer than two dimensions."""
    ks, vs = key[1], key[2]
    if len(ks) < 2 or len(vs) < 2:
        return None
    return (key[0], (*ks[:-2], ks[-1]), (*vs[:-2], vs[-1]), *key[3:])


def _grown(known: _Ready, key: tuple[Any, ...]) -> _Ready | None:
    """:func:`_ready` for ``key`` from ``known``, its answer for the same call with another
    number of keys S (a decoding loop over a slice of its own buffers asks for one more key
    each step, each a new key): the checked plan's fields are the same but for the shapes
    they record (the checks passed for ``known`` hold for any S, and its fields follow from
    the other sizes), the router chooses again for the new S, and where it chooses the same
    road, ``known``'s kept set-up grown to S (:attr:`Kept.grow`) is kept for the first call
    to try (a call whose operands it does not fit keeps its own, as a first call does).
    None where K and V have different numbers of keys (not a plain call: the checks say so)."""
    qs, ks, vs, qt, kt, vt = key[:6]
    S, narrow = ks[-2], known.narrow
    if vs[-2] != S:
        return None
    fields = {**known.fields, "given": ((qt, tuple(qs)), (kt, tuple(ks)), (vt, tuple(vs)))}
    q = stand_in(np.float32 if narrow else qt, qs)
    if narrow:  # (the plan's k and v: float32 stand-ins, the 16-bit ones stored)
        fields.update(k=stand_in(np.float32, ks), v=stand_in(np.float32, vs))
        plan = Plan.trusted(q=q, stored=(stand_in(kt, ks), stand_in(vt, vs)), **fields)
    else:
        plan = Plan.trusted(q=q, k=stand_in(kt, ks), v=stand_in(vt, vs), **fields)
    ready = _Ready(fields, dispatch.choose(plan), narrow)
    grow = None if known.kept is None else known.kept.grow
    if grow is not None and _road(ready.choice) == _road(known.choice):
        ready.kept = grow(S)
    return ready


#: a choice's road: every field but the sizes it was chosen by
_road = operator.itemgetter(
    *(i for i, f in enumerate(dispatch.Choice._fields) if f not in ("kv_bytes", "scores"))
)


def _on_kept(
    kept: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, extra: Any, narrow: bool
) -> Any:
    """The output of a kept road ``kept`` (or None) on ``q``, ``k``, ``v`` and its fourth
    argument ``extra`` (key counts, a mask), or None where it steps aside (the caller then runs
    the plan). 16-bit inputs (``narrow``): q and the output as they are where the road takes
    them so (``kept.io``), else q widened to float32 and the output narrowed back."""
    if kept is None:
        return None
    if kept.io and narrow:
        done = _on_io(kept, q, k, v, extra)
        return None if done is None else done[0]
    if not narrow:
        done = kept(q, k, v, extra)
        return None if done is None else done[0]
    done = kept(q.astype(np.float32), k, v, extra)
    return None if done is None else done[0].astype(q.dtype)


def _on_io(kept: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, extra: Any) -> Any:
    """A kept road that takes 16-bit ``q`` as it is (``kept.io``) on ``q``: in the layout it
    was kept for (the caller's, :func:`qkv.engine.kernels.dispatch.keep`'s ``q_like``), or
    else laid out contiguously, as it was kept for where the caller's could not be read in
    place; None where neither fits."""
    done = kept(q, k, v, extra)
    if done is None and not q.flags.c_contiguous:
        done = kept(np.ascontiguousarray(q), k, v, extra)
    if done is None and q.flags.c_contiguous:  # (a contiguous q whose axes of length 1 have
        done = kept(q.copy(), k, v, extra)  # other strides: a copy's)
    return done


def _padded(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, key: tuple[Any, ...], found: _Ready, mask: Any
) -> Any:
    """:func:`plain` with a padding ``mask`` (``found``: its ``key``'s :func:`_ready`): the
    unmasked call's kept plan with the mask and its key counts put in, run on the key-count
    road kept for these shapes (:func:`_counted`); None where the mask is not such a mask or
    the road depends on the counts themselves (the general road then reads it)."""
    fields, narrow = found.fields, found.narrow
    read = _mask_counts(key, mask)
    if read is None:
        return None
    counted, per_row, counts = read
    if per_row is None:  # hides nothing: no mask at all
        return _unmasked(q, k, v, found)
    done = _on_kept(counted.kept, q, k, v, per_row, narrow)
    if done is not None:
        return done
    wide = q.astype(np.float32) if narrow else q
    if narrow:
        plan = Plan.trusted(q=wide, stored=(k, v), **fields)
    else:
        plan = Plan.trusted(q=q, k=k, v=v, **fields)
    if _keeps(counted, q, k, v):  # the first call of this key (and layout, as above)
        counted.tried += 1  # keeps its road's set-up
        kept = dispatch.keep_counted(plan, counted.choice, q if narrow else None)
        counted.kept = either(kept, counted.kept)
    plan.__dict__.update(mask=mask, key_counts=counts)  # (a plan of this call alone)
    choice = counted.choice._replace(per_row=router.key_counts_per_row(plan))
    out = dispatch.attend(plan, "auto", choice)[0]
    return out.astype(q.dtype) if narrow else out


def _masked(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, key: tuple[Any, ...], found: _Ready, mask: Any
) -> Any:
    """:func:`plain` with a ``mask`` that is no padding (:func:`_padded` did not take it): a
    boolean mask, or a float bias that is not the 0/-inf form of a boolean mask, of the rank
    of ``q``, in ``q``'s dtype (float32, float64; float32 beside 16-bit inputs, whose q is
    widened and K/V read as stored, as for :func:`_unmasked`). The plan the validation would
    make, with the router's choice and its kept set-up worked out once per key and mask layout
    (:func:`_mask_road`; :func:`qkv.engine.kernels.dispatch.keep_masked`), the mask put in as
    it is. None for any other mask (the general road then reads it and says what is wrong)."""
    read = _road_of_mask(key, found, mask)
    if read is None:
        return None
    road, mask = read
    narrow = found.narrow
    done = _on_kept(road.kept, q, k, v, mask, narrow)
    if done is not None:
        return done
    wide = q.astype(np.float32) if narrow else q
    name = "mask" if mask.dtype.kind == "b" else "bias"
    arrays = {"q": wide, "stored": (k, v)} if narrow else {"q": q, "k": k, "v": v}
    plan = Plan.trusted(**{**found.fields, **arrays, name: mask})
    if _keeps(road, q, k, v):  # the first call of this key and mask layout (and layout of
        road.tried += 1  # the operands, as above) keeps its road's set-up
        road.kept = either(dispatch.keep_masked(plan, road.choice, q if narrow else None),
                           road.kept)  # fmt: skip
    out = dispatch.attend(plan, "auto", road.choice)[0]
    return out.astype(q.dtype) if narrow else out


def _road_of_mask(
    key: tuple[Any, ...], found: _Ready, mask: Any
) -> tuple[_Counted, np.ndarray] | None:
    """:func:`_mask_road` for ``mask`` beside :func:`plain`'s ``key`` (``found``: its
    :func:`_ready`), where :func:`_masked` takes it, and the mask as the plan holds it (a
    narrower float bias widened, as the validation widens it); None for a padding mask (the
    validation reads it as key counts), a float mask wider than the compute dtype (narrowed
    there, its range checked) or of 0 and -inf alone (read as the boolean mask it is),
    another rank."""
    if type(mask) is not np.ndarray or mask.ndim != len(key[0]):
        return None
    dt = mask.dtype
    if dt.kind == "b":
        if mask.size <= _SEEN_WHOLE and b"\x00" not in mask.tobytes():
            return None  # (hides nothing: no mask, as the general road reads it)
        if tail_counts(mask, len(key[0]) - 2) is not None:
            return None  # (a padding mask the kept counts road does not serve)
    else:
        acc = _F32 if found.narrow else key[3]
        if dt != acc:  # (a narrower float widened exactly; a wider one: the general road)
            if (dt.kind != "f" and dt.name != "bfloat16") or dt.itemsize >= acc.itemsize:
                return None  # (ml_dtypes' bfloat16 is of kind "V")
            mask, dt = mask.astype(acc), acc
        if _zeros_and_minus_inf(mask):
            return None  # (a boolean mask's float form)
    try:
        road = _mask_road(key, mask.shape, mask.strides, dt)
    except TypeError:  # (shapes that do not hash)
        return None
    return None if road is None else (road, mask)


def _zeros_and_minus_inf(m: np.ndarray) -> bool:
    """Whether float mask ``m`` holds only 0 and -inf (the validation reads it as the boolean
    mask it is); a bias is told by a few of its elements first (a whole pass over a large one
    cost 20 us)."""
    n = m.size
    if n == 0:
        return True
    for i in (0, n // 2, n - 1):
        x = m.flat[i]
        if x != 0 and x != -np.inf:
            return False
    return bool(((m == 0) | (m == -np.inf)).all())


@functools.lru_cache(maxsize=256)
def _mask_road(
    key: tuple[Any, ...], ms: tuple[int, ...], strides: tuple[int, ...], dt: np.dtype
) -> _Counted | None:
    """The router's choice for :func:`plain`'s key with a mask of shape ``ms`` and dtype
    ``dt`` (bool: a mask; float: a bias), and from its first call on, its kept set-up
    (``strides``: the mask's, which the set-up is for); None for a mask shape that does not
    broadcast to the scores' (the general road refuses it by name). Chosen on stand-ins."""
    found = _ready(*key)
    assert found is not None  # (plain asked it first)
    qs, ks, vs, qt, kt, vt = key[:6]
    if not broadcasts_to(ms, (*qs[:-1], ks[-2])):
        return None
    name = "mask" if dt.kind == "b" else "bias"
    if found.narrow:
        arrays = {"q": stand_in(np.float32, qs), "stored": (stand_in(kt, ks), stand_in(vt, vs))}
    else:
        arrays = {"q": stand_in(qt, qs), "k": stand_in(kt, ks), "v": stand_in(vt, vs)}
    plan = Plan.trusted(**{**found.fields, **arrays, name: stand_in(dt, ms)})
    return _Counted(dispatch.choose(plan))


_F32 = np.dtype(np.float32)  # (a bias beside 16-bit inputs: their compute dtype's)

#: masks of at most this many elements are first looked at whole (their bytes): one that hides
#: nothing, the commonest padding mask (a single sentence's, a batch of full ones), is then no
#: mask at all without its counts read (:func:`qkv.masks.tail_counts` costs a few µs)
_SEEN_WHOLE = 4096


def _mask_counts(
    key: tuple[Any, ...], mask: Any
) -> tuple[_Counted, np.ndarray | None, np.ndarray | None] | None:
    """``(counted, per_row, counts)`` of ``mask`` beside :func:`plain`'s key (after
    :func:`_ready` took it): the kept key-count choice for its shape (:func:`_counted`), the
    key counts per index of the first batch axis and as :func:`qkv.masks.tail_counts` reads
    them; ``per_row`` None where it hides nothing (and ``counts`` then None where that was
    seen without reading them). None where it is not a boolean padding mask of q's rank, or no
    kept road serves its shape (the mask is then not read twice)."""
    qs = key[0]
    if type(mask) is not np.ndarray or mask.dtype != bool or mask.ndim != len(qs):
        return None
    counted = _counted(key, mask.shape)  # (None for a mask shape that does not broadcast)
    if counted is None:
        return None
    if mask.size <= _SEEN_WHOLE and b"\x00" not in mask.tobytes():
        return counted, None, None  # hides no key (one sentence's mask): no mask at all
    batch = qs[:-2]
    counts = tail_counts(mask, len(batch))
    if counts is None:
        return None
    # (a few counts compared as Python ints: numpy's comparison and all() cost 1.5 µs)
    if min(counts.tolist() if counts.size <= 8 else [counts.min()]) == key[1][-2]:
        return counted, None, counts
    rows = batch[0] if batch else 1
    return counted, counts if counts.size == rows else np.broadcast_to(counts, (rows,)), counts


class _Counted:
    """What :func:`_padded` works out once per key and mask shape (:func:`_counted`): the
    router's key-count choice and, from the first call on, its road's kept set-up
    (:func:`qkv.engine.kernels.dispatch.keep_counted`; None where the road has none)."""

    __slots__ = ("choice", "kept", "tried")

    def __init__(self, choice: dispatch.Choice) -> None:
        self.choice = choice
        self.kept: Any = None
        self.tried = 0


@functools.lru_cache(maxsize=256)  # (reached after _ready took this key, typed)
def _counted(key: tuple[Any, ...], ms: tuple[int, ...]) -> _Counted | None:
    """The router's choice for :func:`plain`'s key with a padding mask of shape ``ms`` read
    as key counts, where it holds for any counts
    (:data:`~qkv.engine.kernels.router.FOR_ANY_COUNTS`); else None, and None for a mask
    shape that does not broadcast to the scores' (the general road refuses it by name).
    Chosen on stand-ins, one count for every row."""
    found = _ready(*key)
    assert found is not None  # (_padded asked it first)
    qs, ks, vs, qt, kt, vt = key[:6]
    if not broadcasts_to(ms, (*qs[:-1], ks[-2])):
        return None
    fields, narrow = found.fields, found.narrow
    q = stand_in(np.float32 if narrow else qt, qs)
    arrays = {"stored": (stand_in(kt, ks), stand_in(vt, vs))} if narrow else {
        "k": stand_in(kt, ks), "v": stand_in(vt, vs)
    }  # fmt: skip
    rows = ms[0] if len(ms) > 2 else 1
    counts = np.full(rows, max(ks[-2] - 1, 0), dtype=np.int64)
    plan = Plan.trusted(**{**fields, **arrays, "q": q, "mask": stand_in(bool, ms),
                           "key_counts": counts})  # fmt: skip
    choice = dispatch.choose(plan)
    return _Counted(choice) if choice.counts in router.FOR_ANY_COUNTS else None

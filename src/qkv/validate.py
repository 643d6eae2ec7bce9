"""Validation in one place: turn user arguments into a checked :class:`Plan`.

Everything a kernel needs — arrays in their compute dtype, the scale, grouped-query heads,
the mask or bias, causal and window — is checked here, once. Kernels trust the plan and never
re-validate.

Policy for NaN and infinity in ``q``, ``k`` and ``v``: they propagate to the rows they touch,
as in every framework, unless ``check_finite=True`` is passed, which raises instead.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import numerics
from .checks import check_int, check_real, not_rectangular
from .errors import InputError, InputTypeError
from .masks import Window, tail_counts
from .options import VARIANTS, Options

__all__ = [
    "VARIANTS",
    "Plan",
    "as_array",
    "block_plan",
    "check_flag",
    "check_scale",
    "check_variants",
    "check_window",
    "make_plan",
    "plain_plan",
    "stand_in",
    "view_as",
]


def view_as(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``a`` broadcast to ``shape``: the read-only view ``np.broadcast_to`` gives, by a
    shorter road when ``a`` has that shape already (0.5 µs against 3 µs; a plan takes three).

    >>> a = np.arange(6.0).reshape(2, 3)
    >>> b = view_as(a, (2, 3))
    >>> np.shares_memory(a, b), b.flags.writeable, view_as(a[:1], (2, 3)).strides
    (True, False, (0, 8))
    """
    if a.shape != shape:
        return np.broadcast_to(a, shape)
    out = a.view(np.ndarray)
    out.flags.writeable = False
    return out


_NOTHING = bytes(16)  # read-only memory for stand_in's one element (float64 at most)


def stand_in(dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Zeros of ``dtype`` and ``shape`` in no memory (every stride 0, read-only): the K or V
    of a plan whose kernel reads them from elsewhere, checked by their shape and dtype.

    >>> z = stand_in(np.float32, (2, 4, 1000, 64))
    >>> z.strides, z.flags.writeable, float(z.sum())
    ((0, 0, 0, 0), False, 0.0)
    """
    return np.ndarray(shape, dtype, buffer=_NOTHING, strides=(0,) * len(shape))


def as_array(x: Any, name: str, *, narrow: bool = False) -> np.ndarray:
    """Convert ``x`` to a real floating array (ints and lists become float64).

    ml_dtypes' ``bfloat16`` arrays (the NumPy bfloat16 JAX uses) become float32, or stay as
    they are with ``narrow`` (for the attention plan, which reads K/V in their own dtype).
    Raises :class:`InputTypeError` for anything that is not real numbers.
    """
    if type(x) is np.ndarray and x.dtype.kind == "f":
        return x  # (NumPy's own floats, returned as they are below: the commonest input)
    x = from_foreign(x, name)
    try:
        a = np.asarray(x)
    except (ValueError, TypeError) as exc:  # ragged lists and the like
        raise not_rectangular(x, name) or InputError(
            f"{name}: cannot be read as a rectangular array ({exc})"
        ) from None
    if a.dtype.kind == "f":
        return a  # (a tensor's view, say: NumPy's floats as they are, as below)
    if a.dtype.name == "bfloat16":  # ml_dtypes' type (not a NumPy floating subtype)
        return a if narrow else a.astype(np.float32)
    if a.dtype.kind not in "iuf":  # not bool, complex, datetime64/timedelta64, objects...
        raise InputTypeError(
            f"{name}: expected real numbers, got dtype {a.dtype} with shape {a.shape}"
        )
    if not np.issubdtype(a.dtype, np.floating):
        a = a.astype(np.float64)
    return a


#: Readers for array types from other libraries, added by their bridges (the torch bridge
#: adds one for tensors): ``(accepts(x), read(x, name))`` pairs. The core knows no such library;
#: a bridge teaches it to read that library's arrays when the bridge is imported.
_readers: list[tuple[Callable[[Any], bool], Callable[[Any, str], Any]]] = []


def add_reader(accepts: Callable[[Any], bool], read: Callable[[Any, str], Any]) -> None:
    """Teach :func:`as_array` to read a foreign array type: ``read(x, name)`` is called for
    every ``x`` that ``accepts(x)`` and returns something :func:`numpy.asarray` can read (or
    raises :class:`InputError` naming ``name``)."""
    if (accepts, read) not in _readers:
        _readers.append((accepts, read))


def from_foreign(x: Any, name: str) -> Any:
    """``x`` read by the first reader that accepts it (:func:`add_reader`), else ``x``."""
    for accepts, read in _readers:
        if accepts(x):
            return read(x, name)
    return x


#: The attention variants every path takes (see :func:`qkv.attention`).
def check_variants(fn: str, variants: dict[str, Any], allowed: tuple[str, ...] = VARIANTS) -> None:
    """Refuse a keyword that ``fn`` (a public function's name) does not take, by name."""
    for name in variants:
        if name not in allowed:
            near = difflib.get_close_matches(name, allowed, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise InputTypeError(
                f"{name}: {fn}() got an unexpected keyword argument {name!r}{hint} "
                f"(its variants: {', '.join(allowed)})"
            )


def check_flag(x: Any, name: str) -> bool:
    """A True/False argument: refuses ``"no"``, ``0``, ``None`` and the like."""
    if not isinstance(x, (bool, np.bool_)):
        raise InputTypeError(f"{name}: expected True or False, got {x!r}")
    return bool(x)


def check_scale(scale: Any, d: int) -> float:
    """The scale to multiply scores by: ``1/sqrt(d)`` when ``scale`` is ``None``."""
    if scale is None:
        return numerics.default_scale(d)
    if isinstance(scale, str):
        raise InputTypeError(
            f"scale: expected a real number or None, got the text {scale[:40]!r}; the scale "
            "multiplies the scores, so the standard one is 1 / math.sqrt(d) (or None, the "
            "default); expressions in d such as '1/sqrt(d)' are read by qkv.explain and the "
            "qkv command's --scale"
        )
    return check_real(scale, "scale", positive=True)


def check_window(window: Any) -> Window | None:
    """Normalise ``window=(left, right)``; ``None`` on a side means unbounded."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise InputTypeError(f"window: expected (left, right), got {window!r}")
    out: list[int | None] = []
    for side, w in zip(("left", "right"), window, strict=True):
        if w is None:
            out.append(None)
            continue
        out.append(check_int(w, f"window: {side} (None: unbounded)", minimum=0))
    if out == [None, None]:
        return None
    return (out[0], out[1])


def _broadcast(a: tuple[int, ...], b: tuple[int, ...], what: str) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        raise InputError(f"{what}: batch dimensions {a} and {b} do not broadcast") from None


def _clamp_window(window: Window | None, L: int, S: int) -> Window | None:
    """A side of ``L + S`` keys or more restricts nothing: make it ``None`` (unbounded), so no
    position arithmetic ever sees a huge number."""
    if window is None:
        return None
    left, right = (None if w is None or w >= L + S else w for w in window)
    return None if left is None and right is None else (left, right)


def _narrow_bias(m: np.ndarray, acc_dtype: np.dtype) -> np.ndarray:
    """The float bias in the compute dtype; refuses finite values it would turn into ``±inf``
    (a bias of -1e300 would otherwise silently hide keys the definition lets a row see)."""
    if m.dtype.itemsize <= acc_dtype.itemsize:
        return m.astype(acc_dtype, copy=False)
    with np.errstate(over="ignore"):
        bias = m.astype(acc_dtype)
    lost = np.isinf(bias) & np.isfinite(m)
    if lost.any():
        worst = float(m[lost].flat[np.argmax(np.abs(m[lost]))])
        raise InputError(
            f"mask: float bias {worst:.4g} (shape {m.shape}) is beyond the range of {acc_dtype} "
            f"(±{float(np.finfo(acc_dtype).max):.4g}), the dtype q, k, v are computed in; use "
            "-inf (or a boolean mask) to hide keys, a smaller bias, or float64 inputs"
        )
    return bias


@dataclass(frozen=True)
class Plan:
    """A checked attention problem, ready for any kernel.

    Attributes
    ----------
    q : ndarray, shape ``(*batch, L, d)``
        Queries in the compute dtype, broadcast to the full output batch.
    k, v : ndarray, shapes ``(*kv_batch, S, d)`` and ``(*kv_batch, S, dv)``
        Keys and values; ``kv_batch`` equals ``batch`` except that the heads axis (``-3``) holds
        ``Hq // group`` kv heads.
    group : int
        Query heads per kv head (1 without grouped-query attention). Query head ``h`` reads kv
        head ``h // group``.
    mask, bias : ndarray or None
        A boolean mask (``True`` = may attend) or float bias, with ``len(batch) + 2`` dims,
        broadcastable to ``(*batch, L, S)``.
    softcap, sinks, alibi, score_mod, mask_mod
        The attention variants (:mod:`qkv.engine.kernels.mods`): a positive float; per-head arrays
        of shape ``batch`` (sink logits, ALiBi slopes); user functions. ``None`` when unused.
    given : tuple of (dtype, shape)
        ``q`` (a 1-D ``q`` as one row), ``k``, ``v`` and the sinks as the caller gave them,
        before broadcasting: the gradients take these shapes and dtypes.
    stored : tuple of ndarray, or None
        ``(k, v)`` as the caller gave them in float16 or bfloat16, before broadcasting, when
        the call asked to keep them (:func:`make_plan`'s ``keep_stored``): ``k`` and ``v``
        are then zero-stride stand-ins of their shapes. A kernel that reads that dtype takes
        them in place; every other runs on :meth:`materialized`.
    offsets : tuple of (int, int)
        Added to the query and key positions the variants see (ALiBi, ``score_mod``,
        ``mask_mod``; :mod:`qkv.engine.kernels.mods`): ``(0, 0)`` for a whole call. A block of a
        longer sequence (a ring step) sets them so that its variants see global positions;
        causal and the window stay in the block's own bottom-right positions.
    key_counts : ndarray or None
        When the mask (or 0/-inf bias) only hides a tail of keys per batch row, as a padding
        mask does (:func:`qkv.masks.tail_counts`): the keys each row may attend, ``int64`` of
        shape ``(n,)`` along the first batch axis (``n`` is 1 or ``batch[0]``; 1 with no batch
        axis). Row ``b`` then sees keys ``[0, key_counts[b])``, causal and the window still
        aligned to all ``S`` keys. ``mask``/``bias`` stay set (a kernel that does not read the
        counts applies them); the engine runs such a plan on its key counts, without the mask
        (:mod:`qkv.engine.kernels.key_counts`). A mask that hides nothing is dropped instead.
    rows_first : bool
        The caller gives the output back as ``(*batch[:-1], L, heads, dv)``, contiguous
        (``layout="blhd"``): a kernel that can write its output laid out so in memory does
        (the ``(*batch, L, dv)`` result is then a view of it) and no copy is made afterwards.
        Every other kernel ignores it.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray | None
    scale: float
    causal: bool
    window: Window | None
    mask: np.ndarray | None
    bias: np.ndarray | None
    group: int
    out_dtype: np.dtype
    acc_dtype: np.dtype
    squeeze: bool
    softcap: float | None = None
    sinks: np.ndarray | None = None
    alibi: np.ndarray | None = None
    score_mod: Callable[..., Any] | None = None
    mask_mod: Callable[..., Any] | None = None
    given: tuple[tuple[np.dtype, tuple[int, ...]], ...] = ()
    offsets: tuple[int, int] = (0, 0)
    stored: tuple[np.ndarray, np.ndarray] | None = None
    key_counts: np.ndarray | None = None
    rows_first: bool = False

    def materialized(self) -> Plan:
        """This plan with :attr:`stored` K/V widened into ``k`` and ``v`` (itself without)."""
        if self.stored is None:
            return self
        k, v = self.stored
        assert self.v is not None  # stored plans carry values
        return replace(
            self,
            k=np.broadcast_to(k.astype(self.acc_dtype), self.k.shape),
            v=np.broadcast_to(v.astype(self.acc_dtype), self.v.shape),
            stored=None,
        )

    def stored_kv(self) -> tuple[np.ndarray, np.ndarray]:
        """The :attr:`stored` K and V as given, broadcast to the shapes of ``k`` and ``v``
        (views: what a kernel that reads them in place takes)."""
        assert self.stored is not None and self.v is not None  # stored plans carry values
        k, v = self.stored
        return view_as(k, self.k.shape), view_as(v, self.v.shape)

    @classmethod
    def trusted(cls, **fields: Any) -> Plan:
        """A plan from fields checked already, filled in one step: a frozen dataclass's
        ``__init__`` sets its 18 fields one by one (3.5 µs, an eighth of a small call).
        Fields left out keep their defaults."""
        plan = object.__new__(cls)
        plan.__dict__.update(fields)
        return plan

    def but(self, **changes: Any) -> Plan:
        """This plan with ``changes`` (fields of a plan checked already), copied in one step
        as :meth:`trusted` fills one: :func:`dataclasses.replace` runs ``__init__`` (about
        10 µs, which a masked small call paid twice)."""
        plan = object.__new__(type(self))
        plan.__dict__.update(self.__dict__)
        plan.__dict__.update(changes)
        return plan

    def block(
        self,
        rows: slice,
        k: np.ndarray | None = None,
        v: np.ndarray | None = None,
        *,
        causal: bool | None = None,
    ) -> Plan:
        """A block of this checked plan, not checked again: query ``rows`` against ``k``/``v``
        (default: this plan's), bottom-right ``causal`` within the block (default: this
        plan's). For plans without a mask or bias (ring steps, decode splits; a ring step
        sets its own window, ``offsets`` and no sinks with :func:`dataclasses.replace`); the
        block's arrays must come from the same checked call (same dtype, heads and ``d``).
        """
        if self.stored is not None:
            return self.materialized().block(rows, k, v, causal=causal)
        return replace(
            self,
            q=self.q[..., rows, :],
            k=self.k if k is None else k,
            v=self.v if v is None else v,
            causal=self.causal if causal is None else causal,
            given=(),
        )

    def sequences(self, batch: slice, n_keys: int, **variants: Any) -> Plan:
        """Sequences ``batch`` (axis 0) of this checked plan against their first ``n_keys``
        keys (a KV cache's sequences of one length), not checked again; ``variants``
        replaces user functions (whose batch index the caller offsets)."""
        stored = self.stored
        if stored is not None:
            if any(x.shape != self.k.shape[:-1] + x.shape[-1:] for x in stored):
                return self.materialized().sequences(batch, n_keys, **variants)
            # (K/V as given, of the plan's shapes: the same rows of them)
            stored = tuple(x[batch, ..., :n_keys, :] for x in stored)  # type: ignore[assignment]
        per_head: dict[str, Any] = {
            name: None if a is None else a[batch]
            for name, a in (("sinks", self.sinks), ("alibi", self.alibi))
        }
        assert self.v is not None  # a KV cache's plans carry values
        return replace(
            self,
            q=self.q[batch],
            k=self.k[batch, ..., :n_keys, :],
            v=self.v[batch, ..., :n_keys, :],
            given=(),
            stored=stored,
            **per_head,
            **variants,
        )

    @property
    def modded(self) -> bool:
        """True when a variant changes the scores of a tile (all but sinks)."""
        return (
            self.softcap is not None
            or self.alibi is not None
            or self.score_mod is not None
            or self.mask_mod is not None
        )

    @property
    def batch(self) -> tuple[int, ...]:
        return self.q.shape[:-2]

    @property
    def L(self) -> int:
        return self.q.shape[-2]

    @property
    def S(self) -> int:
        return self.k.shape[-2]

    @property
    def d(self) -> int:
        return self.q.shape[-1]

    @property
    def dv(self) -> int:
        return 0 if self.v is None else self.v.shape[-1]

    @property
    def structured(self) -> bool:
        """True when causal or a window restricts which keys a row may see."""
        return self.causal or self.window is not None


def make_plan(
    q: Any,
    k: Any,
    v: Any = None,
    options: Options | None = None,
    *,
    need_v: bool = True,
    check_finite: bool = False,
    dtype: Any = None,
    keep_stored: bool = False,
    **keywords: Any,
) -> Plan:
    """Check every argument and return a :class:`Plan`.

    The call's options come as one :class:`qkv.options.Options` or as its keywords
    (``scale=``, ``causal=``, ...; given with ``options``, they replace its fields).
    ``dtype`` forces the compute dtype (the reference uses float64); otherwise float16 and
    bfloat16 are computed in float32 and other float dtypes in themselves. ``keep_stored``
    keeps float16/bfloat16 K/V as given (:attr:`Plan.stored`) instead of widening them.

    The commonest call — NumPy arrays of one float32/float64 dtype and one rank, nothing but
    ``scale`` and ``causal`` — takes a short road (:func:`plain_plan`) to the same plan.
    """
    if options is None:
        options = Options(**keywords)
    elif keywords:
        options = options.replace(**keywords)
    if options.simple and dtype is None and check_finite is False and need_v:
        causal = options.causal
        if causal is False or causal is True:
            plan = plain_plan(q, k, v, options.scale, causal, keep_stored)
            if plan is not None:
                return plan
    scale, causal, mask, window = options.scale, options.causal, options.mask, options.window
    softcap, sinks, alibi_slopes = options.softcap, options.sinks, options.alibi_slopes
    score_mod, mask_mod = options.score_mod, options.mask_mod
    check_flag(causal, "causal")
    check_flag(check_finite, "check_finite")
    qa, ka, va, squeeze = _read_inputs(q, k, v, need_v, check_finite, keep_stored)
    given = tuple((a.dtype, a.shape) for a in (qa, ka, va) if a is not None)
    out_dtype = np.result_type(*(a for a in (qa, ka, va) if a is not None))
    out_dtype = out_dtype if dtype is None else np.dtype(dtype)
    acc_dtype = numerics.acc_dtype(out_dtype)  # float16 and bfloat16 are computed in float32
    batch, kv_batch, group = _heads(qa, ka, va)
    L, S, d = qa.shape[-2], ka.shape[-2], qa.shape[-1]
    qa = view_as(qa.astype(acc_dtype, copy=False), batch + (L, d))
    stored = None
    if keep_stored and va is not None and acc_dtype == np.float32 and _narrow(ka, va):
        stored = (ka, va)  # read in place by a kernel that can, widened by the others
        ka = stand_in(acc_dtype, kv_batch + (S, d))
        va = stand_in(acc_dtype, kv_batch + (S, va.shape[-1]))
    ka = view_as(ka.astype(acc_dtype, copy=False), kv_batch + (S, d))
    if va is not None:
        va = view_as(va.astype(acc_dtype, copy=False), kv_batch + (S, va.shape[-1]))
    bool_mask, bias = _read_mask(mask, batch + (L, S), acc_dtype)
    if bias is not None:
        keep = bias == 0
        if (keep | (bias == -np.inf)).all():
            # a 0/-inf float mask is the boolean mask it is: every kernel then sees one
            # plan, so the two forms of one mask give the same numbers (a decoding step's
            # native kernel, and the key counts, read boolean rows only)
            bool_mask, bias = keep, None
    key_counts = None
    if bool_mask is not None:
        key_counts = tail_counts(bool_mask, len(batch))
        if key_counts is not None and bool((key_counts == S).all()):
            bool_mask = key_counts = None  # hides nothing: no mask at all
    if sinks is not None:  # the sinks' gradient has the shape they were given in
        sinks = as_array(sinks, "sinks")
        given += ((sinks.dtype, sinks.shape),)

    return Plan(
        q=qa,
        k=ka,
        v=va,
        scale=check_scale(scale, d),
        causal=bool(causal),
        window=_clamp_window(check_window(window), L, S),
        mask=bool_mask,
        bias=bias,
        group=group,
        out_dtype=out_dtype,
        acc_dtype=acc_dtype,
        squeeze=squeeze,
        softcap=check_softcap(softcap),
        sinks=_per_head(sinks, "sinks", batch, acc_dtype),
        alibi=_per_head(alibi_slopes, "alibi_slopes", batch, acc_dtype),
        score_mod=_callable(score_mod, "score_mod"),
        mask_mod=_callable(mask_mod, "mask_mod"),
        given=given,
        stored=stored,
        key_counts=key_counts,
    )


def _narrow(k: np.ndarray, v: np.ndarray) -> bool:
    """Whether K and V are both float16 or both bfloat16 (kept as given for kernels that read
    them in their own dtype)."""
    return k.dtype == v.dtype and (k.dtype == np.float16 or k.dtype.name == "bfloat16")


_PLAIN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_F32 = np.dtype(np.float32)


def plain_plan(
    q: Any, k: Any, v: Any, scale: Any, causal: bool, keep_stored: bool = False
) -> Plan | None:
    """The plan :func:`make_plan` would build, for NumPy ``q``, ``k``, ``v`` of one
    float32/float64 dtype — or, with ``keep_stored``, of one 16-bit dtype (float16, ml_dtypes'
    bfloat16: ``q`` widened to float32, K/V kept as given in :attr:`Plan.stored`) — and one
    rank (>= 2) whose batch dimensions agree (kv heads may group); ``None`` for anything else,
    which then takes the general road (and its messages).
    """
    if not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray):
        return None
    dt = q.dtype
    if k.dtype != dt or v.dtype != dt:
        return None
    narrow = dt not in _PLAIN_DTYPES
    if narrow and not (keep_stored and (dt == np.float16 or dt.name == "bfloat16")):
        return None
    n = q.ndim
    qs, ks, vs = q.shape, k.shape, v.shape
    if n < 2 or k.ndim != n or v.ndim != n or qs[-1] != ks[-1] or ks[-2] != vs[-2] or qs[-1] == 0:
        return None
    if ks[:-2] != vs[:-2] or qs[:-3] != ks[:-3]:
        return None
    group = 1
    if n > 2 and qs[-3] != ks[-3]:
        hq, hkv = qs[-3], ks[-3]
        if hq < 1 or hkv < 1 or hq % hkv:
            return None
        group = hq // hkv
    fscale = numerics.default_scale(qs[-1]) if scale is None else check_scale(scale, qs[-1])
    given = ((dt, qs), (dt, ks), (dt, vs))
    if narrow:  # computed in float32 on K/V read as stored (make_plan's keep_stored)
        return Plan.trusted(
            q=view_as(q.astype(_F32), qs), k=stand_in(_F32, ks), v=stand_in(_F32, vs),
            scale=fscale, causal=causal, window=None, mask=None, bias=None, group=group,
            out_dtype=dt, acc_dtype=_F32, squeeze=False, given=given, stored=(k, v),
        )  # fmt: skip
    return Plan.trusted(
        q=q, k=k, v=v, scale=fscale, causal=causal, window=None, mask=None, bias=None,
        group=group, out_dtype=dt, acc_dtype=dt, squeeze=False, given=given,
    )  # fmt: skip


def block_plan(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    scale: float,
    causal: bool,
    window: Window | None,
    mask: np.ndarray | None = None,
    out_dtype: np.dtype,
) -> Plan:
    """A plan for a block of a call that was checked already (a varlen bucket, one sequence of
    a packed batch): ``q (*batch, L, d)``, ``k``/``v`` with the same batch dims but the kv heads
    (axis -3), a checked ``scale`` and ``window``, a boolean ``mask`` with as many dims as
    ``q``. Nothing is checked again.
    """
    acc = numerics.acc_dtype(out_dtype)
    L, S = q.shape[-2], k.shape[-2]
    group = q.shape[-3] // k.shape[-3] if q.ndim > 2 and k.shape[-3] else 1
    return Plan(
        q=q.astype(acc, copy=False),
        k=k.astype(acc, copy=False),
        v=v.astype(acc, copy=False),
        scale=scale,
        causal=causal,
        window=_clamp_window(window, L, S),
        mask=mask,
        bias=None,
        group=group,
        out_dtype=np.dtype(out_dtype),
        acc_dtype=acc,
        squeeze=False,
    )


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` broadcasts to exactly ``target`` (masks, ``grad_out``)."""
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def _read_inputs(
    q: Any, k: Any, v: Any, need_v: bool, check_finite: bool, narrow: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, bool]:
    """``q``, ``k``, ``v`` as arrays with their ranks, ``d`` and ``S`` checked; a 1-D ``q``
    becomes one row (``squeeze``). ``narrow`` keeps bfloat16 arrays as they are."""
    qa, ka = as_array(q, "q", narrow=narrow), as_array(k, "k", narrow=narrow)
    va = None
    if need_v:
        if v is None:
            raise InputError("v: required")
        va = as_array(v, "v", narrow=narrow)
    if qa.ndim < 1:
        raise InputError(f"q: expected shape (..., L, d) or (d,), got a scalar (shape {qa.shape})")
    if ka.ndim < 2:
        raise InputError(f"k: expected shape (..., S, d) with at least 2 dims, got {ka.shape}")
    if va is not None and va.ndim < 2:
        raise InputError(f"v: expected shape (..., S, dv) with at least 2 dims, got {va.shape}")
    squeeze = qa.ndim == 1
    if squeeze:
        qa = qa[None, :]
    if qa.shape[-1] != ka.shape[-1]:
        raise InputError(
            f"q, k: feature size d differs: q {qa.shape[-1:]} from shape {qa.shape}, "
            f"k {ka.shape[-1:]} from shape {ka.shape}"
        )
    if qa.shape[-1] == 0:
        raise InputError(f"q: feature size d must be >= 1, got shape {qa.shape}")
    if va is not None and va.shape[-2] != ka.shape[-2]:
        raise InputError(
            f"k, v: number of keys S differs: k has shape {ka.shape}, v has shape {va.shape}"
        )
    if check_finite:
        for name, a in (("q", qa), ("k", ka), ("v", va)):
            if a is not None and not np.all(np.isfinite(a)):
                raise InputError(f"{name}: contains NaN or infinity (shape {a.shape})")
    return qa, ka, va, squeeze


def _heads(
    qa: np.ndarray, ka: np.ndarray, va: np.ndarray | None
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The batch dimensions of the scores and of K/V, and the query heads per kv head.

    ``k`` and ``v`` broadcast together; then ``q`` against them, except that axis -3 may hold
    fewer kv heads than query heads when they divide (grouped-query attention).
    """
    kvb = ka.shape[:-2] if va is None else _broadcast(ka.shape[:-2], va.shape[:-2], "k, v")
    qb = qa.shape[:-2]
    if qb and not kvb:  # one K/V for every query head: one kv head, read once
        kvb = (1,)
    group = 1
    if len(qb) >= 1 and len(kvb) >= 1:
        hq, hkv = qb[-1], kvb[-1]
        if hq != hkv and hq > 1 and hkv >= 1:  # one kv head for all (MQA) groups too
            if hq % hkv != 0:
                raise InputError(
                    f"q, k: {hq} query heads cannot share {hkv} kv heads (axis -3): "
                    f"q has shape {qa.shape}, k has shape {ka.shape}{_layout_hint(qa, ka)}"
                )
            group = hq // hkv
    if group == 1:
        batch = _broadcast(qb, kvb, "q, k")
        return batch, batch, 1
    rest = _broadcast(qb[:-1], kvb[:-1], "q, k")
    return rest + (qb[-1],), rest + (kvb[-1],), group


def _layout_hint(qa: np.ndarray, ka: np.ndarray) -> str:
    """A hint when the heads would group read as (..., L, heads, d) (``layout="blhd"``)
    instead of qkv's (..., heads, L, d); it names the other reading, never asserts it."""
    if qa.ndim < 3 or ka.ndim < 3:
        return ""
    hq, hkv = qa.shape[-2], ka.shape[-2]
    if hkv < 1 or hq % hkv:
        return ""
    try:
        np.broadcast_shapes(qa.shape[:-3], ka.shape[:-3])
    except ValueError:
        return ""
    return (
        f"; qkv reads (batch, heads, L, d) by default: if these arrays are laid out "
        f"(batch, L, heads, d) (FlashAttention's and transformers' layout; {hq} query heads "
        f"and {hkv} kv heads read that way), pass layout='blhd'"
    )


def _read_mask(
    mask: Any, target: tuple[int, ...], acc_dtype: np.dtype
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(bool_mask, bias)``: a bool mask (``True`` = may attend) or a float bias, broadcastable
    to the scores' shape ``target`` and given that many dimensions."""
    if mask is None:
        return None, None
    mask = from_foreign(mask, "mask")
    try:
        m = np.asarray(mask)
    except (ValueError, TypeError) as exc:
        raise not_rectangular(mask, "mask") or InputError(
            f"mask: cannot be read as a rectangular array ({exc})"
        ) from None
    if m.dtype.name == "bfloat16":  # ml_dtypes' (a bfloat16 model's additive mask): a float
        m = m.astype(np.float32)
    if m.dtype != bool and not np.issubdtype(m.dtype, np.floating):
        raise InputTypeError(
            f"mask: expected bool (True = may attend) or float (added bias), got dtype "
            f"{m.dtype} with shape {m.shape}"
        )
    if m.dtype != bool:
        m = _narrow_bias(m, acc_dtype)
    if not broadcasts_to(m.shape, target):
        raise InputError(f"mask: shape {m.shape} does not broadcast to the scores' shape {target}")
    m = m.reshape((1,) * (len(target) - m.ndim) + m.shape)
    return (m, None) if m.dtype == bool else (None, m)


def check_softcap(softcap: Any) -> float | None:
    """``softcap=c``: a finite float > 0, or ``None``."""
    if softcap is None:
        return None
    return check_real(softcap, "softcap", positive=True)


def _per_head(x: Any, name: str, batch: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    """One finite number per query head (``(heads,)``, broadcast like the heads axis)."""
    if x is None:
        return None
    a = as_array(x, name)
    if not batch and a.size == 1:
        a = a.reshape(())
    if not broadcasts_to(a.shape, batch):
        raise InputError(
            f"{name}: shape {a.shape} does not broadcast to the query heads {batch} "
            "(one value per head, shape (heads,))"
        )
    if not np.all(np.isfinite(a)):
        raise InputError(f"{name}: must be finite, got NaN or infinity (shape {a.shape})")
    with np.errstate(over="ignore"):
        narrow = a.astype(dtype, copy=False)
    if not np.all(np.isfinite(narrow)):
        worst = float(a.flat[np.argmax(np.abs(np.where(np.isfinite(narrow), 0, a)))])
        raise InputError(
            f"{name}: {worst:.4g} (shape {a.shape}) is beyond the range of {dtype} "
            f"(±{float(np.finfo(dtype).max):.4g}), the dtype q, k, v are computed in; give "
            "smaller values or float64 inputs"
        )
    return np.broadcast_to(narrow, batch)


#: The parameters each user function is called with, by the kernels (:mod:`qkv.variants`).
_PARAMS = {
    "score_mod": ("score", "batch", "head", "q_idx", "kv_idx"),
    "mask_mod": ("batch", "head", "q_idx", "kv_idx"),
}


def _callable(f: Any, name: str) -> Callable[..., Any] | None:
    """``f`` when it is a function that accepts the parameters ``name`` is called with."""
    if f is None:
        return None
    if not callable(f):
        raise InputTypeError(f"{name}: expected a function or None, got {type(f).__name__}")
    params = _PARAMS[name]
    want = f"{name}({', '.join(params)})"
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):  # builtins and the like: they answer for themselves
        return f
    try:
        sig.bind(*params)
    except TypeError:
        label = getattr(f, "__qualname__", None) or type(f).__name__
        raise InputTypeError(
            f"{name}: expected a function of {len(params)} positional parameters, {want}; "
            f"got {label}{sig}"
        ) from None
    return f

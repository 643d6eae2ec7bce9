"""A decoding step planned once and run per layer: qkv's decode plan.

FlashInfer's decode wrappers are the model: a model's decoding step has the same sizes,
grouping, dtypes, scale, soft-cap and keys per sequence in every layer, so :func:`plan_decode`
checks them once (``plan()`` once per step) and :meth:`DecodePlan.run` hands each layer's
``q``, ``k`` and ``v`` to the kernel (``run()`` per layer), checking only what may differ
between layers: that each operand has the dtype, shape and strides the plan was made for (its
memory is read where it is). The router (:data:`qkv.engine.kernels.router.DECODE_PLAN`) says
at plan time which kernel runs: the native decode step (``native_decode``), or the NumPy decode
road where the native one is off or refuses (:attr:`DecodePlan.route`, with the reasons in
:attr:`DecodePlan.refused`). Both equal :func:`qkv.reference.attention` on each sequence's keys.

:class:`qkv.KVCache`'s and :class:`qkv.PagedKVCache`'s decoding steps and the transformers
backend's run through it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import numerics
from ..errors import InputError, InputTypeError
from ..keywords import near_keywords
from ..options import Options
from ..validate import Plan, as_array, make_plan, stand_in
from .kernels import causal_rows as kernels_causal_rows
from .kernels import decode, decode_fast, dispatch, native_decode, router
from .kernels.native_lib import address
from .quant import SCALED, check_format, dequantize_kv, storage_dtype

__all__ = [
    "NATIVE", "NATIVE_FAST", "NUMPY", "NUMPY_FAST", "DecodePlan", "causal_rows", "check_table",
    "plan_checked", "plan_decode",
]  # fmt: skip

#: The router's names of the roads a plan may take: the native step (exact, or the fast road
#: of int8 K/V) and the NumPy one (exact, or its emulation of the fast road).
NATIVE_FAST, NATIVE, NUMPY_FAST, NUMPY = (row.name for row in router.DECODE_PLAN)

# A tensor's conversions by dtype name, as methods (this layer never imports torch).
_TO = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16"}


def _key(x: Any) -> tuple[Any, ...]:
    """What :meth:`DecodePlan.run` compares with the plan: type, dtype, shape and strides."""
    if type(x) is np.ndarray:
        return (np.ndarray, x.dtype, x.shape, x.strides)
    return (type(x), x.dtype, x.shape, x.stride())  # a tensor (its shape a tuple)


def _address(x: Any) -> int:
    # (an array's read as native_lib reads it: ``x.ctypes.data`` cost 2-3 µs, four a step)
    return address(x) if type(x) is np.ndarray else x.data_ptr()


def _describe(key: tuple[Any, ...]) -> str:
    kind, dtype, shape, strides = key
    name = str(dtype).rpartition(".")[2]
    return f"{'array' if kind is np.ndarray else 'tensor'} {name} {tuple(shape)} strides {strides}"


def _raw(x: Any, name: str) -> np.ndarray:
    """``x`` (an array or a CPU tensor) as a NumPy view, its dtype unchanged (codes stay
    integers; a bfloat16 tensor becomes ml_dtypes' bfloat16)."""
    if isinstance(x, np.ndarray):
        return x
    if getattr(x, "is_cpu", True) is False:
        raise InputError(f"{name}: a tensor on {x.device}: a decode plan runs on the CPU")
    if hasattr(x, "data_ptr") and not x.is_floating_point():  # codes, booleans
        return x.detach().numpy()
    if hasattr(x, "data_ptr") and x.is_cpu and not x.requires_grad:
        try:
            return x.numpy()  # float16/32/64: in place
        except TypeError:
            pass  # bfloat16 (or float8): read below
    if hasattr(x, "data_ptr") and str(x.dtype).startswith("torch.float8_e4m3fn"):
        # float8 codes (a tensor's own float8 dtype) as the uint8 bits NumPy holds them in;
        # PyTorch is imported: the tensor is one of its own
        return x.detach().view(sys.modules["torch"].uint8).numpy()
    return as_array(x, name, narrow=True)


def _form(acc: np.dtype, k: np.ndarray, v: np.ndarray, kv_format: str | None) -> str | None:
    """How the native step reads ``k`` and ``v`` computed in ``acc``: ``""`` (in ``acc``
    itself), a stored form, or None (it does not)."""
    if k.dtype != v.dtype:
        return None
    if kv_format is not None:
        return kv_format if acc == np.float32 and k.dtype == storage_dtype(kv_format) else None
    if k.dtype == acc:
        return ""
    if acc == np.float32 and (k.dtype == np.float16 or k.dtype.name == "bfloat16"):
        return k.dtype.name
    return None


def check_table(
    block_table: Any, seqlens: Any, batch: int, num_blocks: int, page: int
) -> tuple[np.ndarray, np.ndarray]:
    """The checked block table (int32, entries past a sequence's pages set to 0) and lengths
    (int64): every entry the lengths need is a page of the pool."""
    bt = _raw(block_table, "block_table") if hasattr(block_table, "shape") else None
    bt = np.asarray(block_table) if bt is None else bt
    if bt.dtype.kind not in "iu":
        raise InputTypeError(f"block_table: expected integers (block ids), got {bt.dtype}")
    if bt.ndim != 2 or bt.shape[0] != batch:
        raise InputError(f"block_table: expected shape (batch={batch}, max_blocks), got {bt.shape}")
    n = _lengths(seqlens, "seqlens", batch)
    cap = bt.shape[1] * page
    if n.size and n.max() > cap:
        b = int(np.argmax(n))
        raise InputError(
            f"seqlens: sequence {b} holds {int(n[b])} keys, which need "
            f"{-(-int(n[b]) // page)} pages of {page}, but block_table has shape {bt.shape} "
            f"({bt.shape[1]} pages, {cap} keys per sequence)"
        )
    need = np.arange(bt.shape[1])[None, :] < -(-n[:, None] // page)
    bad = need & ((bt < 0) | (bt >= num_blocks))
    if bad.any():
        b, c = (int(x[0]) for x in np.nonzero(bad))
        raise InputError(
            f"block_table: entry [{b}, {c}] = {int(bt[b, c])} is not a page of the pool of "
            f"{num_blocks} blocks (k_pages' first axis); block_table has shape {bt.shape}"
        )
    return np.ascontiguousarray(np.where(need, bt, 0), dtype=np.int32), n


def _lengths(x: Any, name: str, batch: int) -> np.ndarray:
    """Integers ``(batch,)`` as int64, not negative: an int64 contiguous array as it is (read
    when the plan runs), anything else copied."""
    n = _raw(x, name) if hasattr(x, "shape") else np.asarray(x)
    if n.dtype.kind not in "iu" and n.size:
        raise InputTypeError(f"{name}: expected integers (keys per sequence), got {n.dtype}")
    if n.shape != (batch,):
        raise InputError(f"{name}: expected shape (batch={batch},), got {n.shape}")
    n = np.ascontiguousarray(n, dtype=np.int64)
    if n.size and n.min() < 0:
        b = int(np.argmin(n))
        raise InputError(f"{name}: sequence {b} has a negative value {int(n[b])}")
    return n


class DecodePlan:
    """A decoding step planned once (:func:`qkv.plan_decode`) and run per layer (:meth:`run`).

    Attributes
    ----------
    route : str
        The kernel that runs it: ``"native decode"`` (the C++ step, on the operands' memory)
        or ``"NumPy decode"`` (the NumPy decode kernel, where the native step is switched off
        or refuses the plan); with ``precision="fast"`` on int8 K/V, ``"native decode, fast
        int8"`` or its NumPy emulation ``"NumPy decode, fast int8"``
        (:mod:`qkv.engine.kernels.decode_fast`).
    precision : str
        ``"exact"`` or ``"fast"``, as asked (:func:`qkv.plan_decode`).
    refused : list of (str, str)
        Each faster kernel the router refused, with the condition that refused it (as
        :attr:`qkv.Route.refused`).
    batch, heads, kv_heads, L, head_dim, value_dim, keys : int
        The sizes: ``q (batch, heads, L, head_dim)`` against ``keys`` keys per sequence.
    scale : float
        The scale (``1/sqrt(head_dim)`` when none was given).
    softcap : float or None
        The soft-cap of the scaled scores.
    kv_format : str or None
        The stored form of K/V codes (:func:`qkv.quantize_kv`), when given.
    dtype : numpy.dtype
        The output's dtype (``q``'s promoted with the values').
    runs : tuple of two int64 arrays, or None
        Each sequence's keys ``[lo[b], hi[b])``: read from ``mask`` once, or ``starts`` and
        ``seqlens`` as given; None when every sequence sees every key.
    """

    __slots__ = (
        "L", "_acc", "_cast_out", "_convert", "_keep", "_keys", "_pages", "_table", "_template",
        "batch", "dtype", "head_dim", "heads", "keys", "kv_format", "kv_heads", "precision",
        "refused", "route", "runs", "scale", "softcap", "value_dim",
    )  # fmt: skip

    route: str
    refused: list[tuple[str, str]]
    batch: int
    heads: int
    kv_heads: int
    L: int
    head_dim: int
    value_dim: int
    keys: int
    scale: float
    softcap: float | None
    kv_format: str | None
    precision: str
    dtype: np.dtype
    runs: decode.KeyRuns | None
    _acc: tuple[np.dtype, str]
    _cast_out: bool
    _convert: bool
    _keep: np.ndarray | None
    _keys: tuple[Any, ...]
    _pages: bool
    _table: np.ndarray | None
    _template: native_decode.Template | None

    def __init__(self, **fields: Any) -> None:
        for name in self.__slots__:
            setattr(self, name, fields.get(name))

    def __repr__(self) -> str:
        return (
            f"DecodePlan(route={self.route!r}, batch={self.batch}, heads={self.heads}, "
            f"kv_heads={self.kv_heads}, L={self.L}, head_dim={self.head_dim}, "
            f"value_dim={self.value_dim}, keys={self.keys}, dtype={self.dtype}, "
            f"scale={self.scale:.6g}, softcap={self.softcap}, kv_format={self.kv_format}, "
            f"precision={self.precision!r})"
        )

    def run(
        self,
        q: Any,
        k: Any,
        v: Any,
        *,
        k_scale: Any = None,
        v_scale: Any = None,
        return_lse: bool = False,
    ) -> Any:
        """One layer's attention: ``q``, ``k`` and ``v`` of the dtypes, shapes and strides
        the plan was made for (their values and memory may differ from layer to layer).

        Parameters
        ----------
        q, k, v : ndarray or CPU tensor
            As given to :func:`qkv.plan_decode` (``k``/``v`` the pools of pages for a paged
            plan, the codes for a ``kv_format``), each of the same type, dtype, shape and
            strides as there.
        k_scale, v_scale : ndarray or CPU tensor, optional
            The 8-bit forms' scales, likewise.
        return_lse : bool, optional
            Also return the log-sum-exp ``(batch, heads, L)`` in the compute dtype.

        Returns
        -------
        array or tensor, shape ``(batch, heads, L, value_dim)``
            Of ``q``'s type, in :attr:`dtype`; with ``return_lse``, ``(out, lse)``.

        Raises
        ------
        InputError
            An operand whose type, dtype, shape or strides differ from the plan's, naming it.
        """
        self._operands(q, k, v, k_scale, v_scale)
        found = self._native(q, k, v, k_scale, v_scale, return_lse)
        if found is not None:
            return found if return_lse else found[0]
        return self._numpy(q, k, v, k_scale, v_scale, return_lse)

    def run_after(
        self, prior: tuple[np.ndarray, np.ndarray], q: Any, k: Any, v: Any, *,
        k_scale: Any = None, v_scale: Any = None,
    ) -> tuple[np.ndarray, np.ndarray] | None:  # fmt: skip
        """:meth:`run` with ``return_lse`` merged with ``prior``, the ``(out, lse)`` of the
        same query rows over other keys (:func:`qkv.merge` of the two parts): a cascade step's
        own keys after the prefix its sequences share (:mod:`qkv.engine.cascade`). The native
        step merges ``prior`` as it merges its own pieces, so no third array is written.

        ``prior``'s output is ``(batch, kv_heads, group · L, value_dim)`` and its lse
        ``(batch, kv_heads, group · L)``, NumPy arrays of the compute dtype (float64 for a
        float64 plan, else float32), each kv head's rows in the order of ``q``'s heads of that
        kv head and then its positions, each row's elements contiguous. Returns None, with
        nothing merged, where the native step does not run the plan (the NumPy road, tensors,
        a ``prior`` of another dtype or layout, a result that is not finite): the caller then
        runs :meth:`run` and merges the parts itself.
        """
        po, pl = prior
        R = self.heads // self.kv_heads * self.L
        acc = self._acc[0]
        if self._template is None or any(type(x) is not np.ndarray for x in (q, po, pl)):
            return None
        if po.dtype != acc or pl.dtype != acc:
            return None
        n = acc.itemsize
        if po.shape != (self.batch, self.kv_heads, R, self.value_dim) or pl.shape != po.shape[:3]:
            return None
        if po.strides[2:] != (self.value_dim * n, n) or pl.strides[2] != n:
            return None
        if any(x % n for x in po.strides[:2] + pl.strides[:2]):
            return None
        self._operands(q, k, v, k_scale, v_scale)
        return self._native(q, k, v, k_scale, v_scale, True, prior)

    def _operands(self, q: Any, k: Any, v: Any, k_scale: Any, v_scale: Any) -> None:
        """Refuse operands that differ from the plan's (:meth:`_check`), after a quick look
        at the common case: q, k and v as planned and no scales."""
        want = self._keys
        try:
            same = _key(q) == want[0] and _key(k) == want[1] and _key(v) == want[2]
        except AttributeError:
            same = False
        if not same or want[3] is not None:
            self._check((q, k, v) if want[3] is None else (q, k, v, k_scale, v_scale))

    def _native(
        self, q: Any, k: Any, v: Any, k_scale: Any, v_scale: Any, return_lse: bool,
        prior: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[Any, Any] | None:  # fmt: skip
        """:meth:`run` on the native step of checked operands: ``(out, lse)`` (lse None
        without ``return_lse``), or None where the plan has no native step or its result is
        not finite; ``prior`` merged in (:meth:`run_after`)."""
        template = self._template
        if template is not None:
            acc = self._acc
            qc = q
            if self._convert:  # (a copy of one step's rows; K/V are read as they are)
                qc = q.astype(acc[0]) if type(q) is np.ndarray else getattr(q, _TO[acc[1]])()
            shape = (self.batch, self.heads, self.L, self.value_dim)
            if type(q) is np.ndarray:
                out = np.empty(shape, acc[0])
                lse = np.empty(shape[:3], acc[0]) if return_lse else None
            else:
                out = qc.new_empty(shape)
                lse = qc.new_empty(shape[:3]) if return_lse else None
            scales = None if k_scale is None else (_address(k_scale), _address(v_scale))
            status = template.run(
                _address(qc), _address(k), _address(v), _address(out),
                0 if lse is None else _address(lse), scales, prior,
            )  # fmt: skip
            if status == 0:
                if self._cast_out:
                    out = self._cast(out)
                return out, lse
        return None

    def for_runs(self, lo: Any, hi: Any) -> DecodePlan:
        """This plan with sequence ``b`` seeing keys ``[lo[b], hi[b])`` (int arrays of shape
        ``(batch,)``): what changes from one model step to the next while everything else
        stays, planned again at the cost of the keys alone (int64 contiguous arrays are kept
        and read when the plan runs, as with ``seqlens``). Not for a paged plan."""
        if self._table is not None:
            raise InputError("lo: a paged plan's keys come with its block table: plan it again")
        lo, hi = _lengths(lo, "lo", self.batch), _lengths(hi, "hi", self.batch)
        if hi.size and (hi.max() > self.keys or (lo > hi).any()):
            raise InputError(
                f"lo, hi: each sequence's keys [lo, hi) must lie in [0, {self.keys}], got lo "
                f"{lo.tolist()}, hi {hi.tolist()}"
            )
        return self._for_runs(decode.KeyRuns(lo, hi))

    def _for_runs(self, runs: decode.KeyRuns) -> DecodePlan:
        """:meth:`for_runs` of checked int64 runs (:func:`qkv.engine.kernels.decode.key_runs`'
        of a mask row per sequence)."""
        new = object.__new__(DecodePlan)
        for name in self.__slots__:
            setattr(new, name, getattr(self, name))
        new.runs, new._keep = runs, None
        if self._template is not None:
            new._template = self._template.with_runs(runs.lo.ctypes.data, runs.hi.ctypes.data)
        return new

    def _cast(self, out: Any) -> Any:
        """``out`` in the plan's dtype (a tensor by its conversion method)."""
        if type(out) is np.ndarray:
            return out.astype(self.dtype)
        return getattr(out, _TO[self.dtype.name])()

    def _check(self, given: tuple[Any, ...]) -> None:
        """Refuse the first of ``given`` (``q``, ``k``, ``v`` and the scales) that differs from
        the plan's."""
        for i, x in enumerate(given):
            try:
                got = _key(x)
            except AttributeError:
                got = None
            if got != self._keys[i]:
                self._refuse(i, x, got)

    def _refuse(self, i: int, x: Any, got: Any) -> None:
        names = ("q", "k_pages" if self._pages else "k", "v_pages" if self._pages else "v")
        name = (*names, "k_scale", "v_scale")[i]
        seen = f"a {type(x).__name__}" if got is None else _describe(got)
        raise InputError(
            f"{name}: the plan was made for {_describe(self._keys[i])}, got {seen}; plan a "
            "step for operands of another type, dtype, shape or layout with qkv.plan_decode"
        )

    def _numpy(self, q: Any, k: Any, v: Any, k_scale: Any, v_scale: Any, return_lse: bool) -> Any:
        """The NumPy decode road: the plan's keys per sequence as a boolean mask, K/V as their
        stored values (gathered from the pages), on the decode kernel with its retries."""
        qa = _raw(q, "q")
        ka: Any = _raw(k, "k")
        va: Any = _raw(v, "v")
        ks = None if k_scale is None else _raw(k_scale, "k_scale")
        vs = None if v_scale is None else _raw(v_scale, "v_scale")
        if self._table is not None:
            ka, va, ks, vs = (self._gather(x) for x in (ka, va, ks, vs))
        codes, vcodes = ka, va
        if self.kv_format is not None:
            ka, va = dequantize_kv(ka, ks, self.kv_format), dequantize_kv(va, vs, self.kv_format)
        mask = self._keep
        if mask is None and self.runs is not None:
            lo, hi = self.runs
            j = np.arange(self.keys)
            mask = ((j >= lo[:, None]) & (j < hi[:, None]))[:, None, None, :]
        if self.route in (NATIVE_FAST, NUMPY_FAST):  # the fast road's scores, emulated
            keys = (
                None if mask is None else np.broadcast_to(mask[:, 0, 0, :], (self.batch, self.keys))
            )
            q32 = qa.astype(np.float32)
            assert ks is not None and vs is not None  # (int8 K/V carry their row scales)
            o64, l64 = decode_fast.attend(
                q32, codes, ks, vcodes, vs, self.scale, keys=keys, softcap=self.softcap
            )
            out = o64.astype(self.dtype)
            lse = l64.astype(self._acc[0])
            if type(q) is not np.ndarray:
                out = getattr(q.new_tensor(o64.astype(np.float32)), _TO[self.dtype.name])()
                lse = q.new_tensor(lse)
            return (out, lse) if return_lse else out
        options = Options(self.scale, False, mask, softcap=self.softcap)
        out, lse = dispatch.attend(make_plan(qa, ka, va, options), "decode")
        out = out.astype(self.dtype, copy=False)
        if type(q) is not np.ndarray:  # a tensor in, a tensor out
            wide = np.float64 if self.dtype == np.float64 else np.float32
            out = getattr(q.new_tensor(out.astype(wide)), _TO[self.dtype.name])()
            lse = q.new_tensor(lse)
        return (out, lse) if return_lse else out

    def _gather(self, pages: np.ndarray | None) -> np.ndarray | None:
        """Each sequence's rows of ``pages`` (its block table's pages, in order) as
        ``(batch, kv_heads, keys, ·)``; the scales ``(batch, kv_heads, keys)``."""
        if pages is None or self._table is None:
            return None
        size = pages.shape[1]
        pos = np.arange(self.keys)
        x = pages[self._table[:, pos // size], pos % size]  # (batch, keys, kv_heads, ·)
        return np.moveaxis(x, 2, 1)


@near_keywords()
def plan_decode(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: Any = None,
    softcap: Any = None,
    mask: Any = None,
    seqlens: Any = None,
    starts: Any = None,
    block_table: Any = None,
    kv_format: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    threads: int | None = None,
    precision: str = "exact",
) -> DecodePlan:
    """Plan a decoding step once, to run it on every layer (:meth:`DecodePlan.run`).

    FlashInfer's ``plan()``: everything the layers of a model's step share is read and
    checked here — the sizes and grouping, the dtypes, the stored form, the scale and
    soft-cap, and which keys each sequence sees — and the router chooses the kernel
    (:attr:`DecodePlan.route`). Only the operands' dtypes, shapes and strides are read from
    ``q``, ``k`` and ``v`` (any layer's), never their values.

    Parameters
    ----------
    q : ndarray or CPU tensor, shape ``(batch, heads, L, head_dim)``
        float32 or float64 (float16/bfloat16: computed in float32). Each query sees all of its
        sequence's keys (a decoding step: no causal structure among the ``L`` rows).
    k, v : ndarray or CPU tensor, shapes ``(batch, kv_heads, S, head_dim)`` and
        ``(batch, kv_heads, S, value_dim)``
        ``heads`` a multiple of ``kv_heads`` (grouped-query attention). Or, with
        ``block_table``, pools of pages ``(num_blocks, page_size, kv_heads, ·)``
        (FlashAttention's layout; :func:`qkv.engine.paged.attend_pages`).
    scale, softcap
        As in :func:`qkv.attention`.
    mask : boolean (or ``0``/``-inf`` float) array or tensor, shape ``(batch or 1, 1, 1, S)``
        Which keys each sequence sees (``True``: may attend), read once here. Where each row is
        one run of keys (a padded batch's real tokens, a filled prefix, a sliding window) the
        native step reads only that run; any other mask runs on the NumPy road.
    seqlens, starts : array_like of int, shape ``(batch,)``
        Or: sequence ``b`` sees keys ``[starts[b], seqlens[b])`` (``starts`` default 0).
        int64 arrays with a contiguous layout are kept, not copied: the plan reads them when it
        runs (a cache updating its lengths in place needs no new plan). Required with
        ``block_table``.
    block_table : array_like of int, shape ``(batch, max_blocks)``
        Reads K/V from pages: key ``p`` of sequence ``b`` is row ``p % page_size`` of page
        ``block_table[b, p // page_size]``; ``S`` is ``max_blocks * page_size``.
    kv_format : str, optional
        ``k``/``v`` hold the codes of a stored form (:func:`qkv.quantize_kv`): ``"bfloat16"``
        (uint16 bits), ``"int8"`` and ``"float8_e4m3fn"`` with their float32 ``k_scale`` and
        ``v_scale``, ``k``'s shape without its last axis.
    threads : int, optional
        Threads of the native step (default: PyTorch's team when PyTorch is imported, else
        qkv's).
    precision : {"exact", "fast"}, optional
        ``"exact"`` (default): every product in float32 of the stored values. ``"fast"`` (opt
        in, int8 K/V): each query row rounded to int8 (one scale per row and head) and its
        products with the keys' codes taken in int32 (:mod:`qkv.engine.kernels.decode_fast`).
        Each score then moves by at most ``ε = scale · (max|q| / 254) · Σ_i |k_i|`` and the
        output by at most ``(e^{2ε} − 1) · max|v|`` from the exact road's. On K/V of any
        other form (floats, bfloat16, float16, float8) ``"fast"`` runs the exact road, and
        :attr:`DecodePlan.refused` says so.

    Returns
    -------
    DecodePlan

    Raises
    ------
    InputError
        Shapes that disagree, heads that do not group, a bad scale or soft-cap, a mask of
        another shape, lengths beyond ``S``: named, with the shapes.

    Examples
    --------
    One plan, run on two layers' q, K and V; each equals the reference:

    >>> import numpy as np
    >>> import qkv
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 8, 1, 16)).astype(np.float32)   # 2 sequences, 8 heads
    >>> k, v = rng.standard_normal((2, 2, 2, 50, 16)).astype(np.float32)  # 2 kv heads
    >>> plan = qkv.plan_decode(q, k, v, seqlens=[50, 20])
    >>> plan.route in ("native decode", "NumPy decode")
    True
    >>> for layer in range(2):
    ...     q2, k2, v2 = q + layer, k * (layer + 1), v - layer
    ...     out = plan.run(q2, k2, v2)
    ...     want = qkv.attention(q2[1], k2[1, :, :20], v2[1, :, :20])
    ...     assert np.allclose(out[1], want, atol=1e-5)
    """
    precision = decode_fast.check_precision(precision)
    form = None if kv_format is None else check_format(kv_format, "kv_format")
    if form == "float16":
        form = None  # float16 arrays are read as what they are
    paged = block_table is not None
    qa = _raw(q, "q")
    if qa.dtype.kind != "f" and qa.dtype.name != "bfloat16":
        raise InputTypeError(f"q: expected floats, got {qa.dtype} of shape {qa.shape}")
    pair = []
    for name, x in (("k_pages" if paged else "k", k), ("v_pages" if paged else "v", v)):
        a = _raw(x, name) if form is not None else as_array(x, name, narrow=True)
        if form is not None and a.dtype != storage_dtype(form):
            raise InputTypeError(
                f"{name}: kv_format={form!r} stores its codes as {storage_dtype(form)}, got "
                f"{a.dtype}"
            )
        pair.append(a)
    ka, va = pair
    for name, a in (("q", qa), ("k", ka), ("v", va)):
        if a.ndim != 4:
            want = "(num_blocks, page_size, kv_heads, ·)" if paged and name != "q" else (
                "(batch, heads, L, ·)" if name == "q" else "(batch, kv_heads, S, ·)"
            )  # fmt: skip
            raise InputError(f"{name}: expected 4 axes {want}, got shape {a.shape}")
    B, H, L, d = qa.shape
    table = None
    hi: np.ndarray | None
    if paged:
        nb, page, kvh, _ = ka.shape
        if va.shape[:3] != ka.shape[:3] or page < 1:
            raise InputError(
                "k_pages, v_pages: (num_blocks, page_size, kv_heads) differ or are empty: "
                f"k_pages has shape {ka.shape}, v_pages {va.shape}"
            )
        if seqlens is None:
            raise InputError("seqlens: a paged plan needs each sequence's length")
        table, hi = check_table(block_table, seqlens, B, nb, page)
        S = table.shape[1] * page
    else:
        kvh, S = ka.shape[1], ka.shape[2]
        if ka.shape[0] != B or va.shape[0] != B:
            raise InputError(
                f"k, v: expected batch {B} (q has shape {qa.shape}), got k {ka.shape}, v {va.shape}"
            )
        hi = None if seqlens is None else _lengths(seqlens, "seqlens", B)
    dv = va.shape[-1]
    scales = _scales(form, ka.shape[:3], k_scale, v_scale)
    values = np.dtype(np.float32) if form is not None else va.dtype
    out_dtype = np.result_type(qa.dtype, values)
    acc = numerics.acc_dtype(out_dtype)
    # The call checked as qkv.attention checks it, against stand-ins of the K/V's shapes
    plan = make_plan(
        stand_in(qa.dtype, qa.shape),
        stand_in(acc, (B, kvh, S, ka.shape[-1])),
        stand_in(acc, (B, kvh, S, dv)),
        Options(scale, softcap=softcap),
    )
    runs, keep, why = _keys_seen(mask, hi, starts, B, S, paged)
    return plan_checked(
        plan, q, k, v, form=form, runs=runs, keep=keep, why=why, table=table, read=(qa, ka, va),
        scales=(k_scale, v_scale) if scales else None, out_dtype=out_dtype, threads=threads,
        precision=precision,
    )  # fmt: skip


def _scales(form: str | None, shape: tuple[int, ...], k_scale: Any, v_scale: Any) -> bool:
    """Whether the plan has 8-bit scales (checked against ``shape``, K's without its last
    axis)."""
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if form not in SCALED:
            if x is not None:
                raise InputError(f"{name}: only the 8-bit forms {SCALED} have scales, got one")
            continue
        if x is None:
            raise InputError(f"{name}: kv_format={form!r} needs its float32 scales, shape {shape}")
        a = _raw(x, name)
        if a.shape != shape or a.dtype != np.float32:
            raise InputError(
                f"{name}: expected float32 scales of shape {shape}, got {a.dtype} {a.shape}"
            )
    return form in SCALED


def _keys_seen(
    mask: Any, hi: np.ndarray | None, starts: Any, B: int, S: int, paged: bool
) -> tuple[decode.KeyRuns | None, np.ndarray | None, str | None]:
    """``(runs, mask, why)``: each sequence's run of keys (or None: every key), the boolean
    mask when its rows are not single runs (then ``why`` says so, for the router)."""
    if mask is not None and (hi is not None or starts is not None or paged):
        raise InputError("mask: give either a mask or seqlens/starts, not both")
    if mask is None:
        if hi is None:
            if starts is not None:
                raise InputError("starts: give seqlens with it")
            return None, None, None
        lo = np.zeros(B, np.int64) if starts is None else _lengths(starts, "starts", B)
        if hi.size and (hi.max() > S or (lo > hi).any()):
            raise InputError(
                f"seqlens, starts: each sequence's keys [starts, seqlens) must lie in [0, S={S}],"
                f" got starts {lo.tolist()}, seqlens {hi.tolist()}"
            )
        return decode.KeyRuns(lo, hi), None, None
    m = _raw(mask, "mask")
    if m.ndim != 4 or m.shape[1:] != (1, 1, S) or m.shape[0] not in (1, B):
        raise InputError(
            f"mask: expected shape (batch={B} or 1, 1, 1, S={S}): the keys each sequence sees,"
            f" got {m.shape}"
        )
    if m.dtype != bool:
        if m.dtype.kind != "f" and m.dtype.name != "bfloat16":
            raise InputTypeError(f"mask: expected booleans or 0/-inf floats, got {m.dtype}")
        keep = m == 0
        if not (keep | (m == -np.inf)).all():
            raise InputError("mask: a float mask of a decode plan holds only 0 and -inf")
        m = keep
    rows = np.broadcast_to(m[:, 0, 0, :], (B, S))
    runs = decode.key_runs(rows)
    if runs is None:
        return None, np.array(m), "a mask row is not one run of keys"
    return runs, None, None


def plan_checked(
    plan: Plan,
    q: Any,
    k: Any,
    v: Any,
    *,
    form: str | None = None,
    runs: decode.KeyRuns | None = None,
    keep: np.ndarray | None = None,
    why: str | None = None,
    table: np.ndarray | None = None,
    scales: tuple[Any, Any] | None = None,
    out_dtype: Any = None,
    threads: int | None = None,
    read: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    precision: str = "exact",
    causal: bool = False,
) -> DecodePlan:
    """:func:`plan_decode` for a call its caller checked (``plan``, made against stand-ins
    of the K/V's shapes in the compute dtype; a cache's own options): ``q``, ``k``, ``v``
    (pages with ``table``) the operands to run on (``read``: as NumPy views, when the caller
    has them), ``runs`` each sequence's keys, ``precision`` checked
    (:func:`qkv.engine.kernels.decode_fast.check_precision`). ``causal``: the native step's
    ``L`` rows bottom-right causal on each sequence's keys (its other roads ignore it: see
    :func:`causal_rows`)."""
    qa, ka, va = read or (_raw(q, "q"), _raw(k, "k"), _raw(v, "v"))
    acc = plan.acc_dtype
    out_dtype = np.dtype(plan.out_dtype if out_dtype is None else out_dtype)
    B, H, L, d = qa.shape
    dv = plan.dv
    if table is not None:  # (the keys a sequence may hold: its operands', not the plan's)
        kvh, S = ka.shape[2], table.shape[1] * ka.shape[1]
    else:
        kvh, S = ka.shape[1], ka.shape[2]
    stored = _form(acc, ka, va, form)
    if why is None and stored is None:
        why = f"K/V of {ka.dtype} (and {va.dtype}) computed in {acc}"
    narrow = form is not None or ka.dtype.itemsize < 4
    q_layout = k_layout = v_layout = None
    scale_layouts = None
    if why is None:
        # q's own strides when it is in the compute dtype, else those of its converted copy
        if qa.dtype == acc:
            q_layout = native_decode._operand(qa, 1)
        else:
            q_layout = native_decode.layout(qa.shape, (H * L * d, L * d, d, 1), 1)
        if table is not None:
            k_layout, v_layout = native_decode._pages(ka), native_decode._pages(va)
        else:
            k_layout, v_layout = native_decode._operand(ka, 1), native_decode._operand(va, 1)
        if scales is not None:
            found = []
            for x in scales:
                a = _raw(x, "scales")
                if table is not None:
                    found.append(native_decode._pages(a))
                elif all(st % 4 == 0 for st in a.strides):
                    strides = (*(st // 4 for st in a.strides), 1)
                    found.append(native_decode.layout((*a.shape, 1), strides, 1))
                else:
                    found.append(None)
            ks_layout, vs_layout = found
            if ks_layout is not None and vs_layout is not None:
                scale_layouts = (ks_layout, vs_layout)
            else:
                why = "the scales' strides (their outer axes do not collapse)"
        if q_layout is None or k_layout is None or v_layout is None:
            why = "the operands' strides (a last axis not contiguous, or axes that do not fit)"
    walk = router.decode_plan(
        plan, narrow, why, precision=precision, kv_format=stored if stored else None
    )
    route = walk[-1][0]
    template = None
    if route in (NATIVE, NATIVE_FAST):
        assert q_layout is not None and k_layout is not None and v_layout is not None
        native = native_decode.DecodePlan.plan(
            (B, H, kvh, L, d, dv, S), f64=acc == np.float64, scale=plan.scale,
            softcap=plan.softcap, kv_format=stored or None, runs=runs, threads=threads,
            precision="fast" if route == NATIVE_FAST else "exact", causal=causal,
        )  # fmt: skip
        pages = None
        if table is not None:
            rs = table.strides[0] // 4 if table.shape[0] > 1 else table.shape[1]
            pages = (table.ctypes.data, rs, ka.shape[1], ka.shape[0])
        if native is not None:
            template = native_decode.template(
                native, q_layout, k_layout, v_layout, scales=scale_layouts, pages=pages
            )
        if template is None:
            fast = route == NATIVE_FAST
            route, walk = (
                (NUMPY_FAST if fast else NUMPY),
                [
                    (NATIVE_FAST if fast else NATIVE, "the native library is not loaded"),
                    (NUMPY_FAST if fast else NUMPY, ""),
                ],
            )
    keys: list[Any] = [_key(q), _key(k), _key(v)]
    keys += [None, None] if scales is None else [_key(scales[0]), _key(scales[1])]
    return DecodePlan(
        route=route, refused=walk[:-1], batch=B, heads=H, kv_heads=kvh, L=L, head_dim=d,
        value_dim=dv, keys=S, scale=plan.scale, softcap=plan.softcap, kv_format=form,
        precision=precision,
        dtype=out_dtype, runs=runs, _acc=(acc, acc.name), _keep=keep, _keys=tuple(keys),
        _pages=table is not None, _table=table, _template=template,
        _convert=qa.dtype != acc, _cast_out=out_dtype != acc,
    )  # fmt: skip


def causal_rows(
    plan: Plan,
    q: np.ndarray,
    k: Any,
    v: Any,
    lo: np.ndarray,
    hi: np.ndarray,
    last: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    *,
    form: str | None = None,
    table: np.ndarray | None = None,
    scales: tuple[Any, Any] | None = None,
    precision: str = "exact",
) -> tuple[np.ndarray, np.ndarray] | None:
    """A checked causal ``plan`` of several query rows ``q (batch, heads, L, d)`` on the
    decode step (:mod:`qkv.engine.kernels.causal_rows`), sequence ``b`` seeing keys
    ``[lo[b], hi[b])`` from its last row, ``k`` and ``v`` pages with ``table``: the native
    step with its rows causal (:func:`plan_checked`). The NumPy emulation of the fast road
    has no causal rows: there the keys all rows see go in one unmasked step, merged with the
    last ``L − 1`` keys, which ``last(valid, positions)`` gives: the keys and values at
    ``positions (batch, L − 1)`` (any finite stand-in where ``valid`` is False) as
    ``(batch, kv_heads, L − 1, ·)`` arrays in the compute dtype. ``(out, lse)`` in the
    compute dtype; None where the step has no native road (nor the NumPy emulation of the
    fast one) or a result is not finite: the caller's general road then runs."""
    rows = q.shape[2]
    acc = plan.acc_dtype
    ks, vs = (None, None) if scales is None else scales
    step = plan_checked(
        plan.but(causal=False), q, k, v, form=form, runs=decode.KeyRuns(lo, hi), table=table,
        out_dtype=acc, scales=scales, precision=precision, causal=True,
    )  # fmt: skip
    if step.route in (NATIVE, NATIVE_FAST):
        return step._native(q, k, v, ks, vs, True)
    if step.route != NUMPY_FAST:
        return None
    step = plan_checked(
        plan.but(causal=False), q, k, v, form=form,
        runs=decode.KeyRuns(lo, np.maximum(hi - (rows - 1), lo)), table=table,
        out_dtype=acc, scales=scales, precision=precision,
    )  # fmt: skip
    found = step.run(q, k, v, k_scale=ks, v_scale=vs, return_lse=True)
    pos, seen = kernels_causal_rows.last_keys(lo, hi, rows)
    kt, vt = last(seen[:, 0, -1], pos)
    out, lse = kernels_causal_rows.with_tail(
        found, q.astype(acc, copy=False), kt, vt, seen, plan.scale, plan.softcap
    )
    return (out, lse) if np.isfinite(out).all() else None


def _contiguous(shape: tuple[int, ...], item: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of ``shape``."""
    strides, n = [], item
    for size in reversed(shape):
        strides.append(n)
        n *= max(size, 1)
    return tuple(reversed(strides))

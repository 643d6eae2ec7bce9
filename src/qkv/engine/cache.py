"""A KV cache for a batch of sequences of different lengths, for autoregressive decoding.

Each sequence's keys and values live in one growing buffer per batch, shaped
``(batch, kv_heads, capacity, head_dim)``; when a sequence outgrows it the capacity doubles,
so appends cost amortised O(1) per token and a sequence's cache is always a plain contiguous
view (no gather before attending). Attention goes through the same dispatch and kernels as
:func:`qkv.attention`, so it equals :func:`qkv.reference.attention` on each sequence.

The buffers may hold K/V in fewer bytes than float32 (:mod:`qkv.engine.quant`: bfloat16,
float16, int8 or float8 e4m3fn with a scale per token and head). A decoding step then reads
them in place: every sequence, each with its own length, in one call of the native decode
kernel (:mod:`qkv.engine.kernels.native_decode`); it equals the reference applied to the
stored values (:func:`qkv.dequantize_kv`). Where that kernel does not serve a call, the
stored values are widened and the call takes the general road.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from .. import numerics
from ..checks import check_int
from ..errors import InputError
from ..keywords import near_keywords
from ..options import Options
from ..validate import (
    VARIANTS,
    Plan,
    as_array,
    broadcasts_to,
    check_flag,
    check_variants,
    make_plan,
    stand_in,
)
from .decoding import NATIVE, NATIVE_FAST, NUMPY_FAST, DecodePlan, causal_rows, plan_checked
from .kernels import decode, dispatch, mods, native_decode, router
from .kernels.decode_fast import check_precision
from .quant import SCALED, dequantize_kv, quantize_kv, storage_dtype
from .quant import storage_of as _storage

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of ``batch`` sequences, each with its own length.

    Parameters
    ----------
    batch : int
        Number of sequences.
    kv_heads : int
        Key/value heads (query heads may be any multiple: grouped-query attention).
    head_dim : int
        Size ``d`` of each key (and query).
    value_dim : int, optional
        Size ``dv`` of each value (default ``head_dim``).
    dtype : float dtype or str, optional
        How keys and values are stored (default float32): ``float16``, ``float32`` or
        ``float64``, to which appended arrays are cast; or ``"bfloat16"``, ``"int8"`` or
        ``"float8_e4m3fn"`` (:func:`qkv.quantize_kv` states each form), computed in float32.
        Results come back in ``q``'s dtype, promoted with a float dtype's.

    Examples
    --------
    Decoding token by token through the cache equals causal attention over the whole sequence:

    >>> import numpy as np
    >>> import qkv
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 1, 2, 5, 4))   # batch 1, 2 heads, 5 tokens, d = 4
    >>> cache = qkv.KVCache(1, 2, 4, dtype=np.float64)
    >>> steps = []
    >>> for t in range(5):
    ...     cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    ...     steps.append(cache.attend(q[:, :, t : t + 1]))
    >>> bool(np.allclose(np.concatenate(steps, axis=2), qkv.attention(q, k, v, causal=True)))
    True
    >>> cache.lengths.tolist()
    [5]

    Sequences may differ in length; append to one of them with ``seq``:

    >>> cache = qkv.KVCache(2, 1, 4)
    >>> cache.append(np.ones((1, 3, 4)), np.ones((1, 3, 4)), seq=1)
    >>> cache.lengths.tolist()
    [0, 3]
    """

    @near_keywords()
    def __init__(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: Any = np.float32,
    ) -> None:
        self.batch = check_int(batch, "batch", minimum=1)
        self.kv_heads = check_int(kv_heads, "kv_heads", minimum=1)
        self.head_dim = check_int(head_dim, "head_dim", minimum=1)
        self.value_dim = (
            self.head_dim if value_dim is None else check_int(value_dim, "value_dim", minimum=1)
        )
        self.dtype, self._form = _storage(dtype)
        code = storage_dtype(self._form) if self._form else self.dtype
        self._lengths = np.zeros(self.batch, dtype=np.int64)
        self._k: np.ndarray = np.empty((self.batch, self.kv_heads, 0, self.head_dim), code)
        self._v: np.ndarray = np.empty((self.batch, self.kv_heads, 0, self.value_dim), code)
        scaled = self._form in SCALED
        self._ks: np.ndarray | None = np.empty((self.batch, self.kv_heads, 0), np.float32)
        self._vs: np.ndarray | None = np.empty((self.batch, self.kv_heads, 0), np.float32)
        if not scaled:
            self._ks = self._vs = None
        self._first = np.zeros(self.batch, dtype=np.int64)  # each sequence's first key seen
        # The last native step a checked call took, with what that call's checks and plan
        # depended on: a call that differs only in q's values and the cache's lengths runs
        # it again (see attend). Dropped when the buffers move.
        self._planned: tuple[tuple[Any, ...], DecodePlan] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a copy (deepcopy, pickle) plans its own step: the kept one addresses these buffers
        # and lengths
        state = self.__dict__.copy()
        state["_planned"] = None
        return state

    def __copy__(self) -> KVCache:
        """An independent cache: ``copy.copy`` copies the buffers and lengths too, as
        ``deepcopy`` does. A cache that shared them with its original would append into the
        original's rows, and grow its lengths past the original's buffers."""
        twin = object.__new__(type(self))
        state = self.__getstate__()
        twin.__dict__.update(
            {n: a.copy() if isinstance(a, np.ndarray) else a for n, a in state.items()}
        )
        return twin

    @property
    def lengths(self) -> np.ndarray:
        """Tokens cached for each sequence, shape ``(batch,)`` (a copy)."""
        return self._lengths.copy()

    @property
    def capacity(self) -> int:
        """Tokens each sequence can hold before the buffers grow (they double)."""
        return self._k.shape[2]

    def __repr__(self) -> str:
        return (
            f"KVCache(batch={self.batch}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
            f"value_dim={self.value_dim}, dtype={self.dtype}, lengths={self._lengths.tolist()})"
        )

    def _check_seq(self, seq: Any) -> int:
        seq = check_int(seq, "seq")
        if not 0 <= seq < self.batch:
            raise InputError(f"seq: {seq} is out of range for a cache of batch {self.batch}")
        return seq

    def _reserve(self, need: int) -> None:
        """Make room for ``need`` tokens per sequence, at least doubling the capacity."""
        cap = self.capacity
        if need <= cap:
            return
        new = max(need, 2 * cap, 16)
        used = int(self._lengths.max())
        # All or nothing: every buffer is allocated before any replaces the old one, so a
        # MemoryError leaves the cache exactly as it was.
        grown: list[np.ndarray | None] = []
        for old in (self._k, self._v, self._ks, self._vs):
            if old is None:
                grown.append(None)
                continue
            # zeroed, not empty: the general road reads every sequence up to the longest one,
            # so a shorter sequence's rows past its length must hold numbers (an uninitialised
            # signalling NaN warns when a float64 call widens it), and calloc's pages cost
            # nothing until written
            buf = np.zeros(old.shape[:2] + (new,) + old.shape[3:], dtype=old.dtype)
            buf[:, :, :used] = old[:, :, :used]
            grown.append(buf)
        k, v, self._ks, self._vs = grown
        assert k is not None and v is not None
        self._k, self._v = k, v
        self._planned = None  # its operands address the old buffers

    def _write(self, where: tuple[Any, ...], k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k`` and ``v`` at ``where`` (an index of the buffers' first three axes), in
        the cache's form."""
        if not self._form or self._form == "float16":
            self._k[where] = k
            self._v[where] = v
            return
        for name, x, buf, scales in (("k", k, self._k, self._ks), ("v", v, self._v, self._vs)):
            try:
                codes, sc = quantize_kv(x, self._form)
            except InputError as exc:
                raise InputError(f"{name}: {str(exc).split(': ', 1)[1]}") from None
            buf[where] = codes
            if scales is not None:
                scales[where] = sc

    @near_keywords()
    def append(self, k: Any, v: Any, seq: int | None = None) -> None:
        """Add ``T >= 1`` tokens to every sequence, or to sequence ``seq`` alone.

        Parameters
        ----------
        k, v : array_like
            With ``seq=None``: shapes ``(batch, kv_heads, T, head_dim)`` and
            ``(batch, kv_heads, T, value_dim)``; each sequence gets its slice after its own last
            token. With ``seq``: shapes ``(kv_heads, T, head_dim)`` and
            ``(kv_heads, T, value_dim)``.
        seq : int, optional
            The sequence to append to.
        """
        ka, va = as_array(k, "k"), as_array(v, "v")
        lead = (self.kv_heads,) if seq is not None else (self.batch, self.kv_heads)
        which = "" if seq is None else f" for seq={seq}"
        for name, a, dim, dname in (
            ("k", ka, self.head_dim, "head_dim"),
            ("v", va, self.value_dim, "value_dim"),
        ):
            want = lead + ("T", dim)
            if a.ndim != len(want) or a.shape[: len(lead)] != lead or a.shape[-1] != dim:
                raise InputError(
                    f"{name}: expected shape {want}{which} ({dname}={dim}), got {a.shape}"
                )
        T = ka.shape[-2]
        if va.shape[-2] != T:
            raise InputError(f"k, v: token counts T differ: k has shape {ka.shape}, v {va.shape}")
        if T < 1:
            raise InputError(f"k: expected at least one token (T >= 1), got shape {ka.shape}")
        if seq is None:
            lengths = self._lengths.tolist()  # (as Python ints: NumPy's max and all on a few
            # lengths cost more than the copy of one token)
            self._reserve(max(lengths) + T)
            if lengths.count(lengths[0]) == len(lengths):
                n = lengths[0]
                self._write((slice(None), slice(None), slice(n, n + T)), ka, va)
            else:
                for b, n in enumerate(lengths):
                    self._write((b, slice(None), slice(n, n + T)), ka[b], va[b])
            self._lengths += T
        else:
            b = self._check_seq(seq)
            n = int(self._lengths[b])
            self._reserve(n + T)
            self._write((b, slice(None), slice(n, n + T)), ka, va)
            self._lengths[b] += T

    @near_keywords()
    def keys(self, seq: int) -> np.ndarray:
        """Cached keys of sequence ``seq``, shape ``(kv_heads, length, head_dim)``: a view of
        a float dtype's buffer, or the stored values of another form (a float32 copy)."""
        b = self._check_seq(seq)
        return self._values(self._k, self._ks, (b, slice(None), slice(0, self._lengths[b])))

    @near_keywords()
    def values(self, seq: int) -> np.ndarray:
        """Cached values of sequence ``seq``, shape ``(kv_heads, length, value_dim)``: a view
        of a float dtype's buffer, or the stored values of another form (a float32 copy)."""
        b = self._check_seq(seq)
        return self._values(self._v, self._vs, (b, slice(None), slice(0, self._lengths[b])))

    def _values(
        self, codes: np.ndarray, scales: np.ndarray | None, where: Any, like: Any = None
    ) -> np.ndarray:
        """The stored values at ``where``: a view of a float dtype's buffer, a copy of another
        form's dequantized, or, for bfloat16 codes and a ``like`` dtype that says where
        ml_dtypes' bfloat16 type is (q's own, or the module if imported), a view as that type
        (the same numbers, read in place by the kernels that take stored K/V)."""
        if not self._form or self._form == "float16":
            return codes[where]
        if self._form == "bfloat16" and like is not None:
            bf16 = like if np.dtype(like).name == "bfloat16" else None
            bf16 = bf16 or getattr(sys.modules.get("ml_dtypes"), "bfloat16", None)
            if bf16 is not None:
                return codes[where].view(bf16)
        return dequantize_kv(codes[where], None if scales is None else scales[where], self._form)

    @near_keywords(VARIANTS)
    def attend(
        self,
        q: Any,
        *,
        scale: Any = None,
        causal: bool = True,
        window: Any = None,
        return_lse: bool = False,
        kernel: str = "auto",
        precision: str = "exact",
        **variants: Any,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Attention of new queries to each sequence's cache.

        Parameters
        ----------
        q : array_like, shape ``(batch, heads, Lq, head_dim)``
            ``heads`` a multiple of ``kv_heads``. The ``Lq`` queries of sequence ``b`` are its
            last ``Lq`` positions (bottom-right causal): row ``i`` sits at position
            ``length_b - Lq + i`` and sees the keys up to it. Append their keys first.
        scale : float, optional
            As in :func:`qkv.attention`.
        causal : bool, optional
            Default True (decoding); False lets every query see the whole cache.
        window, kernel
            As in :func:`qkv.attention`; positions are counted within each sequence.
        return_lse : bool, optional
            Also return the log-sum-exp, shape ``(batch, heads, Lq)``.
        precision : {"exact", "fast"}, optional
            ``"fast"`` opts an int8 cache into the decode step's fast road
            (:func:`qkv.plan_decode`: q rounded to int8, its error bound there), where the
            decode step serves the call (one query row, several with ``causal=False``, or a
            few causal ones, :func:`qkv.engine.kernels.router.causal_chunk_fits`); elsewhere, and
            on caches of any other dtype, the exact road runs.
        **variants
            ``softcap``, ``sinks``, ``alibi_slopes``, ``score_mod``, ``mask_mod`` as in
            :func:`qkv.attention`; positions are each sequence's own, ``batch`` its index.
            ``sinks`` and ``alibi_slopes`` may also hold one value per sequence and head,
            shape ``(batch, heads)``.

        Returns
        -------
        array of ``q``'s type, shape ``(batch, heads, Lq, value_dim)``
            An ndarray for array input, a tensor for a CPU tensor ``q`` (``qkv.KVCache``).
            Equal to ``qkv.attention(q[b], cache.keys(b), cache.values(b), causal=causal, ...)``
            for every sequence ``b``; a sequence with no cached keys gives zeros. With
            ``return_lse``, the pair ``(out, lse)``.
        """
        planned = self._planned
        if planned is not None and not variants and window is None:
            if _call_key(q, scale, causal, return_lse, kernel, precision) == planned[0]:
                if native_decode.available():  # else the checked road below decides
                    return planned[1].run(
                        q, self._k, self._v, k_scale=self._ks, v_scale=self._vs,
                        return_lse=return_lse,
                    )  # fmt: skip
        kernel = dispatch.check_kernel(kernel)
        precision = check_precision(precision)
        check_flag(return_lse, "return_lse")
        check_variants("KVCache.attend", variants)
        qa = as_array(q, "q")
        if qa.ndim != 4 or qa.shape[0] != self.batch or qa.shape[-1] != self.head_dim:
            raise InputError(
                f"q: expected shape (batch={self.batch}, heads, Lq, head_dim={self.head_dim}), "
                f"got {qa.shape}"
            )
        heads, Lq = qa.shape[1], qa.shape[2]
        if heads % self.kv_heads:
            raise InputError(
                f"q: {heads} query heads cannot share {self.kv_heads} kv heads: q has shape "
                f"{qa.shape}, the cache holds {self.kv_heads} kv heads"
            )
        options = Options(scale, causal, None, window, **self._per_head_variants(variants, heads))
        lengths = self._lengths.tolist()
        longest = max(lengths)
        if kernel in ("auto", "decode"):
            again = None
            if not variants and window is None and longest > 0 and qa is q:
                again = _call_key(q, scale, causal, return_lse, kernel, precision)
            found, checked = self._attend_native(qa, longest, options, again, precision)
            if found is not None:
                out, lse = found
                return (out, lse) if return_lse else out
        else:
            checked = None
        # One check, over every sequence against the longest; then one part of that checked
        # plan per run of neighbouring sequences of equal length (one part when all are equal),
        # which the kernels run together, the decode ones in one parallel pass.
        keys = self._values(self._k, self._ks, np.s_[:, :, :longest], qa.dtype)
        vals = self._values(self._v, self._vs, np.s_[:, :, :longest], qa.dtype)
        if checked is not None and checked.k.dtype == keys.dtype == vals.dtype:
            # the native road's plan, checked against stand-ins of these very shapes and dtype
            whole = replace(checked, k=keys, v=vals)  # (no second check: one make_plan a call)
        else:  # (bfloat16 codes as bfloat16 views: the kernels read them as stored)
            whole = make_plan(qa, keys, vals, options, keep_stored=True)
        out = np.zeros((self.batch, heads, Lq, self.value_dim), dtype=whole.out_dtype)
        lse = np.full((self.batch, heads, Lq), -np.inf, dtype=whole.acc_dtype)
        runs, start = [], 0
        for stop in range(1, self.batch + 1):
            if stop == self.batch or lengths[stop] != lengths[start]:
                runs.append((slice(start, stop), lengths[start]))
                start = stop
        plans = [whole.sequences(sl, n, **_offset_batch(whole, sl.start)) for sl, n in runs]
        for (sl, _), (o, s) in zip(runs, dispatch.attend_many(plans, kernel), strict=True):
            out[sl] = o
            lse[sl] = s
        return (out, lse) if return_lse else out

    def _attend_native(
        self,
        qa: np.ndarray,
        longest: int,
        options: Options,
        again: tuple[Any, ...] | None,
        precision: str = "exact",
    ) -> tuple[tuple[np.ndarray, np.ndarray] | None, Plan | None]:
        """Every sequence in one native decode call on the stored buffers, each sequence its
        own run of keys: ``(out, lse)``, or None where the kernel does not serve the call; and
        the plan checked on the way (None where none was made).

        The call is checked as the general road checks it (:func:`make_plan`), against
        zero-stride stand-ins of the buffers' shapes (nothing is read or copied). The step
        reads the cache's lengths when it runs, so with ``again`` (the call's
        :func:`_call_key`) it is kept for the calls that differ from this one only in
        ``q``'s values and the lengths (:meth:`attend`). ``precision="fast"`` on an int8
        cache: the fast road, emulated in NumPy where the native step is off.
        """
        value_dtype = np.dtype(np.float32) if self._form not in (None, "float16") else self.dtype
        out_dtype = np.result_type(qa.dtype, value_dtype)
        # stand-ins in the compute dtype (float16's is float32), so that none is widened
        stand = numerics.acc_dtype(out_dtype)
        plan = make_plan(
            qa,
            stand_in(stand, (self.batch, self.kv_heads, longest, self.head_dim)),
            stand_in(stand, (self.batch, self.kv_heads, longest, self.value_dim)),
            options,
        )
        hi, lo = self._lengths, self._first  # read by the kernel as it runs
        nbytes = int(hi.sum()) * self.kv_heads * (self.head_dim + self.value_dim)
        if router.causal_rows_step(plan, self._form is not None, nbytes * self._k.itemsize):
            if router.cache_rows_on_prefill(plan, self._form is not None):
                return None, plan  # (the general road below: the prefill takes these rows)
            # several causal rows on the step (see causal_rows)
            found = causal_rows(
                plan, qa, self._k, self._v, lo, hi, self._last_keys(stand),
                form=self._form if self._form != "float16" else None,
                scales=None if self._ks is None else (self._ks, self._vs), precision=precision,
            )  # fmt: skip
            if found is None:
                return None, plan
            out = found[0].astype(out_dtype, copy=False)
            return mods.with_sinks(plan, out, found[1]), plan
        if plan.window is not None and plan.window[0] is not None:
            lo = np.maximum(hi - 1 - plan.window[0], 0)  # the one query sits at length - 1
        step = plan_checked(
            plan, qa, self._k, self._v, form=self._form if self._form != "float16" else None,
            runs=decode.KeyRuns(lo, hi), out_dtype=out_dtype,
            scales=None if self._ks is None else (self._ks, self._vs), precision=precision,
        )  # fmt: skip
        if step.route not in (NATIVE, NATIVE_FAST, NUMPY_FAST):  # (the router's reason: refused)
            return None, plan
        out, lse = step.run(
            qa, self._k, self._v, k_scale=self._ks, v_scale=self._vs, return_lse=True
        )
        if again is not None and lo is self._first:  # (a window's starts depend on the lengths)
            self._planned = (again, step)  # q is the caller's array (no copy)
        return mods.with_sinks(plan, out, lse), plan

    def _last_keys(
        self, acc: np.dtype
    ) -> Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """The keys and values at ``positions (batch, n)`` of each sequence, ``(batch,
        kv_heads, n, ·)`` in the compute dtype ``acc`` (:func:`causal_rows`'s ``last``)."""

        def last(valid: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            at = (np.arange(self.batch)[:, None], slice(None), pos)  # -> (batch, n, kv_heads, ·)
            k, v = self._values(self._k, self._ks, at), self._values(self._v, self._vs, at)
            return np.moveaxis(k, 1, 2).astype(acc), np.moveaxis(v, 1, 2).astype(acc)

        return last

    def _per_head_variants(self, variants: dict[str, Any], heads: int) -> dict[str, Any]:
        """``sinks`` and ``alibi_slopes`` as arrays checked against ``(batch, heads)``, so that
        a value per sequence and head can follow its sequence into any run of the batch."""
        out = dict(variants)
        for name in ("sinks", "alibi_slopes"):
            if out.get(name) is None:
                continue
            a = as_array(out[name], name)
            if not broadcasts_to(a.shape, (self.batch, heads)):
                raise InputError(
                    f"{name}: shape {a.shape} does not broadcast to (batch={self.batch}, "
                    f"heads={heads}): give one value per query head, shape (heads,), or per "
                    "sequence and head, shape (batch, heads)"
                )
            out[name] = a
        return out


def _call_key(
    q: Any, scale: Any, causal: Any, return_lse: Any, kernel: Any, precision: Any = "exact"
) -> Any:
    """What :meth:`KVCache.attend`'s checks and its native step's plan depend on, for a call
    with no window and no variants: ``q``'s type, shape, dtype and layout and the options'
    values. None for a call that is not of that plain kind (it always takes the checked
    road). Two calls with equal keys get the same verdicts: the checks read no value of
    ``q``, and the lengths enter the step only as the keys each sequence sees, read when it
    runs (causal decoding with one query row per sequence sees all of them).
    """
    if type(q) is not np.ndarray or not q.flags.c_contiguous:
        return None
    if scale is not None and type(scale) is not float:
        return None
    if type(causal) is not bool or type(return_lse) is not bool or type(kernel) is not str:
        return None
    if type(precision) is not str:
        return None
    return (q.shape, q.strides, q.dtype, scale, causal, kernel, precision)


def _offset_batch(plan: Plan, first: int) -> dict[str, Any]:
    """``score_mod``/``mask_mod`` see the cache's sequence index, not the slice's."""
    out: dict[str, Any] = {}
    if first and plan.score_mod is not None:
        f = plan.score_mod
        out["score_mod"] = lambda s, b, h, qi, kj: f(s, b + first, h, qi, kj)
    if first and plan.mask_mod is not None:
        g = plan.mask_mod
        out["mask_mod"] = lambda b, h, qi, kj: g(b + first, h, qi, kj)
    return out

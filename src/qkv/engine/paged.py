"""Paged K/V: attention over pages read through a block table, and a pool of pages.

A server holds the keys and values of many requests in one pool of fixed-size pages
``(num_blocks, page_size, kv_heads, head_dim)`` (FlashAttention's NHD layout, as vLLM and
FlashInfer lay it out); each request owns a list of pages, its row of a *block table*, and key
position ``p`` of sequence ``b`` lives in page ``block_table[b, p // page_size]`` at row
``p % page_size``. Pages are handed out from a free list as sequences grow and given back when
they end, and a prefix shared by several requests is held once.

:func:`attend_pages` is attention over such a pool: one decoding step (one query per sequence)
runs on the native decode kernel reading the pages in place (no gather); anything else gathers
each sequence's pages and takes qkv's general road. Both equal :func:`qkv.reference.attention`
on each sequence's keys and values (the stored values, :func:`qkv.dequantize_kv`, for a
quantized pool). :class:`PagedKVCache` is the pool itself, with sequences that are allocated,
appended to, forked (their full pages shared by reference count, copy-on-write) and freed.
"""

from __future__ import annotations

import copy as _copy
from typing import Any

import numpy as np

from .. import numerics
from ..checks import check_int
from ..errors import InputError, InputTypeError
from ..keywords import near_keywords
from ..options import Options
from ..validate import Plan, as_array, broadcasts_to, check_flag, make_plan, stand_in
from . import cascade
from .decoding import NATIVE, NATIVE_FAST, NUMPY_FAST, causal_rows, check_table, plan_checked
from .kernels import decode, dispatch, native, router
from .kernels.decode_fast import check_precision
from .quant import SCALED, check_format, dequantize_kv, quantize_kv, storage_dtype, storage_of

__all__ = ["PASSED_ON", "PagedKVCache", "attend_pages"]

_F32 = np.dtype(np.float32)


def _pool(k_pages: Any, v_pages: Any, form: str | None) -> tuple[np.ndarray, np.ndarray]:
    """The pages as arrays: codes of ``form``'s storage dtype, or float (bfloat16 kept)."""
    if form is None:
        kp = as_array(k_pages, "k_pages", narrow=True)
        vp = as_array(v_pages, "v_pages", narrow=True)
    else:
        kp, vp = np.asarray(k_pages), np.asarray(v_pages)
        want = storage_dtype(form)
        for name, a in (("k_pages", kp), ("v_pages", vp)):
            if a.dtype != want:
                raise InputTypeError(
                    f"{name}: kv_format={form!r} stores its codes as {want}, got {a.dtype}"
                )
    for name, a in (("k_pages", kp), ("v_pages", vp)):
        if a.ndim != 4:
            raise InputError(
                f"{name}: expected shape (num_blocks, page_size, kv_heads, head_dim), got {a.shape}"
            )
    if kp.shape[:3] != vp.shape[:3]:
        raise InputError(
            "k_pages, v_pages: (num_blocks, page_size, kv_heads) differ: k_pages has shape "
            f"{kp.shape}, v_pages {vp.shape}"
        )
    if kp.shape[1] < 1:
        raise InputError(f"k_pages: page_size must be at least 1, got shape {kp.shape}")
    return kp, vp


def _scales(x: Any, name: str, form: str | None, shape: tuple[int, ...]) -> np.ndarray | None:
    if form not in SCALED:
        if x is not None:
            raise InputError(f"{name}: only the 8-bit forms {SCALED} have scales, got one")
        return None
    if x is None:
        raise InputError(f"{name}: kv_format={form!r} needs its float32 scales, shape {shape}")
    a = np.asarray(x)
    if a.shape != shape or a.dtype != _F32:
        raise InputError(
            f"{name}: expected float32 scales of shape {shape} (num_blocks, page_size, "
            f"kv_heads), got {a.dtype} {a.shape}"
        )
    return a


def _gathered(
    pages: np.ndarray, scales: np.ndarray | None, form: str | None, row: np.ndarray, n: int
) -> np.ndarray:
    """One sequence's ``n`` keys (or values) ``(kv_heads, n, ·)`` gathered from its pages
    (table ``row``), as stored values: float (bfloat16 widened) or a form dequantized."""
    # whole pages taken (one index per page, not per row), then the first n rows of them
    ids = row[: -(-n // pages.shape[1])]
    x = pages.take(ids, axis=0).reshape(-1, *pages.shape[2:])[:n]
    if form not in (None, "float16"):
        s = None if scales is None else scales.take(ids, axis=0).reshape(-1, *scales.shape[2:])[:n]
        x = dequantize_kv(x, s, form)
    elif x.dtype.name == "bfloat16":
        x = x.astype(np.float32)
    return np.moveaxis(x, 0, 1)


def _rows(
    pages: np.ndarray,
    scales: np.ndarray | None,
    form: str | None,
    ids: np.ndarray,
    rows: np.ndarray,
    acc: np.dtype,
) -> np.ndarray:
    """Rows ``rows`` of pages ``ids`` (both ``(batch, n)``) as ``(batch, kv_heads, n, ·)`` in
    the compute dtype ``acc``: their stored values (a form dequantized)."""
    x = pages[ids, rows]
    if form not in (None, "float16"):
        x = dequantize_kv(x, None if scales is None else scales[ids, rows], form)
    return np.moveaxis(x, 2, 1).astype(acc)


@near_keywords()
def attend_pages(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    block_table: Any,
    seqlens: Any,
    *,
    scale: Any = None,
    causal: bool = True,
    window: Any = None,
    softcap: Any = None,
    alibi_slopes: Any = None,
    return_lse: bool = False,
    kv_format: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    precision: str = "exact",
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Attention of each sequence's queries to its keys and values, read from pages through
    a block table.

    Must equal :func:`qkv.reference.attention` on each sequence ``b``'s keys and values
    (positions ``0 .. seqlens[b] - 1``, gathered from its pages; the stored values,
    :func:`qkv.dequantize_kv`, for a quantized pool). One query per sequence with nothing but
    ``softcap`` or ``window``, or up to 8 with ``softcap`` alone, runs on the native decode
    kernel, which reads the pages in place. A chunk of more rows (causal, no ALiBi, no
    window's left side) reads its sequence's full pages that every row sees whole in place,
    by the native prefill, and gathers the rest. Anything else gathers each sequence's pages
    and takes the general road.

    Parameters
    ----------
    q : array_like, shape ``(batch, heads, Lq, head_dim)``
        ``heads`` a multiple of ``kv_heads``. The ``Lq`` queries of sequence ``b`` are its last
        ``Lq`` positions (bottom-right causal): row ``i`` sits at ``seqlens[b] - Lq + i``.
    k_pages, v_pages : array_like, shapes ``(num_blocks, page_size, kv_heads, head_dim)`` and
        ``(num_blocks, page_size, kv_heads, value_dim)``
        The pool (FlashAttention's NHD layout; any strides). A float dtype (ml_dtypes'
        bfloat16 too), or the codes of ``kv_format``.
    block_table : array_like of int, shape ``(batch, max_blocks)``
        Sequence ``b``'s key position ``p`` is row ``p % page_size`` of page
        ``block_table[b, p // page_size]``. Only the entries ``seqlens`` needs are read.
    seqlens : array_like of int, shape ``(batch,)``
        Keys of each sequence, ``0 .. max_blocks * page_size``. A sequence with none gives
        zeros (log-sum-exp ``-inf``).
    scale, causal, window, softcap
        As in :func:`qkv.attention` (``causal`` defaults to True); positions are each
        sequence's own.
    alibi_slopes : array_like, optional
        Shape ``(heads,)`` or ``(batch, heads)``.
    return_lse : bool, optional
        Also return the log-sum-exp, shape ``(batch, heads, Lq)``.
    kv_format : str, optional
        The pages hold the codes of a stored form of :func:`qkv.quantize_kv`
        (``"bfloat16"`` as uint16 bits, ``"int8"``, ``"float8_e4m3fn"`` as uint8 bits);
        the 8-bit forms with ``k_scale`` and ``v_scale``, float32 of shape
        ``(num_blocks, page_size, kv_heads)``.
    precision : {"exact", "fast"}, optional
        ``"fast"`` opts int8 pages into the decode step's fast road (:func:`qkv.plan_decode`:
        q rounded to int8, its error bound there), where the decode step serves the call (one
        query row per sequence, several with ``causal=False``, or a few causal ones,
        :func:`qkv.engine.kernels.router.causal_chunk_fits`; no ``alibi_slopes``); elsewhere,
        and on pages of any other form, the exact road runs (a shared prefix is then not
        split off: the fast road reads every page).

    Returns
    -------
    ndarray, shape ``(batch, heads, Lq, value_dim)``
        In ``q``'s dtype promoted with the values' (float32 for a stored form). With
        ``return_lse``, the pair ``(out, lse)``.

    Raises
    ------
    InputError
        Shapes that disagree, a length below 0 or beyond the table, a needed block id outside
        ``[0, num_blocks)``: named, with the shapes, before anything is read.

    Examples
    --------
    Two sequences of 5 and 2 keys in a shuffled pool of pages of 4 rows:

    >>> import numpy as np
    >>> import qkv
    >>> from qkv.engine.paged import attend_pages
    >>> rng = np.random.default_rng(0)
    >>> k_pages, v_pages = rng.standard_normal((2, 6, 4, 1, 8))  # 6 blocks, 1 kv head, d 8
    >>> table = np.array([[4, 1], [2, 0]])
    >>> q = rng.standard_normal((2, 2, 1, 8))                       # 2 query heads, 1 token
    >>> out = attend_pages(q, k_pages, v_pages, table, [5, 2])
    >>> k0 = np.concatenate([k_pages[4], k_pages[1]])[:5].transpose(1, 0, 2)  # (1, 5, 8)
    >>> v0 = np.concatenate([v_pages[4], v_pages[1]])[:5].transpose(1, 0, 2)
    >>> bool(np.allclose(out[0], qkv.attention(q[0], k0, v0)))
    True
    """
    check_flag(return_lse, "return_lse")
    precision = check_precision(precision)
    form = None if kv_format is None else check_format(kv_format, "kv_format")
    qa = as_array(q, "q")
    kp, vp = _pool(k_pages, v_pages, form)
    if form == "float16" or (form is None and kp.dtype == np.float16):
        form = "float16" if form else None
    nb, page, kvh, d = kp.shape
    dv = vp.shape[-1]
    if qa.ndim != 4 or qa.shape[-1] != d:
        raise InputError(
            f"q: expected shape (batch, heads, Lq, head_dim={d}), got {qa.shape} (k_pages "
            f"has shape {kp.shape})"
        )
    B, H, Lq, _ = qa.shape
    if H % kvh:
        raise InputError(
            f"q: {H} query heads cannot share {kvh} kv heads: q has shape {qa.shape}, k_pages "
            f"{kp.shape}"
        )
    ks = _scales(k_scale, "k_scale", form, (nb, page, kvh))
    vs = _scales(v_scale, "v_scale", form, (nb, page, kvh))
    table, lengths = check_table(block_table, seqlens, B, nb, page)
    slopes = None
    if alibi_slopes is not None:
        slopes = as_array(alibi_slopes, "alibi_slopes")
        if not broadcasts_to(slopes.shape, (B, H)):
            raise InputError(
                f"alibi_slopes: shape {slopes.shape} does not broadcast to (batch={B}, "
                f"heads={H}): give one value per query head, shape (heads,), or per sequence "
                "and head, shape (batch, heads)"
            )
        slopes = np.broadcast_to(slopes, (B, H))
    options = Options(scale, causal, None, window, softcap=softcap, alibi_slopes=slopes)
    stored_bf16 = form == "bfloat16" or kp.dtype.name == "bfloat16"
    stored = form is not None or stored_bf16
    value_dtype = _F32 if stored and form != "float16" else vp.dtype
    out_dtype = np.result_type(qa.dtype, value_dtype)
    longest = int(lengths.max()) if B else 0
    # The call checked as the general road checks it, against stand-ins of the pool's
    # shapes (nothing read), in the compute dtype
    stand = numerics.acc_dtype(out_dtype)
    plan = make_plan(
        qa,
        stand_in(stand, (B, kvh, longest, d)),
        stand_in(stand, (B, kvh, longest, dv)),
        options,
    )

    # whether the decode step takes these causal rows (K/V stored narrower than the compute
    # dtype, or their bytes, decide how many)
    narrow = stored or kp.dtype.itemsize < np.dtype(stand).itemsize
    nbytes = int(lengths.sum()) * kvh * (d + dv) * kp.dtype.itemsize
    rows_step = router.causal_rows_step(plan, narrow, nbytes)

    def step_over(
        tab: np.ndarray, lens: np.ndarray, prior: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        # (out, lse, merged) of the paged step over rows `tab` of the table, `lens` keys each:
        # the router decides the road (step.route): the native step, the fast road, or
        # neither; `merged`: with the part `prior` over other keys merged in (the native step
        # merges it: DecodePlan.run_after), else without it
        if tab.size and rows_step:
            # several causal rows on the step (`last`: the last Lq - 1 keys, for the NumPy
            # emulation of the fast road, which runs the common keys and merges those in)

            def last(valid: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
                ids = np.where(valid, tab[np.arange(B)[:, None], pos // page], 0)
                at, acc = pos % page, plan.acc_dtype
                return _rows(kp, ks, form, ids, at, acc), _rows(vp, vs, form, ids, at, acc)

            found = causal_rows(
                plan, qa, kp, vp, np.zeros(B, np.int64), lens, last,
                form=form if form != "float16" else None, table=tab,
                scales=None if ks is None else (ks, vs), precision=precision,
            )  # fmt: skip
            if found is not None:
                return found[0].astype(out_dtype, copy=False), found[1], False
        lo = np.zeros(B, np.int64)
        if plan.window is not None and plan.window[0] is not None:
            lo = np.maximum(lens - 1 - plan.window[0], 0)  # the one query sits at length - 1
        step = plan_checked(
            plan, qa, kp, vp, form=form if form != "float16" else None,
            runs=decode.KeyRuns(lo, lens), table=tab, out_dtype=out_dtype,
            scales=None if ks is None else (ks, vs), precision=precision,
        )  # fmt: skip
        if prior is not None and step.route in (NATIVE, NATIVE_FAST):
            merged = step.run_after(prior, qa, kp, vp, k_scale=ks, v_scale=vs)
            if merged is not None:
                return merged[0], merged[1], True
        if step.route in (NATIVE, NATIVE_FAST, NUMPY_FAST):
            return (*step.run(qa, kp, vp, k_scale=ks, v_scale=vs, return_lse=True), False)
        out = np.zeros((B, H, Lq, dv), dtype=out_dtype)
        lse = np.full((B, H, Lq), -np.inf, dtype=plan.acc_dtype)
        for b in range(B):
            n = int(lens[b])
            if n == 0:
                continue
            kb = _gathered(kp, ks, form, tab[b], n)
            vb = _gathered(vp, vs, form, tab[b], n)
            opts = options if slopes is None else options.replace(alibi_slopes=slopes[b])
            o, s = dispatch.attend(make_plan(qa[b], kb, vb, opts))
            out[b] = o
            lse[b] = s
        return out, lse, False

    cols = cascade.shared_columns(table, lengths, page, Lq)
    if router.chunks_alone(plan, B, cols * page, rows_step):
        # chunks of prompts: each sequence alone, its own full pages that every row sees
        # whole split off and read in place (below), the rest gathered
        parts = [
            attend_pages(
                qa[b : b + 1], k_pages, v_pages, table[b : b + 1], lengths[b : b + 1],
                scale=plan.scale, causal=causal, window=window, softcap=softcap,
                alibi_slopes=None if slopes is None else slopes[b : b + 1], return_lse=True,
                kv_format=kv_format, k_scale=k_scale, v_scale=v_scale, precision=precision,
            )
            for b in range(B)
        ]  # fmt: skip
        out = np.concatenate([o for o, _ in parts]).astype(out_dtype, copy=False)
        lse = np.concatenate([s for _, s in parts])
        return (out, lse) if return_lse else out
    if cols and router.cascade(plan, slopes, cols * page, B, precision, rows_step):
        # a prefix every sequence shares: its pages read once for all of them
        ids = table[0, :cols]

        def prefix_part(part: Plan) -> tuple[np.ndarray, np.ndarray]:
            # the native prefill reads the prefix's pages in place where the router runs the
            # part on it; else (8-bit forms, another kernel, an output not finite) the prefix
            # is gathered first
            products = router.prefix_in_place(part, form)
            if products is not None:
                stored = (
                    "bfloat16" if stored_bf16 else "float16" if kp.dtype == np.float16 else None
                )
                found = native.attend_prefix_pages(part, kp, vp, ids, products, stored)
                if found is not None:
                    return found
            k, v = (_gathered(x, s, form, ids, part.S) for x, s in ((kp, ks), (vp, vs)))
            dt = plan.acc_dtype
            full = make_plan(part.q, k.astype(dt, copy=False), v.astype(dt, copy=False),
                             scale=part.scale, softcap=part.softcap)  # fmt: skip
            return dispatch.attend(full)

        # the own pages: the step above over the rest of each row of the table (checked
        # already, with this call's plan)
        prefix = cascade.Prefix(cols * page, kvh, dv, prefix_part)
        out, lse = cascade.attend(
            plan, prefix, lambda rest, prior: step_over(table[:, cols:], rest, prior), lengths
        )
        out = out.astype(out_dtype, copy=False)
        return (out, lse) if return_lse else out
    out, lse, _ = step_over(table, lengths)
    return (out, lse) if return_lse else out


#: The keywords :meth:`PagedKVCache.attend` passes on to :func:`attend_pages`.
PASSED_ON = ("scale", "causal", "window", "softcap", "alibi_slopes", "return_lse", "precision")


class PagedKVCache:
    """A pool of K/V pages shared by sequences that come and go (vLLM's paged cache).

    The pool holds ``num_blocks`` pages of ``page_size`` tokens,
    ``(num_blocks, page_size, kv_heads, head_dim)`` (FlashAttention's NHD layout). A sequence
    is an id (:meth:`allocate`) with a list of pages, taken from a free list as it grows
    (:meth:`append`) and given back by :meth:`free`. :meth:`fork` starts a sequence on another's
    prefix: the prefix's full pages are shared (reference counted) and its partly filled last
    page is copied, so that neither sequence's appends reach the other's keys.
    :meth:`attend` runs :func:`attend_pages` over the pool; :attr:`block_table`,
    :attr:`lengths`, :attr:`k_pages` and :attr:`v_pages` hand it to FlashAttention-style
    callers.

    Parameters
    ----------
    num_blocks : int
        Pages in the pool.
    page_size : int
        Tokens per page.
    kv_heads, head_dim : int
        As in :class:`qkv.KVCache`.
    value_dim : int, optional
        Size of each value (default ``head_dim``).
    dtype : float dtype or str, optional
        How keys and values are stored, as in :class:`qkv.KVCache` (default float32):
        ``float16``, ``float32``, ``float64``, or ``"bfloat16"``, ``"int8"``,
        ``"float8_e4m3fn"`` (:func:`qkv.quantize_kv`).

    Examples
    --------
    Two requests sharing a prompt of 6 tokens, each decoding its own next token:

    >>> import numpy as np
    >>> import qkv
    >>> rng = np.random.default_rng(0)
    >>> cache = qkv.PagedKVCache(num_blocks=8, page_size=4, kv_heads=1, head_dim=8)
    >>> a = cache.allocate()
    >>> k, v = rng.standard_normal((2, 1, 6, 8))                  # (kv_heads, tokens, d)
    >>> cache.append(a, k, v)
    >>> b = cache.fork(a)                # shares the full page, copies the partial one
    >>> cache.free_blocks
    5
    >>> cache.append(b, np.ones((1, 1, 8)), np.ones((1, 1, 8)))
    >>> cache.lengths.tolist()
    [6, 7]
    >>> q = rng.standard_normal((2, 2, 1, 8))                     # 2 query heads
    >>> out = cache.attend(q)
    >>> bool(np.allclose(out[0], qkv.attention(q[0], k, v)))
    True
    """

    @near_keywords()
    def __init__(
        self,
        num_blocks: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: Any = np.float32,
    ) -> None:
        self.num_blocks = check_int(num_blocks, "num_blocks", minimum=1)
        self.page_size = check_int(page_size, "page_size", minimum=1)
        self.kv_heads = check_int(kv_heads, "kv_heads", minimum=1)
        self.head_dim = check_int(head_dim, "head_dim", minimum=1)
        self.value_dim = (
            self.head_dim if value_dim is None else check_int(value_dim, "value_dim", minimum=1)
        )
        self.dtype, self._form = storage_of(dtype)
        code = storage_dtype(self._form) if self._form else self.dtype
        pool = (self.num_blocks, self.page_size, self.kv_heads)
        self._k = np.zeros((*pool, self.head_dim), code)
        self._v = np.zeros((*pool, self.value_dim), code)
        scaled = self._form in SCALED
        self._ks = np.zeros(pool, np.float32) if scaled else None
        self._vs = np.zeros(pool, np.float32) if scaled else None
        self._refs = np.zeros(self.num_blocks, np.int64)  # sequences holding each page
        self._free = list(range(self.num_blocks - 1, -1, -1))  # popped from the end: 0 first
        self._pages: dict[int, list[int]] = {}
        self._len: dict[int, int] = {}
        self._next = 0

    def __copy__(self) -> PagedKVCache:
        """An independent pool: ``copy.copy`` copies the pages and tables too, as
        ``deepcopy`` does (a copy sharing them would write into the original's pages)."""
        return _copy.deepcopy(self)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, page_size={self.page_size}, "
            f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, value_dim={self.value_dim}, "
            f"dtype={self.dtype}, seqs={self.seqs}, lengths={self.lengths.tolist()}, "
            f"free_blocks={self.free_blocks})"
        )

    # --- views for FlashAttention-style callers -------------------------------------------

    @property
    def seqs(self) -> list[int]:
        """The live sequences' ids, in the order they were allocated."""
        return list(self._pages)

    @property
    def free_blocks(self) -> int:
        """Pages no sequence holds."""
        return len(self._free)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each live sequence (:attr:`seqs`' order), int32 (a copy)."""
        return np.array([self._len[s] for s in self._pages], dtype=np.int32)

    @property
    def block_table(self) -> np.ndarray:
        """Each live sequence's pages (:attr:`seqs`' order), int32 ``(sequences,
        max_blocks)``, padded with 0 past a sequence's last page (a copy)."""
        return self._table(self.seqs)

    @property
    def k_pages(self) -> np.ndarray:
        """The pool's keys ``(num_blocks, page_size, kv_heads, head_dim)`` as stored (codes
        for the 16-bit and 8-bit forms; a read-only view)."""
        return _readonly(self._k)

    @property
    def v_pages(self) -> np.ndarray:
        """The pool's values, as :attr:`k_pages`."""
        return _readonly(self._v)

    @property
    def k_scale(self) -> np.ndarray | None:
        """The 8-bit forms' key scales ``(num_blocks, page_size, kv_heads)`` (a read-only
        view), else None."""
        return None if self._ks is None else _readonly(self._ks)

    @property
    def v_scale(self) -> np.ndarray | None:
        """The 8-bit forms' value scales, as :attr:`k_scale`."""
        return None if self._vs is None else _readonly(self._vs)

    def _table(self, seqs: list[int]) -> np.ndarray:
        widest = max((len(self._pages[s]) for s in seqs), default=0)
        out = np.zeros((len(seqs), max(widest, 1)), dtype=np.int32)
        for i, s in enumerate(seqs):
            out[i, : len(self._pages[s])] = self._pages[s]
        return out

    # --- sequences -------------------------------------------------------------------------

    def _check_seq(self, seq: Any) -> int:
        seq = check_int(seq, "seq")
        if seq not in self._pages:
            raise InputError(f"seq: {seq} is not a live sequence of this cache (live: {self.seqs})")
        return seq

    def allocate(self) -> int:
        """A new, empty sequence's id (it takes pages as tokens are appended)."""
        seq = self._next
        self._next += 1
        self._pages[seq] = []
        self._len[seq] = 0
        return seq

    def _take(self, n: int, what: str) -> list[int]:
        if n > len(self._free):
            raise InputError(
                f"{what}: the pool is exhausted: it needs {n} more blocks of {self.page_size} "
                f"tokens, {len(self._free)} of {self.num_blocks} are free"
            )
        return [self._free.pop() for _ in range(n)]

    def _stored(self, x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        """``x`` in the pool's form: (codes, scales)."""
        if not self._form or self._form == "float16":
            return x.astype(self._k.dtype), None
        try:
            return quantize_kv(x, self._form)
        except InputError as exc:
            raise InputError(f"{name}: {str(exc).split(': ', 1)[1]}") from None

    @near_keywords()
    def append(self, seq: int, k: Any, v: Any) -> None:
        """Add ``T >= 1`` tokens to sequence ``seq``, taking pages from the free list.

        Parameters
        ----------
        seq : int
            A live sequence (:meth:`allocate`, :meth:`fork`).
        k, v : array_like
            Shapes ``(kv_heads, T, head_dim)`` and ``(kv_heads, T, value_dim)``.

        A refused call (shapes, a pool without enough free pages) changes nothing.
        """
        seq = self._check_seq(seq)
        ka, va = as_array(k, "k"), as_array(v, "v")
        for name, a, dim, dname in (
            ("k", ka, self.head_dim, "head_dim"),
            ("v", va, self.value_dim, "value_dim"),
        ):
            if a.ndim != 3 or a.shape[0] != self.kv_heads or a.shape[-1] != dim:
                raise InputError(
                    f"{name}: expected shape (kv_heads={self.kv_heads}, T, {dname}={dim}), "
                    f"got {a.shape}"
                )
        T = ka.shape[1]
        if va.shape[1] != T:
            raise InputError(f"k, v: token counts T differ: k has shape {ka.shape}, v {va.shape}")
        if T < 1:
            raise InputError(f"k: expected at least one token (T >= 1), got shape {ka.shape}")
        kc, kscale = self._stored(np.moveaxis(ka, 0, 1), "k")  # (T, kv_heads, ·)
        vc, vscale = self._stored(np.moveaxis(va, 0, 1), "v")
        n, pages = self._len[seq], self._pages[seq]
        need = -(-(n + T) // self.page_size) - len(pages)
        pages.extend(self._take(need, "append"))  # all or nothing: raises before any change
        for p in pages[len(pages) - need :]:
            self._refs[p] = 1
        pos = np.arange(n, n + T)
        at = (np.asarray(pages)[pos // self.page_size], pos % self.page_size)
        self._k[at] = kc
        self._v[at] = vc
        if self._ks is not None and self._vs is not None:
            self._ks[at] = kscale
            self._vs[at] = vscale
        self._len[seq] = n + T

    @near_keywords()
    def free(self, seq: int) -> None:
        """End sequence ``seq``: its pages go back to the pool (a shared one when its last
        holder ends)."""
        seq = self._check_seq(seq)
        for p in self._pages.pop(seq):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
        del self._len[seq]

    @near_keywords()
    def fork(self, seq: int, upto: int | None = None) -> int:
        """A new sequence holding the first ``upto`` tokens of ``seq`` (default all): its
        full pages shared with ``seq`` (reference counted), the partly filled last one copied
        into a page of its own. Returns the new sequence's id; a refused call (``upto`` out of
        range, no free page for the copy) changes nothing."""
        seq = self._check_seq(seq)
        n = self._len[seq]
        upto = n if upto is None else check_int(upto, "upto", minimum=0)
        if upto > n:
            raise InputError(f"upto: {upto} is beyond sequence {seq}'s {n} tokens")
        full, rest = divmod(upto, self.page_size)
        src = self._pages[seq]
        copied = self._take(1, "fork") if rest else []
        new = self.allocate()
        shared = src[:full]
        for p in shared:
            self._refs[p] += 1
        if copied:
            (c,) = copied
            self._refs[c] = 1
            for buf in (self._k, self._v, self._ks, self._vs):
                if buf is not None:
                    buf[c, :rest] = buf[src[full], :rest]
        self._pages[new] = shared + copied
        self._len[new] = upto
        return new

    def _values(self, pages: np.ndarray, scales: np.ndarray | None, seq: int) -> np.ndarray:
        seq = self._check_seq(seq)
        row = np.asarray(self._pages[seq], dtype=np.int64)
        return _gathered(pages, scales, self._form, row, self._len[seq])

    @near_keywords()
    def keys(self, seq: int) -> np.ndarray:
        """Sequence ``seq``'s keys ``(kv_heads, length, head_dim)``: a copy, in the stored
        values (float32 for the 16-bit and 8-bit forms but float16)."""
        return self._values(self._k, self._ks, seq)

    @near_keywords()
    def values(self, seq: int) -> np.ndarray:
        """Sequence ``seq``'s values ``(kv_heads, length, value_dim)``, as :meth:`keys`."""
        return self._values(self._v, self._vs, seq)

    @near_keywords(PASSED_ON)
    def attend(
        self,
        q: Any,
        *,
        seqs: Any = None,
        **options: Any,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Attention of new queries to each sequence's keys: :func:`attend_pages` over the
        pool.

        Parameters
        ----------
        q : array_like, shape ``(len(seqs), heads, Lq, head_dim)``
            Row ``b`` for sequence ``seqs[b]``, its queries its last ``Lq`` positions
            (bottom-right causal; append their keys first).
        seqs : sequence of int, optional
            The sequences, default every live one (:attr:`seqs`).
        **options
            ``scale``, ``causal`` (default True), ``window``, ``softcap``, ``alibi_slopes``,
            ``return_lse``, ``precision``: as in :func:`attend_pages`, which checks them (the
            pool's form and scales are the cache's own).

        Returns
        -------
        ndarray, shape ``(len(seqs), heads, Lq, value_dim)``
            Equal to ``qkv.attention(q[b], cache.keys(s), cache.values(s), causal=causal,
            ...)`` for each ``s = seqs[b]``; with ``return_lse``, ``(out, lse)``.
        """
        if seqs is None:
            order = self.seqs
        else:
            if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
                raise InputTypeError(f"seqs: expected a sequence of ids, got {seqs!r}")
            order = [self._check_seq(s) for s in seqs]
        return attend_pages(
            q, self._k, self._v, self._table(order), [self._len[s] for s in order],
            kv_format=self._form if self._form not in (None, "float16") else None,
            k_scale=self._ks, v_scale=self._vs, **options,
        )  # fmt: skip


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view

"""qkv as an attention backend for Hugging Face ``transformers``.

After :func:`register`, any model that dispatches through transformers' ``AttentionInterface``
(Llama, Mistral, Qwen, BERT, ... — nearly all current ones) can run every attention layer
through :func:`qkv.attention`::

    from qkv.integrations.transformers import register
    from transformers import AutoModelForCausalLM

    register()  # the name "qkv"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="qkv")
    # or: model.set_attn_implementation("qkv") on a model already loaded

What the backend does with what models pass (:func:`attention_forward`):

- ``query (batch, heads, L, d)``, ``key``/``value (batch, kv_heads, S, d)``; fewer kv heads
  than query heads are grouped-query attention, which qkv serves without repeating ``k``/``v``.
- ``scaling`` is the scale (``None``: ``1/sqrt(d)``).
- ``attention_mask``: the 4-D mask transformers builds (``(batch, 1, L, S)``; bool with
  ``True`` = may attend, or float added to the scores), which already holds causal, padding and
  sliding-window structure. It is built by the same function as for ``"sdpa"`` (registered
  under the same name in ``AttentionMaskInterface``), so when it is ``None`` the layer's
  ``is_causal`` says what to do, as with ``"sdpa"``: a causal prefill with ``L == S`` is
  ``causal=True``; one query (decoding from the KV cache) sees every key; a causal prefill into a
  larger, still-empty static cache reads only the first ``L`` keys. A ``sliding_window`` keyword
  becomes ``window=(sliding_window - 1, 0)`` in that case.
- ``dropout`` must be 0 (it is at inference: models pass ``0.0`` unless training). qkv has no
  attention dropout, so training with dropout raises :class:`qkv.InputError`; set the config's
  attention dropout to 0 to train through qkv (gradients come from :func:`qkv.attention_vjp`).
- ``position_bias`` (T5-style learned biases) is added to the scores; ``softcap`` (Gemma 2's
  ``attn_logit_softcapping``) becomes qkv's ``softcap``, and attention sinks, passed as ``s_aux``
  by gpt-oss (or ``sinks``), become qkv's ``sinks`` (with their gradient when training).
  Per-layer sliding windows arrive in the mask each layer is given (or as ``sliding_window``).
- It returns ``(attn_output, attn_weights)`` with ``attn_output`` of shape
  ``(batch, L, heads, dv)``; ``attn_weights`` are computed (by
  :func:`qkv.attention_weights`) only when ``output_attentions=True`` is passed, else ``None``.

A query row whose keys are all masked out (a left-padding position attending only padding) gives
output 0 in qkv; PyTorch's kernels give other values there. Such rows are padding, and the
model's outputs at real tokens do not depend on them.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..engine.kernels.threads import compiled_team
from ..errors import InputError
from ..extras import require

__all__ = ["NAME", "attention_forward", "register"]

NAME = "qkv"

#: Callables ``f(module, query, key, value, options, out)`` told of every call, after qkv has
#: computed ``out``; :mod:`qkv.integrations.capture` adds and removes its recorder here.
OBSERVERS: list[Any] = []


def _split_mask(attention_mask: Any, position_bias: Any) -> Any:
    """One mask for qkv: the boolean/float mask, with a learned position bias added."""
    if position_bias is None:
        return attention_mask
    import torch

    if attention_mask is None:
        return position_bias
    if attention_mask.dtype == torch.bool:
        return position_bias.masked_fill(~attention_mask, float("-inf"))
    return position_bias + attention_mask


class _Seen(NamedTuple):
    """Which keys a decoding step's sequences see (:meth:`_Step.seen`)."""

    first: int  # no sequence sees a key before first ...
    last: int  # ... or from last on
    exact: bool  # every sequence sees exactly keys first:last (the mask is then not needed)


def _keep(mask: Any) -> Any:
    """``mask`` as booleans (``True`` = may attend): a boolean one as it is, a float one of
    only ``0`` and ``-inf`` turned into booleans (the one place the backend does so); None for
    any other (a true float bias, an integer mask)."""
    import torch

    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    keep = mask == 0
    if not bool((keep | (mask == float("-inf"))).all()):
        return None  # a true float bias: keep it
    return keep


class _Step:
    """A model's decoding step, planned once for every layer that shares its mask (FlashInfer's
    ``plan()`` once, ``run()`` per layer is the model).

    ``plan`` is the step's :class:`qkv.DecodePlan` when the native step runs it (sizes and
    grouping, scale, soft-cap, stored form, each sequence's run of keys read once from the
    mask), else None; :meth:`seen` is what the general road reads instead, found once per step.
    """

    __slots__ = ("_runs", "_seen", "keep", "mask", "plan")

    def __init__(
        self, mask: Any, keep: Any, plan: Any, seen: tuple[Any, ...] = (), runs: Any = None
    ) -> None:
        self.mask, self.keep, self.plan = mask, keep, plan
        self._seen: tuple[_Seen | None, ...] = seen
        self._runs = runs  # each sequence's run of keys, when read already

    def seen(self, S: int) -> _Seen | None:
        """Which of ``S`` keys the step's sequences see when each sees one run of them (read
        once by :func:`qkv.engine.kernels.decode.key_runs`); None for any other mask."""
        if not self._seen:
            found = self._runs
            self._seen = (_visible_keys(self.keep, S) if found is None else _seen_of(found),)
        return self._seen[0]


def _seen_of(runs: Any) -> _Seen | None:
    """:class:`_Seen` of each sequence's run of keys ``(lo, hi)``; None without runs or with
    no sequence."""
    if runs is None or not len(runs[0]):
        return None
    lo, hi = runs
    first, last = int(lo.min()), int(hi.max())
    return _Seen(first, last, bool(first == lo.max() and last == hi.min()))


def _visible_keys(keep: Any, S: int) -> _Seen | None:
    """The keys a decoding step's boolean mask ``(batch or 1, 1, 1, S)`` (or None) leaves each
    sequence, when that is one run of keys per sequence: a ``StaticCache``'s filled prefix, a
    left-padded sequence's real tokens, a sliding window's last keys. Read as such, the keys are
    a view of the cache, and with one run for the whole batch the call needs no mask (the fast,
    unmasked kernels) instead of the whole cache under a dense mask. None otherwise."""
    from ..engine.kernels.decode import key_runs

    if keep is None or keep.ndim != 4 or keep.shape[1:] != (1, 1, S) or not keep.is_cpu:
        return None  # (a mask of another length: qkv.attention says so)
    return _seen_of(key_runs(keep[:, 0, 0, :].numpy()))


#: Where a mask keeps the steps planned for it: ``(its _version, {what: step})``. A new mask
#: each model step means a new plan; the plans go with the mask.
_ON_MASK = "_qkv_steps"
#: Steps without a mask, by what they are a pure function of (shapes, strides, dtypes, scale,
#: soft-cap, stored form): a few kept, the oldest dropped first.
_UNMASKED: dict[Any, _Step] = {}
_UNMASKED_KEPT = 16


def _step(query: Any, key: Any, value: Any, mask: Any, scaling: Any, softcap: Any) -> _Step:
    """The plan of this decoding step: the one planned for an earlier layer with the same mask
    (unchanged since), shapes, strides, dtypes, scale and soft-cap, or a new one."""
    stored = getattr(key, "qkv_stored", None)  # a QuantizedKVCache layer's stand-ins
    if stored is not None:
        form: Any = stored.form
        k, v = stored.codes_k, stored.codes_v
    else:
        form, k, v = None, key, value
    what = (
        type(scaling), scaling, type(softcap), softcap, form, query.dtype, k.dtype,
        v.dtype, query.shape, k.shape, v.shape, query.stride(), k.stride(), v.stride(),
    )  # fmt: skip
    try:
        hash(what)
    except TypeError:  # an unhashable scale or soft-cap: qkv.attention says what it is
        return _Step(mask, None, None)
    if mask is None:
        step = _UNMASKED.get(what)
        if step is None:
            step = _unmasked(what, _plan(query, key, value, None, scaling, softcap))
        return step
    kept: Any = getattr(mask, _ON_MASK, None)
    version = getattr(mask, "_version", None)
    if kept is None or kept[0] != version:
        kept = (version, {})
        try:
            setattr(mask, _ON_MASK, kept)
        except (AttributeError, RuntimeError):  # a tensor that takes no attribute: plan per layer
            return _plan(query, key, value, mask, scaling, softcap, what)
    step = kept[1].get(what)
    if step is None:
        step = kept[1][what] = _plan(query, key, value, mask, scaling, softcap, what)
    return step


def _unmasked(what: Any, step: _Step) -> _Step:
    """Keep ``step``, a step without a mask, as the one for ``what``."""
    if len(_UNMASKED) >= _UNMASKED_KEPT:
        del _UNMASKED[next(iter(_UNMASKED))]
    _UNMASKED[what] = step
    return step


def _plan(
    query: Any, key: Any, value: Any, mask: Any, scaling: Any, softcap: Any, what: Any = None
) -> _Step:
    """A new :class:`_Step`: what every layer of it shares, checked once
    (:func:`qkv.plan_decode`). With a mask, the plan of the same step without one (kept by
    value, ``what``) with each sequence's run of keys read from the mask
    (:meth:`qkv.DecodePlan.for_runs`): a model's next step plans only its keys again."""
    from ..engine.kernels.decode import key_runs

    if mask is None:
        return _new_plan(query, key, value, None, scaling, softcap)
    if not mask.is_cpu:
        return _Step(mask, None, None)
    keep = _keep(mask)
    if keep is None:
        return _Step(mask, None, None)  # a float bias: the general road applies it
    B, S = query.shape[0], key.shape[-2]
    if keep.ndim != 4 or keep.shape[1:] != (1, 1, S) or keep.shape[0] not in (1, B):
        return _Step(mask, keep, None)  # (a mask of another shape: qkv.attention says so)
    base = None if what is None else _UNMASKED.get(what)
    if base is None:
        base = _new_plan(query, key, value, None, scaling, softcap)
        if what is not None:
            _unmasked(what, base)
    rows = keep[:, 0, 0, :].numpy()
    runs = key_runs(rows if len(rows) == B else np.broadcast_to(rows, (B, S)))
    if runs is None:  # a row that is not one run of keys: the general road
        return _Step(mask, keep, None, (None,))
    plan = None if base.plan is None else base.plan._for_runs(runs)
    return _Step(mask, keep, plan, runs=runs)


def _new_plan(query: Any, key: Any, value: Any, mask: Any, scaling: Any, softcap: Any) -> _Step:
    """:func:`_plan` read from the tensors by :func:`qkv.plan_decode`."""
    import torch

    from ..engine.decoding import NATIVE, plan_decode

    keep = None if mask is None else _keep(mask)
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4 or query.shape[2] != 1:
        return _Step(mask, keep, None)  # (qkv.attention says what is wrong)
    stored = getattr(key, "qkv_stored", None)
    dt = query.dtype
    if stored is not None:
        k, v, fmt = stored.codes_k, stored.codes_v, stored.form
        scales = {"k_scale": stored.scales_k, "v_scale": stored.scales_v}
        if stored.form not in ("int8", "float8_e4m3fn"):
            scales = {}
    else:
        k, v, fmt, scales = key, value, None, {}
    narrow = fmt is not None or key.dtype in (torch.bfloat16, torch.float16)
    if not (
        (dt in (torch.float32, torch.float64) and key.dtype == dt)
        or (narrow and dt in (torch.float32, torch.bfloat16, torch.float16))
    ) or not (query.is_cpu and k.is_cpu and v.is_cpu):
        return _Step(mask, keep, None)
    try:
        plan = plan_decode(
            query, k, v, scale=scaling, softcap=softcap, mask=keep, kv_format=fmt, **scales
        )
    except InputError:  # (qkv.attention says what is wrong)
        return _Step(mask, keep, None)
    seen = () if mask is None else (_seen_of(plan.runs),)
    return _Step(mask, keep, plan if plan.route == NATIVE else None, seen)


def _decode_step(query: Any, key: Any, value: Any, step: _Step) -> Any:
    """A decoding step's short road: the output ``(batch, 1, heads, dv)``, or None.

    A model's decoding step (one query per head; no mask, or one that leaves each sequence
    one run of keys; no variant but Gemma 2's soft-capping) on CPU float32/float64 tensors,
    or bfloat16/float16 ones (the keys and values read in place and widened in registers,
    computed in float32, the output given back in the model's dtype), that need no gradient
    is one call of the native decode kernel (``step.plan``, a :class:`qkv.DecodePlan` run on
    this layer's tensors), the one :func:`qkv.attention` runs for the same problem, on the
    tensors' memory: between the model's operations every Python step finds cold caches, and
    the general path's checks and conversions cost more than the kernel. A result that is not
    finite is computed again at once by the NumPy decode kernel (the plan's NumPy road, with
    qkv's rules for infinite and NaN inputs), not by the native kernel a second time. None
    where this does not apply (the caller then takes :func:`qkv.attention`): another dtype or
    device, a gradient, the kernel not built or switched off, a mask row that is not one run.
    """
    import torch

    plan = step.plan
    if (
        plan is None
        or not (query.is_cpu and key.is_cpu and value.is_cpu)
        or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
        or (torch.is_grad_enabled() and value.requires_grad)
    ):
        return None
    codes = getattr(key, "qkv_stored", None)  # a QuantizedKVCache layer's stand-ins
    if codes is None:
        out = plan.run(query, key, value)
    elif plan.kv_format in ("int8", "float8_e4m3fn"):  # 8-bit codes with a scale per row
        out = plan.run(
            query, codes.codes_k, codes.codes_v, k_scale=codes.scales_k, v_scale=codes.scales_v
        )
    else:
        out = plan.run(query, codes.codes_k, codes.codes_v)
    return out.transpose(1, 2)  # (batch, heads, 1, dv) in memory: (batch, 1, heads, dv)


def _decode_fast(
    query: Any, key: Any, value: Any, mask: Any, scaling: Any, kwargs: dict[str, Any]
) -> Any:
    """:func:`_decode_step` for a decoding step with nothing but a mask of runs of keys and
    soft-capping (no other variant, no weights asked for); None otherwise.

    The step's plan (:func:`_step`) is made by the first layer and shared by the others: a mask
    ``(batch or 1, 1, 1, S)`` is read once as each sequence's run of keys (transformers builds
    booleans for this backend; a float mask of only ``0`` and ``-inf`` is turned into them
    once).
    """
    for name in ("position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            return None
    if kwargs.get("output_attentions"):
        return None
    step = _step(query, key, value, mask, scaling, kwargs.get("softcap"))
    return _decode_step(query, key, value, step)


#: Where a prefill's mask keeps what it was read as (:func:`_prefill_mask`).
_ON_PREFILL_MASK = "_qkv_prefill"


def _prefill_mask(mask: Any) -> Any:
    """A prefill's mask as every layer hands it to :func:`qkv.attention`, read once per model
    step (kept on the mask; read again if it is changed in place): a padding mask (each
    sequence's keys a leading run, the same for every query) as a ``(batch, 1, 1, S)`` boolean
    array, which the validation reads as key counts at the cost of one row per sequence, or
    None where it hides nothing; the causal mask of a left-padded prompt batch as each
    sequence's first key (:class:`_CausalRuns`); a float mask of only ``0`` and ``-inf`` as
    booleans; any other mask as it is."""
    version = getattr(mask, "_version", None)
    kept = getattr(mask, _ON_PREFILL_MASK, None)
    if kept is not None and kept[0] == version:
        return kept[1]
    found = _read_prefill_mask(mask)
    try:
        setattr(mask, _ON_PREFILL_MASK, (version, found))
    except (AttributeError, RuntimeError):
        pass  # a tensor that takes no attribute: read per layer
    return found


def _read_prefill_mask(mask: Any) -> Any:
    """:func:`_prefill_mask`'s reading of ``mask`` (a 4-D CPU tensor, or anything else as it
    is)."""
    import numpy as np

    from ..masks import tail_counts

    if getattr(mask, "ndim", 0) != 4 or not mask.is_cpu:
        return mask
    keep = _keep(mask)
    if keep is None:
        return mask  # a true float bias
    rows = keep.numpy()
    counts = tail_counts(rows, 2)
    if counts is None:
        starts = _causal_starts(rows)
        if starts is not None:
            return _CausalRuns(rows, starts)
        return rows  # booleans: not read from floats again by each layer
    S = rows.shape[-1]
    if bool((counts == S).all()):
        return None  # hides nothing
    return (np.arange(S)[None, :] < counts[:, None])[:, None, None, :]


class _CausalRuns(NamedTuple):
    """A prefill's mask that is causal (bottom-right) within each sequence's trailing run of
    keys ``[starts[b], S)``: what a batch of left-padded prompts gets. ``rows`` is the mask as
    booleans, for the roads that read it as it is."""

    rows: np.ndarray
    starts: np.ndarray


def _causal_starts(rows: np.ndarray) -> np.ndarray | None:
    """Each sequence's first key when boolean ``rows`` ``(B, 1, L, S)`` is exactly the causal
    mask (query ``i`` sees keys up to ``S - L + i``) cut to the keys ``[start, S)`` of each
    sequence: some start above 0 is left padding, all of them 0 the plain causal mask (a
    chunk of queries, or a speculative step's draft tokens, against a cache); None for any
    other mask. A query row before its sequence's start sees no key. One pass over the mask,
    once per model step.

    >>> import numpy as np
    >>> tri = np.tri(4, 4, dtype=bool)
    >>> m = np.stack([tri, tri & (np.arange(4) >= 2)])[:, None]
    >>> _causal_starts(m).tolist()
    [0, 2]
    >>> _causal_starts(np.tri(2, 5, 3, dtype=bool)[None, None]).tolist()  # 2 rows, 5 keys
    [0]
    >>> m[1, 0, 3, 1] = True  # a key before the run: not this mask
    >>> _causal_starts(m) is None
    True
    """
    B, h, L, S = rows.shape
    if h != 1 or L < 2 or L > S or rows.dtype != np.bool_:
        return None
    starts = S - np.count_nonzero(rows[:, 0, -1, :], axis=-1)  # the last query sees [start, S)
    keys = np.arange(S)
    expected = np.tri(L, S, S - L, dtype=bool)[None] & (keys >= starts[:, None])[:, None, :]
    return starts if np.array_equal(rows[:, 0], expected) else None


def _causal_runs(
    query: Any, key: Any, value: Any, runs: _CausalRuns, options: dict[str, Any]
) -> Any:
    """The attention of a left-padded prefill (:class:`_CausalRuns`), sequence by sequence on
    its own keys, causal, with no mask: ``(batch, L, heads, dv)``, 0 for the query rows that
    see no key (as :func:`qkv.attention` gives a row that sees none). The mask's elementwise
    road took about twice as long on 8 prompts of 33-512 tokens (H8 kv2 d32)."""
    from ..front import attention as qkv_attention

    B, H, L, _ = query.shape
    S = key.shape[-2]
    out = query.new_zeros((B, L, H, value.shape[-1]))
    with compiled_team():  # between PyTorch's operations: see threads.compiled_team
        for b in range(B):
            start = int(runs.starts[b])
            first = max(0, start - (S - L))  # the first query row that sees a key
            if start >= S or first >= L:
                continue
            o = qkv_attention(
                query[b : b + 1, :, first:],
                key[b : b + 1, :, start:],
                value[b : b + 1, :, start:],
                causal=True,
                **options,
            )
            out[b, first:] = o[0].transpose(0, 1)
    return out


def attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """An attention function with the signature of transformers' ``AttentionInterface``.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention layer; its ``is_causal`` (default ``True``) is read when
        ``attention_mask`` is ``None``.
    query : torch.Tensor, shape ``(batch, heads, L, d)``
    key, value : torch.Tensor, shapes ``(batch, kv_heads, S, d)`` and ``(batch, kv_heads, S, dv)``
        ``heads`` must be a multiple of ``kv_heads``.
    attention_mask : torch.Tensor or None
        Broadcastable to ``(batch, heads, L, S)``: bool (``True`` = may attend) or float (bias).
    scaling : float, optional
        Multiplier of the scores; ``None`` is ``1/sqrt(d)``.
    dropout : float, optional
        Must be 0.
    **kwargs
        ``is_causal``, ``sliding_window``, ``position_bias``, ``softcap``, ``s_aux`` (or
        ``sinks``) and ``output_attentions`` are used; anything else is ignored.

    Returns
    -------
    attn_output : torch.Tensor, shape ``(batch, L, heads, dv)``
    attn_weights : torch.Tensor, shape ``(batch, heads, L, S)``, or None
        Only with ``output_attentions=True``.

    Examples
    --------
    >>> import torch
    >>> from types import SimpleNamespace
    >>> from qkv.integrations.transformers import attention_forward
    >>> q, k, v = torch.ones(1, 4, 3, 8), torch.ones(1, 2, 3, 8), torch.rand(1, 2, 3, 5)
    >>> out, w = attention_forward(SimpleNamespace(is_causal=True), q, k, v, None)
    >>> tuple(out.shape), w is None
    ((1, 3, 4, 5), True)
    >>> torch.allclose(out[0, 0, 0], v[0, 0, 0])  # the first token sees only itself
    True
    """
    if dropout:
        raise InputError(
            f"dropout: qkv has no attention dropout, got {dropout}; use the model in eval() "
            "mode, or set its attention dropout to 0 to train through qkv"
        )
    step = None
    if query.ndim == 4 and query.shape[2] == 1:  # a decoding step
        if not OBSERVERS:
            fast = _decode_fast(query, key, value, attention_mask, scaling, kwargs)
            if fast is not None:
                return fast, None
        step = _step(query, key, value, attention_mask, scaling, kwargs.get("softcap"))
    return _general(module, query, key, value, attention_mask, scaling, kwargs, step)


def _general(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: Any,
    kwargs: dict[str, Any],
    step: _Step | None = None,
    kernel: str = "auto",
) -> tuple[Any, Any]:
    """The general road: :func:`qkv.attention` (on ``kernel``) with what the model passed,
    reading only the keys some sequence sees (a decoding step's ``step`` says which)."""
    stored = getattr(key, "qkv_stored", None)
    if stored is not None:  # a QuantizedKVCache: the prompt runs on the widened stored values
        key, value = stored.widened()
    from torch.nn.functional import pad as torch_pad

    from ..front import attention as qkv_attention
    from ..front import attention_weights as qkv_attention_weights

    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    mask = _split_mask(attention_mask, kwargs.get("position_bias"))
    L, S = query.shape[-2], key.shape[-2]
    if L > 1 and mask is attention_mask and mask is not None and not OBSERVERS:
        mask = _prefill_mask(mask)  # read once per model step, for every layer (observers
        # such as qkv.integrations.capture see the model's own mask)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    variants: dict[str, Any] = {"scale": scaling}
    if kwargs.get("softcap") is not None:
        variants["softcap"] = kwargs["softcap"]
    causal, window, skipped = False, None, 0  # skipped: keys left out before those read
    if isinstance(mask, _CausalRuns) and not mask.starts.any():
        mask, causal = None, True  # the causal mask itself, bottom-right: no mask to read
    elif isinstance(mask, _CausalRuns):
        if sinks is None and not kwargs.get("output_attentions") and kernel == "auto":
            return _causal_runs(query, key, value, mask, variants), None
        mask = mask.rows
    if attention_mask is None and is_causal and L > 1:
        # transformers left the mask out because PyTorch's top-left `is_causal` covers it: either
        # L == S (same as bottom-right) or a prefill into an empty, larger static cache whose
        # first L slots hold the keys; read just those, as the "sdpa" backend does.
        causal = True
        if S > L:
            key, value = key[..., :L, :], value[..., :L, :]
            if mask is not None:
                mask = mask[..., :L]
        sliding = kwargs.get("sliding_window")
        if sliding:
            window = (int(sliding) - 1, 0)
    options = {**variants, "causal": causal, "mask": mask, "window": window}
    if sinks is not None:
        options["sinks"] = sinks
    seen = None
    if step is not None and mask is not None and mask is step.mask:  # no position bias added
        seen = step.seen(S)
        if seen is not None:
            lo, hi = seen.first, seen.last
            if hi - lo < S:  # read only the keys some sequence sees, as views of the cache
                key, value, skipped = key[..., lo:hi, :], value[..., lo:hi, :], lo
            options["mask"] = None if seen.exact else mask[..., lo:hi]
    with compiled_team():  # between PyTorch's operations: see threads.compiled_team
        if L > 1 and query.ndim == 4:  # the output written as the model takes it, (batch, L,
            # heads, dv), which the kernels that can write so do: no copy below
            out = qkv_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                kernel=kernel, layout="blhd", **options,
            ).transpose(1, 2)  # fmt: skip
        else:
            out = qkv_attention(query, key, value, kernel=kernel, **options)
    for observe in OBSERVERS:
        observe(module, query, key, value, options, out)
    weights = None
    if kwargs.get("output_attentions"):
        weights = qkv_attention_weights(query, key, **options)
        if weights.shape[-1] < S:  # keys left out above get weight 0, as in "eager"
            weights = torch_pad(weights, (skipped, S - skipped - weights.shape[-1]))
    return out.transpose(1, 2).contiguous(), weights


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` with transformers under ``name`` (default ``"qkv"``).

    Registers it with ``AttentionInterface`` and registers transformers' own boolean mask
    builder (the one ``"sdpa"`` uses) with ``AttentionMaskInterface`` under the same name, so
    models build causal, padding and sliding-window masks for it. Safe to call more than once.

    Returns
    -------
    str
        The name to pass as ``attn_implementation``.
    """
    what = "qkv.integrations.transformers"
    require("torch", what)
    AttentionInterface = require("transformers", what).AttentionInterface
    masking = require("transformers.masking_utils", what)
    AttentionMaskInterface, sdpa_mask = masking.AttentionMaskInterface, masking.sdpa_mask
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name

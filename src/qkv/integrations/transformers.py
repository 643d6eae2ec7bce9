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

    ``plan`` is the native step's checked constants
    (:class:`qkv.engine.kernels.native_decode.DecodePlan`: sizes and grouping, scale,
    soft-cap, stored form, the mask's boolean rows, which the kernel reads as each sequence's
    run of keys), or None where the short road does not apply; :meth:`seen` is what the general
    road reads instead, found once per step.
    """

    __slots__ = ("_seen", "keep", "mask", "plan")

    def __init__(self, mask: Any, keep: Any, plan: Any) -> None:
        self.mask, self.keep, self.plan = mask, keep, plan
        self._seen: tuple[_Seen | None, ...] = ()

    def seen(self, S: int) -> _Seen | None:
        """Which of ``S`` keys the step's sequences see when each sees one run of them (read
        once by :func:`qkv.engine.kernels.decode.key_runs`); None for any other mask."""
        if not self._seen:
            self._seen = (_visible_keys(self.keep, S),)
        return self._seen[0]


def _visible_keys(keep: Any, S: int) -> _Seen | None:
    """The keys a decoding step's boolean mask ``(batch or 1, 1, 1, S)`` (or None) leaves each
    sequence, when that is one run of keys per sequence: a ``StaticCache``'s filled prefix, a
    left-padded sequence's real tokens, a sliding window's last keys. Read as such, the keys are
    a view of the cache, and with one run for the whole batch the call needs no mask (the fast,
    unmasked kernels) instead of the whole cache under a dense mask. None otherwise."""
    from ..engine.kernels.decode import key_runs

    if keep is None or keep.ndim != 4 or keep.shape[1:] != (1, 1, S) or not keep.is_cpu:
        return None  # (a mask of another length: qkv.attention says so)
    runs = key_runs(keep[:, 0, 0, :].numpy())
    if runs is None or not len(runs.lo):
        return None  # not one run each, or a sequence that sees no key: the general path
    lo, hi = runs
    first, last = int(lo.min()), int(hi.max())
    return _Seen(first, last, bool(first == lo.max() and last == hi.min()))


_STEPS: dict[Any, _Step] = {}  # the steps planned lately, by mask and shapes: a few kept


def _step(query: Any, key: Any, value: Any, mask: Any, scaling: Any, softcap: Any) -> _Step:
    """The plan of this decoding step: the one planned for an earlier layer with the same mask
    (unchanged since), shapes, dtypes, scale and soft-cap, or a new one."""
    import torch

    stored = getattr(key, "qkv_stored", None)  # a QuantizedKVCache layer's stand-ins
    if stored is not None:
        form = stored.form
    else:  # K/V in 16 bits: read in place, computed in float32
        form = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(key.dtype)
    name = (
        None if mask is None else (id(mask), getattr(mask, "_version", None)),
        type(scaling), scaling, type(softcap), softcap, form,
        query.dtype, key.dtype, value.dtype, query.shape, key.shape, value.shape,
    )  # fmt: skip
    try:
        step = _STEPS.get(name)
    except TypeError:  # an unhashable scale or soft-cap: qkv.attention says what it is
        return _Step(mask, None, None)
    if step is None or step.mask is not mask:
        if len(_STEPS) >= 8:
            _STEPS.clear()
        step = _STEPS[name] = _plan(query, key, value, mask, scaling, softcap, form)
    return step


def _plan(
    query: Any, key: Any, value: Any, mask: Any, scaling: Any, softcap: Any, form: Any
) -> _Step:
    """A new :class:`_Step`: what every layer of it shares, checked once."""
    import torch

    from ..engine.kernels import native_decode

    if mask is not None and not mask.is_cpu:
        return _Step(mask, None, None)
    keep = None if mask is None else _keep(mask)
    if mask is not None and keep is None:
        return _Step(mask, None, None)  # a float bias: the general road applies it
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        return _Step(mask, keep, None)  # (qkv.attention says what is wrong)
    dt = query.dtype
    B, hq, L, d = query.shape
    kvh, S, dv = key.shape[1], key.shape[2], value.shape[-1]
    rows = None
    if keep is not None:
        if keep.ndim != 4 or keep.shape[1:] != (1, 1, S) or keep.shape[0] not in (1, B):
            return _Step(mask, keep, None)  # (a mask of another shape: qkv.attention says so)
        rows = (keep.data_ptr(), keep.stride(0) if keep.shape[0] > 1 else 0, keep.stride(3))
    if (
        L != 1
        or not (
            (dt in (torch.float32, torch.float64) and key.dtype == dt and form is None)
            or (form is not None and dt in (torch.float32, torch.bfloat16, torch.float16))
        )
        or value.dtype != key.dtype
        or key.shape != (B, kvh, S, d)
        or value.shape[:3] != (B, kvh, S)
    ):
        return _Step(mask, keep, None)
    plan = native_decode.DecodePlan.plan(
        (B, hq, kvh, 1, d, dv, S), f64=dt == torch.float64, scale=scaling, softcap=softcap,
        kv_format=form, mask=rows,
    )  # fmt: skip
    return _Step(mask, keep, plan)


def _decode_step(query: Any, key: Any, value: Any, step: _Step) -> Any:
    """A decoding step's short road: the output ``(batch, 1, heads, dv)``, or None.

    A model's decoding step (one query per head; no mask, or one that leaves each sequence
    one run of keys; no variant but Gemma 2's soft-capping) on CPU float32/float64 tensors,
    or bfloat16/float16 ones (the keys and values read in place and widened in registers,
    computed in float32, the output given back in the model's dtype), that need no gradient
    is one call of the native decode kernel (``step.plan``'s
    :meth:`~qkv.engine.kernels.native_decode.DecodePlan.run`), the one :func:`qkv.attention`
    runs for the same problem, on the tensors' memory: between the model's operations every
    Python step finds cold caches, and the general path's checks and conversions cost more
    than the kernel. A result that is not finite is computed again at once by the NumPy
    decode kernel (:func:`_fallback`), not by the native kernel a second time. None where
    this does not apply (the caller then takes :func:`qkv.attention`): another dtype or
    device, a gradient, the kernel not built, a mask row that is not one run.
    """
    import torch

    from ..engine.kernels.native_decode import layout

    plan = step.plan
    if (
        plan is None
        or not (query.is_cpu and key.is_cpu and value.is_cpu)
        or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
        or (torch.is_grad_enabled() and value.requires_grad)
    ):
        return None
    given, k, v, scales = query, key, value, None
    codes = getattr(key, "qkv_stored", None)  # a QuantizedKVCache layer's stand-ins
    if codes is not None:  # 8-bit codes with a scale per token and head, read in place
        k, v, scales = codes.codes_k, codes.codes_v, (codes.scales_k, codes.scales_v)
    if plan.kv_format is not None and query.dtype != torch.float32:
        query = query.float()  # one token's rows: the keys and values stay as they are
    ql = layout(query.shape, query.stride(), 1)
    kl = layout(k.shape, k.stride(), 1)
    vl = layout(v.shape, v.stride(), 1)
    if ql is None or kl is None or vl is None:
        return None
    rows: Any = None
    if scales is not None:
        found = [layout((*x.shape, 1), (*x.stride(), 1), 1) for x in scales]
        if found[0] is None or found[1] is None:
            return None
        rows = ((scales[0].data_ptr(), found[0]), (scales[1].data_ptr(), found[1]))
    # (B, heads, 1, dv) in memory: what it writes
    B, hq, _, _ = query.shape
    out = torch.empty((B, 1, hq, v.shape[-1]), dtype=query.dtype)
    status = plan.run(
        (query.data_ptr(), ql), (k.data_ptr(), kl), (v.data_ptr(), vl), out.data_ptr(),
        scales=rows,
    )  # fmt: skip
    if status == 3:  # not finite: the NumPy decode kernel, with qkv's rules for that
        return _fallback(given, key, value, step)
    if status:  # 4: a mask row is not one run (so for every layer of the step)
        step.plan, step._seen = None, (None,)  # the kernel's verdict, not read again here
        return None
    return out if out.dtype == given.dtype else out.to(given.dtype)


def _fallback(query: Any, key: Any, value: Any, step: _Step) -> Any:
    """A decoding step whose native result was not finite, on the general road's NumPy
    decode kernel (``kernel="decode"``: its retries, and qkv's rules for infinite and NaN
    inputs) over the keys the mask leaves visible, K/V widened as the general road widens them
    (so that the native kernel is not run on them again)."""
    import torch

    stored = getattr(key, "qkv_stored", None)
    if stored is not None:
        key, value = stored.widened()
    dt = query.dtype
    if key.dtype != dt or dt not in (torch.float32, torch.float64):  # computed in float32
        query, key, value = query.float(), key.float(), value.float()
    plan = step.plan
    assert plan is not None  # it ran
    kwargs = {} if plan.softcap is None else {"softcap": plan.softcap}
    out, _ = _general(None, query, key, value, step.mask, plan.scale, kwargs, step, "decode")
    return out if out.dtype == dt else out.to(dt)


def _decode_fast(
    query: Any, key: Any, value: Any, mask: Any, scaling: Any, kwargs: dict[str, Any]
) -> Any:
    """:func:`_decode_step` for a decoding step with nothing but a mask of runs of keys and
    soft-capping (no other variant, no weights asked for); None otherwise.

    The step's plan (:func:`_step`) is made by the first layer and shared by the others: a mask
    ``(batch or 1, 1, 1, S)`` is handed to the kernel as boolean rows (transformers builds
    booleans for this backend; a float mask of only ``0`` and ``-inf`` is turned into them
    once), and the kernel reads each sequence's run of keys from it.
    """
    for name in ("position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            return None
    if kwargs.get("output_attentions"):
        return None
    step = _step(query, key, value, mask, scaling, kwargs.get("softcap"))
    return _decode_step(query, key, value, step)


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
    causal, window, skipped = False, None, 0  # skipped: keys left out before those read
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
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    options = {"scale": scaling, "causal": causal, "mask": mask, "window": window}
    if kwargs.get("softcap") is not None:
        options["softcap"] = kwargs["softcap"]
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

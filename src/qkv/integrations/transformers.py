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

import math
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
    """Which keys a decoding step's sequences see (:func:`_visible_keys`)."""

    first: int  # no sequence sees a key before first ...
    last: int  # ... or from last on
    exact: bool  # every sequence sees exactly keys first:last (the mask is then not needed)


def _visible_keys(mask: Any, L: int, S: int) -> _Seen | None:
    """Which keys each sequence of a decoding step's mask sees; None when the mask does not
    qualify.

    Decoding (``L == 1``) through transformers' caches, each sequence's mask is one run of
    visible keys: a ``StaticCache``'s filled prefix, a left-padded sequence's real tokens, a
    sliding window's last keys. Read as such, the keys are a view of the cache, and with one run
    for the whole batch the call needs no mask (the fast, unmasked kernels) instead of the whole
    cache under a dense mask. Only a mask
    that is the same for every head (``(batch, 1, 1, S)`` for ``S`` keys), boolean or float with
    only ``0`` and ``-inf``, qualifies.
    """
    import torch

    if L != 1 or mask.ndim != 4 or mask.shape[1:3] != (1, 1) or mask.shape[3] != S:
        return None  # (a mask of another length: qkv.attention says so)
    if not mask.is_cpu:
        return None
    m = mask[:, 0, 0, :]
    if m.dtype != torch.bool:
        if not m.is_floating_point():
            return None
        ok = m == 0
        if not bool((ok | (m == float("-inf"))).all()):
            return None  # a true float bias: keep it
        m = ok
    a = m.numpy()
    S = a.shape[1]
    if S == 0 or not a.any(axis=1).all():
        return None  # a sequence that sees no key: leave it to the general path
    lo = a.argmax(axis=1)
    hi = S - a[:, ::-1].argmax(axis=1)
    first, last = int(lo.min()), int(hi.max())
    exact = bool(first == lo.max() and last == hi.min() and a[:, first:last].all())
    return _Seen(first, last, exact)


def _decode_step(
    query: Any,
    key: Any,
    value: Any,
    scaling: Any,
    softcap: Any = None,
    mask_rows: tuple[int, int, int] | None = None,
) -> Any:
    """A decoding step's short road: the output ``(batch, 1, heads, dv)``, or None.

    A model's decoding step (one query per head; no mask, or one that leaves each sequence
    one run of keys; no variant but Gemma 2's soft-capping) on CPU float32/float64 tensors,
    or bfloat16/float16 ones (the keys and values read in place and widened in registers,
    computed in float32, the output given back in the model's dtype), that need no gradient
    is one call of the native decode kernel
    (:func:`qkv.engine.kernels.native_decode.launch`), the one :func:`qkv.attention` runs for
    the same problem, on the tensors' memory: between the model's operations every Python step
    finds cold caches, and the general path's checks and conversions cost more than the kernel.
    ``mask_rows`` is the address and byte strides of a boolean mask row per sequence, which
    the kernel reads as each sequence's run of keys. None where this does not apply (the
    caller then takes :func:`qkv.attention`): another dtype or device, a gradient, the kernel
    not built, a mask row that is not one run, a result that is not finite.
    """
    import torch

    from ..engine.kernels import native_decode

    dt = query.dtype
    scales = None
    codes = getattr(key, "qkv_stored", None)  # a QuantizedKVCache layer's stand-ins
    if codes is not None:  # 8-bit codes with a scale per token and head, read in place
        key, value, stored = codes.codes_k, codes.codes_v, codes.form
        scales = (codes.scales_k, codes.scales_v)
    else:  # K/V in 16 bits: read in place, computed in float32
        stored = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(key.dtype)
    if (
        query.ndim != 4
        or query.shape[2] != 1
        or not (
            (dt in (torch.float32, torch.float64) and key.dtype == dt)
            or (stored is not None and dt in (torch.float32, torch.bfloat16, torch.float16))
        )
        or value.dtype != key.dtype
        or not (query.is_cpu and key.is_cpu and value.is_cpu)
        or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
        or (torch.is_grad_enabled() and value.requires_grad)
        or not native_decode.available()
    ):
        return None
    B, hq, _, d = query.shape
    kvh, S, dv = key.shape[1], key.shape[2], value.shape[3]
    if (
        key.shape != (B, kvh, S, d)
        or value.shape[:3] != (B, kvh, S)
        or kvh < 1
        or hq % kvh
        or min(d, dv) < 1
    ):
        return None
    if stored is not None and dt != torch.float32:
        query = query.float()  # one token's rows: the keys and values stay as they are
    ql = native_decode.layout(query.shape, query.stride(), 1)
    kl = native_decode.layout(key.shape, key.stride(), 1)
    vl = native_decode.layout(value.shape, value.stride(), 1)
    if scaling is not None and not (type(scaling) in (int, float) and 0 < scaling < math.inf):
        return None  # qkv.attention says what is wrong with it
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    if ql is None or kl is None or vl is None:
        return None
    rows: Any = None
    if scales is not None:
        found = [native_decode.layout((*x.shape, 1), (*x.stride(), 1), 1) for x in scales]
        if found[0] is None or found[1] is None:
            return None
        rows = ((scales[0].data_ptr(), found[0]), (scales[1].data_ptr(), found[1]))
    # (B, heads, 1, dv) in memory: what it writes
    out = torch.empty((B, 1, hq, dv), dtype=query.dtype)
    status = native_decode.launch(
        query.dtype == torch.float64, (B, kvh, hq // kvh, 1, d, dv, S),
        (query.data_ptr(), ql), (key.data_ptr(), kl), (value.data_ptr(), vl), None,
        out.data_ptr(), None, scale, softcap=softcap, mask=mask_rows, kv_format=stored,
        scales=rows,
    )  # fmt: skip
    if status:
        return None
    return out if out.dtype == dt else out.to(dt)


def _decode_fast(
    query: Any, key: Any, value: Any, mask: Any, scaling: Any, kwargs: dict[str, Any]
) -> Any:
    """:func:`_decode_step` for a decoding step with nothing but a mask of runs of keys and
    soft-capping (no other variant, no weights asked for); None otherwise.

    A mask ``(batch or 1, 1, 1, S)`` is handed to the kernel as boolean rows (transformers
    builds booleans for this backend; a float mask of only ``0`` and ``-inf`` is turned into
    them), and the kernel reads each sequence's run of keys from it.
    """
    for name in ("position_bias", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            return None
    softcap = kwargs.get("softcap")
    if softcap is not None and not (type(softcap) in (int, float) and 0 < softcap < math.inf):
        return None  # qkv.attention says what is wrong with it
    if kwargs.get("output_attentions"):
        return None
    if mask is None:
        return _decode_step(query, key, value, scaling, softcap)
    import torch

    S = key.shape[-2]
    if mask.ndim != 4 or mask.shape[1:] != (1, 1, S) or mask.shape[0] not in (1, query.shape[0]):
        return None
    if not mask.is_cpu:
        return None
    if mask.dtype != torch.bool:  # a float mask qualifies with only 0 and -inf: as booleans
        if not mask.is_floating_point():
            return None
        keep = mask == 0
        if not bool((keep | (mask == float("-inf"))).all()):
            return None  # a true float bias
        mask = keep
    rows = (mask.data_ptr(), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(3))
    return _decode_step(query, key, value, scaling, softcap, rows)


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
    if query.ndim == 4 and query.shape[2] == 1 and not OBSERVERS:  # a decoding step
        fast = _decode_fast(query, key, value, attention_mask, scaling, kwargs)
        if fast is not None:
            return fast, None
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
    if mask is not None and kwargs.get("position_bias") is None:
        seen = _visible_keys(mask, L, S)
        if seen is not None:
            lo, hi = seen.first, seen.last
            if hi - lo < S:  # read only the keys some sequence sees, as views of the cache
                key, value, skipped = key[..., lo:hi, :], value[..., lo:hi, :], lo
            options["mask"] = None if seen.exact else mask[..., lo:hi]
    with compiled_team():  # between PyTorch's operations: see threads.compiled_team
        out = qkv_attention(query, key, value, **options)
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

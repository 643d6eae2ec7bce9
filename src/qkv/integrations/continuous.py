"""Continuous batching in Hugging Face ``transformers`` (``model.generate_batch``) on qkv's
kernels.

::

    from qkv.integrations import continuous
    from transformers.generation import ContinuousBatchingConfig

    model.set_attn_implementation(continuous.register())  # the name "qkv/flash"
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=2048, page_size=64)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)

The hook, and why this one
--------------------------
transformers (5.25) runs continuous batching only on ``"paged|eager"``, ``"sdpa"`` or an
implementation whose name contains ``"flash"``; any other name registered with its
``AttentionInterface`` (``"qkv"``, from :func:`qkv.integrations.transformers.register`) is
refused by ``generate_batch`` before it starts. A name containing ``"flash"`` that is only
registered with ``AttentionInterface`` is refused too, by ``set_attn_implementation``: it loads
every flash name as FlashAttention's functions. What transformers offers third-party flash
kernels is the ``kernels`` package: an ``attn_implementation`` of the form ``"owner/name"`` is
loaded by ``kernels.get_kernel``, and transformers' own flash wrapper then calls that kernel's
``flash_attn_varlen_func`` (and ``flash_attn_with_kvcache``, ``flash_attn_func``). ``kernels``
resolves a name to a local build first where its ``LOCAL_KERNELS`` variable maps it to a
folder (``name=path`` entries joined by ``:``).

:func:`register` is that hook: it maps ``"qkv/flash"`` to the folder shipped with qkv
(``qkv/integrations/flash_kernel``: a ``metadata.json`` and an ``__init__.py`` that re-exports
:mod:`qkv.flash`'s three functions), appending to ``LOCAL_KERNELS`` in this process (an entry
the user already made for the name is kept). Nothing is downloaded; transformers' continuous
batching code is not patched. The model must support flash attention (``_supports_flash_attn``:
Llama, Mistral, Qwen, Gemma, ... do).

What runs where
---------------
- Every batch on the CPU (prefill chunks and decoding steps of different requests mixed):
  transformers gathers each layer's pages into contiguous K/V, builds no mask (flash names get
  none) and calls ``flash_attn_varlen_func`` with ``cu_seqlens_q``/``cu_seqlens_k``: qkv's
  packed walk (:func:`qkv.attention_varlen`), each request's queries against its own keys,
  bottom-right causal. Never a dense mask across requests, which is what ``"sdpa"`` gets.
  A batch of decoding steps only (one query per request) runs on qkv's native decode step
  instead, each request reading its own run of the packed keys in place
  (:func:`flash_attn_varlen_func` here: :mod:`qkv.flash`'s, with that one road added); in a
  mixed batch, and in bfloat16, :func:`qkv.attention_varlen` gives its requests of one query
  to that step and the others to the walk.
- Decoding batches where transformers hands over its pages (its fast decode path, which it
  enables on CUDA and XPU only): ``flash_attn_with_kvcache`` with ``block_table``, qkv's paged
  step reading the pages in place (:func:`qkv.flash.flash_attn_with_kvcache`).
- ``generate`` on the same model: transformers' flash wrapper as well (``flash_attn_func``, or
  the varlen function for padded batches).

transformers' flash wrapper forwards ``window_size``, ``softcap`` and ``deterministic``, which
:mod:`qkv.flash` honours; attention sinks (gpt-oss's ``s_aux``) are not among flash-attn 2's
arguments, and transformers drops them for such a kernel: use ``"qkv"`` with ``generate`` for
those models.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from .. import flash
from ..errors import InputError
from ..extras import require

__all__ = ["KERNEL_DIR", "NAME", "flash_attn_varlen_func", "register"]

#: The ``attn_implementation`` :func:`register` makes: a kernel name as transformers reads one
#: (``owner/name``) that contains ``"flash"`` (what its continuous batching accepts).
NAME = "qkv/flash"

#: The local kernel build ``kernels`` loads for :data:`NAME`.
KERNEL_DIR = Path(__file__).with_name("flash_kernel")

_KERNEL = "qkv-flash"  # the build's name in its metadata.json


class _NoDigestNote(logging.Filter):
    """Drops ``kernels``' warning that this local build records no digest (a local build has
    none to record: its files are qkv's, installed with it); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (f"'{_KERNEL}'" in text and "digest" in text)


_FILTER = _NoDigestNote()


def _point(name: str, folder: Path) -> None:
    """Map ``name`` to ``folder`` in ``LOCAL_KERNELS`` unless it is mapped already."""
    entries = [e for e in os.environ.get("LOCAL_KERNELS", "").split(":") if e]
    if any(e.partition("=")[0] == name for e in entries):
        return
    os.environ["LOCAL_KERNELS"] = ":".join([*entries, f"{name}={folder}"])


def register(name: str = NAME) -> str:
    """Make ``name`` (default ``"qkv/flash"``) an ``attn_implementation`` that runs
    transformers' continuous batching (and ``generate``) on :mod:`qkv.flash`.

    Points the ``kernels`` package's local override for ``name`` at the kernel build shipped
    with qkv (:data:`KERNEL_DIR`); transformers loads it on ``set_attn_implementation(name)``
    (or ``from_pretrained(..., attn_implementation=name)``). Safe to call more than once.

    Parameters
    ----------
    name : str, optional
        ``"owner/name"`` containing ``"flash"``: transformers loads such names through
        ``kernels``, and its continuous batching accepts only names containing ``"flash"``
        (besides its own ``"sdpa"`` and ``"paged|eager"``).

    Returns
    -------
    str
        The name to pass as ``attn_implementation``.

    Raises
    ------
    qkv.InputError
        ``name`` is not of that form, or qkv is installed under a path containing ``:``
        (``LOCAL_KERNELS`` separates its entries with it).
    qkv.extras.MissingExtraError
        torch, transformers or kernels is not installed.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[^/:=@\s]+/[^/:=@\s]*flash[^/:=@\s]*", name):
        raise InputError(
            f"name: expected 'owner/name' with 'flash' in the name (transformers' continuous "
            f"batching accepts only flash names, and loads 'owner/name' through kernels), "
            f"got {name!r}"
        )
    if ":" in str(KERNEL_DIR):
        raise InputError(
            f"qkv is installed under {KERNEL_DIR.parent}, a path containing ':', which "
            "LOCAL_KERNELS cannot hold; install it elsewhere to use continuous batching"
        )
    what = "qkv.integrations.continuous"
    require("torch", what)
    require("transformers", what)
    require("kernels", what)
    _point(name, KERNEL_DIR)
    validate = logging.getLogger("kernels._internals.validate")
    if _FILTER not in validate.filters:
        validate.addFilter(_FILTER)
    return name


#: Where the key offsets of a step keep its decode plan: ``(their _version, what, plan)``.
#: transformers hands every layer of a step the same ``cu_seqlens_k``, so one plan serves them.
_ON_OFFSETS = "_qkv_decode_plan"


def _decode_rows(
    q: Any, k: Any, v: Any, offsets: Any, ck: np.ndarray, scale: Any, softcap: Any
) -> Any:
    """One query per request against its run ``[ck[b], ck[b + 1])`` of the packed keys:
    ``(total_q, heads, dv)`` from a :class:`qkv.DecodePlan` (planned once per step, kept on
    the ``offsets`` tensor, and run per layer on ``k``/``v`` in place as a batch of
    ``(kv_heads, T, d)`` views: no gather), or None where the plan refuses the operands (the
    caller then takes the packed walk, which says why). The router chooses the plan's road
    (:attr:`qkv.DecodePlan.route`)."""
    from ..engine.decoding import plan_decode

    B, H, d = q.shape
    T, kvh, dv = v.shape
    lo, hi = np.ascontiguousarray(ck[:-1]), np.ascontiguousarray(ck[1:])
    if B < 1 or not (hi > lo).all():
        return None  # a request with no key: the packed walk's rule (output 0)
    qq = q[:, :, None, :]
    kk = k.permute(1, 0, 2)[None].expand(B, kvh, T, k.shape[-1])
    vv = v.permute(1, 0, 2)[None].expand(B, kvh, T, dv)
    what = (
        q.dtype, k.dtype, v.dtype, q.shape, k.shape, v.shape, q.stride(), k.stride(),
        v.stride(), type(scale), scale, type(softcap), softcap,
    )  # fmt: skip
    version = getattr(offsets, "_version", None)
    kept = getattr(offsets, _ON_OFFSETS, None)
    if kept is not None and kept[0] == version and kept[1] == what:
        plan = kept[2]
    else:
        try:
            plan = plan_decode(qq, kk, vv, scale=scale, softcap=softcap, seqlens=hi, starts=lo)
        except (InputError, TypeError):
            return None
        try:
            setattr(offsets, _ON_OFFSETS, (version, what, plan))
        except (AttributeError, RuntimeError):  # a tensor that takes no attribute: plan per layer
            pass
    return plan.run(qq, kk, vv)[:, :, 0]


# flash_attn_varlen_func's parameters in order, and their defaults: how a call's arguments,
# given by position or by name, are read (the signature is qkv.flash's, written once there).
_PARAMETERS = inspect.signature(flash.flash_attn_varlen_func).parameters
_ORDER = tuple(_PARAMETERS)
_DEFAULTS = {n: p.default for n, p in _PARAMETERS.items() if p.default is not p.empty}


@functools.wraps(flash.flash_attn_varlen_func)
def flash_attn_varlen_func(*args: Any, **kwargs: Any) -> Any:
    out = None
    given = _ORDER[: len(args)]  # (a call naming one of these twice is flash's to refuse)
    if len(args) <= len(_ORDER) and kwargs.keys() <= _PARAMETERS.keys() - set(given):
        call = {**_DEFAULTS, **dict(zip(given, args, strict=True)), **kwargs}
        window = call["window_size"]
        if (
            len(call) == len(_ORDER) and call["max_seqlen_q"] == 1
            and call["block_table"] is None and call["alibi_slopes"] is None
            and not call["return_attn_probs"] and not call["dropout_p"]
            and type(window) in (tuple, list) and len(window) == 2 and window[0] < 0
            and (call["causal"] or window[1] < 0)
        ):  # fmt: skip
            out = _decode_step(
                call["q"], call["k"], call["v"], call["cu_seqlens_q"], call["cu_seqlens_k"],
                call["softmax_scale"], call["softcap"],
            )  # fmt: skip
    return out if out is not None else flash.flash_attn_varlen_func(*args, **kwargs)


flash_attn_varlen_func.__module__ = __name__  # (functools.wraps gave it qkv.flash's)
flash_attn_varlen_func.__doc__ = """:func:`qkv.flash.flash_attn_varlen_func` (the same signature,
names, defaults and results), with one road added for transformers' continuous batching: a
batch of decoding steps — CPU float32/float64 tensors needing no gradient, one query per
request (``cu_seqlens_q = 0, 1, ..., B``), each request's keys packed one after another, no
window, ALiBi, block table or probabilities asked for — runs on qkv's native decode step, each
request reading its run of the packed keys in place. Anything else, and a step whose result is
not finite, runs :func:`qkv.flash.flash_attn_varlen_func` itself.

Examples
--------
>>> import torch
>>> from qkv.integrations.continuous import flash_attn_varlen_func
>>> q, k = torch.randn(3, 4, 8), torch.randn(10, 2, 8)  # 3 requests, 4 heads over 2
>>> cq, ck = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 2, 7, 10])
>>> out = flash_attn_varlen_func(q, k, k, cq, ck, 1, 5, causal=True)
>>> from qkv.flash import flash_attn_varlen_func as walk
>>> bool(torch.allclose(out, walk(q, k, k, cq, ck, 1, 5, causal=True), atol=1e-6))
True
"""


def _decode_step(q: Any, k: Any, v: Any, cq: Any, ck: Any, scale: Any, softcap: Any) -> Any:
    """:func:`_decode_rows` where the call is a plain decoding batch of CPU tensors of one float
    dtype that need no gradient, one query per request; None otherwise."""
    try:
        import torch
    except ImportError:
        return None
    ts = (q, k, v, cq, ck)
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in ts):
        return None
    if (
        q.dtype not in (torch.float32, torch.float64) or k.dtype != q.dtype
        or v.dtype != q.dtype or q.ndim != 3 or k.ndim != 3 or v.ndim != 3
        or cq.ndim != 1 or ck.shape != cq.shape or cq.numel() != q.shape[0] + 1
        or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    ):  # fmt: skip
        return None
    cqa, cka = cq.numpy().astype(np.int64), ck.numpy().astype(np.int64)
    if (cqa != np.arange(cqa.size)).any() or cka[0] != 0 or cka[-1] != k.shape[0]:
        return None  # not one query per request, or keys not packed from 0: the walk checks
    if (np.diff(cka) < 0).any():
        return None
    if isinstance(scale, bool) or (scale is not None and not isinstance(scale, (int, float))):
        return None
    cap = None
    if softcap:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            return None
        cap = float(softcap)
    return _decode_rows(q, k, v, ck, cka, scale, cap)

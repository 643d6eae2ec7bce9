"""Ready-made kernels for the kit: PyTorch's SDPA and FlexAttention, JAX's, and qkv's own.

Each is a :class:`~qkv.testing.Kernel` that states its conventions, so that
``check_attention(TORCH_SDPA)`` judges it by them; none imports its library until it runs.

- :data:`TORCH_SDPA`: ``torch.nn.functional.scaled_dot_product_attention``. Its boolean
  ``attn_mask`` means "may attend" (as qkv's), its float mask is added to the scores, and its
  ``is_causal=True`` is aligned **top-left** (query ``i`` sees keys ``j <= i``), which differs
  from qkv's bottom-right when ``L != S``; it takes ``is_causal`` or a mask, not both.
- :data:`FLEX_ATTENTION`: ``torch.nn.attention.flex_attention`` run eagerly on the CPU (not
  compiled), with causal, masks and windows as a ``mask_mod`` in bottom-right positions and
  float masks, soft-capping and ALiBi as a ``score_mod``.
- :data:`JAX_DOT_PRODUCT_ATTENTION`: ``jax.nn.dot_product_attention`` (layout ``blhd``; its
  ``is_causal`` is top-left aligned). Needs JAX, which qkv does not bring.
- :data:`TRANSFORMERS_SDPA` and :data:`TRANSFORMERS_EAGER`: the attention functions of
  Hugging Face ``transformers`` (``sdpa_attention_forward``; Llama's
  ``eager_attention_forward``), called as a model's attention layer calls them.
- :data:`QKV_ATTENTION` and :data:`QKV_DENSE`, :data:`QKV_TILED`, :data:`QKV_DECODE`:
  :func:`qkv.attention` with every feature, and with each kernel forced; :data:`QKV_TORCH`
  the same on PyTorch tensors, gradients included.

Examples
--------
>>> from qkv.testing import adapters, check_attention
>>> bool(check_attention(adapters.QKV_TILED, examples=3, features=["plain", "softcap"]))
True
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .. import front, wrapped
from ..options import Options
from .kernel import FEATURES, Kernel

__all__ = [
    "FLEX_ATTENTION",
    "JAX_DOT_PRODUCT_ATTENTION",
    "QKV_ATTENTION",
    "QKV_DECODE",
    "QKV_DENSE",
    "QKV_TILED",
    "QKV_TORCH",
    "TORCH_SDPA",
    "TRANSFORMERS_EAGER",
    "TRANSFORMERS_SDPA",
]


#: What every foreign kernel here supports; each adds its own features to these.
_FOREIGN = frozenset(
    (
        "plain",
        "scale",
        "mask",
        "float_mask",
        "gqa",
        "dv",
        "single",
        "extreme",
        "masked_rows",
        "decode",
    )
)


def _sdpa(
    q: Any, k: Any, v: Any, *, causal: bool = False, mask: Any = None, scale: Any = None
) -> Any:
    import torch.nn.functional as F

    gqa = q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )


TORCH_SDPA = Kernel(
    _sdpa,
    name="torch.nn.functional.scaled_dot_product_attention",
    arrays="torch",
    supports=_FOREIGN | {"causal", "empty", "long", "grad"},
    causal_alignment="top-left",
    notes=[
        "is_causal=True is aligned top-left (query i sees keys j <= i): checked as declared; "
        "qkv's causal is bottom-right, the same only when L == S",
        "a boolean attn_mask means 'may attend', as in qkv",
    ],
)


def _flex(q: Any, k: Any, v: Any, **keywords: Any) -> Any:
    # the kit passes qkv.attention's keywords for the features FLEX_ATTENTION supports
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    o = Options(**keywords)
    mask, softcap, alibi_slopes = o.mask, o.softcap, o.alibi_slopes
    L, S = q.shape[-2], k.shape[-2]
    shift = S - L  # bottom-right: query row i sits at position S - L + i
    keep = []
    if o.causal:
        keep.append(lambda b, h, i, j: j <= i + shift)
    if o.window is not None:
        left, right = o.window
        if left is not None:
            keep.append(lambda b, h, i, j: j >= i + shift - left)
        if right is not None:
            keep.append(lambda b, h, i, j: j <= i + shift + right)
    if mask is not None and mask.dtype == torch.bool:
        m = mask
        keep.append(
            lambda b, h, i, j: m[b if m.shape[0] > 1 else 0, h if m.shape[1] > 1 else 0, i, j]
        )
    block = None
    if keep:

        def mask_mod(b: Any, h: Any, i: Any, j: Any) -> Any:
            ok = keep[0](b, h, i, j)
            for f in keep[1:]:
                ok = ok & f(b, h, i, j)
            return ok

        block = create_block_mask(mask_mod, q.shape[0], q.shape[1], L, S, device=q.device)
    bias = mask if mask is not None and mask.dtype != torch.bool else None

    def score_mod(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if alibi_slopes is not None:
            dist = i + shift - j
            s = s - alibi_slopes[h] * torch.where(dist >= 0, dist, 0)
        if bias is not None:
            s = s + bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0, i, j]
        return s

    plain = softcap is None and alibi_slopes is None and bias is None
    with warnings.catch_warnings():  # eager on purpose: the warning urges torch.compile
        warnings.filterwarnings("ignore", message=".*without torch.compile", category=UserWarning)
        return flex_attention(
            q,
            k,
            v,
            score_mod=None if plain else score_mod,
            block_mask=block,
            scale=o.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )


FLEX_ATTENTION = Kernel(
    _flex,
    name="torch.nn.attention.flex_attention (CPU, eager)",
    arrays="torch",
    supports=_FOREIGN | {"causal", "window", "softcap", "alibi"},
    notes=[
        "causal, masks and windows are given as a mask_mod in bottom-right positions; "
        "float masks, softcap and ALiBi as a score_mod"
    ],
)


def _jax(
    q: Any, k: Any, v: Any, *, causal: bool = False, mask: Any = None, scale: Any = None
) -> Any:
    import jax

    bias = None
    if mask is not None and mask.dtype != bool:
        bias, mask = mask, None
    return jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, scale=scale, is_causal=causal
    )


JAX_DOT_PRODUCT_ATTENTION = Kernel(
    _jax,
    name="jax.nn.dot_product_attention",
    layout="blhd",
    arrays="jax",
    supports=_FOREIGN | {"causal", "long"},
    causal_alignment="top-left",
    notes=["layout (batch, L, heads, d); is_causal is aligned top-left"],
)


def _hf_module(q: Any, k: Any) -> Any:
    """The few attributes transformers' attention functions read from the attention layer."""
    from types import SimpleNamespace

    return SimpleNamespace(
        num_key_value_groups=q.shape[1] // max(k.shape[1], 1), training=False, is_causal=True
    )


def _hf_sdpa(q: Any, k: Any, v: Any, *, causal: bool = False, mask: Any = None,
             scale: Any = None) -> Any:  # fmt: skip
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(
        _hf_module(q, k), q, k, v, mask, scaling=scale, is_causal=causal
    )
    return out.transpose(1, 2)  # it returns (batch, L, heads, dv)


def _hf_eager(q: Any, k: Any, v: Any, *, mask: Any = None, scale: Any = None) -> Any:
    import torch
    from transformers.models.llama.modeling_llama import eager_attention_forward

    if mask is not None and mask.dtype == torch.bool:  # as transformers builds eager masks
        mask = torch.where(mask, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
    scaling = q.shape[-1] ** -0.5 if scale is None else scale
    out, _ = eager_attention_forward(_hf_module(q, k), q, k, v, mask, scaling)
    return out.transpose(1, 2)


_HF = _FOREIGN | {"long", "grad"}

TRANSFORMERS_SDPA = Kernel(
    _hf_sdpa,
    name="transformers sdpa_attention_forward",
    arrays="torch",
    supports=_HF | {"causal"},
    causal_alignment="top-left",
    notes=[
        "is_causal is top-left (PyTorch's) for L > 1, but a single query (L = 1) drops it and "
        "sees every key; in a model the causal mask comes as attention_mask instead",
    ],
)

TRANSFORMERS_EAGER = Kernel(
    _hf_eager,
    name="transformers eager_attention_forward (Llama)",
    arrays="torch",
    supports=_HF,
    notes=[
        "a boolean mask is given as transformers builds it for eager: 0 where allowed and the "
        "dtype's minimum elsewhere (not -inf)",
    ],
)

_ALL = set(FEATURES) - {"grad"}
_FORCED = _ALL - {"varlen"}


def _forced(kernel: str) -> Any:
    def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, **options: Any) -> Any:
        return front.attention(q, k, v, kernel=kernel, **options)

    attention.__qualname__ = f"attention(kernel={kernel!r})"
    return attention


QKV_ATTENTION = Kernel(
    front.attention, name="qkv.attention", supports=_ALL, varlen=wrapped.attention_varlen
)
QKV_TORCH = Kernel(
    front.attention,
    name="qkv.attention on PyTorch tensors (autograd)",
    arrays="torch",
    supports=(_ALL | {"grad"}) - {"varlen"},
)
QKV_DENSE = Kernel(_forced("dense"), name="qkv.attention(kernel='dense')", supports=_FORCED)
QKV_TILED = Kernel(_forced("tiled"), name="qkv.attention(kernel='tiled')", supports=_FORCED)
QKV_DECODE = Kernel(_forced("decode"), name="qkv.attention(kernel='decode')", supports=_FORCED)

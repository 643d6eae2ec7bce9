"""A transformers cache that stores K/V as int8 codes (or float8 e4m3fn) for the ``"qkv"``
attention backend, which reads them in place on each decoding step.

:class:`QuantizedKVCache` is a ``transformers.Cache`` of :class:`QuantizedKVLayer`: each
appended token's keys and values are stored in one of :mod:`qkv.engine.quant`'s 8-bit forms
(codes with a float32 scale per token and kv head, in buffers that double as they fill), as
:func:`qkv.quantize_kv` states them. A decoding step of the ``"qkv"`` backend reads the codes
in place on the native decode step, which widens them in registers: a step reads about a
quarter of float32's bytes (half of bfloat16's). A prompt (several queries) is computed on the
widened stored values. Either way the result equals attention over
:func:`qkv.dequantize_kv`'s values.

The layers hand the model zero-stride stand-ins of the K/V shapes, filled with NaN and
carrying the stored buffers: the ``"qkv"`` backend reads the buffers; any other backend would
compute NaN, never a silent wrong number. Use it with ``attn_implementation="qkv"``:

>>> import torch, transformers
>>> from qkv.integrations.transformers import register
>>> from qkv.integrations.kv_cache import QuantizedKVCache
>>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
>>> model = transformers.LlamaForCausalLM(cfg).eval()
>>> model.set_attn_implementation(register())
>>> cache = QuantizedKVCache(cfg, dtype="int8")
>>> with torch.no_grad():
...     out = model(torch.tensor([[1, 5, 7, 9]]), cache=cache, use_cache=True)
>>> cache.get_seq_length(), cache.layers[0].codes_k.dtype
(4, torch.int8)

Importing this module imports torch and transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..engine.quant import SCALED, check_format

__all__ = ["QuantizedKVCache", "QuantizedKVLayer", "stored_of"]

_LIMIT = {"int8": 127.0, "float8_e4m3fn": 448.0}
_CODES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}


def _quantize(x: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``x (..., d)`` as :func:`qkv.quantize_kv` makes them (float32
    arithmetic, round half to even; e4m3fn by PyTorch's own rounding cast)."""
    a = x.float()
    if not bool(torch.isfinite(a).all()):
        raise ValueError(f"key_states/value_states: {form} stores finite values only")
    limit = _LIMIT[form]
    top = a.abs().amax(dim=-1)
    scales = top / limit
    if bool((scales < 2.0**-126).any()):  # subnormal or 0: rounded up to a multiple of 2^-149
        up = torch.ceil(top.double() / limit / 2.0**-149) * 2.0**-149
        scales = torch.where((top > 0) & (scales < 2.0**-126), up.float(), scales)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = (a / safe[..., None]).clamp(-limit, limit)
    if form == "int8":
        return torch.round(y).to(torch.int8), scales
    return y.to(torch.float8_e4m3fn), scales


class Stored:
    """What a layer's stand-ins carry: the stored buffers and the filled length."""

    def __init__(self, layer: QuantizedKVLayer) -> None:
        self.form = layer.form
        self.length = layer.length
        self.codes_k = layer.codes_k[:, :, : self.length]
        self.codes_v = layer.codes_v[:, :, : self.length]
        self.scales_k = layer.scales_k[:, :, : self.length]
        self.scales_v = layer.scales_v[:, :, : self.length]
        self.dtype = layer.dtype

    def widened(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored values as float tensors of the model's dtype."""
        return tuple(  # type: ignore[return-value]
            (c.float() * s[..., None]).to(self.dtype)
            for c, s in ((self.codes_k, self.scales_k), (self.codes_v, self.scales_v))
        )


def stored_of(t: Any) -> Stored | None:
    """The stored buffers a :class:`QuantizedKVLayer` stand-in carries, or None."""
    return getattr(t, "qkv_stored", None)


class QuantizedKVLayer(CacheLayerMixin):
    """One layer's K/V as 8-bit codes with a float32 scale per token and kv head."""

    is_compileable = False
    is_sliding = False

    def __init__(self, dtype: str = "int8") -> None:
        super().__init__()
        self.form = check_format(dtype)
        if self.form not in SCALED:
            raise ValueError(f"dtype: expected one of {SCALED}, got {dtype!r}")
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty buffers for the first tokens' batch, heads and head sizes."""
        b, h, _, d = key_states.shape
        dv = value_states.shape[-1]
        self.device, self.dtype = key_states.device, key_states.dtype
        code = _CODES[self.form]
        self.codes_k = torch.empty(b, h, 0, d, dtype=code)
        self.codes_v = torch.empty(b, h, 0, dv, dtype=code)
        self.scales_k = torch.zeros(b, h, 0)
        self.scales_v = torch.zeros(b, h, 0)
        self.is_initialized = True

    def _reserve(self, need: int) -> None:
        cap = self.codes_k.shape[2]
        if need <= cap:
            return
        new = max(need, 2 * cap, 16)
        grown = []
        for old in (self.codes_k, self.codes_v, self.scales_k, self.scales_v):
            buf = torch.zeros(*old.shape[:2], new, *old.shape[3:], dtype=old.dtype)
            buf[:, :, : self.length] = old[:, :, : self.length]
            grown.append(buf)
        self.codes_k, self.codes_v, self.scales_k, self.scales_v = grown

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens; return stand-ins of the whole cache's K/V shapes."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.length, key_states.shape[-2]
        self._reserve(n + t)
        for x, codes, scales in (
            (key_states, self.codes_k, self.scales_k),
            (value_states, self.codes_v, self.scales_v),
        ):
            c, s = _quantize(x, self.form)
            codes[:, :, n : n + t] = c
            scales[:, :, n : n + t] = s
        self.length = n + t
        stored = Stored(self)
        nan = torch.full((), float("nan"), dtype=self.dtype)
        keys = nan.expand(*self.codes_k.shape[:2], self.length, self.codes_k.shape[-1])
        values = nan.expand(*self.codes_v.shape[:2], self.length, self.codes_v.shape[-1])
        keys.qkv_stored = values.qkv_stored = stored  # type: ignore[attr-defined]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The mask's key length (cached plus new tokens) and offset (0)."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens stored."""
        return self.length

    def get_max_length(self) -> int:
        """-1: the buffers grow without a maximum."""
        return -1

    def reset(self) -> None:
        """Forget every stored token (the buffers are kept)."""
        self.length = 0


class QuantizedKVCache(Cache):
    """A cache of :class:`QuantizedKVLayer` for every layer of ``config``'s model.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (its number of layers).
    dtype : {"int8", "float8_e4m3fn"}, optional
        The stored form (:func:`qkv.quantize_kv`); int8 by default (on the CPU its error is
        about a fifth of e4m3fn's at the same bytes: see the low-precision page).
    """

    def __init__(self, config: Any, dtype: str = "int8") -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers: list[Any] = [QuantizedKVLayer(dtype) for _ in range(text.num_hidden_layers)]
        super().__init__(layers=layers)

"""Tiny random-weight transformers models for the backend tests: one place for their configs
and for the pair of models they compare.

Built from configs (nothing is downloaded): Llama-style grouped-query attention, Mistral,
Qwen2 and Qwen3 with sliding windows, Gemma 2 (logit soft-capping, alternating sliding and full
layers) and gpt-oss (attention sinks, sliding layers). Import after ``pytest.importorskip``
("transformers"): transformers and torch are imported when a model is built.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any


def small(vocab: int) -> dict[str, Any]:
    """The shared small config: 2 layers, 4 query heads over 2 kv heads of size 8."""
    return {
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def config(name: str, vocab: int, **overrides: Any) -> tuple[Any, Any]:
    """``(config, model class)`` of the tiny model ``name`` (one of :data:`NAMES` or
    ``"mistral"``); ``overrides`` replace entries of :func:`small` (a test's layer count)."""
    import transformers

    base = {**small(vocab), **overrides}
    if name == "llama":
        return transformers.LlamaConfig(**base), transformers.LlamaForCausalLM
    if name == "mistral":
        cfg = transformers.MistralConfig(**base, sliding_window=4)
        return cfg, transformers.MistralForCausalLM
    if name == "qwen2":
        cfg = transformers.Qwen2Config(
            **base, use_sliding_window=True, sliding_window=4, max_window_layers=1
        )
        return cfg, transformers.Qwen2ForCausalLM
    if name == "qwen3":
        cfg = transformers.Qwen3Config(
            **base, use_sliding_window=True, sliding_window=3, max_window_layers=0
        )
        return cfg, transformers.Qwen3ForCausalLM
    if name == "gemma2":
        cfg = transformers.Gemma2Config(
            **base,
            sliding_window=4,
            attn_logit_softcapping=0.5,  # small, so that the tanh changes the scores a lot
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"],
        )
        return cfg, transformers.Gemma2ForCausalLM
    if name == "gpt_oss":
        cfg = transformers.GptOssConfig(
            **base,
            num_local_experts=2,
            num_experts_per_tok=1,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        )
        return cfg, transformers.GptOssForCausalLM
    raise ValueError(f"name: expected one of {(*NAMES, 'mistral')}, got {name!r}")


def pair(
    name: str,
    vocab: int,
    *,
    peer: str = "eager",
    seed: int = 0,
    before_copy: Callable[[Any], None] | None = None,
    **overrides: Any,
) -> tuple[Any, Any, Any]:
    """``(config, ours, ref)``: the tiny model ``name`` with random weights drawn after
    ``torch.manual_seed(seed)``, ``ref`` on transformers' ``peer`` attention and ``ours`` a copy
    of it on the ``"qkv"`` backend, both in eval mode.

    ``before_copy(ref)`` may change the weights first (both models then hold the change);
    ``overrides`` go to :func:`config`.
    """
    import torch

    from qkv.integrations.transformers import register

    cfg, cls = config(name, vocab, **overrides)
    cfg._attn_implementation = peer
    torch.manual_seed(seed)
    ref = cls(cfg).eval()
    if before_copy is not None:
        before_copy(ref)
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation(register())
    return cfg, ours, ref


#: The models with a variant each that tests/test_transformers_variants.py runs (Mistral's
#: sliding window is tested on its own in tests/test_transformers_backend.py).
NAMES = ("gemma2", "gpt_oss", "llama", "qwen2", "qwen3")

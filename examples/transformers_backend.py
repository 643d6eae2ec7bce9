"""Run a Hugging Face transformers model through qkv, and plot one layer's attention weights.

What it shows:

1. ``register()`` adds qkv to transformers' ``AttentionInterface`` under the name ``"qkv"``;
   any model can then be built or loaded with ``attn_implementation="qkv"``.
2. A small Llama-style model (randomly initialised from a config, so nothing is downloaded;
   with a real checkpoint, pass ``attn_implementation="qkv"`` to ``from_pretrained``) gives the
   same logits through qkv as through PyTorch's ``"sdpa"``, and the same greedy continuation
   with the KV cache (prefill, then one query at a time).
3. ``output_attentions=True`` returns qkv's attention weights, which ``qkv.plot.weights`` draws
   as a heatmap, saved to a PNG.

Needs ``pip install '.[hf,plot]'``. Run::

    python examples/transformers_backend.py --out attention.png
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qkv import plot
from qkv.integrations.transformers import register


def small_llama(seed: int = 0) -> LlamaForCausalLM:
    """2 layers, 4 query heads sharing 2 kv heads (grouped-query attention), hidden size 64."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def main(out: str = "attention.png", layer: int = 0, head: int = 0) -> dict[str, float]:
    """Compare qkv with sdpa on a small model, plot one head of one layer; return the numbers."""
    name = register()  # "qkv"
    sdpa = small_llama()
    sdpa.set_attn_implementation("sdpa")
    ours = copy.deepcopy(sdpa)  # the same weights
    ours.set_attn_implementation(name)

    # Bytes of a sentence as token ids (the model is untrained; any ids will do).
    text = "attention is all you need"
    ids = torch.tensor([[1, *text.encode()]])

    with torch.no_grad():
        result = ours(ids, output_attentions=True)
        diff = (result.logits - sdpa(ids).logits).abs().max().item()
    print(f"max |logits(qkv) - logits(sdpa)| = {diff:.2e}")

    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    same = ours.generate(ids, **kw).tolist() == sdpa.generate(ids, **kw).tolist()
    print(f"greedy generate with the KV cache, identical tokens: {same}")

    weights = result.attentions[layer]  # (batch, heads, L, S), computed by qkv
    labels = ["<s>", *text.replace(" ", "␣")]
    ax = plot.weights(
        weights,
        index=(0, head),
        query_labels=labels,
        key_labels=labels,
        title=f"layer {layer}, head {head}: causal attention through qkv",
    )
    ax.figure.savefig(out, dpi=120)
    print(f"wrote {out}")
    return {"max_abs_logit_diff": diff, "generate_identical": float(same)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention.png", help="PNG to write")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--head", type=int, default=0)
    args = parser.parse_args()
    main(args.out, args.layer, args.head)

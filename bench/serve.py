"""Serving benchmark: transformers' continuous batching (``generate_batch``) on qkv's kernels.

    python bench/serve.py [--requests 8,32,128] [--new-tokens 16] [--threads 2]
                          [--num-blocks 64 --max-batch-tokens 2048 --page-size 256]
                          [--hidden 1024 --layers 2 --heads 8 --kv-heads 2] [--seed 0]
                          [--dtype float32|bfloat16]
    python bench/serve.py --quick   # 8 requests of 33..160 tokens, 8 new tokens: under a minute

A Llama built from a config (random weights, float32 or ``--dtype bfloat16``, no download;
greedy tokens of a bfloat16 model may part where two kernels round differently; issue 43's
shape: 2 layers,
hidden 1024, 8 query heads over 2 kv heads of size 128, MLP 4096, vocabulary 4096) serves
``R`` requests of 33..512 prompt tokens (seeded), ``--new-tokens`` greedy tokens each, three
ways, in the same process:

- **qkv cb**: ``generate_batch`` on ``attn_implementation="qkv/flash"``
  (:func:`qkv.integrations.continuous.register`): the packed varlen walk per request;
- **sdpa cb**: ``generate_batch`` on ``"sdpa"`` (one dense mask over the packed batch);
- **generate 1x1**: ``generate`` one request after another on ``"sdpa"`` (no padding).

All three use the same weights; the continuous batching runs use the same
``ContinuousBatchingConfig`` (``--num-blocks``, ``--max-batch-tokens``, ``--page-size``).
Reported per way (with ``--repeat N``: the best of N rounds, the ways taking turns): the whole
run's wall time, requests/s and generated tokens/s, the model's time (its forward passes,
timed by hooks on the model), the attention function's time inside it (timed around the
function transformers calls for the implementation) and its share of the model's time, the
paged cache's updates inside it (the new K/V written into the pages, each request's pages
gathered), and the time outside the model (transformers' continuous batching loop: its thread,
its waits, scheduling). Ratios are "qkv cb" over each other way. Greedy tokens of every way
are compared with "generate 1x1", request by request.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import _common

from qkv.integrations import continuous


class Clock:
    """Seconds spent in the model's forward passes and in its attention function."""

    def __init__(self) -> None:
        self.model = 0.0
        self.attention = 0.0
        self.gather = 0.0
        self.calls = 0
        self._t0 = 0.0

    def reset(self) -> None:
        self.model = self.attention = self.gather = 0.0
        self.calls = 0

    def before(self, *_: Any, **__: Any) -> None:
        self._t0 = time.perf_counter()

    def after(self, *_: Any, **__: Any) -> None:
        self.model += time.perf_counter() - self._t0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.attention += time.perf_counter() - t0
                self.calls += 1

        return timed

    def wrap_gather(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.gather += time.perf_counter() - t0

        return timed


def build(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,  # every request generates --new-tokens tokens
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    return transformers.LlamaForCausalLM(cfg).to(getattr(torch, args.dtype)).eval()


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lengths]


def run_cb(model: Any, impl: str, reqs: list[list[int]], gen: Any, cb: Any) -> list[list[int]]:
    model.set_attn_implementation(impl)
    out = model.generate_batch(
        reqs, generation_config=gen, continuous_batching_config=cb, progress_bar=False
    )
    order = sorted(out, key=lambda r: int(r.split("_")[-1]))  # "req_0", "req_1", ...
    return [list(out[r].generated_tokens) for r in order]


def run_each(model: Any, reqs: list[list[int]], gen: Any) -> list[list[int]]:
    import torch

    model.set_attn_implementation("sdpa")
    toks = []
    for p in reqs:
        ids = torch.tensor([p])
        g = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        toks.append(g[0, len(p) :].tolist())
    return toks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", default="8,32,128")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=33)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--ways", default="qkv cb,sdpa cb,generate 1x1")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="rounds; the best run of each way")
    p.add_argument("--quick", action="store_true", help="8 requests of 33..160 tokens, 8 new")
    args = p.parse_args()
    if args.quick:
        args.requests, args.max_prompt, args.new_tokens = "8", 160, 8

    import torch
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import PagedAttentionCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    import logging

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil notes
    torch.set_num_threads(args.threads)
    _common.same_threads(args.threads)
    print("threads:", _common.threads_info())

    model = build(args)
    qkv_name = continuous.register()
    model.set_attn_implementation(qkv_name)  # loads the kernel: its wrapper is now registered
    clock = Clock()
    model.register_forward_pre_hook(clock.before)
    model.register_forward_hook(clock.after)
    originals = {n: ALL_ATTENTION_FUNCTIONS[n] for n in (qkv_name, "sdpa")}
    for n, fn in originals.items():
        ALL_ATTENTION_FUNCTIONS[n] = clock.wrap(fn)
    # the cache's update: the new K/V written into the pages, each request's pages gathered
    PagedAttentionCache.update = clock.wrap_gather(PagedAttentionCache.update)

    def gen() -> Any:  # a fresh one per call: continuous batching writes into the one it gets
        return GenerationConfig(
            max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )

    cb = ContinuousBatchingConfig(
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        page_size=args.page_size,
    )
    ways = {
        "qkv cb": lambda r: run_cb(model, qkv_name, r, gen(), cb),
        "sdpa cb": lambda r: run_cb(model, "sdpa", r, gen(), cb),
        "generate 1x1": lambda r: run_each(model, r, gen()),
    }
    ways = {w: ways[w] for w in args.ways.split(",")}
    warm = prompts(2, 33, 64, args.vocab, args.seed + 1)
    for fn in ways.values():  # warm-up: the kernel's first load, the threads
        fn(warm)

    # (not under inference_mode: there generate slows down after a generate_batch)
    for n in [int(x) for x in args.requests.split(",")]:
        reqs = prompts(n, args.min_prompt, args.max_prompt, args.vocab, args.seed)
        total_prompt = sum(map(len, reqs))
        print(
            f"\n{n} requests, prompts {min(map(len, reqs))}..{max(map(len, reqs))} "
            f"tokens ({total_prompt} in all), {args.new_tokens} new tokens each; "
            f"num_blocks={args.num_blocks} max_batch_tokens={args.max_batch_tokens} "
            f"page_size={args.page_size}; best of {args.repeat} round(s), order rotating"
        )
        best: dict[str, dict[str, float]] = {}
        tokens: dict[str, list[list[int]]] = {}
        names = list(ways)
        for r in range(args.repeat):
            for way in names[r % len(names) :] + names[: r % len(names)]:
                clock.reset()
                t0 = time.perf_counter()
                tokens[way] = ways[way](reqs)
                wall = time.perf_counter() - t0
                if way not in best or wall < best[way]["wall"]:
                    best[way] = {
                        "wall": wall, "model": clock.model, "attention": clock.attention,
                        "gather": clock.gather,
                    }  # fmt: skip
        ref = tokens.get("generate 1x1")
        rows = []
        for way, b in best.items():
            gen_tokens = sum(map(len, tokens[way]))
            row = {
                "way": way,
                "run s": f"{b['wall']:.2f}",
                "req/s": f"{n / b['wall']:.2f}",
                "tok/s": f"{gen_tokens / b['wall']:.1f}",
                "model s": f"{b['model']:.2f}",
                "attention s": f"{b['attention']:.2f}",
                "attn share": f"{b['attention'] / max(b['model'], 1e-9):.0%}",
                "page gathers s": f"{b['gather']:.2f}" if way.endswith("cb") else "",
                "outside model s": f"{b['wall'] - b['model']:.2f}",
            }
            if ref is not None:
                same = sum(a == c for a, c in zip(tokens[way], ref, strict=True))
                row["same tokens"] = f"{same}/{n}"
            if way != "qkv cb" and "qkv cb" in best:
                row["qkv cb / this"] = f"{best['qkv cb']['wall'] / b['wall']:.2f}x"
            rows.append(row)
        cols = ["way", "run s", "req/s", "tok/s", "model s", "attention s", "attn share"]
        cols += ["page gathers s", "outside model s", "same tokens", "qkv cb / this"]
        print(_common.table(rows, [c for c in cols if any(c in row for row in rows)]))
    for n, fn in originals.items():
        ALL_ATTENTION_FUNCTIONS[n] = fn


if __name__ == "__main__":
    main()

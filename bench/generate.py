"""In-model benchmark: qkv as the transformers attention backend against "sdpa" and "eager".

    python bench/generate.py [--models llama,gemma2] [--prompts 512,2048,8192] [--batches 1,4]
                             [--caches dynamic,static] [--new-tokens 16] [--repeat 3] [--threads 2]
                             [--hidden 1024 --layers 4 --heads 16 --kv-heads 4]
                             [--dtype bfloat16] [--kv-dtype int8] [--float64-tokens] [--seed 0]
    python bench/generate.py --prompts 512 --layers 2 --repeat 1   # a quick run
    python bench/generate.py --small [--repeat 5]   # issue 42's two rows of short shapes

Models are built from configs with random weights (no download), float32 (``--dtype
bfloat16`` or ``float16``: the weights and the cache in that dtype), in eval mode: a
Llama-style GQA model (the issue's reference: hidden 1024, 4 layers, 16 query heads over 4 kv
heads, head dim 64) and a Gemma-2-style one of the same size (logit soft-capping, alternating
sliding-window and full layers). Every backend runs the same weights in one process.

For each model, prompt length and batch (batch 4 is four prompts of different lengths, left
padded to the longest), per backend:

- **prefill**: one forward pass over the prompt into a fresh cache (best of ``--repeat``);
- **decode**: per-token time of greedy decoding through a ``DynamicCache`` (or a
  ``StaticCache`` of prompt + new-token slots, ``--caches static``), the median step of
  ``--repeat`` runs of ``--new-tokens`` steps (and the fastest step, in brackets); with
  ``--kv-dtype int8`` (or ``float8_e4m3fn``) qkv decodes on its ``QuantizedKVCache`` in that
  form while the others keep transformers' cache in the model's dtype;
- **attn GB/s**: during one decode run the attention function of every layer is timed; the K/V
  bytes it reads per call over that time, also as a fraction of the machine's read rate
  (``bench/machine.py``);
- the greedy tokens are compared with those of the first backend (``--backends`` order);
  with ``--float64-tokens``, also with the greedy tokens of the same weights run in float64
  (``sdpa``, or ``eager`` for Gemma 2): the leading tokens each backend keeps (the fewest over
  the batch's prompts). In bfloat16 two backends that sum in different orders part where two
  logits nearly tie; this says whether either parts from the float64 run sooner.

With ``--small``, two rows of the short shapes CPU users run most instead (issue 42), qkv
against ``sdpa``, the median of ``--repeat`` rounds taken in turns:

- **encoder batch**: a BERT model with all-MiniLM-L6-v2's sizes (6 layers, hidden 384, 12
  heads of size 32; random weights), one forward pass over 32 sentences padded to 53 tokens
  (the attention mask hides each sentence's padding; some are full); the outputs at the real
  tokens are compared;
- **small-Llama generate**: hidden 256, 2 layers, 8 query heads over 2 kv heads of size 32,
  ``generate`` of 16 greedy tokens for 8 prompts of 33 to 512 tokens (left padded), end to
  end; the tokens must be identical.

The backends take turns round by round (the order rotating), so that the drifting load of a
shared machine meets them alike. Ratios ("x peer") are against ``sdpa``, or ``eager`` for
Gemma 2 (transformers refuses ``sdpa`` there: it cannot soft-cap the scores). ``eager`` is
skipped above ``--eager-max`` prompt tokens (its score matrix grows as the square of the
prompt).
"""

from __future__ import annotations

import argparse
import itertools
import time
import warnings
from collections.abc import Callable
from typing import Any

import _common
import machine

import qkv.integrations.transformers as qkv_hf


def _config(name: str, args: argparse.Namespace, positions: int) -> Any:
    import transformers

    common = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "max_position_embeddings": positions,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if name == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if name == "gemma2":
        kinds = ["sliding_attention", "full_attention"] * args.layers
        cfg = transformers.Gemma2Config(
            **common,
            sliding_window=args.window,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=args.hidden // args.heads,
            layer_types=kinds[: args.layers],
        )
        return cfg, transformers.Gemma2ForCausalLM
    raise SystemExit(f"--models: unknown model {name!r} (llama, gemma2)")


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> tuple[Any, Any]:
    """``batch`` prompts, the i-th ``length - i * length // 8`` tokens long, left padded."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for i in range(batch):
        mask[i, : i * length // 8] = 0
    ids[mask == 0] = 0
    return ids, mask


class AttentionClock:
    """Times the attention function of every layer during a block: decode calls only."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.bytes = 0
        self.calls = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(module: Any, query: Any, key: Any, value: Any, *a: Any, **kw: Any) -> Any:
            if query.shape[-2] != 1:
                return fn(module, query, key, value, *a, **kw)
            t0 = time.perf_counter()
            out = fn(module, query, key, value, *a, **kw)
            self.seconds += time.perf_counter() - t0
            self.bytes += key.element_size() * (key.numel() + value.numel())
            self.calls += 1
            return out

        return timed


def _timed_backend(model: Any, backend: str, clock: AttentionClock) -> str:
    """Register a timed copy of ``backend``'s attention function and switch ``model`` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = f"timed_{backend}"
    fn = qkv_hf.attention_forward if backend == "qkv" else AttentionInterface()[backend]
    AttentionInterface.register(name, clock.wrap(fn))
    AttentionMaskInterface.register(name, AttentionMaskInterface()[backend])
    model.set_attn_implementation(name)
    return name


def _cache(kind: str, model: Any, length: int, kv_dtype: str | None = None) -> Any:
    """A fresh cache: ``DynamicCache``, a ``StaticCache`` of ``length`` slots, or with
    ``kv_dtype`` qkv's ``QuantizedKVCache`` storing K/V in that 8-bit form."""
    from transformers import DynamicCache, StaticCache

    if kv_dtype is not None:
        from qkv.integrations.kv_cache import QuantizedKVCache

        return QuantizedKVCache(model.config, dtype=kv_dtype)
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    return DynamicCache()


def _decode(
    model: Any, ids: Any, mask: Any, new: int, kind: str = "dynamic", kv_dtype: str | None = None
) -> tuple[float, list[float], list]:
    """Prefill into a fresh ``kind`` cache (or a quantized one, :func:`_cache`), then ``new``
    greedy steps: the prefill's seconds, each step's seconds and the tokens."""
    import torch

    cache = _cache(kind, model, ids.shape[1] + new, kv_dtype)
    t0 = time.perf_counter()
    out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    t_pre = time.perf_counter() - t0
    times, tokens = [], []
    for _ in range(new):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        t0 = time.perf_counter()
        out = model(nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
    return t_pre, times, torch.cat(tokens, dim=1).tolist()


def _kv(backend: str, args: argparse.Namespace) -> str | None:
    """The 8-bit K/V form ``backend`` decodes on: ``--kv-dtype`` for qkv, else none (the
    others keep transformers' cache in the model's dtype)."""
    return args.kv_dtype if backend == "qkv" and args.kv_dtype != "none" else None


def measure(
    model: Any,
    backends: list[str],
    ids: Any,
    mask: Any,
    args: argparse.Namespace,
    kind: str = "dynamic",
) -> dict[str, dict]:
    """Per backend: prefill seconds, decode seconds per token, greedy tokens, attention rate.

    The backends take turns, round by round: ``--repeat`` rounds, each one prefill and one run
    of ``--new-tokens`` decode steps per backend, the order rotating each round, so that the
    drifting load of a shared machine meets every backend alike. Prefill is the best round;
    decode the median step over all rounds (a median of many short steps shrugs off bursts
    better than a total), with the fastest step.
    """
    import torch

    runs: dict[str, dict[str, Any]] = {b: {"prefill": [], "steps": []} for b in backends}
    with torch.no_grad():
        for b in backends:  # warm-up: a short prompt each (first-call costs, thread pools)
            model.set_attn_implementation(b)
            _decode(model, ids[:, -64:], mask[:, -64:], 2, kind, _kv(b, args))
        for r in range(args.repeat):
            for b in backends[r % len(backends) :] + backends[: r % len(backends)]:
                model.set_attn_implementation(b)
                time.sleep(0.1)  # let other runtimes' spinning worker threads go idle
                t_pre, times, tokens = _decode(
                    model, ids, mask, args.new_tokens, kind, _kv(b, args)
                )
                runs[b]["prefill"].append(t_pre)
                runs[b]["steps"] += times
                runs[b]["tokens"] = tokens
        results = {}
        for b in backends:
            clock = AttentionClock()
            if b != "eager":  # eager's function lives in each model's module: not timed
                _timed_backend(model, b, clock)
                _decode(model, ids, mask, args.new_tokens, kind, _kv(b, args))
                model.set_attn_implementation(b)
            steps = sorted(runs[b]["steps"])
            results[b] = {
                "prefill": min(runs[b]["prefill"]),
                "decode": steps[len(steps) // 2],
                "decode range": (steps[0], steps[-1]),
                "tokens": runs[b]["tokens"],
                "attn_gbps": clock.bytes / clock.seconds / 1e9 if clock.seconds else float("nan"),
                "attn_ms": 1e3 * clock.seconds / max(1, clock.calls),
            }
    return results


def _float64_tokens(model: Any, peer: str, ids: Any, mask: Any, new: int) -> list:
    """The greedy tokens of ``model``'s weights run in float64 under ``peer``."""
    import copy

    import torch

    wide = copy.deepcopy(model).to(torch.float64)
    wide.set_attn_implementation(peer)
    with torch.no_grad():
        return _decode(wide, ids, mask, new)[2]


def _kept(tokens: list, reference: list) -> int:
    """Leading tokens equal to ``reference``'s, the fewest over the batch's prompts."""
    kept = []
    for got, want in zip(tokens, reference, strict=True):
        n = 0
        while n < len(want) and got[n] == want[n]:
            n += 1
        kept.append(n)
    return min(kept)


def _small_rows(args: argparse.Namespace) -> list[dict[str, str]]:
    """Issue 42's two rows: the MiniLM-shaped encoder batch and the small-Llama ``generate``."""
    import statistics

    import torch
    import transformers

    backends = ["qkv", "sdpa"]
    g = torch.Generator().manual_seed(args.seed)
    # the encoder batch: all-MiniLM-L6-v2's sizes, random weights
    bert_cfg = transformers.BertConfig(
        vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
        intermediate_size=1536, max_position_embeddings=512, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(args.seed)
    bert = transformers.BertModel(bert_cfg, add_pooling_layer=False).eval()
    B, N = 32, 53
    lengths = torch.randint(12, N + 1, (B,), generator=g)
    lengths[:4] = N  # some sentences fill the batch's length
    enc_ids = torch.randint(1000, 30522, (B, N), generator=g)
    enc_mask = (torch.arange(N)[None, :] < lengths[:, None]).long()
    enc_ids[enc_mask == 0] = 0
    # the small Llama: 8 prompts of 33..512 tokens, left padded
    llama_cfg = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(args.seed)
    llama = transformers.LlamaForCausalLM(llama_cfg).eval()
    P = 512
    plens = torch.linspace(33, P, 8).round().long()
    gen_ids = torch.randint(3, 4096, (8, P), generator=g)
    gen_mask = (torch.arange(P)[None, :] >= (P - plens)[:, None]).long()
    gen_ids[gen_mask == 0] = 0

    def encode() -> Any:
        return bert(input_ids=enc_ids, attention_mask=enc_mask).last_hidden_state

    def generate() -> Any:
        return llama.generate(
            gen_ids, attention_mask=gen_mask, max_new_tokens=16, min_new_tokens=16,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip

    times: dict[str, dict[str, list[float]]] = {b: {"enc": [], "gen": []} for b in backends}
    outs: dict[str, dict[str, Any]] = {b: {} for b in backends}
    with torch.no_grad():
        for r in range(args.repeat + 1):  # the first round warms up
            for b in backends[r % 2 :] + backends[: r % 2]:
                for model, key, fn in ((bert, "enc", encode), (llama, "gen", generate)):
                    model.set_attn_implementation(b)
                    time.sleep(0.1)
                    t0 = time.perf_counter()
                    outs[b][key] = fn()
                    if r:
                        times[b][key].append(time.perf_counter() - t0)
    real = enc_mask.bool()
    diff = (outs["qkv"]["enc"] - outs["sdpa"]["enc"])[real].abs().max().item()
    same = torch.equal(outs["qkv"]["gen"], outs["sdpa"]["gen"])
    rows = []
    for key, what, check in (
        ("enc", f"encoder batch B{B} H12 L{N} d32, padding (BERT, 6 layers)", f"{diff:.1e}"),
        ("gen", "small-Llama generate, 8 prompts 33-512, 16 tokens", "yes" if same else "NO"),
    ):
        med = {b: statistics.median(times[b][key]) for b in backends}
        rows.append(
            {
                "row": what,
                "qkv ms": f"{1e3 * med['qkv']:.1f}",
                "sdpa ms": f"{1e3 * med['sdpa']:.1f}",
                "x sdpa": f"{med['qkv'] / med['sdpa']:.2f}",
                "check (max diff / same tokens)": check,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama,gemma2")
    p.add_argument("--prompts", default="512,2048,8192")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--backends", default="qkv,sdpa,eager")
    p.add_argument("--caches", default="dynamic", help="dynamic, static or both (decode only)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--window", type=int, default=4096, help="Gemma 2's sliding window")
    p.add_argument("--eager-max", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0, help="of the random weights and prompts")
    p.add_argument("--no-machine", action="store_true", help="skip measuring the read rate")
    p.add_argument(
        "--float64-tokens",
        action="store_true",
        help="also compare each backend's greedy tokens with the same weights' in float64",
    )
    p.add_argument("--small", action="store_true", help="issue 42's encoder and generate rows")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument(
        "--kv-dtype",
        choices=("none", "int8", "float8_e4m3fn"),
        default="none",
        help="qkv decodes on a QuantizedKVCache in this form (the others on their own cache)",
    )
    args = p.parse_args(argv)

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(args.threads)
    _common.same_threads(args.threads)  # qkv's prefill and decode routes: the same threads
    qkv_hf.register()
    if args.small:
        print(f"threads: torch {torch.get_num_threads()}, {_common.threads_info()}; float32")
        rows = _small_rows(args)
        print(_common.table(rows, list(rows[0])))
        return
    prompts = [int(x) for x in args.prompts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    backends = args.backends.split(",")
    read = float("nan") if args.no_machine else machine.read_gbps(nbytes=1 << 28)
    print(f"threads: torch {torch.get_num_threads()}, {_common.threads_info()}")
    print(f"machine read rate: {read:.1f} GB/s; {args.dtype}; new tokens {args.new_tokens}")
    rows = []
    for name in args.models.split(","):
        cfg, cls = _config(name, args, max(prompts) + args.new_tokens + 8)
        cfg._attn_implementation = "eager"
        torch.manual_seed(args.seed)
        model = cls(cfg).eval().to(getattr(torch, args.dtype))
        for length, batch, kind in itertools.product(prompts, batches, args.caches.split(",")):
            if kind not in ("dynamic", "static"):
                raise SystemExit(f"--caches: unknown cache {kind!r} (dynamic, static)")
            ids, mask = _prompts(batch, length, args.vocab, args.seed)
            here = [
                b
                for b in backends
                if not (b == "sdpa" and name == "gemma2")  # transformers refuses: no soft-capping
                and not (b == "eager" and length > args.eager_max)
            ]
            res = measure(model, here, ids, mask, args, kind)
            first = res[here[0]]["tokens"]
            base = res.get("sdpa") or res.get("eager")
            wide = None
            if args.float64_tokens:
                peer = "eager" if name == "gemma2" else "sdpa"
                wide = _float64_tokens(model, peer, ids, mask, args.new_tokens)
            for backend, r in res.items():
                lo = r["decode range"][0]
                rows.append(
                    {
                        "model": name,
                        "prompt": length,
                        "batch": batch,
                        "cache": kind,
                        "backend": backend,
                        "prefill ms": f"{1e3 * r['prefill']:.1f}",
                        "x peer": f"{r['prefill'] / base['prefill']:.2f}" if base else "-",
                        "decode ms/tok": f"{1e3 * r['decode']:.2f} ({1e3 * lo:.2f})",
                        "x peer ": f"{r['decode'] / base['decode']:.2f}" if base else "-",
                        "attn ms/call": f"{r['attn_ms']:.3f}",
                        "attn GB/s": f"{r['attn_gbps']:.1f}",
                        "of read": f"{r['attn_gbps'] / read:.0%}" if read == read else "-",
                        "same tokens": "yes" if r["tokens"] == first else "NO",
                    }
                )
                if wide is not None:
                    kept = _kept(r["tokens"], wide)
                    rows[-1]["tokens kept of float64's"] = f"{kept}/{args.new_tokens}"
            print(_common.table(rows[-len(res) :], list(rows[-1])), flush=True)
    print()
    print(_common.table(rows, list(rows[0])))


if __name__ == "__main__":
    main()

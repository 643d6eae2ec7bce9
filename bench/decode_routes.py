"""The routes a model's decoding step can take through qkv, timed inside the model.

    python bench/decode_routes.py [--prompts 1024,8192] [--new-tokens 12] [--rounds 2]
                                  [--dtype bfloat16]

The Llama-style model of ``bench/generate.py`` (hidden 1024, 4 layers, 16 query heads over 4
kv heads, head dim 64, random weights, float32 or ``--dtype``, ``DynamicCache``) decodes
greedily with qkv as
its attention backend; every attention call of the decoding steps is timed, and the median call
is reported for each route:

- ``team``: the native decode step on PyTorch's own OpenMP team (the default; a bfloat16
  model's scores on ``vdpbf16ps`` where the CPU has AVX512_BF16);
- ``team, keys widened``: (bfloat16, with AVX512_BF16) the same with the AVX-512 clone forced
  (``QKV_NATIVE_ISA=avx512``), whose scores widen each key to float32 for FMAs;
- ``kept threads``: the native step on the library's own kept threads (``native_src/pool.h``);
- ``one thread``: the native step on the calling thread alone;
- ``numba team``: no native library (``QKV_NATIVE=0``): ``qkv.attention``'s general path,
  its compiled decode on Numba's OpenMP team;
- ``python workers``: no native library and no Numba (``QKV_JIT=0`` too): the general path on
  qkv's Python worker threads;
- ``sdpa``: transformers' ``"sdpa"`` backend, the peer.

The routes take turns round by round in one process (the same model and prompt), so that the
drifting load of a shared machine meets them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import _common
import generate

import qkv.integrations.transformers as qkv_hf
from qkv.engine.kernels import native_bf16, native_decode


@contextmanager
def _route(name: str) -> Iterator[str]:
    """Inside the block, qkv decodes by route ``name``; yields the backend to use."""
    saved_env = {k: os.environ.get(k) for k in ("QKV_NATIVE", "QKV_JIT", "QKV_NATIVE_ISA")}
    saved_team = native_decode.openmp_parallel
    try:
        if name == "kept threads":
            native_decode.openmp_parallel = lambda: (None, saved_team()[1])
        elif name == "team, keys widened":
            os.environ["QKV_NATIVE_ISA"] = "avx512"
        elif name == "one thread":
            native_decode.openmp_parallel = lambda: (None, 1)
        elif name in ("numba team", "python workers"):
            os.environ["QKV_NATIVE"] = "0"
            os.environ["QKV_JIT"] = "1" if name == "numba team" else "0"
        yield "sdpa" if name == "sdpa" else "qkv"
    finally:
        native_decode.openmp_parallel = saved_team
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _timed(fn: Callable[..., Any], calls: list[float]) -> Callable[..., Any]:
    def timed(module: Any, query: Any, *a: Any, **kw: Any) -> Any:
        if query.shape[-2] != 1:
            return fn(module, query, *a, **kw)
        t0 = time.perf_counter()
        out = fn(module, query, *a, **kw)
        calls.append(time.perf_counter() - t0)
        return out

    return timed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", default="1024,8192")
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = p.parse_args(argv)

    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(args.threads)
    _common.same_threads(args.threads)  # qkv's prefill and decode routes: the same threads
    qkv_hf.register()
    routes = ["team", "kept threads", "one thread", "numba team", "python workers", "sdpa"]
    if args.dtype == "bfloat16" and native_bf16.available():
        routes.insert(1, "team, keys widened")
    if not native_decode.available():
        routes = [r for r in routes if r in ("numba team", "python workers", "sdpa")]
    prompts = [int(x) for x in args.prompts.split(",")]
    gen_args = argparse.Namespace(
        vocab=4096, hidden=1024, layers=4, heads=16, kv_heads=4, window=4096
    )
    cfg, cls = generate._config("llama", gen_args, max(prompts) + args.new_tokens + 8)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval().to(getattr(torch, args.dtype))
    calls: dict[str, list[float]] = {}
    for backend in ("qkv", "sdpa"):
        name = f"routes_{backend}"
        AttentionInterface.register(
            name, _timed(AttentionInterface()[backend], calls.setdefault(backend, []))
        )
        AttentionMaskInterface.register(name, AttentionMaskInterface()[backend])
    print(f"threads: torch {torch.get_num_threads()}; {args.dtype}; new tokens {args.new_tokens}")
    for length in prompts:
        ids, mask = generate._prompts(1, length, gen_args.vocab)
        medians: dict[str, list[float]] = {r: [] for r in routes}
        for route in routes:  # warm-up: first-call costs (libraries, thread teams) not timed
            with _route(route) as backend, torch.no_grad():
                model.set_attn_implementation(f"routes_{backend}")
                generate._decode(model, ids[:, -64:], mask[:, -64:], 2)
        for _ in range(args.rounds):
            for route in routes:
                with _route(route) as backend, torch.no_grad():
                    model.set_attn_implementation(f"routes_{backend}")
                    calls[backend].clear()
                    generate._decode(model, ids, mask, args.new_tokens)
                    medians[route] += calls[backend]
        peer = statistics.median(medians["sdpa"])
        print(f"\nprompt {length}, batch 1: the median attention call of the decoding steps")
        rows = [
            {
                "route": r,
                "ms per call": f"{1e3 * statistics.median(medians[r]):.3f}",
                "x sdpa": f"{statistics.median(medians[r]) / peer:.2f}",
            }
            for r in routes
        ]
        print(_common.table(rows, list(rows[0])))


if __name__ == "__main__":
    main()

"""A decoding step of several causal query rows per sequence (speculative decoding's draft
tokens, a short prompt chunk) against a cache, qkv's roads and PyTorch's SDPA, in one process.

    python bench/draft_rows.py                    # B8 H32 kv8 S2048 d128, rows 1 2 4 8
    python bench/draft_rows.py --dtype bfloat16 --rows 4 --threads 1

Row ``i`` of ``L`` sits at position ``S − L + i`` (bottom-right causal): every row sees the
first ``S − L + 1`` keys, and the last ``L − 1`` only from its own on. qkv reads every key
once for all rows of a kv head on the native decode step, each row's weights stopping at its
own last key (``qkv.engine.kernels.causal_rows``). Contenders, each cycling over layers of
its own K/V (at least 96 MiB together, so every call reads its K/V from memory):

- ``qkv.attention``: head-major ``(B, kv, S, d)`` K/V, ``causal=True``;
- ``flash_attn_with_kvcache``: a ``(B, S, kv, d)`` cache, and the same keys in pages of 16
  ``(blocks, 16, kv, d)`` through a random block table, ``cache_seqlens`` all S;
- ``KVCache.attend``: a cache holding S keys per sequence;
- PyTorch's SDPA on head-major K/V with the bottom-right boolean mask (``enable_gqa``).

The table gives each one's median time per call, its ratio to PyTorch's, and the K/V bytes
read per second against this machine's read rate (``bench/machine.py``, measured at the
start).

``--model``: a Llama built from a config (random weights; 2 layers, hidden 1024, 8 heads over
2, head size 128) runs a speculative step: 4 draft tokens after a 2048-token prompt, from its
KV cache, with ``attn_implementation="qkv"`` and ``"sdpa"`` alternating (the causal mask
transformers builds runs as causal rows on qkv). Best of 20 steps, each on a copy of the cache.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import _common
import machine
import ml_dtypes
import numpy as np

import qkv
from qkv.flash import flash_attn_with_kvcache

LAYER_BYTES = 96 << 20
PAGE = 16


def contenders(
    B: int, H: int, kvh: int, S: int, d: int, L: int, dtype: str
) -> dict[str, Callable[[], Any]]:
    """``name: one call``, each cycling over its layers' K/V (results checked against
    PyTorch's first)."""
    import torch

    rng = np.random.default_rng(0)
    npt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    tt = getattr(torch, dtype)
    q = rng.standard_normal((B, H, L, d)).astype(npt)
    k = rng.standard_normal((B, kvh, S, d)).astype(npt)
    v = rng.standard_normal((B, kvh, S, d)).astype(npt)
    layers = -(-LAYER_BYTES // (k.nbytes + v.nbytes))
    bhld = [(k, v)] + [(k.copy(), v.copy()) for _ in range(layers - 1)]
    blhd = [tuple(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in kv) for kv in bhld]
    table = rng.permutation(B * S // PAGE).reshape(B, S // PAGE).astype(np.int32)
    paged = []
    for kk, vv in blhd:  # the same keys in pages: row j of sequence b in page table[b, j // 16]
        kp, vp = (
            np.empty((B * S // PAGE, PAGE, kvh, d), npt),
            np.empty((B * S // PAGE, PAGE, kvh, d), npt),
        )
        kp[table] = kk.reshape(B, S // PAGE, PAGE, kvh, d)
        vp[table] = vv.reshape(B, S // PAGE, PAGE, kvh, d)
        paged.append((kp, vp))
    caches = []
    for kk, vv in bhld[:1] + bhld[1:]:
        cache = qkv.KVCache(B, kvh, d, dtype=npt)
        cache.append(kk, vv)
        caches.append(cache)
    qf = np.ascontiguousarray(q.transpose(0, 2, 1, 3))  # flash-attn's (B, L, H, d)
    lens = np.full(B, S, np.int32)

    def torch_of(x: np.ndarray) -> Any:
        if dtype == "bfloat16":  # (ml_dtypes' bfloat16: its bits)
            return torch.from_numpy(x.view(np.int16)).view(tt)
        return torch.from_numpy(x)

    tq = torch_of(q)
    t_bhld = [tuple(torch_of(x) for x in kv) for kv in bhld]
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = sdpa(tq, *t_bhld[0], attn_mask=mask, enable_gqa=True).float().numpy()
    tol = 2e-2 if dtype == "bfloat16" else 1e-4
    got = {
        "qkv": qkv.attention(q, k, v, causal=True),
        "flash": flash_attn_with_kvcache(qf, *blhd[0], cache_seqlens=lens, causal=True),
        "paged": flash_attn_with_kvcache(
            qf, *paged[0], cache_seqlens=lens, block_table=table, causal=True
        ),  # fmt: skip
        "cache": caches[0].attend(q),
    }
    for name, out in got.items():
        out = np.asarray(out, np.float32)
        out = out if name in ("qkv", "cache") else out.transpose(0, 2, 1, 3)
        np.testing.assert_allclose(out, want, rtol=tol, atol=tol, err_msg=name)

    def cycling(fn: Callable[..., Any], items: list[Any]) -> Callable[[], Any]:
        at = [0]

        def call() -> Any:
            item = items[at[0] % len(items)]
            at[0] += 1
            return fn(item)

        return call

    return {
        "qkv.attention": cycling(lambda kv: qkv.attention(q, *kv, causal=True), bhld),
        "flash_attn_with_kvcache": cycling(
            lambda kv: flash_attn_with_kvcache(qf, *kv, cache_seqlens=lens, causal=True), blhd
        ),
        "  paged, pages of 16": cycling(
            lambda kv: flash_attn_with_kvcache(
                qf, *kv, cache_seqlens=lens, block_table=table, causal=True
            ),  # fmt: skip
            paged,
        ),
        "KVCache.attend": cycling(lambda c: c.attend(q), caches),
        "torch sdpa": cycling(lambda kv: sdpa(tq, *kv, attn_mask=mask, enable_gqa=True), t_bhld),
    }


def model_step(threads: int, rounds: int = 2, prompt: int = 2048, drafts: int = 4) -> None:
    """The ``--model`` measurement (see the module's text)."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from qkv.integrations.transformers import register

    name = register()
    torch.set_num_threads(threads)
    cfg = LlamaConfig(
        hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1000,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 1000, (1, prompt + drafts))
    best: dict[str, list[float]] = {name: [], "sdpa": []}
    for _ in range(rounds):
        for impl in best:
            model.set_attn_implementation(impl)
            with torch.no_grad():
                cache = model(ids[:, :prompt], use_cache=True).past_key_values
                times = []
                for _ in range(20):
                    c = copy.deepcopy(cache)
                    t0 = time.perf_counter()
                    model(ids[:, prompt:], cache=c, use_cache=True)
                    times.append(time.perf_counter() - t0)
            best[impl].append(min(times))
    qkv_ms, sdpa_ms = (min(t) * 1e3 for t in best.values())
    print(
        f"\nLlama (2 layers, hidden 1024, H8 kv2 d128), {drafts} draft tokens after {prompt}: "
        f"qkv {qkv_ms:.2f} ms, sdpa {sdpa_ms:.2f} ms, {qkv_ms / sdpa_ms:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--dtype", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3, help="calls per contender per round")
    ap.add_argument("--model", action="store_true", help="also a model's speculative step")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    _common.same_threads(a.threads)
    read = machine.read_gbps()
    print(f"threads: {_common.threads_info()}; machine read rate {read:.1f} GB/s")
    B, H, kvh, S, d = a.batch, a.heads, a.kv_heads, a.seq, a.dim
    for dtype in a.dtype:
        for L in a.rows:
            calls = contenders(B, H, kvh, S, d, L, dtype)
            times: dict[str, list[float]] = {name: [] for name in calls}
            for r in range(a.rounds):
                for name in list(calls) if r % 2 == 0 else list(reversed(calls)):
                    fn = calls[name]
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        fn()
                    times[name].append((time.perf_counter() - t0) / a.calls)
            nbytes = 2 * B * kvh * S * d * (2 if dtype == "bfloat16" else 4)
            med = {n: statistics.median(t) for n, t in times.items()}
            print(
                f"\n{dtype} B{B} H{H} kv{kvh} S{S} d{d}, {L} causal quer{'y' if L == 1 else 'ies'}"
                f" a sequence, K/V {nbytes / 2**20:.0f} MiB a layer, {a.rounds} rounds"
            )
            rows = [
                {
                    "contender": n,
                    "ms": f"{t * 1e3:.2f}",
                    "/ torch": f"{t / med['torch sdpa']:.2f}",
                    "GB/s": f"{nbytes / t / 1e9:.1f}",
                    "of read": f"{nbytes / t / 1e9 / read:.0%}",
                }
                for n, t in med.items()
            ]
            print(_common.table(rows, list(rows[0])))
    if a.model:
        model_step(a.threads)


if __name__ == "__main__":
    main()

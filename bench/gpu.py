"""Device check for the Triton kernels (qkv.gpu): correctness, then decode and prefill speed.

One run of a few minutes on a machine with a CUDA GPU::

    python bench/gpu.py            # correctness at a few shapes, then the timings
    python bench/gpu.py --quick    # correctness only
    python bench/gpu.py --interpret --quick   # the correctness part on CPU tensors, interpreted

1. Correctness: ``qkv.attention`` on CUDA tensors (forward, lse, and gradients) against
   ``qkv.reference`` / ``qkv.attention_vjp`` in float64 on the host, for float16, bfloat16 and
   float32 at sizes that do not divide the blocks: causal with L < S and L > S, a sliding
   window, grouped heads, a bool mask with an empty row, decode. Exits 1 on a mismatch.
2. The device's memory rate, measured in-process (a large device-to-device copy: bytes read +
   written per second), the limit decode is compared with.
3. Decode (one query per sequence, float16, B8 H32 S4096/16384 d128, kv heads 32 and 8): K/V
   bytes per second as a fraction of the measured copy rate, against PyTorch's SDPA with the
   flash backend on the same tensors.
4. Prefill (float16, B4 H16 N4096 d64/d128, causal and not): TFLOP/s (``4·L·S·d`` per head,
   half for causal), forward and forward+backward (counted as 3.5× the forward's FLOPs),
   against SDPA with the flash backend (``is_causal`` agrees with qkv's bottom-right
   alignment at L == S).

Timings are ``triton.testing.do_bench`` medians; qkv and SDPA run in the same process, and the
qkv time includes its Python argument checks (what a caller pays).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="correctness only")
    p.add_argument("--interpret", action="store_true", help="CPU tensors, Triton's interpreter")
    return p.parse_args()


ARGS = _args()
if ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton's first import

import numpy as np  # noqa: E402
import torch  # noqa: E402

import qkv  # noqa: E402
from qkv import reference  # noqa: E402

TOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}  # max abs error, N(0,1)
GRAD_TOL = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 2.5e-1}


def _device() -> str:
    if ARGS.interpret:
        return "cpu"
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA device (use --interpret --quick to check the script)")
    return "cuda"


def _run(dev: str, q, k, v, **kw):
    if dev == "cpu":  # the interpreter's entry: qkv.attention keeps CPU tensors on the CPU path
        from qkv.gpu import api

        return api.attention(q, k, v, **kw)
    return qkv.attention(q, k, v, **kw)


def correctness(dev: str) -> bool:
    g = torch.Generator().manual_seed(0)
    cases = [  # (name, q shape, k shape, dv, causal, window, mask)
        ("causal L<S gqa", (2, 8, 77, 64), (2, 2, 201, 64), 64, True, None, False),
        ("causal L>S", (1, 4, 150, 40), (1, 4, 97, 40), 48, True, None, False),
        ("window", (1, 4, 130, 128), (1, 4, 130, 128), 128, True, (37, None), False),
        ("mask", (2, 4, 45, 64), (2, 4, 70, 64), 64, False, None, True),
        ("decode gqa", (4, 16, 1, 128), (4, 4, 1000, 128), 128, True, None, False),
    ]
    if dev == "cpu":  # interpreted: small
        cases = [
            ("causal L<S gqa", (1, 4, 19, 12), (1, 2, 33, 12), 10, True, None, False),
            ("decode gqa", (1, 4, 1, 16), (1, 1, 40, 16), 16, True, None, False),
        ]
    ok = True
    print("correctness (max abs error against the float64 reference):")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for name, sq, sk, dv, causal, window, use_mask in cases:
            q, k = torch.randn(sq, generator=g), torch.randn(sk, generator=g)
            v = torch.randn(sk[:-1] + (dv,), generator=g)
            mask = None
            if use_mask:
                mask = torch.rand((sq[-2], sk[-2]), generator=g) > 0.3
                mask[3] = False
            q, k, v = (t.to(dtype) for t in (q, k, v))
            ref_out, ref_lse = reference.attention(
                *(t.double().numpy() for t in (q, k, v)),
                causal=causal,
                window=window,
                mask=None if mask is None else mask.numpy(),
                return_lse=True,
            )
            qd, kd, vd = (t.to(dev, copy=True).requires_grad_() for t in (q, k, v))
            out, lse = _run(
                dev, qd, kd, vd, causal=causal, window=window,
                mask=None if mask is None else mask.to(dev), return_lse=True,
            )  # fmt: skip
            do = torch.randn(out.shape, generator=g).to(dtype)
            out.backward(do.to(dev))
            want = qkv.attention_vjp(
                *(t.double().numpy() for t in (q, k, v)),
                do.double().numpy(),
                causal=causal,
                window=window,
                mask=None if mask is None else mask.numpy(),
            )
            e_out = float(np.max(np.abs(out.detach().double().cpu().numpy() - ref_out)))
            lse_h = lse.double().cpu().numpy()
            fin = np.isfinite(ref_lse)
            same_empty = bool((np.isneginf(lse_h) == ~fin).all())
            e_lse = float(np.max(np.abs(lse_h[fin] - ref_lse[fin]), initial=0.0))
            e_grad = max(
                float(np.max(np.abs(t.grad.double().cpu().numpy() - w)))
                for t, w in zip((qd, kd, vd), want, strict=True)
            )
            good = (
                e_out <= TOL[dtype]
                and e_lse <= 1e-3
                and same_empty
                and e_grad <= GRAD_TOL[dtype] * max(1.0, float(np.max(np.abs(want[0]))))
            )
            ok &= good
            print(
                f"  {'ok ' if good else 'BAD'} {str(dtype)[6:]:8} {name:15} out {e_out:.1e}  "
                f"lse {e_lse:.1e}  empty rows {'same' if same_empty else 'DIFFER'}  "
                f"grads {e_grad:.1e}"
            )
    return ok


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200) * 1e-3  # seconds


def _sdpa(fn):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return fn()

    return run


def copy_rate() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = _bench(lambda: y.copy_(x))
    return 2 * x.numel() / t  # bytes read + written


def decode(rate: float) -> None:
    F = torch.nn.functional
    print(f"\ndecode, float16, one query per sequence (device copy rate {rate / 1e9:.0f} GB/s):")
    print("  shape                        qkv       SDPA flash  qkv GB/s  of copy  qkv/SDPA time")
    for S in (4096, 16384):
        for hkv in (32, 8):
            B, H, d = 8, 32, 128
            q = torch.randn(B, H, 1, d, device="cuda", dtype=torch.float16)
            k = torch.randn(B, hkv, S, d, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            t_q = _bench(lambda q=q, k=k, v=v: qkv.attention(q, k, v))
            gqa = {"enable_gqa": True} if hkv != H else {}
            t_s = _bench(_sdpa(lambda q=q, k=k, v=v, g=gqa: F.scaled_dot_product_attention(
                q, k, v, **g)))  # fmt: skip
            gbs = 2 * k.numel() * 2 / t_q
            print(
                f"  B{B} H{H} kv{hkv} S{S} d{d}  {t_q * 1e6:7.1f} us  {t_s * 1e6:7.1f} us  "
                f"{gbs / 1e9:8.0f}  {gbs / rate:6.0%}  {t_q / t_s:6.2f}x"
            )


def _prefill_row(B: int, H: int, N: int, d: int, causal: bool) -> None:
    F = torch.nn.functional
    q, k, v = (
        torch.randn(B, H, N, d, device="cuda", dtype=torch.float16, requires_grad=True)
        for _ in range(3)
    )
    flops = 4 * B * H * N * N * d * (0.5 if causal else 1.0)
    do = torch.randn_like(q)

    def ours():
        return qkv.attention(q, k, v, causal=causal)

    def theirs():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    with torch.no_grad():
        t_f, t_fs = _bench(ours), _bench(_sdpa(theirs))
    t_b = _bench(lambda: ours().backward(do))
    t_bs = _bench(_sdpa(lambda: theirs().backward(do)))
    print(
        f"  B{B} H{H} N{N} d{d}  {causal!s:6}  {flops / t_f / 1e12:7.1f}  "
        f"{flops / t_fs / 1e12:8.1f}  {3.5 * flops / t_b / 1e12:11.1f}  "
        f"{3.5 * flops / t_bs / 1e12:12.1f}"
    )


def prefill() -> None:
    print("\nprefill, float16, TFLOP/s (4·L·S·d per head, half when causal; fwd+bwd 3.5×):")
    print("  shape                    causal  fwd qkv  fwd SDPA  fwd+bwd qkv  fwd+bwd SDPA")
    for d in (64, 128):
        for causal in (True, False):
            _prefill_row(4, 16, 4096, d, causal)


def main() -> int:
    dev = _device()
    name = "Triton interpreter (CPU)" if dev == "cpu" else torch.cuda.get_device_name()
    print(f"qkv.gpu on {name}; torch {torch.__version__}")
    ok = correctness(dev)
    if not ok:
        print("MISMATCH: not timing")
        return 1
    if ARGS.quick or dev == "cpu":
        return 0
    decode(copy_rate())
    prefill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

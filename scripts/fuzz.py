"""Fuzz every kernel of ``qkv.attention`` against the float64 oracle ``qkv.reference``.

Random shapes (batch dims, grouped heads, 1-D queries, S = 0), causal, windows, boolean masks
and float biases (with ``-inf``), dtypes float16/32/64, magnitudes from tiny to beyond float32's
range (powers of two times small integers, so the scores are exact and the comparison stays
well-conditioned), and NaN/±inf in ``q``, ``k`` and ``v``. Tiles and key splits are made small
so that the tiled kernel's edges and the decode kernel's merges are exercised on small inputs.

The comparison follows the README's policy: outputs and log-sum-exps agree with the reference,
NaN in exactly the same places — except that a non-finite *value* whose key a row may not see
or that it scores ``-inf`` may or may not reach that row (kernel-dependent, documented); there
the output is NaN or equals the value computed without the keys of weight 0.

Run from the repository root::

    PYTHONPATH=src python scripts/fuzz.py --cases 10000 --seed 0

It prints the number of cases and exits with status 1 on the first mismatch (with the case).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

import qkv
from qkv import reference
from qkv.engine.kernels import decode, tiled

KERNELS = ("dense", "tiled", "decode")
EXPONENTS = {
    np.float16: (-6, 0, 4, 7),
    np.float32: (-40, 0, 20, 60, 100),
    np.float64: (-200, 0, 100, 400),
}
TOL = {np.float16: 4e-3, np.float32: 2e-5, np.float64: 1e-10}


def random_case(rng: np.random.Generator) -> dict[str, Any]:
    """One problem: arrays, options and the dtype, as keyword arguments of ``qkv.attention``."""
    dtype = rng.choice([np.float16, np.float32, np.float32, np.float64])
    L, S = int(rng.integers(1, 24)), int(rng.integers(0, 40))
    d, dv = int(rng.integers(1, 9)), int(rng.integers(1, 6))
    shape = rng.integers(0, 3)
    hkv = int(rng.integers(1, 3))
    group = int(rng.integers(1, 3))
    if shape == 0:
        qb, kb = (), ()
    elif shape == 1:
        b = int(rng.integers(1, 3))
        qb, kb = (b,), (b,)
    else:
        b = int(rng.integers(1, 3))
        qb, kb = (b, hkv * group), (rng.choice([1, b]), hkv)
    one_query = shape == 0 and L == 1 and rng.random() < 0.5
    mag = rng.choice(["normal", "exact"])
    e, huge = 0, False
    if mag == "normal":
        q, k, v = (rng.standard_normal(s) for s in (qb + (L, d), kb + (S, d), kb + (S, dv)))
        scale = None if rng.random() < 0.7 else float(rng.uniform(0.1, 3.0))
    else:  # small integers times a power of two: exact scores, any magnitude
        e = int(rng.choice(EXPONENTS[dtype]))
        q, k = (rng.integers(-3, 4, s) * 2.0**e for s in (qb + (L, d), kb + (S, d)))
        v = rng.integers(-3, 4, kb + (S, dv)) * 2.0 ** int(rng.choice(EXPONENTS[dtype]))
        huge = rng.random() < 0.5  # scores as large as q·k, or brought back near 1 by the scale
        scale = 2.0 ** int(rng.integers(-3, 2)) * (1.0 if huge else 2.0 ** (-2 * e))
    arrays = {"q": q.astype(dtype), "k": k.astype(dtype), "v": v.astype(dtype)}
    if rng.random() < 0.3:  # non-finite entries
        for _ in range(int(rng.integers(1, 3))):
            name = str(rng.choice(["q", "k", "v"]))
            a = arrays[name]
            if a.size:
                a.flat[rng.integers(a.size)] = rng.choice([np.inf, -np.inf, np.nan])
    if one_query:
        arrays["q"] = arrays["q"][0]
    case: dict[str, Any] = dict(arrays, scale=scale, causal=bool(rng.random() < 0.5))
    # Splitting the keys (decode) merges partial log-sum-exps, which cannot hold log(count)
    # next to a score of 2**100: only scores of moderate size get forced splits.
    case["split"] = mag == "normal" or not huge or e <= 0
    if rng.random() < 0.4:
        side = lambda: None if rng.random() < 0.3 else int(rng.integers(0, S + 2))  # noqa: E731
        case["window"] = (side(), side())
    r = rng.random()
    full = tuple(np.broadcast_shapes(qb, kb[:-1] + (qb[-1],) if len(kb) == 2 else kb)) + (L, S)
    if r < 0.2:
        case["mask"] = rng.random(full) < 0.7
    elif r < 0.35:
        # (in the exact class only 0 and -inf: a bias of 1 beside scores of 2**45 is rounding)
        bias = rng.standard_normal(full[-2:]) * 2 if mag == "normal" else np.zeros(full[-2:])
        bias[rng.random(full[-2:]) < 0.2] = -np.inf
        case["mask"] = bias.astype(rng.choice([dtype, np.float64])) if dtype != np.float16 else bias
    return case


@contextlib.contextmanager
def small_tiles(rng: np.random.Generator, split: bool = True) -> Iterator[None]:
    """Small tiles for ``tiled`` and (with ``split``) forced key splits for ``decode``."""
    saved = tiled.attend, decode.MIN_SPLIT, decode.PARALLEL_BYTES
    tiled.attend = functools.partial(  # dispatch looks the kernel up at each call
        saved[0], block_q=int(rng.integers(1, 9)), block_k=int(rng.integers(1, 9))
    )
    min_split = int(rng.integers(1, 8))
    if split:
        decode.MIN_SPLIT, decode.PARALLEL_BYTES = min_split, 0
    try:
        yield
    finally:
        tiled.attend, decode.MIN_SPLIT, decode.PARALLEL_BYTES = saved


def without_hidden(case: dict[str, Any]) -> np.ndarray:
    """Output with the keys of weight exactly 0 (masked, or scored ``-inf``) left out entirely,
    so that ``0 · inf`` adds nothing (float64)."""
    w = reference.attention_weights(
        case["q"],
        case["k"],
        scale=case["scale"],
        causal=case["causal"],
        mask=case.get("mask"),
        window=case.get("window"),
    )
    v = np.asarray(case["v"], dtype=np.float64)
    if np.asarray(case["q"]).ndim == 1:
        w = w[None]
    heads = w.shape[-3] if w.ndim >= 3 else 1
    if v.ndim >= 3 and w.ndim >= 3 and v.shape[-3] != heads and v.shape[-3] > 1:
        v = np.repeat(v, heads // v.shape[-3], axis=-3)
    terms = w[..., :, :, None] * v[..., None, :, :]  # (..., L, S, dv)
    out = np.where((w != 0)[..., None], terms, 0.0).sum(axis=-2)
    return out[..., 0, :] if np.asarray(case["q"]).ndim == 1 else out


def compare(case: dict[str, Any], kernel: str) -> str | None:
    """``None`` when ``kernel`` agrees with the reference on ``case``, else what differs."""
    args = {n: case[n] for n in ("q", "k", "v")}
    opts = {n: case[n] for n in ("scale", "causal", "mask", "window") if n in case}
    with np.errstate(all="ignore"):
        ref, ref_lse = reference.attention(**args, **opts, return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning may escape qkv, whatever the input
        out, lse = qkv.attention(**args, **opts, kernel=kernel, return_lse=True)
    dtype = np.asarray(case["q"]).dtype.type
    if out.dtype != np.result_type(case["q"], case["k"], case["v"]) or out.shape != ref.shape:
        return f"dtype/shape {out.dtype} {out.shape} vs {ref.shape}"
    tol = TOL[dtype]
    got = out.astype(np.float64)
    vfin = np.asarray(case["v"], dtype=np.float64)
    vmax = float(np.max(np.abs(vfin[np.isfinite(vfin)]), initial=0.0))
    atol = tol * vmax + (np.finfo(dtype).tiny if vmax else 0)
    same_nan = np.isnan(got) == np.isnan(ref)
    close = np.isclose(got, ref, rtol=tol, atol=atol, equal_nan=True)
    bad = ~(same_nan & close)
    if bad.any() and not np.all(np.isfinite(case["v"])):
        # a non-finite value under a hidden key: NaN, or the value without the hidden keys
        with np.errstate(all="ignore"):
            alt = without_hidden(case)
        bad &= ~(np.isnan(got) | np.isclose(got, alt, rtol=tol, atol=atol, equal_nan=True))
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        return f"out{list(i)}: got {got[i]!r}, reference {ref[i]!r}"
    lse64 = lse.astype(np.float64)
    lse_tol = max(tol, 1e-6) * np.maximum(1.0, np.abs(np.where(np.isfinite(ref_lse), ref_lse, 0)))
    both_nan = np.isnan(lse64) & np.isnan(ref_lse)
    with np.errstate(invalid="ignore"):  # inf - inf
        near = np.abs(lse64 - ref_lse) <= lse_tol * 4
    lse_ok = (np.isnan(lse64) == np.isnan(ref_lse)) & (both_nan | (lse64 == ref_lse) | near)
    big = np.abs(ref_lse) > float(np.finfo(lse.dtype).max)  # beyond the lse dtype: inf is right
    lse_ok |= big & np.isinf(lse64) & (np.sign(lse64) == np.sign(ref_lse))
    if not lse_ok.all():
        i = tuple(np.argwhere(~lse_ok)[0])
        return f"lse{list(i)}: got {lse64[i]!r}, reference {ref_lse[i]!r}"
    return None


def run(cases: int, seed: int, verbose: bool = False) -> int:
    """Run ``cases`` random problems on every kernel; returns how many failed (stops at 1)."""
    rng = np.random.default_rng(seed)
    for n in range(cases):
        case = random_case(rng)
        for kernel in KERNELS:
            with small_tiles(rng, case["split"]):
                try:
                    problem = compare(case, kernel)
                except Exception as exc:  # noqa: BLE001 - every failure is reported the same way
                    problem = f"{type(exc).__name__}: {exc}"
            if problem:
                print(f"case {n} (seed {seed}), kernel {kernel}: {problem}", file=sys.stderr)
                if verbose:
                    print(case, file=sys.stderr)
                return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10_000, help="random problems (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("-v", "--verbose", action="store_true", help="print a failing case whole")
    a = p.parse_args(argv)
    failed = run(a.cases, a.seed, a.verbose)
    print(
        f"{a.cases} cases x {len(KERNELS)} kernels, seed {a.seed}: "
        f"{'a mismatch (above)' if failed else 'all agree with qkv.reference'}"
    )
    return failed


if __name__ == "__main__":
    sys.exit(main())

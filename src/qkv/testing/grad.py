"""Gradients of a PyTorch callable against the float64 reference's vector-Jacobian product.

The kernel's output is multiplied by a random ``grad_out`` and summed; PyTorch's autograd
gives ``dq, dk, dv``, compared with :func:`qkv.engine.grad.reference_attention_vjp` on the same
inputs. A gradient passes within ``GRAD_ULPS · eps(dtype) · max(|reference gradient|, 1) ·
√max(S, 1)`` (a sum over ``S`` keys in the dtype's precision).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from ..engine.grad import reference_attention_vjp
from .features import Case, case_strategy
from .kernel import Kernel
from .report import Failure, FeatureResult
from .search import Search
from .strategies import values
from .tolerance import eps

__all__ = ["GRAD_ULPS", "check_grad"]

GRAD_ULPS = 8.0


def _run(
    kernel: Kernel, case: Case, g: np.ndarray, dtype: str
) -> tuple[list[Any], float, float, str]:
    """(obtained grads or [], largest error, allowed, message)."""
    want = reference_attention_vjp(case.q, case.k, case.v, g, **case.ref_options)
    size = max((float(np.max(np.abs(w))) for w in want if w.size), default=0.0)
    tol = GRAD_ULPS * eps(dtype) * max(size, 1.0) * np.sqrt(max(case.shape.S, 1))
    try:
        args = [kernel.to_arrays(x, dtype).requires_grad_() for x in (case.q, case.k, case.v)]
        kw = {
            n: kernel.mask_arrays(x, dtype) if n == "mask" else x for n, x in case.options.items()
        }
        out = kernel.fn(*args, **kw)
        weight = kernel.to_arrays(g, "float32" if dtype != "float64" else dtype)
        (out.to(weight.dtype) * weight).sum().backward()  # float64 stays float64
        # an input the output does not depend on (through autograd) has gradient 0
        got = [
            np.zeros_like(w) if a.grad is None else kernel.from_arrays(a.grad)
            for a, w in zip(args, want, strict=True)
        ]
    except Exception as exc:  # the kernel's error is the failure reported
        return [], np.inf, tol, f"raised {type(exc).__name__}: {exc}"
    with np.errstate(invalid="ignore"):
        errs = [
            float(np.max(np.abs(a - w))) if w.size else 0.0 for a, w in zip(got, want, strict=True)
        ]
    err = max(errs) if all(np.isfinite(errs)) else np.inf
    return got, err, tol, ""


def check_grad(kernel: Kernel, dtype: str, examples: int, seed: int) -> FeatureResult:
    """The ``grad`` row of the report card (PyTorch callables only)."""
    if kernel.arrays != "torch":
        return FeatureResult(
            "grad", dtype, "skipped", note="gradients are checked for PyTorch callables"
        )
    feature = "causal" if "causal" in (kernel.supports or ()) else "plain"
    base = case_strategy(feature, alignment=kernel.causal_alignment, dtype=dtype)
    pair = st.tuples(base, st.integers(0, 2**32 - 1))
    search = Search(examples, f"{seed}:grad:{dtype}")

    def grad_out(case: Case, gseed: int) -> np.ndarray:
        s = case.shape
        return values(np.random.default_rng(gseed), (s.B, s.Hq, s.L, s.dv))

    def judged(drawn: tuple[Case, int]) -> tuple[bool, float, float]:
        _, err, tol, _ = _run(kernel, drawn[0], grad_out(*drawn), dtype)
        return err <= tol, err, tol

    found = search.smallest_failure(pair, judged)
    if found is None:
        return FeatureResult("grad", dtype, "pass", examples, search.worst, search.allowed)
    case, gseed = found
    g = grad_out(case, gseed)
    got, err, tol, msg = _run(kernel, case, g, dtype)
    want = reference_attention_vjp(case.q, case.k, case.v, g, **case.ref_options)
    inputs: dict[str, Any] = {"q": case.q, "k": case.k, "v": case.v, "grad_out": g, **case.options}
    names = ("dq", "dk", "dv")
    slip = why = None
    if got:
        with np.errstate(invalid="ignore"):
            bad = [
                n
                for n, a, w in zip(names, got, want, strict=True)
                if not np.all(np.abs(a - w) <= tol)
            ]
        good = [n for n in names if n not in bad]
        slip = f"wrong {', '.join(bad)}"
        why = f"{', '.join(bad)} differ from the reference's vector-Jacobian product" + (
            f"; {', '.join(good)} agree" if good else ""
        )
    failure = Failure(
        case.shape.describe(),
        inputs,
        dict(zip(names, want, strict=True)),
        dict(zip(names, got, strict=False)),
        err,
        tol,
        msg,
        slip,
        why,
    )
    return FeatureResult("grad", dtype, "fail", search.first, failure=failure)

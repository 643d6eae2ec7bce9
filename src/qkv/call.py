"""One checked call: what the public front builds once and every back end runs.

:func:`qkv.attention`, :func:`qkv.attention_weights` and :func:`qkv.scores` each build a
:class:`Call` here — the arguments checked once by :func:`qkv.validate.make_plan`, the tensor
policy (:mod:`qkv.tensors`) applied once — and hand it to one back end, which runs it without
checking anything again:

- the NumPy engine (:func:`qkv.engine.run.run`), for arrays and for CPU tensors without autograd;
- the torch bridge (:func:`qkv.torch_bridge.run`), for CPU tensors that require grad;
- the Triton kernels (:func:`qkv.gpu.api.run`), for tensors on a GPU; the plan then holds
  zero-stride stand-ins of the tensors' shapes (no data is copied to the host).

Examples
--------
>>> from qkv.call import build
>>> call = build("attention", [2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], scale=0.5)
>>> call.route, call.plan.scale, call.plan.squeeze
('numpy', 0.5, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InputError, InputTypeError
from .options import Options
from .tensors import Want, is_tensor, read_cpu, read_shadow, survey, swap_axes
from .validate import Plan, check_flag, check_variants, from_foreign, make_plan

__all__ = ["LAYOUTS", "Call", "build", "check_layout"]

#: The layouts :func:`qkv.attention` reads ``q``, ``k``, ``v`` in: qkv's (and PyTorch SDPA's)
#: ``(..., heads, L, d)``, and FlashAttention's and transformers' ``(..., L, heads, d)``.
LAYOUTS = ("bhld", "blhd")

_PLAIN = Options()  # the options of a call that gives none


@dataclass(frozen=True, init=False)
class Call:
    """A checked call of one of the public attention functions.

    Attributes
    ----------
    fn : str
        ``"attention"``, ``"attention_weights"`` or ``"scores"``.
    plan : Plan
        The checked problem (:class:`qkv.validate.Plan`); for device tensors its arrays are
        zero-stride stand-ins carrying the shapes only.
    route : str
        The back end: ``"numpy"``, ``"autograd"`` (CPU tensors that require grad) or
        ``"device"`` (tensors on a GPU).
    given : dict
        The tensor arguments as the caller gave them (``q``, ``k``, ``v``, ``mask``,
        ``sinks``, ``alibi_slopes``), for autograd and the device path; empty for NumPy input.
    want : Want or None
        The type the results go back as (:mod:`qkv.tensors`); ``None`` for NumPy arrays.
    kernel : str
        The kernel asked for (``"auto"`` by default).
    return_lse : bool
        Whether the caller wants the log-sum-exp too.
    check_finite : bool
        Whether NaN and infinity in ``q``, ``k``, ``v`` are refused (read on the device path;
        the plan has checked them otherwise).
    options : Options
        The call's options as given (:class:`qkv.options.Options`), for a back end that
        calls again with them (the GPU's CPU fallback).
    layout : str
        The layout the caller's ``q``, ``k``, ``v`` came in (:data:`LAYOUTS`); the plan and
        :attr:`given` hold them as ``(..., heads, L, d)`` already, and the front turns the
        results back (:func:`qkv.front.attention`).
    """

    fn: str
    plan: Plan
    route: str
    given: dict[str, Any]
    want: Want | None
    kernel: str = "auto"
    return_lse: bool = False
    check_finite: bool = False
    options: Options = _PLAIN
    layout: str = "bhld"

    def __init__(
        self,
        fn: str,
        plan: Plan,
        route: str,
        given: dict[str, Any],
        want: Want | None,
        kernel: str = "auto",
        return_lse: bool = False,
        check_finite: bool = False,
        options: Options = _PLAIN,
        layout: str = "bhld",
    ) -> None:
        # One dict update, not ten object.__setattr__ calls: every public call builds one.
        self.__dict__.update(
            fn=fn, plan=plan, route=route, given=given, want=want, kernel=kernel,
            return_lse=return_lse, check_finite=check_finite, options=options, layout=layout,
        )  # fmt: skip


_BASIC = frozenset(("scale", "causal", "mask", "window"))


def build(
    fn: str,
    q: Any,
    k: Any,
    v: Any = None,
    options: Options | None = None,
    *,
    return_lse: bool = False,
    check_finite: bool = False,
    kernel: str = "auto",
    layout: str = "bhld",
    **keywords: Any,
) -> Call:
    """Check a public call once and return it as a :class:`Call`.

    ``fn`` names the public function (for messages); ``v`` is ``None`` for the functions that
    stop before the values. The call's options come as the public function's keywords
    (``scale=``, ``causal=``, ``mask=``, ``window=`` and the variants), read once into one
    :class:`qkv.options.Options`, or as that value itself (keywords given beside it replace
    its fields). ``layout="blhd"`` reads ``q``, ``k``, ``v`` as ``(..., L, heads, d)``: they
    are swapped to qkv's ``(..., heads, L, d)`` here (views, tensors too), and the front swaps
    the results back. Raises :class:`qkv.InputError` naming the argument for anything the call
    cannot run.
    """
    check_flag(return_lse, "return_lse")
    if layout != "bhld":
        check_layout(layout)
        q, k, v = _from_blhd(q, k, v)
    if kernel != "auto":  # the kernels load on the first call that runs, not at import
        from .engine.kernels.dispatch import check_kernel

        kernel = check_kernel(kernel)
    if options is None:
        if len(keywords) > 4 or not _BASIC.issuperset(keywords):
            check_variants(fn, {n: x for n, x in keywords.items() if n not in _BASIC})
        options = Options(**keywords)
    elif keywords:
        options = options.replace(**keywords)
    need_v = fn == "attention"
    mask, sinks, alibi = options.mask, options.sinks, options.alibi_slopes
    extra = (mask,) if sinks is None and alibi is None else (mask, sinks, alibi)
    if not is_tensor(q, k, v, *extra):
        plan = make_plan(
            q, k, v, options, need_v=need_v, check_finite=check_finite, keep_stored=need_v
        )
        if layout != "bhld":  # (the output given back rows first: written so where it can be)
            plan = plan.but(rows_first=True)
        return Call(fn, plan, "numpy", {}, None, kernel, return_lse, options=options, layout=layout)
    given = {"q": q, "k": k, "v": v, "mask": mask}
    for name, x in (("sinks", sinks), ("alibi_slopes", alibi)):
        if x is not None:
            given[name] = x
    seen = survey(given)
    if seen.device:
        shadows: dict[str, Any] = {name: read_shadow(x, name) for name, x in given.items()}
        shadowed = options.replace(
            mask=shadows["mask"],
            sinks=shadows.get("sinks"),
            alibi_slopes=shadows.get("alibi_slopes"),
        )
        plan = make_plan(shadows["q"], shadows["k"], shadows["v"], shadowed, need_v=need_v)
        return Call(
            fn, plan, "device", given, seen.want, kernel, return_lse, check_finite, options, layout
        )
    plan = make_plan(
        read_cpu(q, "q"), read_cpu(k, "k"), None if v is None else read_cpu(v, "v"), options,
        need_v=need_v, check_finite=check_finite, keep_stored=need_v,
    )  # fmt: skip
    route = "numpy"
    if seen.grad:
        _check_differentiable(fn, plan, given, seen.grad)
        route = "autograd" if set(seen.grad) & {"q", "k", "v", "sinks"} else "numpy"
    if layout != "bhld" and route == "numpy":  # (as for arrays above)
        plan = plan.but(rows_first=True)
    return Call(
        fn, plan, route, given, seen.want, kernel, return_lse, options=options, layout=layout
    )


def check_layout(layout: Any) -> str:
    """``layout``: one of :data:`LAYOUTS`, else :class:`qkv.InputError` naming them."""
    if not isinstance(layout, str):
        raise InputTypeError(f"layout: expected 'bhld' or 'blhd', got {layout!r}")
    if layout not in LAYOUTS:
        raise InputError(
            f"layout: expected 'bhld' (batch, heads, L, d) or 'blhd' (batch, L, heads, d), "
            f"got {layout!r}"
        )
    return layout


def _from_blhd(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """``q``, ``k``, ``v`` given as ``(..., L, heads, d)``, as qkv's ``(..., heads, L, d)``
    (views); :class:`qkv.InputError` naming ``layout`` where the shapes cannot be read so."""
    arrays: list[Any] = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is None:
            arrays.append(x)
            continue
        if not is_tensor(x):
            try:
                x = np.asarray(from_foreign(x, name))
            except (ValueError, TypeError):
                arrays.append(x)  # unreadable: the checks refuse it by name
                continue
        shape = tuple(x.shape)
        if len(shape) < 3:
            raise InputError(
                f"layout: 'blhd' reads {name} as (..., L, heads, d), which needs at least 3 "
                f"dimensions; {name} has shape {shape}"
            )
        arrays.append(x)
    qa, ka, va = arrays
    if hasattr(qa, "shape") and hasattr(ka, "shape"):  # read, at least 3 dimensions each
        hq, hkv = qa.shape[-2], ka.shape[-2]
        if hq != hkv and hq > 1 and hkv >= 1 and hq % hkv:
            fits = qa.shape[-3] > 1 and ka.shape[-3] >= 1 and qa.shape[-3] % ka.shape[-3] == 0
            hint = (
                "; read as qkv's (..., heads, L, d) they would group: if that is how they are "
                "laid out, leave layout='bhld'"
                if fits
                else ""
            )
            raise InputError(
                f"layout: with layout='blhd' the heads are axis -2: q has shape "
                f"{tuple(qa.shape)} ({hq} heads) and k has shape {tuple(ka.shape)} ({hkv} kv "
                f"heads), which do not group{hint}"
            )
    qs, ks, vs = (None if x is None else swap_axes(x, -3, -2) for x in arrays)
    return qs, ks, vs


def _check_differentiable(fn: str, plan: Plan, given: dict[str, Any], grad: tuple) -> None:
    """What qkv cannot differentiate is refused by name when gradients are wanted."""
    for name in ("mask", "alibi_slopes"):  # never differentiable: refused even alone
        if name in grad:
            kind = "a float mask" if name == "mask" else "ALiBi slopes"
            raise InputError(
                f"{name}: qkv gives no gradient for {kind} (shape "
                f"{tuple(given[name].shape)}); detach it, or compute its gradient with "
                "PyTorch's own attention"
            )
    if plan.score_mod is not None and set(grad) & {"q", "k", "v", "sinks"}:
        raise InputError(
            "score_mod: qkv cannot differentiate a user function; run under torch.no_grad() "
            "or use PyTorch's flex_attention for gradients"
        )
    if fn != "attention" and "sinks" in grad:
        raise InputError(
            f"sinks: {fn} gives no gradient for the sinks (shape {tuple(given['sinks'].shape)}); "
            "qkv.attention does, or detach them"
        )

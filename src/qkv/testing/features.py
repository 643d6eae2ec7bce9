"""One hypothesis strategy per feature: the cases the kit runs, each with its expected value.

A :class:`Case` holds float64 inputs in the ``(batch, heads, L, d)`` layout, the keywords the
kernel is called with, and the keywords the float64 reference gets for the same meaning (they
differ for a kernel whose ``causal`` is top-left aligned: the reference then gets the top-left
triangle as a mask). A case passes a keyword only when the kernel supports its feature:
rows with no key come from a mask, bottom-right causal or a window, whichever it takes
(:func:`unaskable` says why none can be drawn).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import reject
from hypothesis import strategies as st

from .. import reference
from . import strategies as qs

__all__ = ["Case", "case_strategy", "top_left", "unaskable"]


@dataclass
class Case:
    """One input of one feature."""

    feature: str
    shape: qs.Shape
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    options: dict[str, Any] = field(default_factory=dict)
    ref_options: dict[str, Any] = field(default_factory=dict)

    def expected(self) -> np.ndarray:
        """The float64 reference on this case."""
        return np.asarray(reference.attention(self.q, self.k, self.v, **self.ref_options))

    def no_key_rows(self) -> np.ndarray:
        """Rows (batch, head, query) that may attend no key, shape ``(B, Hq, L)``."""
        if self.shape.L == 0:
            return np.zeros((self.shape.B, self.shape.Hq, 0), dtype=bool)
        opts = {k: v for k, v in self.ref_options.items() if k != "sinks"}
        w = reference.attention_weights(self.q, self.k, **opts)
        return np.broadcast_to(~(w > 0).any(axis=-1), (self.shape.B, self.shape.Hq, self.shape.L))


def top_left(L: int, S: int) -> np.ndarray:
    """The top-left causal mask: query ``i`` sees keys ``j <= i`` (PyTorch's ``is_causal``)."""
    return np.tril(np.ones((L, S), dtype=bool))


def unaskable(feature: str, supports: frozenset[str] | set[str], alignment: str) -> str:
    """Why no case of ``feature`` can be drawn for a kernel supporting ``supports`` ('' when
    one can)."""
    if feature == "masked_rows" and not {"mask", "window"} & set(supports):
        if "causal" not in supports:
            return "a row with no key needs a mask, a window or causal, none of which it takes"
        if alignment == "top-left":
            return (
                "top-left causal leaves every query its first key, and it takes no mask or "
                "window to empty a row"
            )
    return ""


def _and_mask(opts: dict[str, Any], m: np.ndarray) -> dict[str, Any]:
    out = dict(opts)
    old = out.get("mask")
    out["mask"] = (
        m
        if old is None
        else (np.logical_and(old, m) if old.dtype == bool else np.where(m, old, -np.inf))
    )
    return out


def _case(
    feature: str,
    s: qs.Shape,
    seed: int,
    options: dict[str, Any],
    alignment: str,
    spread: tuple[float, float] = (1.0, 1.0),
) -> Case:
    rng = np.random.default_rng(seed)
    q = qs.values(rng, (s.B, s.Hq, s.L, s.d), spread[0])
    k = qs.values(rng, (s.B, s.Hkv, s.S, s.d), spread[0])
    v = qs.values(rng, (s.B, s.Hkv, s.S, s.dv), spread[1])
    ref = dict(options)
    if options.get("causal") and alignment == "top-left":
        ref.pop("causal")
        ref = _and_mask(ref, top_left(s.L, s.S))
    return Case(feature, s, q, k, v, dict(options), ref)


@st.composite
def case_strategy(
    draw: Any,
    feature: str,
    *,
    alignment: str = "bottom-right",
    supports: frozenset[str] = frozenset(),
    dtype: str = "float64",
) -> Case:
    """A strategy of :class:`Case` for ``feature`` (a key of :data:`qkv.testing.FEATURES`),
    with values representable in ``dtype``."""
    seed = draw(st.integers(0, 2**32 - 1))
    opts: dict[str, Any] = {}
    spread = (1.0, 1.0)
    if feature == "gqa":
        s = draw(qs.shapes(grouped=True))
    elif feature == "dv":
        s = draw(qs.shapes(dv_differs=True))
    elif feature == "empty":
        s = draw(qs.shapes(L=(0, 3), S=(0, 3)).filter(lambda s: s.L == 0 or s.S == 0))
    elif feature == "single":
        s = draw(qs.shapes(L=(1, 4), S=(1, 4)).filter(lambda s: s.L == 1 or s.S == 1))
    elif feature == "long":
        s = draw(qs.shapes(batch=(1, 1), heads=(1, 1), L=(1, 3), S=(1000, 1000), d=(8, 8)))
        s = s._replace(S=draw(st.sampled_from([1024, 4099])))
    elif feature == "causal":
        s = draw(qs.shapes())
        opts["causal"] = True
    elif feature == "decode":
        s = draw(qs.shapes(L=(1, 2), S=(3, 40), grouped="gqa" in supports and draw(st.booleans())))
        if "causal" in supports:
            opts["causal"] = True
    else:
        s = draw(qs.shapes())
    if feature == "scale":
        opts["scale"] = draw(st.sampled_from([0.125, 0.5, 1.0, 2.0]))
    elif feature == "mask":
        opts["mask"] = draw(qs.bool_masks(s.B, s.Hq, s.L, s.S))
    elif feature == "float_mask":
        opts["mask"] = draw(qs.float_masks(s.B, s.Hq, s.L, s.S))
    elif feature == "window":
        s = s._replace(L=min(s.L, s.S))  # every query then has a position with a key
        w = draw(qs.windows())
        opts["window"] = w
    elif feature == "extreme":
        big = 2.0**12 if dtype == "float16" else 2.0**20  # float16 ends at 65504
        small = 2.0**-12 if dtype == "float16" else 2.0**-20
        spread = draw(
            st.sampled_from([(16.0, 1.0), (32.0, 1.0), (1.0, big), (1.0, small), (8.0, big / 16)])
        )
    elif feature == "masked_rows":
        if "mask" in supports:
            m = draw(qs.bool_masks(s.B, s.Hq, s.L, s.S, every_row_sees=False))
            rows = draw(st.integers(0, max(0, s.L - 1)))
            m = np.broadcast_to(m, (m.shape[0], m.shape[1], s.L, s.S)).copy()
            m[..., rows, :] = False  # at least one row sees nothing
            opts["mask"] = m
        elif "causal" in supports and alignment == "bottom-right":
            # S >= 2: with one key, top-left and bottom-right give the same rows that see it
            # and the top-left row that should see none equals the values' mean, so the two
            # slips could not be told apart
            s = s._replace(S=max(s.S, 2))
            s = s._replace(L=s.S + draw(st.integers(1, 3)))
            opts["causal"] = True
        elif "window" in supports:
            s = s._replace(L=max(s.L, 2))
            opts["window"] = (0, 0)
            s = s._replace(S=max(1, s.L - 1 - draw(st.integers(0, 2))) if s.L > 1 else 1)
        else:  # the check reports why (unaskable) and draws none
            reject()
    elif feature == "lse":
        # one of the keywords the kernel takes, or none; every row sees a key (a row with
        # none is masked_rows' business)
        which = draw(st.sampled_from(["none"] + [w for w in ("causal", "mask") if w in supports]))
        if which == "causal":
            opts["causal"] = True
            if alignment == "bottom-right":
                s = s._replace(L=min(s.L, s.S))
        elif which == "mask":
            opts["mask"] = draw(qs.bool_masks(s.B, s.Hq, s.L, s.S))
        if "scale" in supports and draw(st.booleans()):
            opts["scale"] = draw(st.sampled_from([0.125, 0.5, 2.0]))
    elif feature in ("softcap", "sinks", "alibi"):
        opts.update(draw(qs.variants(s.Hq, which=(feature,))))
        if feature == "softcap":
            spread = (4.0, 1.0)
    return _case(feature, s, seed, opts, alignment, spread)

"""The options of an attention call, as one value: what every public function takes beside
``q``, ``k`` and ``v``.

Their one order, everywhere public: ``scale``, ``causal``, ``mask``, ``window``, then the
variants ``softcap``, ``sinks``, ``alibi_slopes``, ``score_mod``, ``mask_mod``
(:data:`NAMES`). :func:`qkv.call.build` reads a public call's keywords into one
:class:`Options` once; :func:`qkv.validate.make_plan` checks it, and the back ends that call
another public function with the same options (the reference, the gradients, the GPU
fallback, the distributed ring) pass it on instead of naming each keyword again.

Examples
--------
>>> from qkv.options import Options
>>> o = Options(causal=True, softcap=30.0)
>>> o.keywords()
{'causal': True, 'softcap': 30.0}
>>> o.variants()
{'softcap': 30.0}
>>> o.replace(causal=False).keywords()
{'softcap': 30.0}
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = ["NAMES", "VARIANTS", "Options"]

#: The attention variants, in the order the public signatures list them.
VARIANTS = ("softcap", "sinks", "alibi_slopes", "score_mod", "mask_mod")


@dataclass(frozen=True, init=False)
class Options:
    """The options of one attention call, unchecked (:func:`qkv.validate.make_plan` checks
    them). Each has the default of :func:`qkv.attention`.

    Attributes
    ----------
    scale : float or None
        Multiplier of the dot products; ``None``: ``1/sqrt(d)``.
    causal : bool
        Bottom-right aligned causal masking.
    mask : array_like or None
        Boolean (``True`` = may attend) or float (added to the scaled scores).
    window : (int or None, int or None) or None
        ``(left, right)`` sliding window.
    softcap, sinks, alibi_slopes, score_mod, mask_mod
        The variants (see :func:`qkv.attention`); ``None`` when unused.
    simple : bool
        No mask, window or variant: ``scale`` and ``causal`` at most (read from the other
        fields, not given; for the short road of :func:`qkv.validate.make_plan`).
    """

    scale: Any = None
    causal: Any = False
    mask: Any = None
    window: Any = None
    softcap: Any = None
    sinks: Any = None
    alibi_slopes: Any = None
    score_mod: Any = None
    mask_mod: Any = None
    simple: bool = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        scale: Any = None,
        causal: Any = False,
        mask: Any = None,
        window: Any = None,
        softcap: Any = None,
        sinks: Any = None,
        alibi_slopes: Any = None,
        score_mod: Any = None,
        mask_mod: Any = None,
    ) -> None:
        # One dict update instead of a frozen dataclass's nine object.__setattr__ calls: every
        # public call builds one, and a small call pays for each microsecond.
        self.__dict__.update(
            scale=scale, causal=causal, mask=mask, window=window, softcap=softcap, sinks=sinks,
            alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod,
            simple=(
                mask is None and window is None and softcap is None and sinks is None
                and alibi_slopes is None and score_mod is None and mask_mod is None
            ),
        )  # fmt: skip

    def keywords(self) -> dict[str, Any]:
        """The options that differ from the defaults, as keyword arguments (in :data:`NAMES`
        order), for a public function that takes them one by one."""
        out = {}
        for name in NAMES:
            value = getattr(self, name)
            if value is not _DEFAULTS[name]:
                out[name] = value
        return out

    def variants(self) -> dict[str, Any]:
        """The variants that were given (``None`` ones left out)."""
        return {name: getattr(self, name) for name in VARIANTS if getattr(self, name) is not None}

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` (host copies of the tensors, a block's window, ...)."""
        return replace(self, **changes)


#: Every option, in the one order the public signatures list them.
NAMES = tuple(f.name for f in fields(Options) if f.init)
_DEFAULTS = {f.name: f.default for f in fields(Options) if f.init}

"""An unknown keyword argument refused by name, with the nearest keyword the function takes.

Python's own message for ``attention(q, k, v, casual=True)`` names the typo but not the
keyword meant. :func:`near_keywords` wraps a public function so that such a call raises
:class:`~qkv.InputTypeError` saying ``did you mean 'causal'?``, searched over every keyword
the function takes (its parameters and, for a function with ``**variants``, the variants it
names). The search runs only when the call fails: a call that succeeds pays one frame.

A name for the head dimension (``d_k``, ``head_dim``, ``d`` ...) given to a function that reads
``d`` from its arrays is not a typo of ``k``: the message says how to set the scale instead
(``scale=1/math.sqrt(d)``), and that :func:`qkv.explain` and the command line take ``d``.

Examples
--------
>>> @near_keywords()
... def f(q, *, causal=False, scale=None):
...     return q
>>> f(1, casual=True)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
qkv.errors.InputTypeError: casual: ... did you mean 'causal'? (it takes: q, causal, scale)
>>> nearest("is_causal", ("q", "causal", "mask"))
'causal'
>>> @near_keywords()
... def g(q, k, *, scale=None):
...     return q
>>> g(1, 2, d_k=64)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
qkv.errors.InputTypeError: d_k: ... 'd_k'; g() takes no head dimension: ... scale=1/math.sqrt(d) ...
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .errors import InputTypeError

__all__ = ["HEAD_DIM", "hint", "near_keywords", "nearest"]

F = TypeVar("F", bound=Callable[..., Any])

#: Names other libraries (and the literature) give qkv's keywords; a match here wins when the
#: function takes the keyword it points at.
ALIASES = {
    "is_causal": "causal",
    "attn_mask": "mask",
    "attention_mask": "mask",
    "sm_scale": "scale",
    "softmax_scale": "scale",
    "window_size": "window",
    "sliding_window": "window",
    "softcapping": "softcap",
    "logit_softcapping": "softcap",
    "head_dim": "d",
    "d_k": "d",
    "dk": "d",
    "d_head": "d",
    "lse": "return_lse",
    "cu_seqlens_q": "cu_seqlens",
    "cu_seqlens_k": "cu_seqlens",
    "dout": "grad_out",
}

#: Names for the head dimension ``d`` (of ``1/√d``). They point at ``d`` or ``head_dim``
#: where a function takes one, and at nothing else: ``d_k`` is not a slip for ``k``.
HEAD_DIM = frozenset(
    {"d", "dk", "d_k", "d_q", "d_qk", "d_head", "head_dim", "headdim", "head_size", "dim_head"}
)


def nearest(name: str, keywords: Iterable[str]) -> str | None:
    """The keyword in ``keywords`` that ``name`` most likely meant, or ``None``.

    Tried in turn: another library's name for it (:data:`ALIASES`), the same letters in
    another case, a close spelling (:func:`difflib.get_close_matches`), then a keyword that is
    one ``_``-separated part of ``name`` (``attn_mask`` → ``mask``).
    """
    keys = list(dict.fromkeys(keywords))
    if name.lower() in HEAD_DIM:
        return next((k for k in ("d", "head_dim") if k in keys and k != name), None)
    alias = ALIASES.get(name.lower())
    if alias in keys:
        return alias
    lower = {k.lower(): k for k in keys}
    if name.lower() in lower:
        return lower[name.lower()]
    close = difflib.get_close_matches(name.lower(), keys, n=1, cutoff=0.6)
    if close:
        return close[0]
    parts = [p for p in name.lower().split("_") if p]
    for part in sorted(parts, key=len, reverse=True):
        if part in lower and len(parts) > 1:
            return lower[part]
    return None


def hint(name: str, keywords: Iterable[str], where: str) -> str:
    """What follows "unexpected keyword argument" for ``name`` given to ``where`` (a function
    that takes ``keywords``): ``"; did you mean 'causal'?"``, for a head-dimension name given
    to a function with a ``scale`` how to set ``1/√d``, or ``""``.

    >>> hint("casual", ("q", "causal"), "attention")
    "; did you mean 'causal'?"
    >>> print(hint("head_dim", ("q", "scale"), "attention"))  # doctest: +NORMALIZE_WHITESPACE
    ; attention() takes no head dimension: it scales by 1/√d with d = q.shape[-1]; for
    another d pass scale=1/math.sqrt(d) (qkv.explain and the command line take d)
    """
    keys = tuple(keywords)
    near = nearest(name, keys)
    if near is not None:
        return f"; did you mean {near!r}?"
    if name.lower() in HEAD_DIM and "scale" in keys:
        return (
            f"; {where}() takes no head dimension: it scales by 1/√d with d = q.shape[-1]; "
            "for another d pass scale=1/math.sqrt(d) (qkv.explain and the command line take d)"
        )
    return ""


def near_keywords(
    variants: Iterable[str] = (), like: Callable[..., Any] | None = None
) -> Callable[[F], F]:
    """Decorate a public function so an unknown keyword is refused with the nearest match.

    ``variants`` are the keywords a function with ``**variants`` accepts beyond its named
    parameters; ``like`` is the function whose parameters it takes when it passes its own on
    (``**options``) without :func:`functools.wraps`, and whose name an error gives. Only a
    failing call looks at the keywords: when it was given one the function does not take,
    that is reported (an :class:`~qkv.InputTypeError` naming it), in place of whatever else
    went wrong; otherwise the original error is raised unchanged.
    """
    extra = tuple(variants)

    def decorate(fn: F) -> F:
        params = inspect.signature(like or fn).parameters.values()
        named = tuple(
            p.name
            for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
        )
        takes = named + tuple(v for v in extra if v not in named)
        where = (like or fn).__qualname__.replace(".__init__", "")

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception:
                unknown = [name for name in kwargs if name not in takes]
                if not unknown:
                    raise
                name = unknown[0]
                raise InputTypeError(
                    f"{name}: {where}() got an unexpected keyword argument {name!r}"
                    f"{hint(name, takes, where)} "
                    f"(it takes: {', '.join(takes)})"
                ) from None

        return checked  # type: ignore[return-value]

    return decorate

"""Exceptions raised for bad input.

Every user error in qkv is an :class:`InputError` (a :class:`ValueError`) or an
:class:`InputTypeError` (both an :class:`InputError` and a :class:`TypeError`), so callers
can catch either the built-in type or the project's own. Messages name the argument and the
shapes involved.
"""

from __future__ import annotations

__all__ = ["InputError", "InputTypeError"]


class InputError(ValueError):
    """An argument has a value, shape or rank that qkv cannot use."""


class InputTypeError(InputError, TypeError):
    """An argument has a type (or dtype) that qkv cannot use."""

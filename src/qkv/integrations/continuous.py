"""Continuous batching in Hugging Face ``transformers`` (``model.generate_batch``) on qkv's
kernels.

::

    from qkv.integrations import continuous
    from transformers.generation import ContinuousBatchingConfig

    model.set_attn_implementation(continuous.register())  # the name "qkv/flash"
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=2048, page_size=64)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)

The hook, and why this one
--------------------------
transformers (5.25) runs continuous batching only on ``"paged|eager"``, ``"sdpa"`` or an
implementation whose name contains ``"flash"``; any other name registered with its
``AttentionInterface`` (``"qkv"``, from :func:`qkv.integrations.transformers.register`) is
refused by ``generate_batch`` before it starts. A name containing ``"flash"`` that is only
registered with ``AttentionInterface`` is refused too, by ``set_attn_implementation``: it loads
every flash name as FlashAttention's functions. What transformers offers third-party flash
kernels is the ``kernels`` package: an ``attn_implementation`` of the form ``"owner/name"`` is
loaded by ``kernels.get_kernel``, and transformers' own flash wrapper then calls that kernel's
``flash_attn_varlen_func`` (and ``flash_attn_with_kvcache``, ``flash_attn_func``). ``kernels``
resolves a name to a local build first where its ``LOCAL_KERNELS`` variable maps it to a
folder (``name=path`` entries joined by ``:``).

:func:`register` is that hook: it maps ``"qkv/flash"`` to the folder shipped with qkv
(``qkv/integrations/flash_kernel``: a ``metadata.json`` and an ``__init__.py`` that re-exports
:mod:`qkv.flash`'s three functions), appending to ``LOCAL_KERNELS`` in this process (an entry
the user already made for the name is kept). Nothing is downloaded; transformers' continuous
batching code is not patched. The model must support flash attention (``_supports_flash_attn``:
Llama, Mistral, Qwen, Gemma, ... do).

What runs where
---------------
- Every batch on the CPU (prefill chunks and decoding steps of different requests mixed):
  transformers gathers each layer's pages into contiguous K/V, builds no mask (flash names get
  none) and calls ``flash_attn_varlen_func`` with ``cu_seqlens_q``/``cu_seqlens_k``: qkv's
  packed walk (:func:`qkv.attention_varlen`), each request's queries against its own keys,
  bottom-right causal. Never a dense mask across requests, which is what ``"sdpa"`` gets.
- Decoding batches where transformers hands over its pages (its fast decode path, which it
  enables on CUDA and XPU only): ``flash_attn_with_kvcache`` with ``block_table``, qkv's paged
  step reading the pages in place (:func:`qkv.flash.flash_attn_with_kvcache`).
- ``generate`` on the same model: transformers' flash wrapper as well (``flash_attn_func``, or
  the varlen function for padded batches).

transformers' flash wrapper forwards ``window_size``, ``softcap`` and ``deterministic``, which
:mod:`qkv.flash` honours; attention sinks (gpt-oss's ``s_aux``) are not among flash-attn 2's
arguments, and transformers drops them for such a kernel: use ``"qkv"`` with ``generate`` for
those models.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from ..errors import InputError
from ..extras import require

__all__ = ["KERNEL_DIR", "NAME", "register"]

#: The ``attn_implementation`` :func:`register` makes: a kernel name as transformers reads one
#: (``owner/name``) that contains ``"flash"`` (what its continuous batching accepts).
NAME = "qkv/flash"

#: The local kernel build ``kernels`` loads for :data:`NAME`.
KERNEL_DIR = Path(__file__).with_name("flash_kernel")

_KERNEL = "qkv-flash"  # the build's name in its metadata.json


class _NoDigestNote(logging.Filter):
    """Drops ``kernels``' warning that this local build records no digest (a local build has
    none to record: its files are qkv's, installed with it); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (f"'{_KERNEL}'" in text and "digest" in text)


_FILTER = _NoDigestNote()


def _point(name: str, folder: Path) -> None:
    """Map ``name`` to ``folder`` in ``LOCAL_KERNELS`` unless it is mapped already."""
    entries = [e for e in os.environ.get("LOCAL_KERNELS", "").split(":") if e]
    if any(e.partition("=")[0] == name for e in entries):
        return
    os.environ["LOCAL_KERNELS"] = ":".join([*entries, f"{name}={folder}"])


def register(name: str = NAME) -> str:
    """Make ``name`` (default ``"qkv/flash"``) an ``attn_implementation`` that runs
    transformers' continuous batching (and ``generate``) on :mod:`qkv.flash`.

    Points the ``kernels`` package's local override for ``name`` at the kernel build shipped
    with qkv (:data:`KERNEL_DIR`); transformers loads it on ``set_attn_implementation(name)``
    (or ``from_pretrained(..., attn_implementation=name)``). Safe to call more than once.

    Parameters
    ----------
    name : str, optional
        ``"owner/name"`` containing ``"flash"``: transformers loads such names through
        ``kernels``, and its continuous batching accepts only names containing ``"flash"``
        (besides its own ``"sdpa"`` and ``"paged|eager"``).

    Returns
    -------
    str
        The name to pass as ``attn_implementation``.

    Raises
    ------
    qkv.InputError
        ``name`` is not of that form, or qkv is installed under a path containing ``:``
        (``LOCAL_KERNELS`` separates its entries with it).
    qkv.extras.MissingExtraError
        torch, transformers or kernels is not installed.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[^/:=@\s]+/[^/:=@\s]*flash[^/:=@\s]*", name):
        raise InputError(
            f"name: expected 'owner/name' with 'flash' in the name (transformers' continuous "
            f"batching accepts only flash names, and loads 'owner/name' through kernels), "
            f"got {name!r}"
        )
    if ":" in str(KERNEL_DIR):
        raise InputError(
            f"qkv is installed under {KERNEL_DIR.parent}, a path containing ':', which "
            "LOCAL_KERNELS cannot hold; install it elsewhere to use continuous batching"
        )
    what = "qkv.integrations.continuous"
    require("torch", what)
    require("transformers", what)
    require("kernels", what)
    _point(name, KERNEL_DIR)
    validate = logging.getLogger("kernels._internals.validate")
    if _FILTER not in validate.filters:
        validate.addFilter(_FILTER)
    return name

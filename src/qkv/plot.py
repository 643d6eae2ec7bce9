"""Plots of attention: heatmaps of the weights (matplotlib, the ``plot`` extra).

matplotlib is imported on the first call, never by ``import qkv``. A new figure is made through
``pyplot``, as matplotlib users expect: ``plt.show()`` shows it and ``plt.savefig("w.png")``
saves it (and ``plt.close(ax.figure)`` releases it); pass ``ax=`` to draw into a figure of your
own. Without a display pyplot picks a non-interactive backend by itself.

Examples
--------
>>> import qkv
>>> from qkv import plot
>>> w = qkv.attention_weights([[1, 0], [0, 1]], [[1, 0], [0, 1]], causal=True)
>>> ax = plot.weights(w, title="causal")
>>> ax.get_title(), ax.get_xlabel()
('causal', 'key j')
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InputError, InputTypeError
from .extras import require
from .keywords import near_keywords
from .validate import from_foreign

__all__ = ["weights"]

#: Heatmaps with at most this many cells write each weight in its cell by default.
ANNOTATE_MAX_CELLS = 64


def _matplotlib() -> Any:
    matplotlib = require("matplotlib", "qkv.plot")
    return matplotlib, require("matplotlib.figure", "qkv.plot").Figure


def _as_numpy(x: Any, name: str) -> np.ndarray:
    x = from_foreign(x, name)  # a tensor, through the torch bridge's reader
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputTypeError(
            f"{name}: expected an array of attention weights or an object with .weights, "
            f"got {type(x).__name__}"
        ) from None
    return a


def _select(a: np.ndarray, index: Any, name: str) -> np.ndarray:
    """Pick one ``(L, S)`` slice of ``a`` with ``index`` over its leading dimensions."""
    if a.ndim == 0:
        raise InputError(f"{name}: expected shape (..., L, S) or (S,), got a scalar")
    if a.ndim == 1:
        a = a[None, :]
    lead = a.shape[:-2]
    if index is None:
        if int(np.prod(lead)) != 1:
            raise InputError(
                f"index: {name} has shape {a.shape}; pass index=(...) to pick one of the "
                f"{lead} leading positions (e.g. batch and head)"
            )
        return a.reshape(a.shape[-2:])
    idx = (index,) if isinstance(index, (int, np.integer)) else tuple(index)
    if len(idx) != len(lead):
        raise InputError(
            f"index: expected {len(lead)} indices for the leading dims {lead} of {name} "
            f"(shape {a.shape}), got {index!r}"
        )
    try:
        return a[idx]
    except (IndexError, TypeError):
        raise InputError(
            f"index: {index!r} is out of range for the leading dims {lead} of {name} "
            f"(shape {a.shape})"
        ) from None


@near_keywords()
def weights(
    w: Any,
    *,
    index: Any = None,
    ax: Any = None,
    title: str | None = None,
    query_labels: Any = None,
    key_labels: Any = None,
    annotate: bool | None = None,
    cmap: str = "viridis",
    vmax: float | None = None,
    colorbar: bool = True,
) -> Any:
    """Heatmap of attention weights: one row per query, one column per key.

    Parameters
    ----------
    w : array_like or torch.Tensor or trace
        Weights of shape ``(..., L, S)`` (e.g. :func:`qkv.attention_weights`, or a layer's
        ``attentions`` from a transformers model, ``(batch, heads, L, S)``), a 1-D row ``(S,)``,
        or an object with a ``weights`` attribute such as :func:`qkv.explain`'s trace. A trace's
        ``excluded`` cells (causal, window, mask) are drawn grey instead of as weight 0, and
        its ``positions`` label the rows.
    index : int or tuple of int, optional
        Which ``(L, S)`` slice to draw when there are leading dimensions, e.g. ``(0, 3)`` for
        batch 0, head 3. Not needed when they are all of size 1.
    ax : matplotlib.axes.Axes, optional
        Where to draw; by default a new figure.
    title : str, optional
        Axes title (a trace's ``title`` by default).
    query_labels, key_labels : sequence of str, optional
        Tick labels, e.g. tokens.
    annotate : bool, optional
        Write each weight in its cell; by default when there are at most
        :data:`ANNOTATE_MAX_CELLS` cells.
    cmap : str, optional
        A matplotlib colormap name.
    vmax : float, optional
        Top of the colour scale (bottom is 0); by default the largest weight shown. ``1.0``
        makes plots comparable.
    colorbar : bool, optional
        Draw a colour bar.

    Returns
    -------
    matplotlib.axes.Axes
        The axes drawn on (its ``.figure`` is the figure).

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import plot
    >>> ax = plot.weights(np.full((2, 3, 4), 0.25), index=1, key_labels=list("abcd"))
    >>> [t.get_text() for t in ax.get_xticklabels()]
    ['a', 'b', 'c', 'd']
    """
    mpl, _ = _matplotlib()
    excluded, positions = None, None
    if hasattr(w, "weights") and not hasattr(w, "shape"):  # a trace
        trace = w
        if trace.weights is None:
            raise InputError("w: this trace stops before the weights; explain it further")
        w = trace.weights
        excluded = getattr(trace, "excluded", None)
        positions = getattr(trace, "positions", None)
        title = title if title is not None else getattr(trace, "title", None)
    a = _select(_as_numpy(w, "w"), index, "w")
    L, S = a.shape
    if excluded is not None:
        excluded = np.broadcast_to(np.asarray(excluded, dtype=bool).reshape(-1, S), a.shape)
    for name, labels, n in (("query_labels", query_labels, L), ("key_labels", key_labels, S)):
        if labels is not None and len(labels) != n:
            raise InputError(f"{name}: expected {n} labels for weights of shape {a.shape}")

    if ax is None:
        import matplotlib.pyplot as plt  # so that plt.show() / plt.savefig() see the figure

        size = (1.2 + 0.45 * min(S, 40), 0.8 + 0.45 * min(L, 40))
        ax = plt.figure(figsize=size, layout="tight").add_subplot()
    shown = np.ma.masked_array(a, mask=excluded) if excluded is not None else a
    colours = ax.figure.colorbar if colorbar else None
    cm = mpl.colormaps[cmap].with_extremes(bad="0.85")
    top = float(np.nanmax(a)) if vmax is None and a.size else vmax
    image = ax.imshow(shown, cmap=cm, vmin=0.0, vmax=top if top and top > 0 else 1.0, aspect="auto")
    if colours is not None:
        colours(image, ax=ax, label="weight")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i" if positions is None else "query at position p")
    if key_labels is not None or S <= 40:
        ax.set_xticks(range(S), labels=list(key_labels) if key_labels is not None else None)
    if query_labels is not None or positions is not None or L <= 40:
        if query_labels is not None:
            rows = list(query_labels)
        elif positions is not None:
            rows = [str(int(p)) for p in np.asarray(positions).reshape(-1)]
        else:
            rows = None
        ax.set_yticks(range(L), labels=rows)
    if key_labels is not None:
        ax.tick_params(axis="x", labelrotation=60)
    if annotate if annotate is not None else L * S <= ANNOTATE_MAX_CELLS:
        for i in range(L):
            for j in range(S):
                if excluded is not None and excluded[i, j]:
                    continue
                bright = a[i, j] > 0.6 * (top or 1.0)
                colour = "black" if bright else "white"
                ax.text(j, i, f"{a[i, j]:.2f}", ha="center", va="center", fontsize=8, color=colour)
    if title:
        ax.set_title(title)
    return ax

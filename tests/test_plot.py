"""qkv.plot.weights: the heatmap shows exactly the weights it is given."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import qkv
from qkv import reference

pytest.importorskip("matplotlib")
from qkv import plot  # noqa: E402


def drawn(ax) -> np.ma.MaskedArray:
    return np.ma.asarray(ax.images[0].get_array())


def test_heatmap_of_an_array_shows_its_weights():
    q, k = np.eye(3), np.eye(3)
    w = qkv.attention_weights(q, k, causal=True)
    ax = plot.weights(w, title="causal")
    np.testing.assert_allclose(drawn(ax), reference.attention_weights(q, k, causal=True))
    assert ax.get_title() == "causal"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("key j", "query i")
    texts = [t.get_text() for t in ax.texts]
    assert (
        len(texts) == 9 and texts[0] == "1.00" and texts[3] == f"{w[1, 0]:.2f}" == "0.36"
    )  # cells annotated
    assert len(ax.figure.axes) == 2  # the heatmap and its colour bar


def test_index_picks_batch_and_head_and_labels_are_used():
    w = qkv.attention_weights(np.random.default_rng(0).normal(size=(2, 3, 4, 5)), np.ones((6, 5)))
    ax = plot.weights(w, index=(1, 2), key_labels=list("abcdef"), annotate=False, colorbar=False)
    np.testing.assert_allclose(drawn(ax), w[1, 2])
    assert [t.get_text() for t in ax.get_xticklabels()] == list("abcdef")
    assert len(ax.texts) == 0 and len(ax.figure.axes) == 1


def test_trace_like_object_greys_excluded_cells_and_labels_positions():
    w = reference.attention_weights(np.eye(2), np.ones((4, 2)), causal=True)
    excluded = np.array([[False, False, False, True], [False, False, False, False]])
    trace = SimpleNamespace(weights=w, excluded=excluded, positions=np.array([2, 3]), title="t")
    ax = plot.weights(trace)
    shown = drawn(ax)
    assert shown.mask.tolist() == excluded.tolist()
    np.testing.assert_allclose(shown.data[~excluded], w[~excluded])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["2", "3"]
    assert ax.get_title() == "t" and len(ax.texts) == 7  # excluded cell not annotated


def test_real_trace():
    trace = qkv.explain([[2, 1]], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
    ax = plot.weights(trace)
    np.testing.assert_allclose(drawn(ax)[0], [0.04742587317756679, 0.9525741268224334])


def test_torch_tensor_and_png_output(tmp_path):
    torch = pytest.importorskip("torch")
    w = torch.softmax(torch.randn(1, 1, 6, 6, dtype=torch.bfloat16), dim=-1)
    ax = plot.weights(w)
    np.testing.assert_allclose(drawn(ax), w[0, 0].float().numpy())
    path = tmp_path / "w.png"
    ax.figure.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_raises_input_error_naming_shapes():
    with pytest.raises(qkv.InputError, match=r"index: w has shape \(2, 3, 3\)"):
        plot.weights(np.ones((2, 3, 3)))
    with pytest.raises(qkv.InputError, match=r"index: \(0, 5\) is out of range"):
        plot.weights(np.ones((2, 3, 3, 3)), index=(0, 5))
    with pytest.raises(qkv.InputError, match=r"key_labels: expected 3 labels .*\(2, 3\)"):
        plot.weights(np.ones((2, 3)), key_labels=["a"])
    with pytest.raises(qkv.InputTypeError, match="w: expected an array"):
        plot.weights({"not": "weights"})

"""The scaling study: seed figures, theory, and its tables and plots."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.study import scaling_study
from qkv.study.scaling import mode_scale, softmax_jacobian_norm
from qkv.study.table import render_rows


@pytest.fixture(scope="module")
def study():
    return scaling_study(dims=[4, 64, 1024, 4096], keys=64, samples=512, seed=1)


def test_reproduces_seed_figures(study, seed_cases):
    fig = seed_cases["omit-scaling"]["expect"]["reference_figures_64_keys"]
    assert fig["d"] == [4, 64, 1024, 4096]
    for i, d in enumerate(fig["d"]):
        un, sc = study.row(d, "unscaled"), study.row(d, "scaled")
        # the reference figures are +-0.03; allow our own Monte Carlo error on top
        assert abs(un.mean_max_weight - fig["unscaled_mean_max_weight"][i]) <= (
            0.03 + 3 * un.max_weight_se
        )
        assert abs(un.entropy - fig["unscaled_entropy_nats"][i]) <= 0.03 + 3 * un.entropy_se
        assert abs(sc.entropy - fig["scaled_entropy_nats"][i]) <= 0.03 + 3 * sc.entropy_se
    assert math.log(64) == pytest.approx(fig["max_entropy_nats"], abs=1e-3)
    assert study.row(4, "scaled").entropy_fraction == pytest.approx(
        study.row(4, "scaled").entropy / math.log(64)
    )


def test_score_std_follows_theory(study):
    for r in study.rows:
        assert r.score_std_theory == pytest.approx(mode_scale(r.mode, r.d) * math.sqrt(r.d))
        assert r.score_std == pytest.approx(r.score_std_theory, rel=0.05)
    for d in (4, 64, 1024, 4096):
        assert study.row(d, "scaled").score_std == pytest.approx(1.0, rel=0.05)
        assert study.row(d, "unscaled").score_std == pytest.approx(math.sqrt(d), rel=0.05)
        assert study.row(d, "card").score_std == pytest.approx(d, rel=0.05)


def test_scaled_is_flat_and_unscaled_saturates(study):
    scaled = [study.row(d, "scaled") for d in (4, 64, 1024, 4096)]
    ent = [r.entropy for r in scaled]
    assert max(ent) - min(ent) < 0.06
    assert all(0.09 < r.mean_max_weight < 0.13 for r in scaled)
    un = [study.row(d, "unscaled") for d in (4, 64, 1024, 4096)]
    assert all(a.entropy > b.entropy for a, b in zip(un, un[1:], strict=False))
    assert all(a.mean_max_weight < b.mean_max_weight for a, b in zip(un, un[1:], strict=False))
    # x sqrt(d) saturates harder than no scaling at every d
    for d in (4, 64, 1024, 4096):
        assert study.row(d, "card").entropy < study.row(d, "unscaled").entropy
    # the typical (median) gradient reaching q vanishes unscaled, not scaled
    assert all(0.4 < r.grad_q_median < 1.0 for r in scaled)
    assert (
        study.row(4096, "unscaled").grad_q_median < 1e-3 * study.row(4096, "scaled").grad_q_median
    )
    assert study.row(4096, "unscaled").jacobian_median < 1e-3
    assert all(0.15 < r.jacobian_norm < 0.22 for r in scaled)


def test_same_seed_same_rows_and_modes_share_draws():
    a = scaling_study(dims=[8, 32], keys=8, samples=70, seed=3)
    b = scaling_study(dims=[32, 8], keys=8, samples=70, seed=3)
    assert a.rows == b.rows
    assert a.rows[0].samples == 128  # 70 rows rounded up to sets of 64
    c = scaling_study(dims=[8, 32], keys=8, samples=70, seed=4)
    assert a.rows != c.rows
    # common random numbers: the raw scores are the same draws, only scaled differently
    r8 = {r.mode: r for r in a.rows if r.d == 8}
    assert r8["unscaled"].score_std == pytest.approx(r8["scaled"].score_std * math.sqrt(8))
    assert r8["times_sqrt_d"].score_std == pytest.approx(r8["scaled"].score_std * 8)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=1, max_size=8))
def test_jacobian_norm_closed_form(z):
    p = qkv.softmax(np.array(z))
    jac = -np.outer(p, p)
    for i in range(len(p)):  # p_i (1 - p_i), with 1 - p_i summed from the others
        jac[i, i] = p[i] * (np.sum(p[:i]) + np.sum(p[i + 1 :]))
    assert softmax_jacobian_norm(p) == pytest.approx(np.linalg.norm(jac), rel=1e-9, abs=1e-300)
    assert softmax_jacobian_norm(p[None, :])[0] == softmax_jacobian_norm(p)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dims=[]), "dims"),
        (dict(dims=[0]), "dims"),
        (dict(dims=["a"]), "dims"),
        (dict(keys=0), "keys"),
        (dict(samples=1), "samples"),
        (dict(seed=-1), "seed"),
        (dict(modes=["half"]), "mode"),
        (dict(dims=[4, 8], panel_d=16), "panel_d"),
    ],
)
def test_bad_arguments(kw, match):
    with pytest.raises(qkv.InputError, match=match):
        scaling_study(**{"samples": 4, **kw})


def test_table_formats():
    s = scaling_study(dims=[4, 16], keys=8, samples=8, seed=0, modes=["scaled", "card"])
    rows = [r.as_dict() for r in s.rows]
    data = json.loads(render_rows(rows, "json"))
    assert [(r["d"], r["mode"]) for r in data["rows"]] == [
        (4, "scaled"),
        (4, "times_sqrt_d"),
        (16, "scaled"),
        (16, "times_sqrt_d"),
    ]
    assert data["rows"][0]["max_weight_se"] is None  # one set of keys: no error estimate
    parsed = list(csv.DictReader(render_rows(rows, "csv").splitlines()))
    assert float(parsed[3]["entropy"]) == rows[3]["entropy"]
    md = render_rows(rows, "markdown", columns=["d", "mode", "entropy"]).splitlines()
    assert md[0] == "| d | mode | entropy |" and md[2].startswith("| 4 | scaled | ")
    text = render_rows(rows, "text", columns=["d", "mode"]).splitlines()
    assert text[0].split() == ["d", "mode"] and text[4].split() == ["16", "scaled"]
    with pytest.raises(qkv.InputError, match="format"):
        render_rows(rows, "html")


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plots_are_valid_png(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from qkv.study.plots import plot_scaling

    s = scaling_study(dims=[4, 16, 64], keys=16, samples=64, seed=0)
    assert s.panel_d == 64 and set(s.profiles) == {"scaled", "unscaled", "times_sqrt_d"}
    prof = s.profiles["scaled"]["mean"]
    assert prof.shape == (16,) and np.all(np.diff(prof) <= 0) and prof.sum() == pytest.approx(1)
    paths = plot_scaling(s, tmp_path)
    assert [p.name for p in paths] == [
        "scaling_saturation.png",
        "scaling_gradients.png",
        "scaling_weights.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_SIGNATURE
        img = matplotlib.image.imread(p)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400
        assert img.std() > 0.01  # something was drawn


def test_progress_callback_counts_every_row():
    from qkv.study.scaling import total_work

    seen = []
    s = scaling_study(dims=[4, 8, 16], keys=4, samples=100, seed=0, progress=seen.append)
    assert sum(seen) == total_work([4, 8, 16], 100) == 3 * s.rows[0].samples == 384

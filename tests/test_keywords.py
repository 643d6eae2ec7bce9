"""A mistyped keyword names the keyword meant, searched over every keyword the function takes
(issue 33, item 2): every public function and method, and every option of every command."""

from __future__ import annotations

import argparse
import inspect
import math

import numpy as np
import pytest

import qkv
import qkv.distributed
import qkv.plot
import qkv.reference
import qkv.study
import qkv.variants
from qkv.cli import build_parser, main
from qkv.engine.grad import reference_attention_vjp
from qkv.keywords import nearest


def typo(name: str) -> str:
    """A slip of the keyboard: two letters swapped, or a short name's last letter doubled."""
    if len(name) >= 4 and name[1] != name[2]:
        return name[0] + name[2] + name[1] + name[3:]
    return name + name[-1]


def public_functions():
    found = {}
    for mod in (qkv, qkv.reference, qkv.distributed, qkv.study, qkv.plot, qkv.variants):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isfunction(obj):
                found[f"{mod.__name__}.{name}"] = obj
    found["qkv.engine.grad.reference_attention_vjp"] = reference_attention_vjp
    cache = qkv.KVCache(1, 1, 2)
    for name in ("append", "attend", "keys", "values"):
        found[f"qkv.KVCache.{name}"] = getattr(cache, name)
    found["qkv.KVCache"] = qkv.KVCache
    del found["qkv.variants.causal"]  # a mask_mod: the engine calls it, by position
    return found


def keyword_cases():
    for label, fn in public_functions().items():
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                yield pytest.param(fn, p.name, id=f"{label}:{p.name}")


def call_with(fn, **kwargs):
    """Call ``fn`` with small arrays for its required positional arguments and ``kwargs``."""
    args = [
        np.ones((2, 2))
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return fn(*args, **kwargs)


@pytest.mark.parametrize("fn, keyword", list(keyword_cases()))
def test_a_mistyped_keyword_names_the_one_meant(fn, keyword):
    wrong = typo(keyword)
    with pytest.raises(qkv.InputTypeError, match=f"did you mean {keyword!r}") as err:
        call_with(fn, **{wrong: 1})
    assert str(err.value).startswith(f"{wrong}: ")


@pytest.mark.parametrize(
    "call, meant",
    [
        (lambda a: qkv.attention(a, a, a, casual=True), "causal"),
        (lambda a: qkv.attention(a, a, a, is_causal=True), "causal"),
        (lambda a: qkv.attention(a, a, a, attn_mask=a), "mask"),
        (lambda a: qkv.explain(a, a, d_k=4), "d"),
        (lambda a: qkv.attention_weights(a, a, softcapping=2.0), "softcap"),
        (lambda a: qkv.KVCache(1, 1, 2).attend(a[None, None], scael=1.0), "scale"),
    ],
)
def test_the_issue_slips_and_other_libraries_names(call, meant):
    with pytest.raises(qkv.InputTypeError, match=f"did you mean {meant!r}"):
        call(np.ones((2, 2)))


def test_an_unknown_keyword_is_reported_before_other_problems():
    # the arrays are bad as well (ragged); the keyword is what the user can fix at once
    with pytest.raises(qkv.InputTypeError, match="did you mean 'causal'"):
        qkv.attention([[1, 2], [3]], [[1]], [[1]], casual=True)


def test_a_valid_variant_with_another_error_keeps_that_error():
    with pytest.raises(qkv.InputError, match="softcap"):
        qkv.attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), softcap=-1.0)


HEAD_DIM_NAMES = ["d", "d_k", "dk", "head_dim", "d_head", "headdim"]


def scale_takers():
    """The public functions and methods that take ``scale`` and no ``d``: they read ``d`` from
    their arrays."""
    for label, fn in public_functions().items():
        params = inspect.signature(fn).parameters
        if "scale" in params and "d" not in params and "head_dim" not in params:
            yield pytest.param(fn, id=label)
    yield pytest.param(qkv.KVCache(1, 1, 2).attend, id="qkv.KVCache.attend")  # **options


@pytest.mark.parametrize("name", HEAD_DIM_NAMES)
@pytest.mark.parametrize("fn", list(scale_takers()))
def test_a_head_dimension_points_at_the_scale_not_at_k(fn, name):
    """``attention(..., d_k=64)`` suggested 'k'; ``d=4`` and ``head_dim=`` got no hint."""
    with pytest.raises(qkv.InputTypeError) as err:
        call_with(fn, **{name: 4})
    message = str(err.value)
    assert message.startswith(f"{name}: ") and "did you mean" not in message
    assert "takes no head dimension" in message and "scale=1/math.sqrt(d)" in message
    assert "qkv.explain and the command line take d" in message


def test_the_scale_the_hint_gives_is_explains_d():
    """The advice is right: ``scale=1/math.sqrt(d)`` is what ``qkv.explain(d=...)`` uses."""
    q, k, v = [[2.0, 1.0]], [[1.0, 0.0], [3.0, 2.0]], [[1.0, 2.0], [3.0, 4.0]]
    with pytest.raises(qkv.InputTypeError, match=r"scale=1/math\.sqrt\(d\)"):
        qkv.attention(q, k, v, d=4)
    np.testing.assert_allclose(
        qkv.attention(q, k, v, scale=1 / math.sqrt(4)), qkv.explain(q, k, v, d=4).output
    )


@pytest.mark.parametrize(
    "call, meant",
    [
        (lambda: qkv.explain([2, 1], [[1, 0]], head_dim=4), "d"),
        (lambda: qkv.explain([2, 1], [[1, 0]], d_k=4), "d"),
        (lambda: qkv.KVCache(1, 1, d=4), "head_dim"),
        (lambda: qkv.KVCache(1, 1, d_k=4), "head_dim"),
    ],
)
def test_a_head_dimension_names_the_keyword_where_there_is_one(call, meant):
    with pytest.raises(qkv.InputTypeError, match=f"did you mean {meant!r}"):
        call()


@pytest.mark.parametrize(
    "given, meant",
    [
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        ("fp8", "float8_e4m3fn"),
        ("e4m3", "float8_e4m3fn"),
        ("fp8_e4m3", "float8_e4m3fn"),
        ("float8", "float8_e4m3fn"),
        ("fp16", "float16"),
        ("f16", "float16"),  # NumPy reads it as float128
        ("fp32", "float32"),
        ("bfloat", "bfloat16"),
    ],
)
def test_a_cache_dtype_in_another_librarys_spelling_is_named(given, meant):
    with pytest.raises(qkv.InputTypeError, match=f"^dtype: .*; did you mean {meant!r}\\?$"):
        qkv.KVCache(1, 1, 4, dtype=given)
    cache = qkv.KVCache(1, 1, 4, dtype=meant)  # the name suggested is one the cache takes
    cache.append(np.ones((1, 1, 2, 4)), np.ones((1, 1, 2, 4)))
    np.testing.assert_array_equal(cache.keys(0), np.ones((1, 2, 4)))


@pytest.mark.parametrize("given", ["int4", "float8_e5m2", "float128", np.int32])
def test_no_dtype_is_suggested_for_what_qkv_does_not_store(given):
    with pytest.raises(qkv.InputTypeError) as err:
        qkv.KVCache(1, 1, 4, dtype=given)
    assert "did you mean" not in str(err.value)


def test_quantize_kv_names_the_form_meant():
    with pytest.raises(qkv.InputTypeError, match=r"got 'bf16'; did you mean 'bfloat16'\?$"):
        qkv.quantize_kv(np.ones((1, 4)), "bf16")
    with pytest.raises(qkv.InputTypeError, match=r"got 'e4m3'; did you mean 'float8_e4m3fn'\?"):
        qkv.quantize_kv(np.ones((1, 4)), "e4m3")


def test_nearest_finds_nothing_for_nonsense():
    assert nearest("frobnicate", ("q", "k", "causal")) is None


def subcommands(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommands(sub, (*prefix, name))
            return
    yield prefix, parser


def option_cases():
    for words, parser in subcommands(build_parser()):
        if not words:
            continue
        for option in parser._option_string_actions:
            if option.startswith("--") and option not in ("--help",):
                yield pytest.param(words, option, id=f"{' '.join(words)}:{option}")


@pytest.mark.parametrize("words, option", list(option_cases()))
def test_a_mistyped_option_names_the_one_meant(capsys, words, option):
    wrong = "--" + typo(option[2:])
    rc = main([*words, wrong, "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert f"unrecognized arguments: {wrong}" in err and f"did you mean {option}?" in err


def test_a_mistyped_command_names_the_one_meant(capsys):
    assert main(["explian", "--q", "1"]) == 2
    assert "did you mean 'explain'?" in capsys.readouterr().err

"""``import qkv`` is light: NumPy and the front of the compute library, the rest on first use.

Each check runs in a fresh interpreter (the test session has imported everything already):
the modules ``import qkv`` loads are counted and the heavy ones named; every public name
resolves, through the lazy table, to the object its home module defines; ``dir(qkv)`` lists
the public names and no leftovers; the first call loads the kernels and still no ml_dtypes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import qkv
from qkv import reference

SRC = Path(__file__).resolve().parents[1] / "src"

#: The most of qkv's own modules ``import qkv`` may load (issue 41).
MOST_MODULES = 15

#: Packages and modules that ``import qkv`` must not load: optional libraries, and the parts of
#: qkv that load on first use (explanations, renderers, the engine and its kernels...).
HEAVY = (
    "torch", "matplotlib", "sympy", "rich", "ml_dtypes", "numba", "scipy", "transformers",
    "triton", "mpi4py", "tqdm", "anywidget", "hypothesis",
    "qkv.render", "qkv.learn", "qkv.explanation.trace", "qkv.explanation.exact",
    "qkv.integrations", "qkv.study", "qkv.plot", "qkv.distributed", "qkv.testing", "qkv.gpu",
    "qkv.cli", "qkv.engine", "qkv.torch_bridge", "qkv.about", "qkv.reference", "qkv.wrapped",
    "qkv.flash",
)  # fmt: skip

#: Where each public name is defined (a module's name for a module).
HOMES = {
    "DecodePlan": "qkv.engine.decoding",
    "InputError": "qkv.errors",
    "InputTypeError": "qkv.errors",
    "KVCache": "qkv.wrapped",
    "PagedKVCache": "qkv.wrapped",
    "Trace": "qkv.explanation.trace",
    "__version__": "qkv._version",
    "attention": "qkv.front",
    "attention_varlen": "qkv.wrapped",
    "attention_vjp": "qkv.wrapped",
    "attention_weights": "qkv.front",
    "dequantize_kv": "qkv.engine.quant",
    "explain": "qkv.explanation.trace",
    "info": "qkv.about",
    "route": "qkv.about",
    "Route": "qkv.about",
    "merge": "qkv.wrapped",
    "plan_decode": "qkv.engine.decoding",
    "quantize_kv": "qkv.engine.quant",
    "reference": "qkv.reference",
    "scores": "qkv.front",
    "softmax": "qkv.front",
    "widget": "qkv.learn.widget",
}


def _fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter on this tree; it prints one JSON value."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def _loaded(names: list[str], heavy: tuple[str, ...]) -> list[str]:
    return sorted({h for h in heavy for m in names if m == h or m.startswith(h + ".")})


def test_import_qkv_loads_few_of_its_modules_and_nothing_heavy():
    seen = _fresh(
        "import json, sys, qkv\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )  # fmt: skip
    own = [m for m in seen if m == "qkv" or m.startswith("qkv.")]
    assert len(own) <= MOST_MODULES, own
    assert _loaded(seen, HEAVY) == []


def test_the_first_call_loads_the_kernels_and_no_ml_dtypes():
    seen = _fresh(
        "import json, sys, numpy as np, qkv\n"
        "q = np.ones((3, 4), np.float32)\n"
        "out = qkv.attention(q, q, np.arange(12.0, dtype=np.float32).reshape(3, 4))\n"
        "half = qkv.attention(q.astype(np.float16), q.astype(np.float16), q.astype(np.float16))\n"
        "print(json.dumps([sorted(sys.modules), out.tolist(), str(half.dtype)]))\n"
    )  # fmt: skip
    names, out, half = seen
    assert "qkv.engine.run" in names and "qkv.engine.kernels.dispatch" in names
    assert _loaded(names, ("ml_dtypes", "torch", "qkv.render", "qkv.explanation.trace")) == []
    want = reference.attention(np.ones((3, 4)), np.ones((3, 4)), np.arange(12.0).reshape(3, 4))
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert half == "float16"


def test_every_public_name_resolves_to_its_home_modules_object():
    assert sorted(HOMES) == sorted(qkv.__all__)  # a new public name gets its home here
    # in a fresh interpreter, where each lazy name is looked up for the first time
    same = _fresh(
        "import importlib, json, qkv\n"
        f"homes = {HOMES!r}\n"
        "def home(name):\n"
        "    module = importlib.import_module(homes[name])\n"
        "    return module if module.__name__ == 'qkv.' + name else getattr(module, name)\n"
        "print(json.dumps({n: getattr(qkv, n) is home(n) for n in qkv.__all__}))\n"
    )  # fmt: skip
    assert same == {name: True for name in qkv.__all__}
    for name in qkv.__all__:  # and here, after the test session's imports
        assert getattr(qkv, name) is not None


def test_dir_lists_the_public_names_without_leftovers():
    names = dir(qkv)
    assert "annotations" not in names
    assert set(qkv.__all__) <= set(names)
    private = [n for n in names if n.startswith("_") and n not in qkv.__all__]
    assert private == []
    others = set(names) - set(qkv.__all__)  # the public submodules, which import on first use
    assert {"plot", "testing", "distributed", "engine"} <= others
    assert [n for n in sorted(others) if importlib.util.find_spec(f"qkv.{n}") is None] == []


def test_a_subpackage_loads_on_first_access_and_an_unknown_name_is_refused():
    seen = _fresh(
        "import json, sys, qkv\n"
        "before = 'qkv.plot' in sys.modules\n"
        "plot = qkv.plot\n"
        "try:\n"
        "    qkv.no_such_name\n"
        "    refused = False\n"
        "except AttributeError as exc:\n"
        "    refused = str(exc)\n"
        "print(json.dumps([before, plot.__name__, refused, hasattr(qkv, '__wrapped__')]))\n"
    )  # fmt: skip
    assert seen == [False, "qkv.plot", "module 'qkv' has no attribute 'no_such_name'", False]


def test_a_trace_finds_its_renderers_without_the_top_level_name():
    # the render package is imported by the first lookup of a format, whichever way the trace
    # was made (here through the explanation's own module)
    seen = _fresh(
        "import json, sys\n"
        "from qkv.explanation.trace import explain\n"
        "before = 'qkv.render' in sys.modules\n"
        "text = explain([2, 1], [[1, 0], [3, 2]], d=4).render('text')\n"
        "print(json.dumps([before, text.splitlines()[0]]))\n"
    )  # fmt: skip
    assert seen == [False, "Scaled dot-product attention, step by step"]


def test_a_format_registered_before_the_renderers_load_replaces_the_built_in():
    seen = _fresh(
        "import json, sys\n"
        "from qkv.explanation import formats\n"
        "from qkv.explanation.trace import explain\n"
        "formats.register('text', lambda trace, **_: 'mine')\n"
        "text = explain([2, 1], [[1, 0], [3, 2]], d=4).render('text')\n"
        "print(json.dumps([text, 'qkv.render' in sys.modules, formats.known()]))\n"
    )  # fmt: skip
    assert seen == ["mine", True, ["text", "markdown", "latex", "json", "html"]]

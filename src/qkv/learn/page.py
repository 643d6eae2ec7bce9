"""The live page: a form, the step view and the practice pane, as one self-contained HTML text.

The page loads nothing from the network. Its script sends the form to the local server on each
edit and draws the numbers that come back (already formatted by the library); it does no
arithmetic itself. A field the library refuses shows the library's message next to it, and
the results still on the page (the last input's) are dimmed until the input is valid again.

Examples
--------
>>> page = live_page()
>>> page.startswith("<!DOCTYPE html>"), 'id="f-q"' in page, "/api/explain" in page
(True, True, True)
"""

from __future__ import annotations

import html
from typing import Any

from ..explanation.readings import READINGS
from ..render.style import PAGE_CSS

__all__ = ["CSS", "DRAW_JS", "SEED", "live_page"]

#: The example the page opens with: the seed's worked example, ``q = [2, 1]`` with ``d = 4``.
SEED: dict[str, Any] = {
    "q": "2, 1",
    "k": "1, 0; 3, 2",
    "v": "1, 2; 3, 4",
    "d": "4",
    "reading": "divide",
    "causal": False,
    "align": "bottom-right",
    "mask": "",
    "window": "",
    "exact": False,
}

CSS = (
    PAGE_CSS
    + """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #1a1a1a;
  max-width: 1300px; margin: 1em auto; padding: 0 1em; line-height: 1.4; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; }
h2 { font-size: 1.1em; border-bottom: 1px solid #ddd; }
.cols { display: flex; gap: 2em; align-items: flex-start; flex-wrap: wrap; }
form.inputs { flex: 0 0 330px; }
.view { flex: 1 1 600px; min-width: 0; }
label { display: block; font-weight: 600; margin-top: 0.6em; }
label small { font-weight: 400; color: #555; }
textarea, input[type=text] { font-family: ui-monospace, "DejaVu Sans Mono", monospace;
  font-size: 0.95em; width: 100%; box-sizing: border-box; padding: 3px 5px; }
textarea { height: 3.4em; resize: vertical; }
.bad { border: 2px solid #c62828; background: #fff5f5; }
.err { display: block; color: #b71c1c; font-size: 0.85em; min-height: 0; }
.err:empty { display: none; }
.toggle button { font: inherit; padding: 3px 9px; margin: 2px 4px 2px 0; border: 1px solid #8aa;
  background: #fff; border-radius: 4px; cursor: pointer; }
.row { display: flex; gap: 0.8em; align-items: center; margin-top: 0.5em; flex-wrap: wrap; }
.row label { display: inline; margin: 0; }
table { border-collapse: collapse; margin: 0.2em 0 0.6em; font-size: 0.9em; }
th { background: #f0f3f6; font-weight: 600; }
td.off { color: #888; background: #f0f0f0; }
td .ex { display: block; font-size: 0.8em; color: #0b4f8a; }
table.heat td.w { width: 54px; height: 30px; text-align: center; font-size: 0.75em; padding: 0; }
.wide { overflow-x: auto; }
#m-steps .step { max-width: 100%; overflow-x: auto; }
#steps, #m-steps { display: flex; flex-wrap: wrap; gap: 0 1.6em; align-items: flex-start; }
.step { margin-bottom: 0.4em; }
.row input[type=text] { width: auto; }
.task input[type=text] { width: 22em; margin-right: 0.4em; }
.task label { font-weight: 400; }
.step h3 { font-size: 0.98em; margin: 0.5em 0 0.1em; }
.step p.how { margin: 0; color: #555; font-size: 0.85em; }
#status { color: #555; font-size: 0.85em; }
section.practice { margin-top: 1.5em; }
.task { margin: 0.4em 0; }
.fb { margin-left: 0.5em; font-size: 0.9em; }
.fb.right { color: #1b5e20; font-weight: 600; }
.fb.wrong { color: #b71c1c; }
pre.worked { background: #f6f8fa; padding: 4px 8px; font-size: 0.85em; white-space: pre-wrap; }
.stale { opacity: 0.3; filter: grayscale(1); }
#status.stale-note, #m-status.stale-note { color: #b71c1c; }
"""
)

DRAW_JS = r"""
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function table(cls, head, rows, cell) {
  const t = el("table", { class: cls });
  const tr = el("tr");
  for (const h of head) tr.appendChild(el("th", {}, h));
  t.appendChild(tr);
  rows.forEach((r, i) => {
    const row = el("tr");
    row.appendChild(el("th", {}, r.label));
    r.cells.forEach((c, j) => row.appendChild(cell(c, i, j)));
    t.appendChild(row);
  });
  return t;
}

/* The results drawn last, dimmed (and hidden from screen readers) while the input they came
   from has been replaced by input the library refuses: they are not its results. */
const RESULTS = ["title", "scale", "note", "heat", "steps"];
function stale(on, p, root) {
  for (const id of RESULTS) {
    const e = (root || document).querySelector("#" + p + id);
    if (!e) continue;
    e.classList.toggle("stale", on);
    if (on) e.setAttribute("aria-hidden", "true");
    else e.removeAttribute("aria-hidden");
  }
}

function draw(b, p, root) {
  const $ = (id) => (root || document).querySelector("#" + id);
  const S = b.shape.S;
  $(p + "scale").textContent = b.scale;
  $(p + "note").textContent = b.note;
  const keys = b.keys;
  const rows = (m) => m.map((cells, i) => ({ label: b.queries[i], cells: cells }));
  const heat = table("heat", [""].concat(keys), rows(b.shown.weights), (w, i, j) => {
    const td = el("td", { class: "w", "data-i": i, "data-j": j,
                          style: "background:" + b.colors[i][j] });
    td.textContent = b.excluded[i][j] ? "×" : w;
    if (b.excluded[i][j]) td.title = b.reasons[i][j];
    td.style.color = b.excluded[i][j] ? "#777" : (parseFloat(w) > 0.5 ? "#fff" : "#111");
    return td;
  });
  $(p + "heat").replaceChildren(heat);
  const steps = [];
  for (const s of b.steps) {
    const box = el("div", { class: "step", "data-step": s.key });
    box.appendChild(el("h3", {}, s.title));
    box.appendChild(el("p", { class: "how" }, s.how));
    const m = b.shown[s.key];
    const perRow = s.key === "row_max" || s.key === "sums";
    const head = [""].concat(s.key === "output" ? m[0].map((_, c) => "out" + c)
                             : perRow ? [s.key === "row_max" ? "max" : "Σ"] : keys);
    const ex = b.exact ? b.exact[s.key] : null;
    box.appendChild(table("steps", head, rows(m), (x, i, j) => {
      const off = !perRow && s.key !== "output" && s.key !== "raw" && s.key !== "scaled"
                  && b.excluded[i][j];
      const td = el("td", { class: "num" + (off ? " off" : ""), "data-step": s.key,
                            "data-i": i, "data-j": j }, x);
      if (s.key === "raw") td.title = b.dots[i][j];
      else if (off) td.title = b.reasons[i][j];
      if (ex && ex[i] && ex[i][j] !== undefined) {
        td.appendChild(el("span", { class: "ex" }, ex[i][j]));
      }
      return td;
    }));
    steps.push(box);
  }
  $(p + "steps").replaceChildren(...steps);
}

"""

SCRIPT = r"""
"use strict";
const $ = (id) => document.getElementById(id);
const FIELDS = ["q", "k", "v", "d", "mask", "window"];
let seq = 0, reading = "divide";

function formData() {
  const out = { reading: reading, causal: $("f-causal").checked, align: $("f-align").value,
                exact: $("f-exact").checked };
  for (const f of FIELDS) out[f] = $("f-" + f).value;
  return out;
}

function clearErrors() {
  for (const f of FIELDS.concat(["reading", "causal", "align", "exact"])) {
    const e = $("err-" + f);
    if (e) e.textContent = "";
    const input = $("f-" + f);
    if (input) input.classList.remove("bad");
  }
}

function showError(field, fields, message) {
  const target = $("err-" + field) ? field : "q";
  $("err-" + target).textContent = message;
  for (const f of [target].concat(fields || [])) {
    const input = $("f-" + f);
    if (input) input.classList.add("bad");
  }
}

const STALE = "not redrawn: the input above has an error; the dimmed numbers are for the " +
              "last input qkv could compute";

function notCurrent(status, p, message) {
  stale(true, p);
  $(status).textContent = message;
  $(status).classList.add("stale-note");
}

async function redraw() {
  const mine = ++seq;
  const t0 = performance.now();
  let r, body;
  try {
    r = await fetch("/api/explain", { method: "POST", body: JSON.stringify(formData()),
                                      headers: { "Content-Type": "application/json" } });
    body = await r.json();
  } catch (e) {
    if (mine === seq) notCurrent("status", "", "the qkv server is not answering");
    return;
  }
  if (mine !== seq) return;  // a later edit is already on its way
  clearErrors();
  if (!r.ok) {
    showError(body.field, body.fields, body.error);
    refused("status", "", "", mine);
    return;
  }
  shown(body, "status", "", "", mine, t0);
}

/* What a panel ("" the explanation, "m-" the model's head) shows once its answer is in: the
   refusal's stale state, or the drawing and its time; data-<key>state, data-<key>drawn and
   data-<key>ms say so to the page's tests. */
function refused(status, p, key, mine) {
  notCurrent(status, p, STALE);
  document.body.dataset[key + "state"] = "error";
  document.body.dataset[key + "drawn"] = String(mine);
}

function shown(body, status, p, key, mine, t0) {
  draw(body, p);
  stale(false, p);
  $(status).classList.remove("stale-note");
  const ms = performance.now() - t0;
  $(status).textContent = "redrawn in " + ms.toFixed(0) + " ms";
  document.body.dataset[key + "ms"] = ms.toFixed(2);
  document.body.dataset[key + "state"] = "ok";
  document.body.dataset[key + "drawn"] = String(mine);
}

function press(which) {
  reading = which;
  document.querySelectorAll(".toggle button").forEach(
    (b) => b.setAttribute("aria-pressed", String(b.dataset.reading === which)));
  document.body.dataset.reading = which;
  redraw();
  if (modelOn) runModel();
}

/* ----- a real model's head ----- */
const MODEL_FIELDS = ["text", "layer", "head", "query"];
let mseq = 0, modelOn = false;

async function runModel() {
  modelOn = true;
  const mine = ++mseq;
  const t0 = performance.now();
  const fields = { reading: reading };
  for (const f of MODEL_FIELDS) fields[f] = $("f-m-" + f).value;
  $("m-status").textContent = "running the model…";
  let r, body;
  try {
    r = await fetch("/api/model", { method: "POST", body: JSON.stringify(fields),
                                    headers: { "Content-Type": "application/json" } });
    body = await r.json();
  } catch (e) {
    if (mine === mseq) notCurrent("m-status", "m-", "the qkv server is not answering");
    return;
  }
  if (mine !== mseq) return;
  for (const f of MODEL_FIELDS.concat(["reading"])) {
    const e = $("err-m-" + f);
    if (e) e.textContent = "";
    const input = $("f-m-" + f);
    if (input) input.classList.remove("bad");
  }
  if (!r.ok) {
    const target = $("err-m-" + body.field) ? body.field : "text";
    $("err-m-" + target).textContent = body.error;
    if ($("f-m-" + target)) $("f-m-" + target).classList.add("bad");
    refused("m-status", "m-", "m", mine);
    return;
  }
  $("m-title").textContent = body.title + " (" + body.layers + " layers, " + body.heads +
                             " heads; query token " + body.query + ")";
  shown(body, "m-status", "m-", "m", mine, t0);
}

/* ----- practice ----- */
let exercise = null;

async function newExercise() {
  const seed = $("p-seed").value.trim();
  const kind = $("p-kind").value;
  const r = await fetch("/api/exercise", { method: "POST", body: JSON.stringify(
    { kind: kind, seed: seed, causal: $("p-causal").checked, queries: $("p-queries").value }),
    headers: { "Content-Type": "application/json" } });
  const b = await r.json();
  $("err-p-seed").textContent = r.ok ? "" : b.error;
  if (!r.ok) return;
  exercise = b;
  $("p-seed").value = b.seed;
  $("p-problem").replaceChildren(...b.problem.map((line) => el("p", { class: "task" }, line)));
  const boxes = b.steps.map((s) => {
    const box = el("div", { class: "task", "data-step": s.key });
    box.appendChild(el("label", { for: "a-" + s.key }, s.prompt));
    const input = el("input", { type: "text", id: "a-" + s.key, "data-step": s.key });
    const btn = el("button", { type: "button", "data-step": s.key }, "check");
    const fb = el("span", { class: "fb", id: "fb-" + s.key });
    const worked = el("pre", { class: "worked", id: "w-" + s.key, hidden: "" });
    btn.addEventListener("click", () => check(s.key));
    input.addEventListener("keydown", (e) => { if (e.key === "Enter") check(s.key); });
    box.append(input, btn, fb, worked);
    return box;
  });
  $("p-steps").replaceChildren(...boxes);
  document.body.dataset.exercise = String(b.seed) + ":" + b.kind;
}

async function check(key) {
  const misses = Number($("fb-" + key).dataset.misses || "0");
  const r = await fetch("/api/check", { method: "POST", body: JSON.stringify(
    { kind: exercise.kind, seed: exercise.seed, causal: exercise.causal,
      queries: exercise.queries, step: key, answer: $("a-" + key).value, misses: misses }),
    headers: { "Content-Type": "application/json" } });
  const b = await r.json();
  const fb = $("fb-" + key);
  if (!r.ok) { fb.className = "fb wrong"; fb.textContent = b.error; return; }
  fb.className = "fb " + (b.correct ? "right" : "wrong");
  fb.textContent = (b.slip ? "slip: " + b.slip + " — " : "") + b.message;
  fb.dataset.slip = b.slip || "";
  fb.dataset.correct = String(b.correct);
  if (!b.correct && b.readable) fb.dataset.misses = String(misses + 1);
  if (b.worked) { const w = $("w-" + key); w.textContent = b.worked.join("\n"); w.hidden = false; }
}

window.addEventListener("DOMContentLoaded", () => {
  for (const f of FIELDS) $("f-" + f).addEventListener("input", redraw);
  for (const f of ["causal", "align", "exact"]) $("f-" + f).addEventListener("change", redraw);
  document.querySelectorAll(".toggle button").forEach(
    (b) => b.addEventListener("click", () => press(b.dataset.reading)));
  $("p-new").addEventListener("click", newExercise);
  $("m-run").addEventListener("click", runModel);
  for (const f of MODEL_FIELDS) {
    $("f-m-" + f).addEventListener("change", () => { if (modelOn) runModel(); });
  }
  press(document.body.dataset.reading || "divide");
  newExercise();
  document.body.dataset.ready = "1";
});
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _field(name: str, label: str, hint: str, value: str, area: bool = True) -> str:
    box = (
        f'<textarea id="f-{name}" name="{name}" spellcheck="false">{_e(value)}</textarea>'
        if area
        else f'<input type="text" id="f-{name}" name="{name}" value="{_e(value)}" '
        'spellcheck="false">'
    )
    return (
        f'<label for="f-{name}">{_e(label)} <small>{_e(hint)}</small></label>{box}'
        f'<span class="err" id="err-{name}" role="alert"></span>'
    )


def live_page(fields: dict[str, Any] | None = None) -> str:
    """The page's HTML, its form filled with ``fields`` (default :data:`SEED`)."""
    f = {**SEED, **(fields or {})}
    buttons = "".join(
        f'<button type="button" data-reading="{key}" aria-pressed="false">{_e(text)}</button>'
        for key, text, _ in READINGS
    )
    align = "".join(
        f'<option value="{a}"{" selected" if f["align"] == a else ""}>{a}</option>'
        for a in ("bottom-right", "top-left")
    )
    checked = {n: " checked" if f[n] else "" for n in ("causal", "exact")}
    form = "".join(
        [
            _field("q", "q", "query rows: 2, 1 (rows split by ;)", f["q"]),
            _field("k", "K", "keys, one per row", f["k"]),
            _field("v", "V", "values, one per row (optional)", f["v"]),
            _field("d", "d", "the d of 1/√d (empty: len(q))", f["d"], area=False),
            '<label>scale</label><div class="toggle" role="group">' + buttons + "</div>",
            '<span class="err" id="err-reading"></span>',
            f'<div class="row"><input type="checkbox" id="f-causal"{checked["causal"]}>'
            '<label for="f-causal">causal</label>'
            f'<select id="f-align" aria-label="causal alignment">{align}</select></div>',
            '<span class="err" id="err-causal"></span><span class="err" id="err-align"></span>',
            _field("mask", "mask", "1 may attend, 0 may not; one row or one per query", f["mask"]),
            _field("window", "window", "L,R: keys p−L … p+R (empty: none)", f["window"], False),
            f'<div class="row"><input type="checkbox" id="f-exact"{checked["exact"]}>'
            '<label for="f-exact">exact values (SymPy)</label></div>',
            '<span class="err" id="err-exact"></span>',
        ]
    )
    practice = (
        '<section class="practice"><h2>Practice</h2>'
        '<div class="row"><label for="p-kind">kind</label><select id="p-kind">'
        '<option value="steps">attention, step by step</option>'
        '<option value="masks">masks and softmax</option></select>'
        '<label for="p-seed">seed</label><input type="text" id="p-seed" value="7" size="8">'
        '<label for="p-queries">query rows</label>'
        '<input type="text" id="p-queries" value="1" size="3">'
        '<input type="checkbox" id="p-causal"><label for="p-causal">causal</label>'
        '<button type="button" id="p-new">new problem</button></div>'
        '<span class="err" id="err-p-seed" role="alert"></span>'
        '<div id="p-problem"></div><div id="p-steps"></div></section>'
    )
    model = (
        '<section class="model"><h2>A real model\'s head</h2>'
        '<p class="how">A sentence through the small trained all-MiniLM-L6-v2 of the '
        "<code>model</code> extra (read from disk; nothing is downloaded): pick a layer, a "
        "head and a query token, and see that head's steps for the token. The scale toggle "
        "above applies here too.</p>"
        '<div class="row">'
        '<label for="f-m-text">sentence</label>'
        '<input type="text" id="f-m-text" value="The cat sat on the mat" size="40">'
        '<label for="f-m-layer">layer</label><input type="text" id="f-m-layer" value="2" size="3">'
        '<label for="f-m-head">head</label><input type="text" id="f-m-head" value="3" size="3">'
        '<label for="f-m-query">token</label><input type="text" id="f-m-query" value="cat" '
        'size="8"><button type="button" id="m-run">run the model</button></div>'
        + "".join(
            f'<span class="err" id="err-m-{n}" role="alert"></span>'
            for n in ("text", "layer", "head", "query", "reading")
        )
        + '<p id="m-title"></p><p id="m-scale"></p><p class="note" id="m-note"></p>'
        '<div id="m-heat" class="wide"></div><div id="m-steps"></div><p id="m-status"></p>'
        "</section>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>qkv learn: attention, live</title>"
        '<link rel="icon" href="data:,">'
        f"<style>{CSS}</style></head>"
        f'<body data-reading="{_e(f["reading"])}">'
        "<h1>Attention, live</h1>"
        '<p class="formula">softmax(q·Kᵀ · scale + mask) · V — change any number; every step '
        "is recomputed by qkv.</p>"
        f'<div class="cols"><form class="inputs" autocomplete="off">{form}</form>'
        '<div class="view"><p id="scale"></p><p class="note" id="note"></p>'
        '<h2>Weights at a glance</h2><div id="heat"></div>'
        '<h2>Step by step</h2><div id="steps"></div><p id="status"></p></div></div>'
        f"{practice}{model}"
        f"<script>{SCRIPT}{DRAW_JS}</script></body></html>\n"
    )

// The specserve playground: a chat on /v1/chat/completions (streamed) that shows how each
// token came, from the speculation trace the server sends with it (`return_spec_trace`).
// Model output only ever reaches the page as text (textContent, SVG <text> nodes): nothing
// here parses markup, so generated "<script>" or HTML shows as the characters it is.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const MAX_TREES = 4;
const POLL_MS = 2000;

const state = {
  key: sessionStorage.getItem("specserve-api-key") || "",
  history: [],          // [{role, content}] of the conversation so far
  busy: null,           // AbortController of the run in flight
  accept: [],           // histogram: verify steps that gave k tokens (index k)
  trees: [],            // the last MAX_TREES traced trees
  speculative: false,   // the server has a speculative algorithm
};

// ---- small DOM helpers (text only) ------------------------------------------------------
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}
function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
function stat(box, key, value) {
  box.appendChild(el("span", "k", key));
  box.appendChild(el("span", "v", value));
}
function setStatus(text, error) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("error", !!error);
}
const fmt = (x, d = 1) => (Number.isFinite(x) ? x.toFixed(d) : "–");

// ---- the API, with the key ---------------------------------------------------------------
class AuthError extends Error {}

async function api(path, init = {}) {
  const headers = Object.assign({}, init.headers || {});
  if (state.key) headers.Authorization = "Bearer " + state.key;
  const r = await fetch(path, Object.assign({}, init, { headers }));
  if (r.status === 401) {
    $("key-bar").hidden = false;
    $("api-key").focus();
    throw new AuthError("this server needs its API key");
  }
  return r;
}

async function errorText(r) {
  try {
    const body = await r.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return r.status + " " + r.statusText;
  }
}

// ---- what the form asks for --------------------------------------------------------------
function numberField(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function requestBody(messages, disableSpeculation, seed) {
  const body = { messages, stream: true, return_spec_trace: $("trace").checked };
  for (const k of ["temperature", "top_p", "max_tokens", "frequency_penalty",
                   "presence_penalty", "repetition_penalty"]) {
    const v = numberField(k);
    if (v !== null) body[k] = v;
  }
  if (seed !== null) body.seed = seed;
  const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
  if (stop.length) body.stop = stop;
  const schema = $("schema").value.trim();
  if (schema) {
    let parsed;
    try { parsed = JSON.parse(schema); } catch (e) {
      throw new Error("the JSON schema does not parse: " + e.message);
    }
    body.response_format = { type: "json_schema",
                             json_schema: { name: "playground", schema: parsed } };
  }
  if (disableSpeculation) body.disable_speculation = true;
  return body;
}

// ---- one streamed run into one column ----------------------------------------------------
class Run {
  constructor(parent, title) {
    this.box = el("div", "run");
    this.box.appendChild(el("div", "who", title));
    this.body = el("div", "body");
    this.meta = el("div", "meta");
    this.box.appendChild(this.body);
    this.box.appendChild(this.meta);
    parent.appendChild(this.box);
    this.content = "";      // the text the API sent (deltas joined)
    this.pieces = [];       // [text, kind, title] per token, from the trace
    this.tokens = 0;
    this.steps = 0;
    this.drafted = 0;
    this.accepted = 0;
    this.t0 = performance.now();
    this.tFirst = null;
    this.tLast = null;
  }

  addText(text) {
    if (!text) return;
    this.content += text;
    if (!this.traced) this.body.appendChild(document.createTextNode(text));
  }

  addSteps(steps, onTree) {
    this.traced = true;
    for (const s of steps) {
      const tree = s.tree;
      const nAcc = tree ? tree.accepted.length - 1 : 0;
      s.output.forEach((_, j) => {
        let kind = "plain", why = "plain step (no draft)";
        if (tree && j < nAcc) {
          kind = "d" + Math.min(j + 1, 5);
          why = "accepted draft, depth " + (j + 1);
        } else if (tree) {
          kind = "bonus";
          why = "bonus token of a verify step (" + nAcc + " of " +
                (tree.tokens.length - 1) + " drafts accepted)";
        }
        const piece = s.text[j] || "";
        this.pieces.push([piece, kind, why]);
        if (piece) {
          const span = el("span", "tok " + kind, piece);
          span.title = why + ", " + fmt(s.step_ms, 2) + " ms step";
          this.body.appendChild(span);
        }
      });
      this.tokens += s.output.length;
      if (tree) {
        this.steps += 1;
        this.drafted += tree.tokens.length - 1;
        this.accepted += nAcc;
        onTree(s);
      }
    }
  }

  tick() {
    const now = performance.now();
    if (this.tFirst === null) this.tFirst = now;
    this.tLast = now;
  }

  // The final text is the API's: the trace's pieces run ahead of it where a stop string is
  // held back or cut, so the coloured tokens are trimmed to the text, or dropped if unequal.
  finish(usage) {
    if (this.traced) {
      const joined = this.pieces.map((p) => p[0]).join("");
      if (joined !== this.content) {
        clear(this.body);
        if (joined.startsWith(this.content)) {
          let left = this.content.length;
          for (const [piece, kind, why] of this.pieces) {
            if (left <= 0) break;
            const part = piece.slice(0, left);
            left -= part.length;
            if (!part) continue;
            const span = el("span", "tok " + kind, part);
            span.title = why;
            this.body.appendChild(span);
          }
        } else {
          this.body.appendChild(document.createTextNode(this.content));
        }
      }
    }
    const n = usage ? usage.completion_tokens : this.tokens;
    this.completionTokens = n;
    const total = ((this.tLast || performance.now()) - this.t0) / 1000;
    const decode = this.tFirst !== null && this.tLast > this.tFirst && n > 1
      ? (n - 1) / ((this.tLast - this.tFirst) / 1000) : NaN;
    this.decodeRate = decode;
    this.totalSeconds = total;
    const parts = [n + " tokens", fmt(total, 2) + " s", fmt(decode) + " tok/s decoding"];
    if (this.steps) {
      parts.push(this.steps + " verify steps, " + this.accepted + "/" + this.drafted +
                 " drafts accepted");
    }
    this.meta.textContent = parts.join(" · ");
  }

  fail(message) {
    this.box.classList.add("error");
    this.body.appendChild(el("div", "", message));
  }
}

async function stream(body, run, signal, onTree) {
  const r = await api("/v1/chat/completions", {
    method: "POST", signal, headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  if (!r.ok) throw new Error(await errorText(r));
  run.traced = !!body.return_spec_trace;
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buf = "", usage = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices || []) {
          run.tick();
          if (c.spec_trace && c.spec_trace.length) run.addSteps(c.spec_trace, onTree);
          run.addText(c.delta && c.delta.content);
        }
      }
    }
  }
  run.finish(usage);
  return run.content;
}

// ---- the conversation --------------------------------------------------------------------
function addUser(text) {
  const m = el("div", "msg user");
  m.appendChild(el("div", "who", "you"));
  m.appendChild(document.createTextNode(text));
  $("messages").appendChild(m);
}

async function send(text) {
  const compare = $("compare").checked;
  let seed = numberField("seed");
  if (compare && seed === null && (numberField("temperature") || 0) > 0) {
    // a sampled side-by-side pair draws the same tokens only with the same seed
    seed = Math.floor(Math.random() * 2 ** 31);
  }
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : [])
    .concat(state.history, [{ role: "user", content: text }]);
  let specBody, plainBody;
  try {
    specBody = requestBody(messages, false, seed);
    if (compare) plainBody = requestBody(messages, true, seed);
  } catch (e) {
    setStatus(e.message, true);
    return;
  }
  addUser(text);
  const msg = el("div", "msg assistant");
  const runs = el("div", compare ? "runs compare" : "runs");
  msg.appendChild(runs);
  $("messages").appendChild(msg);
  const label = state.speculative ? "with speculation" : "assistant";
  const spec = new Run(runs, compare ? label : "assistant");
  const plain = compare ? new Run(runs, "without speculation") : null;
  if (plain) plain.body.textContent = "(runs when the left one is done, so each has the machine to itself)";
  state.accept = [];
  drawHistogram();
  const ctrl = new AbortController();
  setBusy(ctrl);
  let answer = null;
  try {
    setStatus("generating…");
    answer = await stream(specBody, spec, ctrl.signal, onTree);
    if (plain) {
      clear(plain.body);
      plain.t0 = performance.now();
      plain.tFirst = plain.tLast = null;
      setStatus("generating without speculation…");
      await stream(plainBody, plain, ctrl.signal, () => {});
      compareRuns(spec, plain);
    }
    setStatus("");
  } catch (e) {
    if (e.name === "AbortError") {
      setStatus("stopped");
    } else {
      (plain && answer !== null ? plain : spec).fail(e.message);
      setStatus(e.message, true);
    }
  } finally {
    setBusy(null);
    showSpeed(spec, plain);
  }
  if (answer !== null) {
    state.history.push({ role: "user", content: text }, { role: "assistant", content: answer });
  }
  $("messages").scrollTop = $("messages").scrollHeight;
}

function compareRuns(spec, plain) {
  const same = spec.content === plain.content;
  const speedup = plain.totalSeconds / spec.totalSeconds;
  plain.meta.textContent += " · " + (same ? "same text" : "text differs") +
    " · speculation " + fmt(speedup, 2) + "x end to end";
  plain.meta.classList.add(same ? "ok" : "bad");
  plain.box.dataset.same = same ? "yes" : "no";
}

function setBusy(ctrl) {
  state.busy = ctrl;
  $("send").disabled = !!ctrl;
  $("stop-btn").disabled = !ctrl;
}

// ---- the speculation panel ---------------------------------------------------------------
function onTree(step) {
  const k = step.tree.accepted.length;  // tokens the step gave: accepted drafts + bonus
  while (state.accept.length <= k) state.accept.push(0);
  state.accept[k] += 1;
  state.trees.push(step);
  if (state.trees.length > MAX_TREES) state.trees.shift();
  drawHistogram();
  drawTrees();
}

function showSpeed(spec, plain) {
  const box = $("speed");
  clear(box);
  stat(box, "decoding", fmt(spec.decodeRate) + " tok/s");
  stat(box, "tokens", String(spec.completionTokens || 0));
  if (spec.steps) {
    stat(box, "verify steps", String(spec.steps));
    stat(box, "accepted", spec.accepted + " of " + spec.drafted + " drafts (" +
         fmt(100 * spec.accepted / Math.max(spec.drafted, 1), 0) + "%)");
    stat(box, "tokens / step", fmt((spec.accepted + spec.steps) / spec.steps, 2));
  }
  if (plain && plain.completionTokens) {
    stat(box, "without", fmt(plain.decodeRate) + " tok/s");
  }
}

function drawHistogram() {
  const h = $("histogram");
  clear(h);
  const counts = state.accept.slice(1);
  if (!counts.length) {
    h.appendChild(svg("text", { x: 8, y: 60 }, "no verify step yet"));
    return;
  }
  const max = Math.max(...counts, 1);
  const w = 300 / Math.max(counts.length, 4);
  counts.forEach((c, i) => {
    const bh = (c / max) * 90;
    const x = i * w + 4;
    const bar = svg("rect", { x, y: 100 - bh, width: w - 8, height: bh });
    bar.appendChild(svg("title", {}, c + " steps gave " + (i + 1) + " tokens"));
    h.appendChild(bar);
    h.appendChild(svg("text", { x: x + (w - 8) / 2 - 3, y: 114 }, String(i + 1)));
    h.appendChild(svg("text", { x: x + (w - 8) / 2 - 3, y: 96 - bh }, String(c)));
  });
}

// Each tree left to right by depth; leaves take rows in depth-first order and a parent sits
// beside its first child. The accepted path is green, the bonus token orange and dashed.
function layout(parents) {
  const n = parents.length, kids = parents.map(() => []), depth = new Array(n).fill(0);
  for (let i = 1; i < n; i++) { kids[parents[i]].push(i); depth[i] = depth[parents[i]] + 1; }
  const row = new Array(n).fill(0);
  let next = 0;
  const visit = (u) => {
    if (!kids[u].length) { row[u] = next++; return; }
    kids[u].forEach(visit);
    row[u] = row[kids[u][0]];
  };
  visit(0);
  return { depth, row, rows: Math.max(next, 1) };
}

function label(text) {
  const t = JSON.stringify(text).slice(1, -1);
  return t.length > 9 ? t.slice(0, 8) + "…" : t;
}

function drawTree(step) {
  const t = step.tree;
  const { depth, row, rows } = layout(t.parents);
  const acc = new Set(t.accepted);
  const last = t.accepted[t.accepted.length - 1];
  const maxDepth = Math.max(...depth) + 1;  // + the bonus column
  const dx = 62, dy = 18, W = dx * (maxDepth + 1), H = dy * rows + 6;
  const s = svg("svg", { viewBox: "0 0 " + W + " " + H, class: "tree-svg" });
  const X = (d) => 8 + d * dx, Y = (r) => 10 + r * dy;
  for (let i = 1; i < t.parents.length; i++) {
    const p = t.parents[i];
    s.appendChild(svg("line", { x1: X(depth[p]), y1: Y(row[p]), x2: X(depth[i]), y2: Y(row[i]),
                                class: acc.has(i) ? "acc" : "" }));
  }
  s.appendChild(svg("line", { x1: X(depth[last]), y1: Y(row[last]), x2: X(depth[last] + 1),
                              y2: Y(row[last]), class: "bonus" }));
  const node = (x, y, cls, text, tip) => {
    const g = svg("g", {});
    g.appendChild(svg("circle", { cx: x, cy: y, r: 4, class: cls }));
    g.appendChild(svg("text", { x: x + 6, y: y + 3 }, label(text)));
    g.appendChild(svg("title", {}, tip));
    s.appendChild(g);
  };
  for (let i = 0; i < t.parents.length; i++) {
    const q = t.draft_probs ? ", drafter p = " + fmt(t.draft_probs[i], 3) : "";
    const cls = i === 0 ? "root" : acc.has(i) ? "acc" : "";
    const tip = (i === 0 ? "root (last verified token)" : acc.has(i) ? "accepted draft"
      : "rejected draft") + ": " + JSON.stringify(t.texts[i]) + q;
    node(X(depth[i]), Y(row[i]), cls, t.texts[i], tip);
  }
  const bonusText = step.text[t.accepted.length - 1];
  node(X(depth[last] + 1), Y(row[last]), "bonus",
       bonusText === undefined ? "(cut)" : bonusText, "bonus token (the target's own)");
  return s;
}

function drawTrees() {
  const box = $("trees");
  clear(box);
  for (const step of state.trees.slice().reverse()) {
    const t = step.tree;
    const fig = el("div", "tree");
    fig.appendChild(el("div", "cap", (t.tokens.length - 1) + " drafts, " +
      (t.accepted.length - 1) + " accepted · " + fmt(step.step_ms, 2) + " ms step" +
      (step.batch_size > 1 ? " (batch of " + step.batch_size + ")" : "")));
    fig.appendChild(drawTree(step));
    box.appendChild(fig);
  }
}

// ---- the server view (/metrics, /server_info) -------------------------------------------
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of (m[2] || "").matchAll(/(\w+)="([^"]*)"/g)) labels[k] = v;
    (out[m[1]] = out[m[1]] || []).push({ labels, value: Number(m[3]) });
  }
  return out;
}
const metric = (ms, name) => (ms[name] && ms[name].length ? ms[name][0].value : NaN);

async function pollServer() {
  if (document.hidden) return;
  try {
    const info = await (await api("/server_info")).json();
    // /metrics answers 404 unless enabled, which the browser would log as an error
    const r = info.enable_metrics ? await api("/metrics") : null;
    const ms = r && r.ok ? parseMetrics(await r.text()) : null;
    showServer(info, ms);
  } catch (e) {
    if (!(e instanceof AuthError)) setStatus("server: " + e.message, true);
  }
}

function showServer(info, ms) {
  const box = $("server");
  clear(box);
  const algo = info.speculative_algorithm || "none";
  stat(box, "speculation", algo);
  const pick = (m, i) => (Number.isFinite(m) ? m : i);
  stat(box, "running", String(pick(ms ? metric(ms, "specserve_num_running_reqs") : NaN,
                                   info.num_running_reqs)) +
       " · waiting " + pick(ms ? metric(ms, "specserve_num_queue_reqs") : NaN,
                            info.num_waiting_reqs));
  const usage = pick(ms ? metric(ms, "specserve_token_usage") : NaN, info.kv_usage);
  stat(box, "KV in use", fmt(100 * usage, 1) + "% of " + info.kv_capacity + " slots");
  const bar = el("div", "bar");
  const fill = el("div");
  fill.style.width = Math.min(100, 100 * usage).toFixed(1) + "%";
  bar.appendChild(fill);
  box.appendChild(el("span", "k", ""));
  box.appendChild(bar);
  if (algo !== "none") {
    const drafts = pick(ms ? metric(ms, "specserve_spec_decode_num_draft_tokens_total") : NaN,
                        info.spec_decode_num_draft_tokens);
    const acc = pick(ms ? metric(ms, "specserve_spec_decode_num_accepted_tokens_total") : NaN,
                     info.spec_decode_num_accepted_tokens);
    stat(box, algo + " acceptance", fmt(100 * acc / Math.max(drafts, 1), 1) + "% (" + acc +
         " of " + drafts + " drafts)");
    stat(box, "tokens / step", fmt(info.avg_spec_accept_length, 2));
    const perPos = ms && ms.specserve_spec_decode_num_accepted_tokens_per_pos_total
      ? ms.specserve_spec_decode_num_accepted_tokens_per_pos_total.map((x) => x.value)
      : info.spec_decode_num_accepted_tokens_per_pos || [];
    const steps = pick(ms ? metric(ms, "specserve_spec_decode_num_drafts_total") : NaN,
                       info.spec_verify_steps);
    if (perPos.length) {
      stat(box, "accepted at depth", perPos.map((c, i) => (i + 1) + ": " +
           fmt(100 * c / Math.max(steps, 1), 0) + "%").join("  "));
    }
  }
  if (!ms) box.appendChild(el("span", "note", "(/metrics is off: start the server with " +
                                              "--enable-metrics; figures from /server_info)"));
  const body = $("requests").tBodies[0];
  clear(body);
  for (const q of info.running_requests || []) {
    const tr = el("tr");
    tr.appendChild(el("td", "", q.rid.slice(0, 14)));
    tr.appendChild(el("td", "", String(q.output_tokens)));
    const on = q.disable_speculation ? "off (asked)" : q.planned_nodes > 1
      ? "on, " + (q.planned_nodes - 1) + " nodes" : "off (controller)";
    tr.appendChild(el("td", "", algo === "none" ? "–" : on));
    tr.appendChild(el("td", "", q.spec_num_correct_drafts + "/" + q.spec_num_proposed_drafts));
    body.appendChild(tr);
  }
}

// ---- start -------------------------------------------------------------------------------
async function start() {
  try {
    const models = await (await api("/v1/models")).json();
    $("model").textContent = models.data[0].id;
    const info = await (await api("/server_info")).json();
    state.speculative = !!info.speculative_algorithm;
    $("algorithm").textContent = info.speculative_algorithm || "no speculation";
    $("key-bar").hidden = true;
    setStatus("ready");
    showServer(info, null);
    pollServer();
  } catch (e) {
    if (!(e instanceof AuthError)) setStatus(e.message, true);
    else setStatus("API key needed", true);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || state.busy) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop-btn").addEventListener("click", () => state.busy && state.busy.abort());
  $("clear").addEventListener("click", () => {
    state.history = [];
    state.trees = [];
    state.accept = [];
    clear($("messages"));
    drawTrees();
    drawHistogram();
  });
  $("key-save").addEventListener("click", () => {
    state.key = $("api-key").value.trim();
    sessionStorage.setItem("specserve-api-key", state.key);
    start();
  });
  drawHistogram();
  start();
  setInterval(pollServer, POLL_MS);
});

// mmreplay view: the page. Plain JS, no build step, no dependency. It only talks to the
// viewer's own /api endpoints (see server.py) and draws on <canvas>.
"use strict";

const POLL_MS = 1000;
const state = { generation: null, view: null, poll: null };

// -- small helpers ---------------------------------------------------------------------
function el(tag, attrs = {}, ...kids) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const kid of kids) if (kid !== null && kid !== undefined)
    node.append(kid instanceof Node ? kid : String(kid));
  return node;
}

async function api(path) {
  const response = await fetch(path, { cache: "no-store" });
  const body = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
  if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
  return body;
}

function showError(message) {
  document.getElementById("error-text").textContent = message;
  document.getElementById("error").hidden = false;
}

function clearError() { document.getElementById("error").hidden = true; }

function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number" && !Number.isInteger(value)) return value.toPrecision(digits);
  if (Array.isArray(value)) return `[${value.map((v) => fmt(v, digits)).join(", ")}]`;
  return String(value);
}

function bytes(n) {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let i = -1;
  do { n /= 1024; i += 1; } while (n >= 1024 && i < units.length - 1);
  return `${n.toFixed(1)} ${units[i]}`;
}

function kvTable(pairs) {
  return el("table", { class: "kv" }, el("tbody", {},
    ...pairs.map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", { text: fmt(v) })))));
}

function card(title, ...kids) { return el("div", { class: "card" }, el("h3", { text: title }), ...kids); }

// The view is drawn: say which, and when (ms since navigation started, the browser's clock).
function ready(view) {
  document.body.dataset.readyMs = performance.now().toFixed(1);
  document.body.dataset.ready = view;
}

// Counts finished redraws of a view's data (tests wait on it instead of guessing).
function rendered() { document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1); }

// -- plots on canvas -------------------------------------------------------------------
function setupCanvas(canvas, height) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 600;
  canvas.width = width * ratio; canvas.height = height * ratio;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, width, height };
}

function extent(values, fromZero = false) {
  const finite = values.filter((v) => v !== null && Number.isFinite(v));
  if (!finite.length) return [0, 1];
  let lo = Math.min(...finite), hi = Math.max(...finite);
  if (fromZero) { lo = Math.min(lo, 0); hi = Math.max(hi, 0); }
  if (lo === hi) { lo -= 0.5; hi += 0.5; }
  return [lo, hi];
}

// Lines (or bars) of several series over a shared x; each series {name, color, y, bars}.
function plotXY(canvas, x, series, { height = 180, title = "", cursor = null, at = null } = {}) {
  const { ctx, width } = setupCanvas(canvas, height);
  const pad = { l: 120, r: 10, t: 18, b: 20 };
  const [x0, x1] = extent(x);
  const sx = (v) => pad.l + ((v - x0) / (x1 - x0 || 1)) * (width - pad.l - pad.r);
  ctx.fillStyle = "#9a9ca6"; ctx.fillText(title, pad.l, 12);
  ctx.fillText(fmt(x0), pad.l, height - 6);
  ctx.fillText(fmt(x1), width - pad.r - 40, height - 6);
  const rows = series.length;
  const rowH = (height - pad.t - pad.b) / rows;
  series.forEach((s, i) => {
    const top = pad.t + i * rowH, bottom = top + rowH - 4;
    const [y0, y1] = extent(s.y, s.bars || s.zero);
    const sy = (v) => bottom - ((v - y0) / (y1 - y0)) * (bottom - top);
    ctx.fillStyle = s.color; ctx.strokeStyle = s.color;
    ctx.fillText(s.name, 4, top + 10);
    ctx.fillStyle = "#9a9ca6";
    ctx.fillText(fmt(y1, 3), 4, top + 22); ctx.fillText(fmt(y0, 3), 4, bottom);
    ctx.fillStyle = s.color;
    ctx.beginPath();
    let pen = false;
    s.y.forEach((v, j) => {
      if (v === null || !Number.isFinite(v)) { pen = false; return; }
      if (s.bars) { ctx.fillRect(sx(x[j]), Math.min(sy(v), sy(Math.max(y0, 0))), 2,
                                 Math.abs(sy(v) - sy(Math.max(y0, 0))) || 1); return; }
      if (pen) ctx.lineTo(sx(x[j]), sy(v)); else ctx.moveTo(sx(x[j]), sy(v));
      pen = true;
    });
    if (!s.bars) ctx.stroke();
  });
  const cursorX = cursor === null ? null : Math.round(sx(cursor)) + 0.5;
  if (at !== null) series.forEach((s, i) => valueTag(ctx, fmt(s.y[at], 4), cursorX,
    pad.t + i * rowH + 10, width - pad.r));
  if (cursor !== null) {
    ctx.strokeStyle = "#ffffff"; ctx.lineWidth = 1; ctx.beginPath();
    ctx.moveTo(cursorX, pad.t); ctx.lineTo(cursorX, height - pad.b); ctx.stroke();
  }
  return { xOf: (px) => x0 + ((px - pad.l) / (width - pad.l - pad.r)) * (x1 - x0), cursorX };
}

// A value written beside the cursor line (left of it near the right edge), on a dark box.
function valueTag(ctx, text, x, y, right) {
  const w = ctx.measureText(text).width + 6;
  const left = x + 4 + w > right ? x - 4 - w : x + 4;
  ctx.fillStyle = "rgba(22, 23, 27, 0.85)"; ctx.fillRect(left, y - 10, w, 13);
  ctx.fillStyle = "#ffffff"; ctx.fillText(text, left + 3, y);
}

function histogram(canvas, edges, mass, { height = 160, title = "", color = "#5aa9ff" } = {}) {
  const { ctx, width } = setupCanvas(canvas, height);
  const pad = { l: 46, r: 10, t: 18, b: 20 };
  const top = Math.max(...mass, 1e-12);
  const w = (width - pad.l - pad.r) / mass.length;
  ctx.fillStyle = "#9a9ca6"; ctx.fillText(title, pad.l, 12);
  ctx.fillText(fmt(edges[0]), pad.l, height - 6);
  ctx.fillText(fmt(edges[edges.length - 1]), width - pad.r - 40, height - 6);
  ctx.fillText(fmt(top, 3), 4, pad.t + 8);
  ctx.fillStyle = color;
  mass.forEach((m, i) => {
    const h = (m / top) * (height - pad.t - pad.b);
    ctx.fillRect(pad.l + i * w, height - pad.b - h, Math.max(1, w - 1), h);
  });
}

// -- overview --------------------------------------------------------------------------
async function overviewView(main) {
  const [info, health] = await Promise.all([api("/api/overview"), api("/api/health")]);
  const c = info.counts, d = info.disk, r = info.ram;
  const files = el("table", {}, el("thead", {}, el("tr", {}, el("th", { text: "entry" }),
    el("th", { class: "num", text: "files" }), el("th", { class: "num", text: "size" }))),
  el("tbody", {}, ...info.entries.map((e) => el("tr", {}, el("td", { text: e.name }),
    el("td", { class: "num", text: e.files }), el("td", { class: "num", text: bytes(e.bytes) })))));
  const prio = info.priorities ? [["priority min", info.priorities.min],
    ["priority mean", info.priorities.mean], ["priority max", info.priorities.max]] : [];
  main.replaceChildren(el("h2", { text: info.path }), el("div", { class: "grid", id: "overview" },
    card("store", kvTable([["format", `mmreplay v${info.format_version}`],
      ["generation", info.generation], ["images", info.images ? "yes" : "no (vectors)"]])),
    card("counts", kvTable([["frames written", c.frames_written], ["frames kept", c.frames_kept],
      ["transitions", c.transitions], ["sampleable", c.sampleable], ["episodes", c.episodes],
      ["episodes running", info.episodes_running]])),
    card("disk", kvTable([["total", bytes(d.total_bytes)], ["frames", bytes(d.frames_bytes)],
      ["frame files", d.chunk_files], ["compression", d.compression_ratio === null ? "n/a"
        : `${d.compression_ratio.toFixed(2)}x`], ["frames in RAM tail", d.frames_in_tail]])),
    card("RAM (estimated)", kvTable([["step columns", bytes(r.steps_bytes)],
      ["masks", bytes(r.masks_bytes)], ["sampler", bytes(r.sampler_bytes)],
      ["frame tail", bytes(r.tail_bytes)], ["total", bytes(r.total_bytes)]])),
    card("sampler", kvTable([["kind", info.sampler], ...prio])),
    healthCard(),
    card("config", kvTable(Object.entries(info.spec))),
    card("files", files)));
  showHealth(health);
  if (health.state === "running") followHealth();
  return { refresh: () => overviewView(main) };
}

// -- health: `mmreplay verify` on demand (the server runs it in the background, bounded) --
function healthCard() {
  return card("health", el("div", { id: "health" }), el("div", { class: "controls" },
    el("button", { id: "verify", type: "button", text: "verify now", onclick: async () => {
      try { showHealth(await api("/api/health?run=1")); followHealth(); }
      catch (err) { showError(err.message); }
    } })));
}

async function followHealth() {
  for (;;) {
    const h = await api("/api/health");
    if (!document.getElementById("health")) return; // the user left the overview
    showHealth(h);
    if (h.state !== "running") return;
    await new Promise((resolve) => { setTimeout(resolve, 250); });
  }
}

function showHealth(h) {
  const box = document.getElementById("health");
  if (!box) return;
  box.dataset.state = h.state;
  const r = h.report;
  const lines = {
    never: [["verify", `not run yet (checks every checksum and invariant, read-only; ` +
      `stops after ${h.limit_s} s)`]],
    unavailable: [["verify", h.error]],
    running: [["verify", `running: ${h.chunks_done} of ${fmt(h.chunks_total)} frame chunks, ` +
      `${fmt(h.elapsed_s, 3)} s`]],
    stopped: [["verify", h.error]],
    failed: [["verify", `could not run: ${h.error}`]],
  }[h.state] || [["result", r.ok ? "sound: no problem found" : `${r.problems.length} problem(s)`],
    ["generation", r.generation], ["files checked", r.files_checked],
    ["frame chunks checked", r.chunks_checked], ["frames checked", r.frames_checked],
    ["took", `${fmt(h.elapsed_s, 3)} s`], ...(r.note ? [["note", r.note]] : [])];
  box.replaceChildren(kvTable(lines));
  box.classList.toggle("bad", h.state === "done" && !r.ok);
  box.classList.toggle("good", h.state === "done" && r.ok);
  if (h.state === "done" && !r.ok) {
    box.append(el("ul", { class: "problems" }, ...r.problems.slice(0, 50).map((p) => el("li", { text: p }))));
    showError(`verify found ${r.problems.length} problem(s) in generation ${r.generation}: ` +
      r.problems.slice(0, 3).join("; "));
  } else if (h.state === "failed") showError(`verify could not run: ${h.error}`);
  document.body.dataset.health = h.state === "done" ? (r.ok ? "ok" : "problems") : h.state;
}

// -- episodes --------------------------------------------------------------------------
const COLUMNS = [["episode", "episode", true], ["env", "env", true], ["first_id", "first id", true],
  ["last_id", "last id", false], ["length", "length", true], ["return", "return", true],
  ["status", "status", false], ["fully_kept", "kept", false]];

async function episodesView(main) {
  const q = { sort: "episode", order: "asc", status: "", kept: "", env: "", offset: 0, limit: 50 };
  const body = el("tbody");
  const info = el("span", { class: "dim", id: "page-info" });
  const head = el("tr");
  const select = (name, options) => el("select", { id: `f-${name}`, onchange: (ev) => {
    q[name] = ev.target.value; q.offset = 0; load(); } },
  ...options.map(([v, t]) => el("option", { value: v, text: t })));
  const envInput = el("input", { id: "f-env", type: "number", min: "0", placeholder: "any",
    onchange: (ev) => { q.env = ev.target.value; q.offset = 0; load(); } });
  const prev = el("button", { id: "prev", text: "◀ prev", onclick: () => {
    q.offset = Math.max(0, q.offset - Number(q.limit)); load(); } });
  const next = el("button", { id: "next", text: "next ▶", onclick: () => {
    q.offset += Number(q.limit); load(); } });
  const plot = el("canvas", { id: "series" });
  main.replaceChildren(el("h2", { text: "Episodes" }),
    el("div", { class: "controls" },
      el("label", { text: "status" }), select("status", [["", "any"], ["terminated", "terminated"],
        ["truncated", "truncated"], ["running", "running"]]),
      el("label", { text: "kept" }), select("kept", [["", "any"], ["yes", "fully"],
        ["partial", "partly evicted"]]),
      el("label", { text: "env" }), envInput,
      el("label", { text: "per page" }), select("limit", [["50", "50"], ["10", "10"],
        ["200", "200"], ["500", "500"]]), prev, next, info),
    el("table", { class: "rows", id: "episodes" }, el("thead", {}, head), body),
    el("h3", { text: "return and length over episode" }), plot);
  COLUMNS.forEach(([key, label, sortable]) => head.append(el("th", {
    class: `${sortable ? "sortable" : ""} ${["episode", "env", "first_id", "last_id", "length",
      "return"].includes(key) ? "num" : ""}`, "data-key": key, text: label,
    onclick: sortable ? () => {
      q.order = q.sort === key && q.order === "asc" ? "desc" : "asc"; q.sort = key;
      q.offset = 0; load();
    } : null })));

  async function load() {
    const params = new URLSearchParams(Object.entries(q).filter(([, v]) => v !== ""));
    const [page, s] = await Promise.all([api(`/api/episodes?${params}`), api("/api/series")]);
    body.replaceChildren(...page.rows.map((r) => el("tr", {
      "data-episode": r.episode, onclick: () => { location.hash = `#/episode/${r.episode}`; } },
    el("td", { class: "num", text: r.episode }), el("td", { class: "num", text: r.env }),
    el("td", { class: "num", text: fmt(r.first_id) }), el("td", { class: "num", text: fmt(r.last_id) }),
    el("td", { class: "num", text: r.length }), el("td", { class: "num", text: fmt(r.return) }),
    el("td", { class: `status-${r.status}`, text: r.status }),
    el("td", { text: r.fully_kept ? "yes" : "partial" }))));
    head.querySelectorAll("th").forEach((th) => th.classList.toggle("sorted",
      th.dataset.key === q.sort));
    const last = Math.min(page.offset + page.rows.length, page.matching);
    info.textContent = `rows ${page.rows.length ? page.offset + 1 : 0}–${last} of ` +
      `${page.matching} matching (${page.total} episodes)`;
    info.dataset.total = page.total;
    prev.disabled = page.offset === 0; next.disabled = last >= page.matching;
    plotXY(plot, s.episode, [
      { name: s.bucket > 1 ? `return (mean of ${s.bucket})` : "return", color: "#7bd88f", y: s.return },
      { name: s.bucket > 1 ? `length (mean of ${s.bucket})` : "length", color: "#5aa9ff", y: s.length }],
    { height: 200, title: "ended episodes, by episode number" });
    rendered();
  }
  await load();
  return { refresh: load };
}

// -- episode player ----------------------------------------------------------------------
// One episode: the frame at the scrubber, the step taken from it, its stacked and n-step
// states, and a timeline of the episode's columns. `p.t` is the frame shown.
async function playerView(main, episode, t0) {
  const ep = await api(`/api/episode/${episode === null ? "first" : episode}`);
  if (ep.episode === null) { main.replaceChildren(el("p", { text: "No episode yet." })); return {}; }
  episode = ep.episode;
  const p = { ep, episode, n: ep.frames, t: 0, timer: null, fps: 15, shown: seriesShown(ep) };
  const ui = playerLayout(main, p);
  const set = (t) => {
    p.t = Math.min(Math.max(t, 0), p.n - 1);
    ui.scrub.value = String(p.t);
    ui.label.textContent = `t = ${p.t} / ${p.n - 1}`;
    if (ep.images) {
      ui.frame.dataset.want = String(p.t);
      ui.frame.src = `/api/episode/${episode}/frame/${p.t}.png`;
    }
    history.replaceState(null, "", `#/episode/${episode}?t=${p.t}`);
    stepFields(ui.fields, ep, p.t);
    stackImages(ui.stacks, ep, p.t);
    drawTimeline(ui.timeline, p, set);
  };
  const play = () => {
    ui.playBtn.textContent = "❚❚ pause";
    p.timer = setInterval(() => {
      if (ep.images && !ui.frame.complete) return; // keep frames and fields in step
      if (p.t >= p.n - 1) { stop(); return; }
      set(p.t + 1);
    }, 1000 / p.fps);
  };
  const stop = () => { clearInterval(p.timer); p.timer = null; ui.playBtn.textContent = "▶ play"; };
  const toggle = () => (p.timer ? stop() : play());
  ui.frame.addEventListener("load", () => { ui.frame.dataset.t = ui.frame.dataset.want; });
  ui.frame.addEventListener("error", () => showError(`frame ${ui.frame.dataset.want} failed to load`));
  ui.playBtn.addEventListener("click", toggle);
  ui.scrub.addEventListener("input", () => set(Number(ui.scrub.value)));
  ui.fps.addEventListener("change", (ev) => { p.fps = Number(ev.target.value);
    if (p.timer) { stop(); play(); } });
  ui.toggles.addEventListener("change", (ev) => {
    p.shown[ev.target.dataset.series] = ev.target.checked; drawTimeline(ui.timeline, p, set); });
  const keys = playerKeys(p, set, toggle);
  document.addEventListener("keydown", keys);
  set(t0);
  return { leave: () => { stop(); document.removeEventListener("keydown", keys); }, seek: set };
}

// Every per-step column of an episode as timeline series {key, name, color, y, bars}:
// reward, n-step return, discount, action (each component of a vector action),
// terminated, truncated, priority and each extra (wider extras as their mean).
function timelineSeries(ep) {
  const out = [{ key: "reward", name: "reward", color: "#7bd88f", y: ep.reward, bars: true }];
  if (ep.n_step > 1) out.push({ key: "n_step_return", name: `${ep.n_step}-step return`,
    color: "#a6e3a1", y: ep.n_step_return });
  out.push({ key: "discount", name: "discount", color: "#89dceb", y: ep.discount, zero: true });
  const width = ep.action.length && Array.isArray(ep.action[0]) ? ep.action[0].length : 0;
  if (!width) out.push({ key: "action", name: "action", color: "#5aa9ff", y: ep.action });
  else for (let i = 0; i < Math.min(width, 4); i += 1) out.push({ key: `action:${i}`,
    name: `action[${i}]`, color: "#5aa9ff", y: ep.action.map((a) => a[i]) });
  out.push({ key: "terminated", name: "terminated", color: "#ff6b6b", bars: true,
    y: ep.terminated.map(Number) });
  out.push({ key: "truncated", name: "truncated", color: "#ffb454", bars: true,
    y: ep.truncated.map(Number) });
  if (ep.priority.some((v) => v !== null)) out.push({ key: "priority", name: "priority",
    color: "#f9e2af", y: ep.priority });
  Object.entries(ep.extras).forEach(([k, e]) => out.push({ key: `extra:${k}`,
    name: `${k}${e.summary === "mean" ? " (mean)" : ""}`, color: "#c792ea", y: e.values }));
  return out;
}

function seriesShown(ep) {
  const shown = {};
  timelineSeries(ep).forEach((s) => { shown[s.key] = true; });
  return shown;
}

function playerLayout(main, p) {
  const { ep, episode, n } = p;
  const ui = {
    frame: el("img", { class: "frame", id: "frame", alt: "frame" }),
    scrub: el("input", { id: "scrub", type: "range", min: "0", max: String(n - 1), value: "0" }),
    playBtn: el("button", { id: "play", type: "button", text: "▶ play" }),
    label: el("span", { id: "tlabel", class: "dim" }), fields: el("div"),
    stacks: el("div", { id: "stacks" }), timeline: el("canvas", { id: "timeline" }),
    toggles: el("div", { class: "toggles" }),
    fps: el("select", { id: "fps" }, ...[5, 15, 30, 60].map((f) => el("option", {
      value: String(f), text: `${f} fps`, ...(f === 15 ? { selected: "" } : {}) }))),
  };
  Object.keys(p.shown).forEach((k) => ui.toggles.append(el("label", {}, el("input", {
    type: "checkbox", "data-series": k, ...(p.shown[k] ? { checked: "" } : {}) }), ` ${k}`)));
  const gif = el("span", {}, el("a", { id: "gif", href: `/api/episode/${episode}.gif?fps=15&scale=2`,
    download: `episode_${episode}.gif`, text: "export GIF" }), " · ",
  el("a", { id: "mp4", href: `/api/episode/${episode}.mp4?fps=15&scale=2`,
    download: `episode_${episode}.mp4`, text: "MP4" }));
  const status = ep.terminated.some(Boolean) ? "terminated" : ep.truncated.some(Boolean)
    ? "truncated" : "running or evicted end";
  main.replaceChildren(el("h2", { text: `Episode ${episode}` },
    el("span", { class: "dim", text: ` · env ${ep.env} · ${n} kept frames · ${status} · ` +
      `stack ${ep.frame_stack} · n-step ${ep.n_step} · ` }), gif),
  el("div", { class: "player", id: "player" },
    el("div", {}, ep.images ? ui.frame : el("p", { class: "dim", text:
      "Observations are not images: no frames to draw." }),
    el("div", { class: "controls" }, ui.playBtn, ui.fps, ui.label), ui.scrub,
    el("p", { class: "dim", text: "space: play/pause · ←/→: step · shift: ×10 · home/end" })),
    el("div", {}, card("step", ui.fields), card("stacked state → n-step next state", ui.stacks))),
  el("h3", { text: "timeline" }), ui.toggles, ui.timeline);
  return ui;
}

// The timeline: each shown series over episode position, a white line at the frame shown
// and each series' value there (also in canvas.dataset: t, cursorX and values, by name).
function drawTimeline(canvas, p, seek) {
  const { ep, shown } = p;
  const series = timelineSeries(ep).filter((s) => shown[s.key]);
  if (!series.length) { setupCanvas(canvas, 40); return; }
  const plot = plotXY(canvas, ep.pos, series, { height: 40 + 46 * series.length,
    title: "episode position", cursor: ep.pos[p.t], at: p.t });
  canvas.dataset.t = String(p.t);
  canvas.dataset.cursorX = String(plot.cursorX);
  canvas.dataset.values = JSON.stringify(Object.fromEntries(series.map((s) => [s.name, s.y[p.t]])));
  canvas.onclick = (ev) => {
    const pos = Math.round(plot.xOf(ev.offsetX));
    const i = ep.pos.findIndex((v) => v >= pos);
    seek(i < 0 ? p.n - 1 : i);
  };
}

function stepFields(box, ep, t) {
  const id = ep.ids[t];
  const extras = Object.entries(ep.extras).map(([k, e]) => [k, e.values[t]]);
  box.replaceChildren(kvTable([["frame", `${t} of ${ep.frames} (position ${ep.pos[t]})`],
    ["transition id", id < 0 ? "none (no step from this frame)" : id],
    ["action", id < 0 ? null : ep.action[t]], ["reward", id < 0 ? null : ep.reward[t]],
    ...(ep.n_step > 1 ? [[`${ep.n_step}-step return`, ep.n_step_return[t]]] : []),
    ["discount", ep.discount[t]], ["terminated", ep.terminated[t]], ["truncated", ep.truncated[t]],
    ["priority", ep.priority[t]], ["sampleable", ep.sampleable[t]], ...extras]));
}

function stackImages(box, ep, t) {
  if (!ep.images) return;
  const id = ep.ids[t];
  if (id < 0 || !ep.sampleable[t]) {
    box.replaceChildren(el("p", { class: "dim", text: id < 0 ? "No transition starts here."
      : "Not sampleable (too close to the ring's oldest frame or the writer's cursor)." }));
    return;
  }
  box.replaceChildren(el("div", { class: "dim", text: "obs (oldest … newest)" }),
    el("img", { class: "stack", id: "obs-stack", alt: "stacked state",
      src: `/api/transition/${id}/obs.png` }),
    el("div", { class: "dim", text: `next obs (${ep.n_step} step${ep.n_step > 1 ? "s" : ""} on)` }),
    el("img", { class: "stack", id: "next-stack", alt: "next state",
      src: `/api/transition/${id}/next.png` }));
}

function playerKeys(p, set, toggle) {
  return (ev) => {
    if (ev.target instanceof HTMLInputElement && ev.target.type !== "range") return;
    const step = ev.shiftKey ? 10 : 1;
    if (ev.key === " ") { ev.preventDefault(); toggle(); }
    else if (ev.key === "ArrowRight") { ev.preventDefault(); set(p.t + step); }
    else if (ev.key === "ArrowLeft") { ev.preventDefault(); set(p.t - step); }
    else if (ev.key === "Home") set(0);
    else if (ev.key === "End") set(p.n - 1);
  };
}

// -- sampling ----------------------------------------------------------------------------
async function samplingView(main) {
  const batchIn = el("input", { id: "batch", type: "number", min: "1", max: "64", value: "8" });
  const betaIn = el("input", { id: "beta", type: "number", step: "0.1", value: "0.4" });
  const seedIn = el("input", { id: "seed", type: "number", min: "0", value: "0" });
  const summary = el("div", { id: "sampling-summary" });
  const ring = el("canvas", { id: "ring" });
  const ages = el("canvas", { id: "ages" });
  const grid = el("div", { class: "batch", id: "batch-items" });
  const drawBtn = el("button", { id: "draw", type: "button", text: "draw a batch",
    onclick: () => { seedIn.value = String(Number(seedIn.value) + 1); load(); } });
  main.replaceChildren(el("h2", { text: "Sampling" }),
    el("div", { class: "controls" }, el("label", { text: "batch" }), batchIn,
      el("label", { text: "beta" }), betaIn, el("label", { text: "seed" }), seedIn, drawBtn),
    el("div", { class: "grid" }, card("sampler", summary),
      card("P(draw) over the ring (by id, oldest left)", ring),
      card("age of a drawn id (transitions), exact", ages)),
    el("h3", { text: "a freshly drawn batch" }), grid);

  async function load() {
    const params = new URLSearchParams({ batch: batchIn.value, beta: betaIn.value,
      seed: seedIn.value });
    const s = await api(`/api/sampling?${params}`);
    summary.replaceChildren(kvTable([["kind", s.sampler], ["sampleable", s.sampleable],
      ["effective sample size", s.effective_sample_size],
      ["ESS / sampleable", s.sampleable ? s.effective_sample_size / s.sampleable : null]]));
    if (!s.ring) { grid.replaceChildren(el("p", { text: "Nothing sampleable yet." })); return; }
    const series = [{ name: "P(draw) per id", color: "#5aa9ff", y: s.ring.probability,
      zero: true }];
    if (s.ring.max_priority) series.push({ name: "max priority", color: "#ffb454",
      y: s.ring.max_priority, zero: true });
    plotXY(ring, s.ring.first_id, series, { height: 180, title: "transition id" });
    histogram(ages, s.ages.edges, s.ages.probability, { title: "age (0 = newest)" });
    const b = s.batch;
    grid.replaceChildren(...b.ids.map((id, i) => el("div", { class: "item", "data-id": id },
      s.images ? el("img", { src: `/api/transition/${id}/obs.png`, alt: `transition ${id}` })
        : null,
      el("div", { text: `id ${id} · age ${b.age[i]} · IS weight ${fmt(b.weights[i], 3)}` }),
      el("div", { class: "dim", text: `action ${fmt(b.action[i])} · reward ${fmt(b.reward[i])}` +
        ` · discount ${fmt(b.discount[i], 3)}${b.terminated[i] ? " · terminated" : ""}` +
        `${b.truncated[i] ? " · truncated" : ""}` }))));
    rendered();
  }
  await load();
  return {};
}

// -- routing and live follow ---------------------------------------------------------------
function parseHash() {
  const [path, query] = (location.hash.slice(1) || "/overview").split("?");
  const parts = path.split("/").filter(Boolean);
  const params = new URLSearchParams(query || "");
  return { name: parts[0] || "overview", arg: parts[1] === undefined ? null : Number(parts[1]),
    t: Number(params.get("t") || 0) };
}

async function route() {
  if (state.view && state.view.leave) state.view.leave();
  const { name, arg, t } = parseHash();
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active",
    a.dataset.nav === name));
  const main = document.getElementById("main");
  delete document.body.dataset.ready;
  clearError();
  try {
    if (name === "episodes") state.view = await episodesView(main);
    else if (name === "episode") state.view = await playerView(main, arg, t);
    else if (name === "sampling") state.view = await samplingView(main);
    else state.view = await overviewView(main);
    state.viewName = name;
    ready(name);
  } catch (err) {
    state.view = null;
    showError(err.message);
    ready(`${name}:error`);
  }
}

async function poll() {
  const live = document.getElementById("live");
  try {
    const s = await api("/api/status");
    live.classList.toggle("stale", Boolean(s.follow_error));
    live.title = s.follow_error ? `following stopped at this generation: ${s.follow_error}`
      : "the page polls the store for new generations";
    document.getElementById("gen").textContent = s.generation;
    document.getElementById("counts").textContent =
      `${s.episodes} episodes · ${s.transitions} transitions · ${s.sampleable} sampleable`;
    const moved = state.generation !== null && s.generation !== state.generation;
    state.generation = s.generation;
    if (moved && state.view && state.view.refresh) await state.view.refresh();
  } catch (err) {
    live.classList.add("stale");
    live.title = err.message;
  }
}

window.addEventListener("hashchange", () => {
  const { name, arg } = parseHash();
  // the player rewrites its own hash on every step; only a new episode re-routes
  if (name === "episode" && state.viewName === "episode" && state.episodeArg === arg &&
      state.view && state.view.seek) { state.view.seek(parseHash().t); return; }
  state.episodeArg = arg;
  route();
});
document.getElementById("error-close").addEventListener("click", clearError);
state.episodeArg = parseHash().arg;
// The first poll waits for the first view: its requests go first to the server.
route().then(poll).then(() => { state.poll = setInterval(poll, POLL_MS); });

// gradwatch's run view: the runs, and one run's charts drawn as SVG from the daemon's JSON API
// (/api/v1/...). No library, nothing loaded from elsewhere. What the page shows is also kept in
// window.gradwatch (the browser test reads it).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const REFRESH_MS = 3000;
const MAX_POINTS = 1000;
const TOTAL_KEY = "grad/norm/total";

const state = {
  run: null,          // the run shown, or null on the list
  summary: null,      // its RunSummary
  alerts: [],         // its pending and firing alerts
  history: [],        // its alert state changes, oldest first (resolved alerts included)
  series: {},         // key -> points as numbers
  range: null,        // [from, to] steps when zoomed, else null (everything, live)
  finalParam: null,   // the norm gain charted with its slopes
  errors: [],
  renders: 0,
};
window.gradwatch = state;

// ---------------------------------------------------------------------------------------------
// Data

function num(x) {
  // The API's 64-bit integers come as strings, NaN and infinities as "NaN", "Infinity".
  return typeof x === "number" ? x : Number(x);
}

async function api(path) {
  const response = await fetch(path, {headers: {Accept: "application/json"}, cache: "no-store"});
  const body = await response.json().catch(() => ({error: `not JSON (HTTP ${response.status})`}));
  if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
  return body;
}

function runPath(run) {
  return "/api/v1/runs/" + encodeURIComponent(run);
}

async function loadSeries(run, key, range) {
  let q = `?key=${encodeURIComponent(key)}&max_points=${MAX_POINTS}`;
  if (range) q += `&from=${Math.max(0, Math.floor(range[0]))}&to=${Math.max(1, Math.ceil(range[1]))}`;
  const body = await api(runPath(run) + "/series" + q);
  return (body.points || []).map((p) => ({
    step: num(p.step),
    last: num(p.last_step),
    value: num(p.value),
    min: num(p.min),
    max: num(p.max),
    count: num(p.count),
  }));
}

function shortState(s) {
  return String(s || "").replace(/^(RUN_STATE_|ALERT_STATE_)/, "").toLowerCase();
}

// ---------------------------------------------------------------------------------------------
// Formatting

function fmt(v, digits = 4) {
  if (!Number.isFinite(v)) return String(v);
  if (v === 0 || Math.abs(v) < 1e-12) return "0";
  const a = Math.abs(v);
  if (a >= 1e6 || a < 1e-3) return v.toExponential(2);
  return Number(v.toPrecision(digits)).toLocaleString("en-US", {maximumFractionDigits: 6});
}

function fmtStep(v) {
  return Math.round(v).toLocaleString("en-US");
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svgEl(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function setStatus(text, error) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = error ? "status error" : "status";
}

// Round numbers for an axis between lo and hi, about `count` of them.
function ticks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
  return out;
}

// The what-if's path as segments: AdamW's norm map n(t+1)² = ((1 − ηλ)·n(t) + η·ρ)² + η²·|u⊥|²
// iterated from p.from_step to p.to_step (server/analytics/projection.h), one segment per piece.
function projectionSegments(p) {
  const eta = num(p.learning_rate), lambda = num(p.weight_decay), rho = num(p.radial), perp = num(p.orthogonal) || 0;
  const from = num(p.from_step), to = num(p.to_step);
  if (!(eta > 0) || !(to > from) || !Number.isFinite(rho)) return [];
  const pieces = 40, stride = Math.max(1, Math.floor((to - from) / pieces));
  const out = [];
  let n = num(p.norm_now), step = from;
  while (step < to) {
    const next = Math.min(to, step + stride);
    let m = n;
    for (let s = step; s < next; s += 1) {
      const along = (1 - eta * lambda) * m + eta * rho;
      m = Math.sqrt(along * along + eta * eta * perp * perp);
    }
    out.push({x0: step, y0: n, x1: next, y1: m, cls: "projection"});
    n = m;
    step = next;
  }
  out[out.length - 1].label = `with weight decay ${fmt(lambda)}: ~${fmt(n)} by step ${fmtStep(to)}`;
  out[out.length - 1].labelCls = "projection-label";
  return out;
}

// ---------------------------------------------------------------------------------------------
// Charts

const PAD = {left: 62, right: 16, top: 12, bottom: 28};

// A line chart of `points` (with min/max bands where a point covers several steps), horizontal
// lines, vertical event lines and straight segments; a drag selects a step range (onZoom).
function lineChart(options) {
  const width = 640, height = 280;
  const svg = svgEl("svg", {class: "chart", viewBox: `0 0 ${width} ${height}`, "data-chart": options.name});
  const pts = options.points.filter((p) => Number.isFinite(p.value));
  let x0 = options.xrange ? options.xrange[0] : Math.min(...pts.map((p) => p.step));
  let x1 = options.xrange ? options.xrange[1] : Math.max(...pts.map((p) => p.last));
  // A forecast may reach far beyond the data: the axis goes at most half the data's span further,
  // and a longer segment is cut there (its label still says where it ends); a path's pieces
  // beyond it are left out, their label carried by the last piece drawn.
  const xLimit = x1 + (x1 - x0) * 0.5;
  const segments = [];
  for (const s of options.segments || []) {
    if (options.xrange || !(s.x1 > xLimit && s.x1 > s.x0)) {
      segments.push(s);
    } else if (s.x0 < xLimit) {
      segments.push({...s, x1: xLimit, y1: s.y0 + (s.y1 - s.y0) * (xLimit - s.x0) / (s.x1 - s.x0)});
    } else if (s.label && segments.length && segments[segments.length - 1].cls === s.cls) {
      segments[segments.length - 1] = {...segments[segments.length - 1], label: s.label, labelCls: s.labelCls};
    }
  }
  if (!options.xrange) for (const s of segments) x1 = Math.max(x1, s.x1);
  if (!Number.isFinite(x0) || !Number.isFinite(x1)) {
    svg.append(svgEl("text", {x: width / 2, y: height / 2, "text-anchor": "middle", class: "label"}, "no data yet"));
    return svg;
  }
  if (x1 <= x0) x1 = x0 + 1;
  svg.dataset.x0 = String(x0);
  svg.dataset.x1 = String(x1);
  const ys = [];
  for (const p of pts) ys.push(p.min, p.max, p.value);
  for (const h of options.hlines || []) ys.push(h.y);
  for (const s of segments) ys.push(s.y0, s.y1);
  const finite = ys.filter(Number.isFinite);
  let y0 = Math.min(...finite), y1 = Math.max(...finite);
  if (!(y1 > y0)) { y0 -= 1; y1 += 1; }
  const margin = (y1 - y0) * 0.06;
  y0 -= margin; y1 += margin;
  const X = (v) => PAD.left + (v - x0) / (x1 - x0) * (width - PAD.left - PAD.right);
  const Y = (v) => height - PAD.bottom - (v - y0) / (y1 - y0) * (height - PAD.top - PAD.bottom);
  const clipId = `clip-${options.name}`;
  const defs = svgEl("defs");
  const clip = svgEl("clipPath", {id: clipId});
  clip.append(svgEl("rect", {x: PAD.left, y: PAD.top, width: width - PAD.left - PAD.right, height: height - PAD.top - PAD.bottom}));
  defs.append(clip);
  svg.append(defs);

  const axis = svgEl("g", {class: "axis"});
  for (const t of ticks(y0, y1, 5)) {
    axis.append(svgEl("line", {class: "grid-line", x1: PAD.left, x2: width - PAD.right, y1: Y(t), y2: Y(t)}));
    axis.append(svgEl("text", {x: PAD.left - 6, y: Y(t) + 4, "text-anchor": "end"}, fmt(t, 3)));
  }
  for (const t of ticks(x0, x1, 6)) {
    axis.append(svgEl("line", {x1: X(t), x2: X(t), y1: height - PAD.bottom, y2: height - PAD.bottom + 4}));
    axis.append(svgEl("text", {x: X(t), y: height - 8, "text-anchor": "middle"}, fmtStep(t)));
  }
  axis.append(svgEl("path", {d: `M${PAD.left},${PAD.top}V${height - PAD.bottom}H${width - PAD.right}`, fill: "none"}));
  svg.append(axis);

  const plot = svgEl("g", {"clip-path": `url(#${clipId})`});
  const banded = pts.filter((p) => p.count > 1 && p.max > p.min);
  if (banded.length > 0) {
    const upper = pts.map((p) => `${X(p.step)},${Y(p.max)}`);
    const lower = pts.slice().reverse().map((p) => `${X(p.step)},${Y(p.min)}`);
    plot.append(svgEl("polygon", {class: "band", points: upper.concat(lower).join(" ")}));
  }
  if (pts.length > 0) {
    const d = pts.map((p, i) => `${i ? "L" : "M"}${X(p.step).toFixed(1)},${Y(p.value).toFixed(1)}`).join("");
    plot.append(svgEl("path", {class: "series", d, "data-points": String(pts.length)}));
  }
  for (const s of segments) {
    plot.append(svgEl("line", {class: s.cls, x1: X(s.x0), y1: Y(s.y0), x2: X(s.x1), y2: Y(s.y1)}));
    if (s.label) plot.append(svgEl("text", {class: `label ${s.labelCls || "fit-label"}`, x: X(s.x1) - 4, y: Y(s.y1) + 16, "text-anchor": "end"}, s.label));
  }
  for (const h of options.hlines || []) {
    plot.append(svgEl("line", {class: h.cls, x1: PAD.left, x2: width - PAD.right, y1: Y(h.y), y2: Y(h.y)}));
    plot.append(svgEl("text", {class: `label ${h.cls}-label`, x: PAD.left + 6, y: Y(h.y) - 5}, h.label));
  }
  for (const v of options.vlines || []) {
    if (v.x < x0 || v.x > x1) continue;
    plot.append(svgEl("line", {class: "event", x1: X(v.x), x2: X(v.x), y1: PAD.top, y2: height - PAD.bottom}));
    plot.append(svgEl("text", {class: "label event-label", x: X(v.x) + 4, y: height - PAD.bottom - 6}, v.label));
  }
  svg.append(plot);

  if (options.onZoom) {
    const selection = svgEl("rect", {class: "selection", y: PAD.top, height: height - PAD.top - PAD.bottom, width: 0, visibility: "hidden"});
    svg.append(selection);
    const toStep = (event) => {
      const box = svg.getBoundingClientRect();
      const px = (event.clientX - box.left) / box.width * width;
      return x0 + (px - PAD.left) / (width - PAD.left - PAD.right) * (x1 - x0);
    };
    let start = null;
    svg.addEventListener("mousedown", (e) => { start = toStep(e); });
    svg.addEventListener("mousemove", (e) => {
      if (start === null) return;
      const a = X(Math.min(start, toStep(e))), b = X(Math.max(start, toStep(e)));
      selection.setAttribute("x", a);
      selection.setAttribute("width", Math.max(0, b - a));
      selection.setAttribute("visibility", "visible");
    });
    svg.addEventListener("mouseup", (e) => {
      if (start === null) return;
      const end = toStep(e);
      const lo = Math.max(x0, Math.min(start, end)), hi = Math.min(x1, Math.max(start, end));
      start = null;
      selection.setAttribute("visibility", "hidden");
      if (hi - lo >= 2) options.onZoom([lo, hi]);
    });
  }
  return svg;
}

// Horizontal bars: [{label, value, cls}] with values in [0, max].
function barChart(name, bars, format) {
  const width = 640, rowHeight = 20, labelWidth = 230;
  const height = Math.max(40, bars.length * rowHeight + 10);
  const svg = svgEl("svg", {class: "chart", viewBox: `0 0 ${width} ${height}`, "data-chart": name});
  svg.style.height = `${height}px`;
  const max = Math.max(...bars.map((b) => b.value).filter(Number.isFinite), 1e-12);
  bars.forEach((b, i) => {
    const y = 5 + i * rowHeight;
    const w = Number.isFinite(b.value) ? Math.max(1, b.value / max * (width - labelWidth - 90)) : 0;
    svg.append(svgEl("text", {class: "bar-label", x: labelWidth - 6, y: y + 13, "text-anchor": "end"}, b.label));
    svg.append(svgEl("rect", {class: `bar ${b.cls || ""}`, x: labelWidth, y: y + 3, width: w, height: rowHeight - 6, "data-value": String(b.value)}));
    svg.append(svgEl("text", {class: "bar-label", x: labelWidth + w + 6, y: y + 13}, format(b.value)));
  });
  return svg;
}

// The alert history as one row per alert instance: [{fingerprint, name, label, spans, last}],
// spans [{state: "pending"|"firing", from, to, open}] (open: still in that state, drawn to `end`).
function alertRows(history, end) {
  const rows = new Map();
  for (const e of history) {
    const a = e.alert || {};
    const step = num(a.step);
    let row = rows.get(a.fingerprint);
    if (!row) {
      // The labels that tell instances of one rule apart (the run's own labels are on all).
      const labels = a.labels || {};
      const which = ["param", "series", "group", "rank"].filter((k) => labels[k]).map((k) => labels[k]);
      row = {fingerprint: a.fingerprint, name: a.name, label: a.name + (which.length ? ` · ${which.join(", ")}` : ""), spans: [], last: null};
      rows.set(a.fingerprint, row);
    }
    const open = row.spans.length && row.spans[row.spans.length - 1].open ? row.spans[row.spans.length - 1] : null;
    if (open) { open.to = step; open.open = false; }
    const s = shortState(a.state);
    if (s === "pending" || s === "firing") row.spans.push({state: s, from: step, to: end, open: true});
    row.last = e;
  }
  for (const row of rows.values()) for (const span of row.spans) if (span.open) span.to = Math.max(end, span.from);
  return [...rows.values()];
}

// The alert timeline: a row per alert, pending (amber) and firing (red) spans on the step axis,
// resolutions as ticks, events as vertical lines.
function timelineChart(rows, x0, x1, events) {
  const width = 1240, rowHeight = 22, labelWidth = 330;
  const height = PAD.top + rows.length * rowHeight + PAD.bottom;
  const svg = svgEl("svg", {class: "chart", viewBox: `0 0 ${width} ${height}`, "data-chart": "alerts"});
  svg.style.height = `${height}px`;
  if (!(x1 > x0)) x1 = x0 + 1;
  const X = (v) => labelWidth + (Math.min(Math.max(v, x0), x1) - x0) / (x1 - x0) * (width - labelWidth - PAD.right);
  const axis = svgEl("g", {class: "axis"});
  for (const t of ticks(x0, x1, 5)) {
    axis.append(svgEl("line", {class: "grid-line", x1: X(t), x2: X(t), y1: PAD.top, y2: height - PAD.bottom}));
    axis.append(svgEl("text", {x: X(t), y: height - 8, "text-anchor": "middle"}, fmtStep(t)));
  }
  svg.append(axis);
  rows.forEach((row, i) => {
    const y = PAD.top + i * rowHeight;
    const label = svgEl("text", {class: "bar-label", x: labelWidth - 6, y: y + 15, "text-anchor": "end"},
      row.label.length > 52 ? row.label.slice(0, 51) + "…" : row.label);
    label.append(svgEl("title", {}, row.label));
    svg.append(label);
    for (const span of row.spans) {
      if (span.to < x0 || span.from > x1) continue;
      const rect = svgEl("rect", {class: `span timeline-${span.state}`, x: X(span.from), y: y + 4,
        width: Math.max(2, X(span.to) - X(span.from)), height: rowHeight - 8,
        "data-fingerprint": row.fingerprint, "data-state": span.state, "data-from": String(span.from), "data-to": String(span.to)});
      rect.append(svgEl("title", {}, `${row.label}: ${span.state} from step ${fmtStep(span.from)}` + (span.open ? " (now)" : ` to ${fmtStep(span.to)}`)));
      svg.append(rect);
    }
    const last = row.last;
    if (last && shortState(last.alert.state) === "resolved") {
      const at = num(last.alert.step);
      if (at >= x0 && at <= x1) svg.append(svgEl("line", {class: "resolved-tick", x1: X(at), x2: X(at), y1: y + 2, y2: y + rowHeight - 2}));
    }
  });
  for (const v of events || []) {
    if (v.x < x0 || v.x > x1) continue;
    svg.append(svgEl("line", {class: "event", x1: X(v.x), x2: X(v.x), y1: PAD.top, y2: height - PAD.bottom}));
  }
  return svg;
}

// The latest changes, newest first, with the summary and (for a page) the recommendation.
function historyList(history, limit) {
  const list = el("ol", {class: "history", id: "alert-history"});
  for (const e of history.slice(-limit).reverse()) {
    const a = e.alert || {};
    const s = shortState(a.state) || "inactive";
    const ann = a.annotations || {};
    const when = num(e.at) > 0 ? new Date(num(e.at) * 1000).toLocaleString() : "";
    list.append(el("li", {class: `change ${s}`, "data-state": s},
      el("span", {class: `state ${s}`}, s === "inactive" ? "cleared" : s),
      el("span", {}, ` ${a.name} at step ${fmtStep(num(a.step))}`),
      when ? el("span", {class: "muted"}, ` · ${when}`) : "",
      ann.summary ? el("div", {}, ann.summary) : "",
      s === "firing" && ann.recommendation ? el("div", {class: "recommendation"}, ann.recommendation) : ""));
  }
  return list;
}

// ---------------------------------------------------------------------------------------------
// Views

function panel(title, note, ...content) {
  return el("section", {class: "panel"}, el("h2", {}, title), el("p", {class: "note"}, note), ...content);
}

// A panel across the whole grid.
function widePanel(title, note, ...content) {
  const p = panel(title, note, ...content);
  p.classList.add("wide");
  return p;
}

async function showRuns() {
  document.getElementById("where").textContent = "runs";
  const [runs, alerts] = await Promise.all([api("/api/v1/runs"), api("/api/v1/alerts")]);
  const firing = {};
  for (const a of alerts.alerts || []) {
    const run = (a.labels || {}).run;
    if (run && shortState(a.state) === "firing") firing[run] = (firing[run] || 0) + 1;
  }
  const rows = (runs.runs || []).map((r) => el("tr", {"data-run": r.run_id},
    el("td", {}, el("a", {href: "/runs/" + encodeURIComponent(r.run_id)}, r.run_id)),
    el("td", {}, el("span", {class: `state ${shortState(r.state)}`}, shortState(r.state))),
    el("td", {class: "num"}, num(r.step_count) ? fmtStep(num(r.last_step)) : "–"),
    el("td", {class: "num"}, num(r.steps_per_second) ? fmt(num(r.steps_per_second), 3) : "–"),
    el("td", {class: "num"}, firing[r.run_id] ? el("span", {class: "state firing"}, `${firing[r.run_id]} firing`) : "0")));
  const table = el("table", {id: "runs"},
    el("thead", {}, el("tr", {}, el("th", {}, "run"), el("th", {}, "state"), el("th", {class: "num"}, "last step"),
      el("th", {class: "num"}, "steps/s"), el("th", {class: "num"}, "alerts"))),
    el("tbody", {}, ...rows));
  const main = document.getElementById("main");
  main.replaceChildren(rows.length ? table : el("p", {class: "muted"}, "No runs yet: stream steps to the daemon."));
  state.runs = runs.runs || [];
  state.renders += 1;
  document.body.dataset.renders = String(state.renders);
}

// The norm gain whose slopes the second chart shows: the final norm's, else the norm gain that
// grew most over its initial norm.
function pickFinalParam(summary) {
  const params = summary.params || [];
  const byRole = params.find((p) => p.role === "final_norm");
  if (byRole) return byRole.name;
  const analysis = summary.analysis || {};
  const amplified = (analysis.amplifications || []).slice().sort((a, b) => num(b.amplification) - num(a.amplification));
  if (amplified.length) return amplified[0].param;
  const grown = analysis.growth_without_decay || [];
  if (grown.length) return grown[0].param;
  const gain = params.find((p) => /NORM_GAIN/.test(p.kind));
  return gain ? gain.name : null;
}

// Least-squares line with the daemon's slope through the centroid of the points in [lo, hi).
function fittedSegment(points, lo, hi, slopePerKstep, cls, label) {
  const inside = points.filter((p) => p.step >= lo && p.step < hi && Number.isFinite(p.value));
  if (inside.length < 2 || !Number.isFinite(slopePerKstep)) return null;
  const mx = inside.reduce((s, p) => s + p.step, 0) / inside.length;
  const my = inside.reduce((s, p) => s + p.value, 0) / inside.length;
  const slope = slopePerKstep / 1000;
  const a = inside[0].step, b = inside[inside.length - 1].step;
  return {x0: a, y0: my + slope * (a - mx), x1: b, y1: my + slope * (b - mx), cls, label};
}

function renderRun() {
  const summary = state.summary;
  const info = summary.info || {};
  const analysis = summary.analysis || {};
  const events = (summary.events || []).map((e) => ({x: num(e.step), label: e.text}));
  const zoom = (range) => { state.range = range; refresh(); };
  const main = document.getElementById("main");
  const parts = [];

  const toolbar = el("div", {class: "toolbar"},
    el("span", {class: `state ${shortState(info.state)}`}, shortState(info.state)),
    el("span", {}, `step ${fmtStep(num(info.last_step))}`),
    el("span", {class: "muted"}, `${fmtStep(num(info.step_count))} steps held`),
    el("span", {class: "muted"}, state.range ? `zoomed to steps ${fmtStep(state.range[0])}–${fmtStep(state.range[1])}` : "live: drag across a chart to zoom"));
  if (state.range) {
    const reset = el("button", {id: "reset-zoom"}, "whole run");
    reset.addEventListener("click", () => { state.range = null; refresh(); });
    toolbar.append(reset);
  }
  parts.push(toolbar);

  // The diagnosis: the evidence every alert's words come from.
  const diagnosis = summary.diagnosis;
  if (diagnosis && diagnosis.text) {
    parts.push(el("div", {class: "diagnosis", id: "diagnosis", "data-cause": diagnosis.cause || "none"},
      el("div", {class: "title"}, `Diagnosis at step ${fmtStep(num(diagnosis.step))}`),
      el("div", {}, diagnosis.text),
      diagnosis.recommendation ? el("div", {class: "recommendation"}, diagnosis.recommendation) : "",
      diagnosis.page_held ? el("div", {class: "muted"}, `Pages held: ${diagnosis.page_held}`) : ""));
  }

  const alertBox = el("div", {class: "alerts", id: "alerts"});
  for (const a of state.alerts) {
    const ann = a.annotations || {};
    const s = shortState(a.state);
    alertBox.append(el("div", {class: `alert ${s}`, "data-fingerprint": a.fingerprint},
      el("div", {class: "title"}, `${a.name} — ${s} at step ${fmtStep(num(a.step))}, value ${fmt(num(a.value))}`),
      ann.summary ? el("div", {}, ann.summary) : "",
      ann.description ? el("div", {class: "muted"}, ann.description) : "",
      ann.recommendation ? el("div", {class: "recommendation"}, ann.recommendation) : ""));
  }
  if (state.alerts.length) parts.push(alertBox);

  const charts = el("div", {class: "grid"});
  // 1. The total grad norm, its threshold and the forecast of the crossing.
  const total = state.series[TOTAL_KEY] || [];
  const forecast = (analysis.forecasts || []).find((f) => f.key === TOTAL_KEY);
  const hlines = [], segments = [];
  let note = "Mean per point; the band is min–max where a point covers several steps.";
  if (forecast) {
    const threshold = num(forecast.threshold);
    hlines.push({y: threshold, cls: "threshold", label: `threshold ${fmt(threshold)}`});
    if (forecast.reachable && total.length) {
      const from = Math.max(...total.map((p) => p.last));
      segments.push({x0: num(info.last_step) || from, y0: num(forecast.current_value), x1: num(forecast.at_step), y1: threshold,
        cls: "forecast", label: `reaches it at step ${fmtStep(num(forecast.at_step))}`, labelCls: "forecast-label"});
      note += ` At the current slope (${fmt(num(forecast.slope_per_kstep))} per 1k steps) it reaches ${fmt(threshold)} in ${fmtStep(num(forecast.steps_to_threshold))} steps.`;
    } else {
      note += " Not rising: no crossing forecast.";
    }
  }
  charts.append(panel("Total grad norm", note,
    lineChart({name: "total", points: total, hlines, segments: state.range ? [] : segments, vlines: events, xrange: state.range, onZoom: zoom})));

  // 2. The final norm gain's norm, with the slopes before and after each event.
  if (state.finalParam) {
    const key = "params/norm/" + state.finalParam;
    const points = state.series[key] || [];
    const changes = (analysis.slope_changes || []).filter((c) => c.key === key).sort((a, b) => num(a.event_step) - num(b.event_step));
    const fits = [];
    const first = points.length ? points[0].step : 0, last = points.length ? points[points.length - 1].last + 1 : 0;
    changes.forEach((c, i) => {
      const at = num(c.event_step);
      const lo = i > 0 ? num(changes[i - 1].event_step) : first;
      const hi = i + 1 < changes.length ? num(changes[i + 1].event_step) : last;
      const before = fittedSegment(points, lo, at, num(c.before_per_kstep), "fit-before", `${fmt(num(c.before_per_kstep), 3)}/1k`);
      const after = fittedSegment(points, at, hi, num(c.after_per_kstep), "fit-after",
        `${fmt(num(c.after_per_kstep), 3)}/1k (×${fmt(num(c.ratio), 2)})`);
      if (before) fits.push(before);
      if (after) fits.push(after);
    });
    const amp = (analysis.amplifications || []).find((a) => a.param === state.finalParam);
    let finalNote = "Lines: the daemon's least-squares slopes before (green) and after (red) each event.";
    if (amp) finalNote += ` Now ${fmt(num(amp.norm))}, ${fmt(num(amp.amplification), 3)}× its initial norm ${fmt(num(amp.init_norm))}.`;
    // The what-if of weight decay on it, and the check of a weight-decay change made.
    const projection = (analysis.projections || []).find((p) => p.param === state.finalParam);
    if (projection && !state.range) {
      fits.push(...projectionSegments(projection));
      finalNote += ` Dotted: the what-if of weight decay ${fmt(num(projection.weight_decay))} from step ${fmtStep(num(projection.from_step))} (equilibrium ~${fmt(num(projection.equilibrium_norm))}).`;
    }
    for (const r of (analysis.remediations || []).filter((x) => x.param === state.finalParam)) {
      const at = num(r.step), now = num(r.at_step);
      if (!(now > at)) continue;
      fits.push({x0: at, y0: num(r.norm_at_step), x1: now, y1: num(r.projected_norm), cls: "remediation",
        label: `projected ~${fmt(num(r.projected_norm))}: ${r.verdict}`, labelCls: "projection-label"});
      fits.push({x0: at, y0: num(r.norm_at_step), x1: now, y1: num(r.unchanged_norm), cls: "unchanged",
        label: `without the change ~${fmt(num(r.unchanged_norm))}`, labelCls: "fit-label"});
      finalNote += ` Weight decay ${fmt(num(r.previous_weight_decay))} → ${fmt(num(r.weight_decay))} at step ${fmtStep(at)}: ${r.verdict}.`;
    }
    charts.append(panel(`Norm of ${state.finalParam}`, finalNote,
      lineChart({name: "final", points, segments: fits, vlines: events, xrange: state.range, onZoom: zoom})));
  }

  // 3. Where the grad norm comes from.
  const shares = (analysis.shares || []).slice(0, 16).map((s) => ({label: s.name + (s.is_group ? " (group)" : ""), value: num(s.share), cls: s.is_group ? "group" : ""}));
  charts.append(panel("Share of the squared total grad norm", "Largest first; groups and single parameters.",
    shares.length ? barChart("shares", shares, (v) => `${fmt(v * 100, 3)} %`) : el("p", {class: "muted"}, "No attribution yet.")));

  // 4. Norm gains over their initial norm.
  const amps = (analysis.amplifications || []).slice().sort((a, b) => num(b.amplification) - num(a.amplification)).slice(0, 16)
    .map((a) => ({label: a.param, value: num(a.amplification)}));
  charts.append(panel("Amplification (norm / initial norm)", "Norm gains without weight decay grow without bound.",
    amps.length ? barChart("amplification", amps, (v) => `${fmt(v, 3)}×`) : el("p", {class: "muted"}, "No norm gains with a known initial norm.")));

  // 5. The alert timeline: every alert of the run, resolved ones included.
  const lastStep = Math.max(num(info.last_step) || 0, ...total.map((p) => p.last));
  const firstStep = total.length ? total[0].step : 0;
  const rows = alertRows(state.history, lastStep);
  const [t0, t1] = state.range || [firstStep, lastStep];
  charts.append(widePanel("Alert timeline", "Pending (amber) and firing (red) on the step axis, a tick where an alert resolved; the latest changes below.",
    rows.length ? timelineChart(rows, t0, t1, events) : el("p", {class: "muted"}, "No alert in this run so far."),
    rows.length ? historyList(state.history, 12) : ""));

  parts.push(charts);
  main.replaceChildren(...parts);
  state.renders += 1;
  document.body.dataset.renders = String(state.renders);
}

async function showRun(run) {
  document.getElementById("where").textContent = run;
  document.title = `${run} — gradwatch`;
  const q = "?run=" + encodeURIComponent(run);
  const [summary, alerts, history] = await Promise.all([api(runPath(run)), api("/api/v1/alerts" + q), api("/api/v1/alerts/history" + q)]);
  state.summary = summary;
  state.alerts = alerts.alerts || [];
  state.history = history.entries || [];
  state.finalParam = pickFinalParam(summary);
  const keys = [TOTAL_KEY];
  if (state.finalParam) keys.push("params/norm/" + state.finalParam);
  const loaded = await Promise.all(keys.map((k) => loadSeries(run, k, state.range).catch(() => [])));
  keys.forEach((k, i) => { state.series[k] = loaded[i]; });
  renderRun();
}

let timer = null;

async function refresh() {
  clearTimeout(timer);
  try {
    if (state.run === null) await showRuns();
    else await showRun(state.run);
    setStatus(`updated ${new Date().toLocaleTimeString()}`, false);
  } catch (e) {
    state.errors.push(String(e.message || e));
    document.body.dataset.errors = String(state.errors.length);
    setStatus(`cannot reach the daemon: ${e.message || e}`, true);
    if (state.run !== null && state.summary === null) {
      document.getElementById("main").replaceChildren(el("p", {class: "muted"}, `No run ${state.run}: ${e.message || e}. `, el("a", {href: "/runs/"}, "All runs")));
    }
  }
  // Live while the view reaches the latest step; a zoomed range stays as it is.
  if (!state.range) timer = setTimeout(refresh, REFRESH_MS);
}

function start() {
  const path = window.location.pathname;
  const prefix = "/runs/";
  const rest = path.startsWith(prefix) ? path.slice(prefix.length) : "";
  state.run = rest ? decodeURIComponent(rest.replace(/\/$/, "")) : null;
  refresh();
}

document.addEventListener("DOMContentLoaded", start);

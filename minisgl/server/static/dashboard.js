// The minisgl dashboard: polls /dashboard/data once a second and plots the samples on canvases.
"use strict";

const POLL_MS = 1000;
const KEEP_S = 600; // the server keeps ten minutes of samples too

const COLORS = ["#4fa3ff", "#f5a623", "#7ed321", "#e85d75"];

const count = (v) => v.toFixed(0);

// `integer`: a count of things, whose axis shows whole numbers only; `cuda`: a note for CUDA;
// `speculative`: drawn only on a server that speculates; `hierarchical`: only with
// --enable-hierarchical-cache's tiers
const CHARTS = [
  { id: "requests", title: "Requests", series: [["running", "running"], ["waiting", "waiting"]],
    format: count, integer: true },
  { id: "kv", title: "KV pool use", series: [["kv_requests", "requests"], ["kv_cache", "prefix cache"]],
    format: pct, max: 1 },
  { id: "throughput", title: "Output tokens / s", series: [["output_tok_s", "output tok/s"]],
    format: count },
  { id: "ttft", title: "Time to first token (last 10 s)",
    series: [["ttft_p50", "p50"], ["ttft_p99", "p99"]], format: ms },
  { id: "itl", title: "Inter-token latency (last 10 s)",
    series: [["itl_p50", "p50"], ["itl_p99", "p99"]], format: ms },
  { id: "batch", title: "Batch composition (tokens forwarded / s)",
    series: [["prefill_tok_s", "prefill"], ["decode_tok_s", "decode"]], format: count },
  { id: "spec", title: "Speculative decoding: tokens per verify step (0: none verified)",
    series: [["spec_accept_length", "accept length"]], format: (v) => v.toFixed(1),
    speculative: true },
  { id: "hicache", title: "Hierarchical cache: prompt tokens read back / s",
    series: [["hicache_host_tok_s", "host memory"], ["hicache_disk_tok_s", "disk"]],
    format: count, hierarchical: true },
  { id: "busy", title: "Engine busy share", cuda: "CUDA: launch time only", series: [["busy", "busy"]],
    format: pct, max: 1 },
];

const STATS = [
  ["running", "Running", count],
  ["waiting", "Waiting", count],
  ["kv_requests", "KV in use", pct],
  ["cache_hit_rate", "Cache hit rate", pct],
  ["output_tok_s", "Output tok/s", count],
  ["busy", "Engine busy", pct],
];

// The smallest 4 x (1, 2, 2.5 or 5 x 10^k) at or above v: four gridlines at round values.
function niceTop(v) {
  if (!(v > 0)) return 4;
  const scale = Math.pow(10, Math.floor(Math.log10(v / 4)));
  for (const m of [1, 2, 2.5, 5, 10]) if (4 * m * scale >= v) return 4 * m * scale;
  return 40 * scale;
}
// The y axis's ticks, 0 to the top, for values up to `high`: four steps of niceTop, or for an
// integer series whole-number steps of 1, 2 or 5 x 10^k, at most four of them.
function ticks(spec, high) {
  if (!spec.integer) {
    const top = spec.max || niceTop(high);
    return [0, 1, 2, 3, 4].map((i) => (top * i) / 4);
  }
  high = Number.isFinite(high) && high > 0 ? high : 0;
  const step = wholeStep(high);
  return Array.from({ length: Math.max(1, Math.ceil(high / step)) + 1 }, (_, i) => i * step);
}
function wholeStep(high) {
  for (let scale = 1; ; scale *= 10) {
    for (const m of [1, 2, 5]) if (4 * m * scale >= high) return m * scale;
  }
}
// A tick's label: a count's format, with the decimals a fractional step needs (2.5, not 3).
function tickLabel(spec, v, step) {
  if (spec.format !== count || Number.isInteger(step)) return spec.format(v);
  return String(Number(v.toFixed(Math.max(0, 1 - Math.floor(Math.log10(step))))));
}
function pct(v) { return (100 * v).toFixed(v < 0.1 ? 1 : 0) + "%"; }
function ms(v) { return v < 1 ? (1000 * v).toFixed(v < 0.01 ? 1 : 0) + " ms" : v.toFixed(2) + " s"; }
function el(tag, attrs, text) {
  const node = document.createElement(tag);
  Object.entries(attrs || {}).forEach(([k, v]) => node.setAttribute(k, v));
  if (text !== undefined) node.textContent = text;
  return node;
}

class Chart {
  constructor(spec, parent) {
    this.spec = spec;
    const box = el("section", { class: "chart" });
    this.box = box;
    this.heading = el("h2", {}, spec.title);
    box.appendChild(this.heading);
    this.canvas = el("canvas", { id: "chart-" + spec.id, "data-points": "0" });
    box.appendChild(this.canvas);
    this.legend = el("div", { class: "legend" });
    this.labels = spec.series.map(([, label], i) => {
      const item = el("span");
      const swatch = el("i");
      swatch.style.background = COLORS[i];
      item.appendChild(swatch);
      const text = el("span", {}, label);
      item.appendChild(text);
      this.legend.appendChild(item);
      return text;
    });
    box.appendChild(this.legend);
    parent.appendChild(box);
  }

  draw(samples, windowS, now) {
    const canvas = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (width === 0) return;
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const shown = samples.filter((s) => s.t >= now - windowS);
    let high = 0;
    for (const s of shown) {
      for (const [key] of this.spec.series) if (s[key] !== null) high = Math.max(high, s[key]);
    }
    const values = ticks(this.spec, high), top = values[values.length - 1], step = values[1];
    const left = 48, bottom = height - 16, plotW = width - left - 4, plotH = bottom - 6;
    const x = (t) => left + plotW * (1 - (now - t) / windowS);
    const y = (v) => bottom - plotH * (v / top);
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#8a96a3";
    ctx.strokeStyle = "#2a3542";
    ctx.lineWidth = 1;
    for (const v of values) {
      const py = y(v);
      ctx.beginPath(); ctx.moveTo(left, py); ctx.lineTo(width - 4, py); ctx.stroke();
      ctx.textAlign = "right"; ctx.textBaseline = "middle";
      ctx.fillText(tickLabel(this.spec, v, step), left - 4, py);
    }
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (const frac of [0, 0.5, 1]) {
      const ago = windowS * (1 - frac);
      ctx.fillText(ago === 0 ? "now" : "-" + (ago >= 60 ? ago / 60 + " min" : ago + " s"),
                   Math.min(Math.max(left + plotW * frac, left + 14), width - 16), bottom + 3);
    }
    let points = 0;
    this.spec.series.forEach(([key, label], i) => {
      ctx.strokeStyle = COLORS[i];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let drawing = false;
      for (const s of shown) {
        if (s[key] === null) { drawing = false; continue; }
        if (drawing) ctx.lineTo(x(s.t), y(s[key])); else ctx.moveTo(x(s.t), y(s[key]));
        drawing = true;
        points++;
      }
      ctx.stroke();
      const last = shown.length ? shown[shown.length - 1][key] : null;
      this.labels[i].textContent = label + " " + (last === null || last === undefined ? "–" : this.spec.format(last));
    });
    canvas.dataset.points = String(points);
  }
}

const state = { samples: [], since: 0, key: sessionStorage.getItem("minisgl-key") || "" };
let charts = CHARTS.map((spec) => new Chart(spec, document.getElementById("charts")));
const statNodes = STATS.map(([key, label, format]) => {
  const box = el("div", { class: "stat" });
  box.appendChild(el("div", { class: "label" }, label));
  const value = el("div", { class: "value", id: "stat-" + key }, "–");
  box.appendChild(value);
  document.getElementById("stats").appendChild(box);
  return [key, value, format];
});

function windowSeconds() { return Number(document.getElementById("window").value); }

function render() {
  const samples = state.samples;
  const now = samples.length ? samples[samples.length - 1].t : Date.now() / 1000;
  charts.forEach((chart) => chart.draw(samples, windowSeconds(), now));
  const last = samples[samples.length - 1];
  if (last) {
    statNodes.forEach(([key, node, format]) => { node.textContent = format(last[key]); });
    document.getElementById("sampled").textContent =
      "last sample " + new Date(last.t * 1000).toLocaleTimeString();
  }
}

function showServer(server) {
  document.getElementById("model").textContent =
    server.model + " · minisgl " + server.version + " · " + server.device;
  charts = charts.filter((chart) => {
    if ((chart.spec.speculative && !server.speculation)
        || (chart.spec.hierarchical && !server.hierarchical_cache)) {
      chart.box.remove();
      return false;
    }
    return true;
  });
  charts.forEach((chart) => {
    const note = server.device === "cuda" && chart.spec.cuda;
    chart.heading.textContent = chart.spec.title + (note ? " (" + note + ")" : "");
  });
  const table = document.getElementById("args");
  table.replaceChildren();
  Object.entries(server.args).sort(([a], [b]) => a.localeCompare(b)).forEach(([name, value]) => {
    const row = el("tr");
    row.appendChild(el("td", {}, name));
    row.appendChild(el("td", {}, typeof value === "string" ? value : JSON.stringify(value)));
    table.appendChild(row);
  });
}

function setStatus(text, kind) {
  const node = document.getElementById("status");
  node.textContent = text;
  node.className = kind;
}

async function poll() {
  try {
    const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
    const response = await fetch("/dashboard/data?since=" + state.since, { headers, cache: "no-store" });
    if (response.status === 401) {
      document.getElementById("key-form").classList.add("shown");
      setStatus("API key needed", "down");
      return;
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    const body = await response.json();
    if (body.server) showServer(body.server);
    if (body.samples.length) {
      state.samples = state.samples.concat(body.samples);
      state.since = body.samples[body.samples.length - 1].t;
      const oldest = state.since - KEEP_S;
      state.samples = state.samples.filter((s) => s.t >= oldest);
    }
    setStatus("live", "live");
    render();
  } catch (error) {
    setStatus("disconnected: retrying", "down");
  } finally {
    if (!document.getElementById("key-form").classList.contains("shown")) setTimeout(poll, POLL_MS);
  }
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = document.getElementById("key").value;
  sessionStorage.setItem("minisgl-key", state.key);
  document.getElementById("key-form").classList.remove("shown");
  state.since = 0;
  poll();
});
document.getElementById("window").addEventListener("change", render);
window.addEventListener("resize", render);
poll();

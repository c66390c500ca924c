// The live dashboard: reads /metrics (Prometheus text) every second or two and plots what the server is doing.
//
// Rates are differences between two scrapes; percentiles are computed from the histograms' bucket counts gained
// over the last WINDOW seconds, the way Prometheus's histogram_quantile(rate(...)) does.

import { authHeaders, setupKeyField, setupTheme, showModelInfo } from "./common.js";

const $ = (id) => document.getElementById(id);
const WINDOW = 30; // seconds of histogram counts behind each percentile
const POINTS = 300; // points kept per plot (5 minutes at one scrape a second)
const COLORS = ["#e0703b", "#3b82c4", "#8a5cc2", "#2f9e6e", "#c2414b", "#b08a1e"];
const QUANTILES = [0.5, 0.9, 0.99];

// Each panel: its plot's series and how to read one point of each from a scrape (`now`, the one before `prev`,
// and `base`, the scrape WINDOW seconds ago); `smooth` panels headline the mean of their last few points.
const PANELS = [
  {
    id: "requests",
    title: "Requests per second",
    series: ["received", "failed"],
    point: ({ now, prev, dt }) => [rate(now, prev, dt, "tgi_request_count"), rate(now, prev, dt, "tgi_request_failure")],
    headline: ([received], now) => [fixed(received, 2), "req/s", `${sum(now, "tgi_request_success") ?? 0} served so far`],
    smooth: true,
  },
  {
    id: "tokens",
    title: "Tokens per second",
    series: ["generated", "prompt"],
    point: ({ now, prev, dt }) => [
      rate(now, prev, dt, "tgi_request_generated_tokens_sum"),
      rate(now, prev, dt, "tgi_request_input_length_sum"),
    ],
    headline: ([generated, prompt]) => [fixed(generated, 1), "generated tok/s", `prompt ${fixed(prompt, 1)} tok/s`],
    hint: "Counted as requests finish.",
    smooth: true,
  },
  {
    id: "load",
    title: "Queue and batch size",
    series: ["queued", "in batch"],
    point: ({ now }) => [sum(now, "tgi_queue_size"), sum(now, "tgi_batch_current_size")],
    headline: ([queued, batch]) => [`${batch ?? "–"}`, "in batch", `${queued ?? "–"} queued`],
  },
  {
    id: "kv",
    title: "KV cache use",
    series: ["blocks in use %"],
    point: ({ now }) => {
      const total = sum(now, "kettle_kv_blocks_total");
      return [total > 0 ? (100 * (total - sum(now, "kettle_kv_blocks_free"))) / total : null];
    },
    headline: ([used], now) => {
      const total = sum(now, "kettle_kv_blocks_total");
      const free = sum(now, "kettle_kv_blocks_free");
      return [fixed(used, used < 1 ? 2 : 1), "%", total ? `${total - free} of ${total} blocks` : ""];
    },
    floor: 1, // the axis reaches at least 1%: small requests in a large cache still show
  },
  {
    id: "ttft",
    title: "Time to first token",
    series: QUANTILES.map(label),
    point: ({ now, base }) => QUANTILES.map((q) => windowQuantile(q, now, base, "kettle_request_time_to_first_token")),
    headline: (values) => percentileHeadline(values, "s", (v) => fixed(v, 3)),
  },
  {
    id: "itl",
    title: "Time per output token",
    series: QUANTILES.map(label),
    point: ({ now, base }) =>
      QUANTILES.map((q) => milliseconds(windowQuantile(q, now, base, "tgi_request_mean_time_per_token_duration"))),
    headline: (values) => percentileHeadline(values, "ms", (v) => fixed(v, 1)),
    hint: "Each finished request's mean time per generated token.",
  },
  {
    id: "memory",
    title: "Resident memory per process",
    series: [], // one per `process` label, added as they appear
    point: ({ now }, panel) => panel.series.map((name) => mebibytes(byLabel(now, "kettle_process_resident_memory_bytes", "process", name))),
    headline: (values) => {
      const known = values.filter((v) => v !== null);
      return [known.length ? fixed(known.reduce((a, b) => a + b, 0), 0) : "–", "MiB in all", ""];
    },
  },
];

const times = [];
const history = []; // recent scrapes {t, metrics}, reaching back WINDOW seconds
let timer = null;

const keyField = setupKeyField($("key-row"), $("api-key"), { upFront: false });
setupTheme($("theme-toggle"), () => PANELS.forEach(build));
showModelInfo();
for (const panel of PANELS) {
  panel.data = panel.series.map(() => []);
  layout(panel);
  build(panel);
}
$("interval").addEventListener("change", schedule);
scrape();

function layout(panel) {
  const section = document.createElement("section");
  section.className = "panel";
  section.id = `panel-${panel.id}`;
  section.setAttribute("aria-labelledby", `title-${panel.id}`);
  section.innerHTML = `<h2 id="title-${panel.id}"></h2><output class="value"></output><p class="detail"></p><div class="plot"></div>`;
  section.querySelector("h2").textContent = panel.title;
  if (panel.hint) {
    const hint = document.createElement("p");
    hint.className = "hint";
    hint.textContent = panel.hint;
    section.append(hint);
  }
  $("panels").append(section);
  panel.element = section;
  new ResizeObserver(() => panel.plot?.setSize(size(panel))).observe(section.querySelector(".plot"));
}

function size(panel) {
  return { width: Math.max(200, panel.element.querySelector(".plot").clientWidth), height: 150 };
}

/** (Re)creates a panel's plot: at start, when a series appears, and when the theme changes. */
function build(panel) {
  panel.plot?.destroy();
  const css = getComputedStyle(document.documentElement);
  const fg = css.getPropertyValue("--muted").trim();
  const grid = css.getPropertyValue("--plot-grid").trim();
  const axis = { stroke: fg, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } };
  const options = {
    ...size(panel),
    series: [
      {},
      ...panel.series.map((name, i) => ({ label: name, stroke: COLORS[i % COLORS.length], width: 1.5, points: { show: false } })),
    ],
    // Clock times only (uPlot's default adds the date below, which a 5-minute window does not need); units are in
    // each panel's headline.
    axes: [{ ...axis, space: 70, size: 30, values: (u, splits) => splits.map(clock) }, { ...axis, size: 48 }],
    scales: { y: { range: (u, min, max) => [0, Math.max((max ?? 0) * 1.1, panel.floor ?? 0) || 1] } },
    legend: { show: true, live: false },
    cursor: { drag: { x: false, y: false } },
  };
  panel.plot = new uPlot(options, [times, ...panel.data], panel.element.querySelector(".plot"));
}

function schedule() {
  clearTimeout(timer);
  const every = Number($("interval").value);
  if (every > 0) timer = setTimeout(scrape, every);
}

async function scrape() {
  let text = null;
  try {
    const response = await fetch("/metrics", { headers: authHeaders(), cache: "no-store" });
    if (response.status === 401) {
      keyField.ask();
      throw new Error("/metrics needs the API key");
    }
    if (!response.ok) throw new Error(`/metrics answered ${response.status}`);
    text = await response.text();
  } catch (error) {
    $("updated").innerHTML = "";
    const message = document.createElement("span");
    message.className = "dash-error";
    message.textContent = `Cannot read metrics: ${error.message}`;
    $("updated").append(message);
  }
  if (text !== null) record(Date.now() / 1000, parse(text));
  else record(Date.now() / 1000, null); // a gap in every plot
  schedule();
}

function record(t, metrics) {
  const prev = history.at(-1);
  if (metrics) {
    history.push({ t, metrics });
    while (history.length > 2 && history[1].t <= t - WINDOW) history.shift();
    $("updated").textContent = `Updated ${new Date(t * 1000).toLocaleTimeString()}`;
  }
  times.push(t);
  const context = metrics && prev ? { now: metrics, prev: prev.metrics, dt: t - prev.t, base: history[0].metrics } : null;
  for (const panel of PANELS) {
    if (metrics && panel.id === "memory") addProcesses(panel, metrics);
    const values = context ? panel.point(context, panel) : panel.series.map(() => null);
    panel.data.forEach((column, i) => column.push(values[i] ?? null));
    if (times.length > POINTS) panel.data.forEach((column) => column.shift());
    if (context) headline(panel, panel.smooth ? panel.data.map(recent) : values, metrics);
  }
  if (times.length > POINTS) times.shift();
  for (const panel of PANELS) panel.plot.setData([times, ...panel.data]);
}

function addProcesses(panel, metrics) {
  const names = new Set((metrics.get("kettle_process_resident_memory_bytes") || []).map((s) => s.labels.process));
  const fresh = [...names].filter((name) => name && !panel.series.includes(name));
  if (!fresh.length) return;
  for (const name of fresh.sort()) {
    panel.series.push(name);
    panel.data.push(times.map(() => null)); // new series: nothing known before now
  }
  build(panel);
}

// Rates jump between scrapes; their headline is the mean of the last SMOOTH points.
const SMOOTH = 10;
function recent(column) {
  const known = column.slice(-SMOOTH).filter((v) => v !== null);
  return known.length ? known.reduce((a, b) => a + b, 0) / known.length : null;
}

function headline(panel, values, metrics) {
  const [value, unit, detail] = panel.headline(values, metrics);
  const output = panel.element.querySelector(".value");
  output.textContent = `${value} `;
  const small = document.createElement("small");
  small.textContent = unit;
  output.append(small);
  panel.element.querySelector(".detail").textContent = detail;
}

// Prometheus text format → Map(name → [{labels, value}]).
function parse(text) {
  const metrics = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, key, value] of (match[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[key] = value;
    if (!metrics.has(match[1])) metrics.set(match[1], []);
    metrics.get(match[1]).push({ labels, value: Number(match[3]) });
  }
  return metrics;
}

function sum(metrics, name) {
  const samples = metrics.get(name);
  if (!samples) return null;
  return samples.reduce((total, sample) => total + (Number.isFinite(sample.value) ? sample.value : 0), 0);
}

function byLabel(metrics, name, key, value) {
  const sample = (metrics.get(name) || []).find((s) => s.labels[key] === value);
  return sample && Number.isFinite(sample.value) ? sample.value : null;
}

function rate(now, prev, dt, name) {
  const a = sum(now, name) ?? 0;
  const b = sum(prev, name) ?? 0;
  // A counter that went down belongs to a restarted server: no rate for that interval.
  return dt > 0 && a >= b ? (a - b) / dt : null;
}

/** Cumulative bucket counts (le → count, summed over other labels) gained between `base` and `now`. */
function bucketDelta(now, base, name) {
  const counts = (metrics) => {
    const byLe = new Map();
    for (const sample of metrics.get(`${name}_bucket`) || []) {
      const le = sample.labels.le === "+Inf" ? Infinity : Number(sample.labels.le);
      byLe.set(le, (byLe.get(le) || 0) + sample.value);
    }
    return byLe;
  };
  const later = counts(now);
  const earlier = counts(base);
  return [...later.entries()].map(([le, count]) => [le, count - (earlier.get(le) || 0)]).sort((x, y) => x[0] - y[0]);
}

/** Prometheus's histogram_quantile: linear interpolation inside the bucket that holds the q-th observation. */
function windowQuantile(q, now, base, name) {
  const buckets = bucketDelta(now, base, name);
  const total = buckets.at(-1)?.[1] ?? 0;
  if (!(total > 0)) return null;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const [le, count] of buckets) {
    if (count >= rank) {
      if (le === Infinity) return lower; // beyond the last bound: the last bound is all that is known
      return count === below ? le : lower + ((le - lower) * (rank - below)) / (count - below);
    }
    lower = le;
    below = count;
  }
  return lower;
}

function percentileHeadline(values, unit, format) {
  const [p50, p90, p99] = values;
  if (p50 === null) return ["–", unit, "no finished requests in the last 30 s"];
  return [format(p50), `${unit} p50`, `p90 ${format(p90)} · p99 ${format(p99)}`];
}

function clock(seconds) {
  const time = new Date(seconds * 1000);
  return [time.getHours(), time.getMinutes(), time.getSeconds()].map((n) => String(n).padStart(2, "0")).join(":");
}

function label(q) {
  return `p${Math.round(q * 100)}`;
}

function fixed(value, digits) {
  return value === null || value === undefined ? "–" : value.toFixed(digits);
}

function milliseconds(seconds) {
  return seconds === null ? null : seconds * 1000;
}

function mebibytes(bytes) {
  return bytes === null ? null : bytes / 2 ** 20;
}

// The time view: charts of /api/series over a chosen window, live, and the requests of a window dragged on any
// chart, each openable in Perfetto. Uses traceUrl, perfettoUrl, cell and fmt from dashboard.js.
"use strict";

const SERIES_NAMES = [
  "requests", "output_tokens", "errors", "rejected", "failovers", "ttft_ms", "tpot_ms", "queue_depth", "running",
  "batch_size", "step_time_ms", "kv_blocks_used", "mfu", "mbu", "worker_tokens",
];
const MAX_LISTED = 200;
// Points per chart: a step of 2 s over 5 minutes, so that a request every other second reads as a rate.
const POINTS = 150;

function rows(read, name, stat) {
  return read.series.filter((s) => s.name === name && s.stat === stat);
}

function summed(read, name, stat, label) {
  // One line: the series' rows added up per step (over tenants, models or workers).
  const found = rows(read, name, stat);
  if (found.length === 0) return [];
  const values = read.times.map((_t, i) => {
    const present = found.map((s) => s.values[i]).filter((v) => v !== null);
    return present.length ? present.reduce((a, b) => a + b, 0) : null;
  });
  return [{ key: `${name}:${stat}`, label, values }];
}

function perLabel(read, name, stat, describe) {
  return rows(read, name, stat).map((s) => ({
    key: `${name}:${stat}:${Object.values(s.labels).join("|")}`,
    label: describe(s.labels),
    values: s.values,
  }));
}

const byModelTenant = (labels) => `${labels.model || "(no model)"} · ${labels.tenant || "(none)"}`;
const byWorker = (prefix) => (labels) => `${prefix}${labels.worker}`;
const percentiles = (name) => (read) => {
  const models = new Set(rows(read, name, "p50").map((s) => s.labels.model));
  const which = (stat) => (labels) => (models.size > 1 ? `${stat} ${labels.model}` : stat);
  return [...perLabel(read, name, "p50", which("p50")), ...perLabel(read, name, "p99", which("p99"))];
};

// Each chart: the series that feed it, and its lines. Names match the Grafana dashboard's panels.
const CHARTS = [
  ["requests", "Requests / s, by model and tenant", (r) => perLabel(r, "requests", "rate", byModelTenant)],
  ["tokens", "Output tokens / s, by model and tenant", (r) => perLabel(r, "output_tokens", "rate", byModelTenant)],
  ["ttft", "Time to first token (TTFT), ms", percentiles("ttft_ms")],
  ["tpot", "Time per output token (TPOT), ms", percentiles("tpot_ms")],
  ["queue", "Queue depth and requests in flight", (r) => [
    ...summed(r, "queue_depth", "max", "queue depth (max)"), ...summed(r, "running", "mean", "running"),
  ]],
  ["failures", "429s, errors and failovers / s", (r) => [
    ...summed(r, "rejected", "rate", "429s"), ...summed(r, "errors", "rate", "errors"),
    ...summed(r, "failovers", "rate", "failovers"),
  ]],
  ["throughput", "Generation throughput per worker, tokens / s", (r) =>
    perLabel(r, "worker_tokens", "rate", byWorker(""))],
  ["batch", "Batch size per worker", (r) => perLabel(r, "batch_size", "mean", byWorker(""))],
  ["step", "Step time per worker, ms", (r) => perLabel(r, "step_time_ms", "mean", byWorker(""))],
  ["kv", "KV blocks in use per worker", (r) => perLabel(r, "kv_blocks_used", "max", byWorker(""))],
  ["util", "MFU and MBU per worker", (r) => [
    ...perLabel(r, "mfu", "mean", byWorker("MFU ")), ...perLabel(r, "mbu", "mean", byWorker("MBU ")),
  ]],
];

const timeView = {
  charts: [],
  selection: null,
  read: null,
};

function windowSeconds() {
  return Number(document.getElementById("time-window").value);
}

async function refreshTimeView() {
  const error = document.getElementById("time-error");
  const to = Date.now() / 1000;
  const step = Math.max(1, Math.round(windowSeconds() / POINTS));
  const params = new URLSearchParams({ names: SERIES_NAMES.join(","), from: to - windowSeconds(), to, step });
  try {
    const read = await getJson(`/api/series?${params}`);
    timeView.read = read;
    const section = document.getElementById("time-view");
    Object.assign(section.dataset, { from: read.from, to: read.to, step: read.step_s });
    CHARTS.forEach(([, , lines], i) => timeView.charts[i].draw(read.times, read.step_s, lines(read)));
    document.getElementById("time-step").textContent = `(a point every ${read.step_s} s)`;
    error.hidden = true;
  } catch (err) {
    error.textContent = `Could not load the series: ${err.message}`;
    error.hidden = false;
  }
}

async function selectWindow(from, to) {
  timeView.selection = [from, to];
  for (const chart of timeView.charts) chart.showSelection(timeView.selection);
  const box = document.getElementById("window-requests");
  box.hidden = false;
  box.dataset.from = from;
  box.dataset.to = to;
  document.getElementById("window-label").textContent =
    `${clock(from, true)} – ${clock(to, true)}`;
  const whole = document.getElementById("window-perfetto");
  whole.href = perfettoUrl(traceUrl({ since: from, until: to }));
  const listed = await getJson(`/api/requests?${new URLSearchParams({ from, to, limit: MAX_LISTED })}`);
  const body = document.querySelector("#window-table tbody");
  body.replaceChildren();
  for (const r of listed.requests) {
    const row = body.insertRow();
    row.dataset.requestId = r.request_id;
    cell(row, r.request_id, "id");
    cell(row, new Date(r.start_unix_s * 1000).toLocaleTimeString(), "time");
    cell(row, r.tenant || "–", "tenant");
    const status = cell(row, r.status, `status ${r.status}`);
    if (r.error) status.title = r.error;
    cell(row, fmt(r.ttft_ms, 1), "num");
    cell(row, fmt(r.e2e_ms, 1), "num");
    cell(row, r.worker || "–");
    link(row.insertCell(), perfettoUrl(traceUrl({ request: r.request_id })), "Perfetto", { target: "_blank" });
  }
  const more = listed.total > listed.requests.length ? ` (first ${listed.requests.length})` : "";
  document.getElementById("window-count").textContent = `${listed.total} requests${more}`;
  const ids = new URLSearchParams(listed.requests.map((r) => ["request", r.request_id]));
  const these = document.getElementById("window-requests-perfetto");
  these.hidden = listed.requests.length === 0;
  these.href = perfettoUrl(`${location.origin}/api/trace?${ids}`);
}

function setupTimeView() {
  const grid = document.getElementById("charts");
  timeView.charts = CHARTS.map(([id, title]) => new LineChart(grid, id, title, selectWindow));
  document.getElementById("time-window").addEventListener("change", refreshTimeView);
  document.getElementById("window-clear").addEventListener("click", () => {
    timeView.selection = null;
    for (const chart of timeView.charts) chart.showSelection(null);
    document.getElementById("window-requests").hidden = true;
  });
  setInterval(() => {
    if (document.getElementById("auto-refresh").checked) refreshTimeView();
  }, REFRESH_MS);
  refreshTimeView();
}

setupTimeView();

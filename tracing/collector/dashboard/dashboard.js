// The dashboard page: renders /api/requests and /api/tenants, and builds trace links. No framework, no network
// beyond this service, so it works where the stack has no internet.
"use strict";

const STAGES = ["tokenize", "queue", "prefill", "decode", "detokenize"];
const REFRESH_MS = 5000;

function traceUrl(params) {
  return `${location.origin}/api/trace?${new URLSearchParams(params)}`;
}

function perfettoUrl(trace) {
  // Perfetto's deep link: the UI fetches `url` and opens it (see tracing/collector/perfetto_ui.py).
  return `/perfetto/#!/viewer?url=${encodeURIComponent(trace)}`;
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text ?? "–";
  if (className) td.className = className;
  return td;
}

function fmt(value, digits) {
  return value === null || value === undefined ? "–" : value.toFixed(digits);
}

function link(parent, href, text, attrs) {
  const a = document.createElement("a");
  a.href = href;
  a.textContent = text;
  Object.assign(a, attrs);
  parent.appendChild(a);
  return a;
}

function breakdown(td, request, maxE2e) {
  const bar = document.createElement("div");
  bar.className = "bar";
  const total = STAGES.reduce((sum, stage) => sum + (request.stages_ms[stage] || 0), 0);
  bar.style.width = `${maxE2e > 0 ? Math.max(2, (100 * total) / maxE2e) : 100}%`;
  for (const stage of STAGES) {
    const ms = request.stages_ms[stage] || 0;
    if (total <= 0 || ms <= 0) continue;
    const part = document.createElement("span");
    part.className = `stage ${stage}`;
    part.style.width = `${(100 * ms) / total}%`;
    part.title = `${stage} ${ms.toFixed(1)} ms`;
    bar.appendChild(part);
  }
  bar.title = STAGES.map((s) => `${s} ${(request.stages_ms[s] || 0).toFixed(1)} ms`).join("\n");
  td.appendChild(bar);
}

function render(requests) {
  const body = document.querySelector("#requests tbody");
  body.replaceChildren();
  const maxE2e = Math.max(0, ...requests.map((r) => r.e2e_ms ?? 0));
  for (const r of requests) {
    const row = body.insertRow();
    row.dataset.requestId = r.request_id;
    const id = cell(row, r.request_id, "id");
    id.title = `trace ${r.trace_id}\nservices: ${r.instances.join(", ")}`;
    cell(row, new Date(r.start_unix_s * 1000).toLocaleTimeString(), "time");
    cell(row, r.tenant || "–", "tenant");
    const status = cell(row, r.status, `status ${r.status}`);
    if (r.error) status.title = r.error;
    cell(row, r.input_tokens, "num");
    cell(row, r.output_tokens, "num");
    const ttft = cell(row, fmt(r.ttft_ms, 1), r.slo_outcome ? `num slo ${r.slo_outcome}` : "num");
    if (r.ttft_target_ms !== null) ttft.title = `TTFT target ${r.ttft_target_ms} ms: ${r.slo_outcome ?? "pending"}`;
    cell(row, fmt(r.tpot_ms, 2), "num");
    cell(row, fmt(r.e2e_ms, 1), "num");
    breakdown(row.insertCell(), r, maxE2e);
    cell(row, r.worker || "–");
    const links = row.insertCell();
    links.className = "links";
    const trace = traceUrl({ request: r.request_id });
    link(links, trace, ".pftrace", { download: `${r.request_id}.pftrace` });
    link(links, perfettoUrl(trace), "Perfetto", { target: "_blank", rel: "noopener" });
  }
  document.getElementById("count").textContent = `(${requests.length})`;
  document.getElementById("empty").hidden = requests.length > 0;
}

function renderTenants(summary) {
  const body = document.querySelector("#tenants tbody");
  body.replaceChildren();
  for (const t of summary.tenants) {
    const row = body.insertRow();
    row.dataset.tenant = t.tenant;
    cell(row, t.tenant || "(none)", "tenant");
    for (const n of [t.requests, t.running, t.errors, t.input_tokens, t.output_tokens]) cell(row, n, "num");
    cell(row, fmt(t.ttft_p50_ms, 1), "num");
    cell(row, fmt(t.ttft_p99_ms, 1), "num");
    for (const outcome of ["met", "missed", "refused"]) {
      cell(row, t.slo[outcome], t.slo[outcome] ? `num slo ${outcome}` : "num"); // colour only what happened
    }
    cell(row, t.slo_attainment === null ? "–" : `${(100 * t.slo_attainment).toFixed(1)}%`, "num attainment");
  }
  document.getElementById("tenant-count").textContent = `(last ${summary.requests} requests)`;
}

async function getJson(path) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`${response.status} ${await response.text()}`);
  return response.json();
}

async function refresh() {
  const error = document.getElementById("error");
  try {
    const [requests, tenants] = await Promise.all([getJson("/api/requests?limit=50"), getJson("/api/tenants")]);
    render(requests.requests);
    renderTenants(tenants);
    error.hidden = true;
  } catch (err) {
    error.textContent = `Could not load requests: ${err.message}`;
    error.hidden = false;
  }
}

function legend() {
  const box = document.getElementById("legend");
  for (const stage of STAGES) {
    const item = document.createElement("span");
    item.className = "legend-item";
    const swatch = document.createElement("span");
    swatch.className = `stage ${stage}`;
    item.append(swatch, stage === "detokenize" ? "detokenize / stream" : stage);
    box.appendChild(item);
  }
}

function unixSeconds(input) {
  // datetime-local is zone-less; the Date constructor reads it as local time, as the user typed it.
  return input.value ? String(new Date(input.value).getTime() / 1000) : null;
}

function setupWindowForm() {
  const form = document.getElementById("window-form");
  const since = document.getElementById("since");
  const local = new Date(Date.now() - 5 * 60 * 1000 - new Date().getTimezoneOffset() * 60 * 1000);
  since.value = local.toISOString().slice(0, 19);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const params = { since: unixSeconds(since) };
    const until = unixSeconds(document.getElementById("until"));
    if (until) params.until = until;
    const trace = traceUrl(params);
    if (event.submitter && event.submitter.value === "perfetto") {
      window.open(perfettoUrl(trace), "_blank", "noopener");
    } else {
      location.href = trace;
    }
  });
}

legend();
setupWindowForm();
document.getElementById("refresh").addEventListener("click", refresh);
setInterval(() => {
  if (document.getElementById("auto-refresh").checked) refresh();
}, REFRESH_MS);
refresh();

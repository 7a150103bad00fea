"""End-to-end tracing: a real stack with the tracing service, spans from every service, a .pftrace
read back by Perfetto's own trace processor, and the dashboard in a real (headless) browser.

Artifacts (git-ignored): artifacts/tracing/ holds the exported trace and screenshots of the
dashboard and of the local Perfetto UI with that trace open.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from shardline.cli.main import main as shardline_cli
from shardline.client import ShardlineClient
from shardline.stack.local_stack import LocalStack, StackConfig
from tests.e2e.conftest import log_dir, running_stack
from tests.e2e.http_client import get, post, sse
from tests.tracing.collector.headless_chromium import HeadlessChromium, find_chromium

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / "tracing"
PERFETTO_QUERY = REPO.parent / "shared" / "tools" / "perfetto_query" / "perfetto_query.py"
SERVICES = {"gateway", "tokenizer", "scheduler", "gpu_worker"}
COUNTERS = {"queue depth", "batch size rank 0", "KV blocks used rank 0", "tokens/s rank 0", "MFU rank 0", "MBU rank 0"}


@dataclass(slots=True)
class Served:
    """The requests sent to the traced stack, and the dashboard's rows for them."""

    dashboard: str
    # The HTTP completion sent with a traceparent, and that traceparent's trace id.
    traced_id: str
    trace_id: str
    request_ids: list[str]
    rows: dict[str, dict]


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory):
    # TP 3 (the default model's only split), so the trace shows a thread track per rank.
    config = StackConfig.on_free_ports(
        tracing=True,
        tp_size=3,
        data_dir=tmp_path_factory.mktemp("traced-data"),
        log_dir=log_dir(tmp_path_factory, "traced"),
        env={"KV_CACHE_BYTES": str(64 << 20)},
        batch_workers=1,
    )
    with running_stack(config) as stack:
        yield stack


def _rows(dashboard: str) -> dict[str, dict]:
    status, body = get(f"{dashboard}/api/requests")
    assert status == 200, body
    return {row["request_id"]: row for row in json.loads(body)["requests"]}


def _settled(row: dict) -> bool:
    instances = row["instances"]
    return "batch-0" in instances and any(i.startswith("worker-0") for i in instances) and row["status"] != "running"


@pytest.fixture(scope="module")
def served(traced_stack: LocalStack) -> Served:
    http = f"http://127.0.0.1:{traced_stack.config.http_port}"
    trace_id = secrets.token_hex(16)
    traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    status, body = post(
        f"{http}/v1/completions",
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        headers={"traceparent": traceparent},
    )
    assert status == 200, body
    events = list(
        sse(f"{http}/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 6})
    )
    with ShardlineClient(f"127.0.0.1:{traced_stack.config.grpc_port}") as client:
        done = client.generate("Once upon a time", max_tokens=6, seed=1)
    request_ids = [body["id"], events[0]["id"], done.request_id]
    dashboard = f"http://127.0.0.1:{traced_stack.config.dashboard_port}"
    # Services export in batches every 500 ms; the gateway's span ends last.
    deadline = time.monotonic() + 30
    while True:
        rows = _rows(dashboard)
        if all(rows.get(rid, {}).get("status") not in (None, "running") for rid in request_ids):
            break
        assert time.monotonic() < deadline, f"spans missing: {rows}"
        time.sleep(0.5)
    return Served(dashboard, body["id"], trace_id, request_ids, rows)


def test_a_client_traceparent_is_the_requests_trace(served: Served) -> None:
    assert served.rows[served.traced_id]["trace_id"] == served.trace_id
    others = {served.rows[rid]["trace_id"] for rid in served.request_ids[1:]}
    assert served.trace_id not in others and len(others) == 2


def test_a_batch_lines_request_is_in_the_batch_workers_trace(traced_stack: LocalStack) -> None:
    """A batch line's gateway request is a child of the batch worker's batch.line span: one trace."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{traced_stack.config.http_port}/v1", api_key="x")
    line = {"custom_id": "t", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}
    upload = client.files.create(file=("t.jsonl", json.dumps(line).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.25)
    dashboard = f"http://127.0.0.1:{traced_stack.config.dashboard_port}"
    # Each service exports every half second, so the batch, gateway and worker spans land in any order.
    while (row := _rows(dashboard).get(f"{batch.id}-0")) is None or not _settled(row):
        assert time.monotonic() < deadline, row
        time.sleep(0.25)
    assert any(i.startswith("gateway") for i in row["instances"]), row
    assert any(i.startswith("worker-0") for i in row["instances"]) and row["status"] == "length", row


def test_dashboard_api_lists_the_requests_with_latencies(served: Served) -> None:
    for rid in served.request_ids:
        row = served.rows[rid]
        assert row["status"] in ("stop", "length"), row
        assert row["model"] == "SmolLM2-135M-Instruct" and row["input_tokens"] > 0 and row["output_tokens"] > 1
        assert 0 < row["ttft_ms"] < row["e2e_ms"]
        assert 0 < row["tpot_ms"] < row["e2e_ms"]
        assert sum(row["stages_ms"].values()) == pytest.approx(row["e2e_ms"], abs=0.01)
        assert row["stages_ms"]["decode"] > 0 and row["stages_ms"]["prefill"] > 0
        assert row["worker"] == "worker-0"
        assert {"gateway-0", "scheduler", "worker-0"} <= set(row["instances"])
        assert any(instance.startswith("tokenizer") for instance in row["instances"])


def _series(dashboard: str, query: str) -> dict:
    status, body = get(f"{dashboard}/api/series?{query}")
    assert status == 200, body
    return json.loads(body)


def _total(read: dict, name: str, stat: str = "rate") -> float:
    """A counter's events over the window: its rates summed over labels and steps, times the step."""
    rows = [s for s in read["series"] if s["name"] == name and s["stat"] == stat]
    return sum(v for row in rows for v in row["values"] if v is not None) * read["step_s"]


def test_series_api_counts_the_served_requests_and_the_workers_steps(served: Served) -> None:
    start = min(row["start_unix_s"] for row in served.rows.values() if row["request_id"] in served.request_ids)
    names = "requests,output_tokens,ttft_ms,batch_size,kv_blocks_used,step_time_ms,worker_tokens,running"
    deadline = time.monotonic() + 30
    while True:  # the series are written with the spans the rows came from; allow the last exports in
        read = _series(served.dashboard, f"names={names}&from={start - 1}&to={time.time() + 1}&step=1")
        if _total(read, "requests") >= len(served.request_ids):
            break
        assert time.monotonic() < deadline, read
        time.sleep(0.5)
    output_tokens = sum(served.rows[rid]["output_tokens"] for rid in served.request_ids)
    assert _total(read, "output_tokens") >= output_tokens
    assert _total(read, "worker_tokens") >= output_tokens - len(served.request_ids)  # each first token is prefill's
    labels = {(s["name"], tuple(sorted(s["labels"].items()))) for s in read["series"]}
    assert ("requests", (("model", "SmolLM2-135M-Instruct"), ("tenant", "default"))) in labels, labels
    assert {("batch_size", (("worker", "worker-0"),)), ("kv_blocks_used", (("worker", "worker-0"),))} <= labels
    p99 = [v for s in read["series"] if s["name"] == "ttft_ms" and s["stat"] == "p99" for v in s["values"] if v]
    slowest = max(served.rows[rid]["ttft_ms"] for rid in served.request_ids)
    assert p99 and max(p99) >= slowest * 0.5, (p99, slowest)
    # The window's requests, as the time view lists them for Perfetto.
    status, body = get(f"{served.dashboard}/api/requests?from={start - 1}&to={time.time() + 1}&limit=1000")
    assert status == 200, body
    assert set(served.request_ids) <= {row["request_id"] for row in json.loads(body)["requests"]}


def _perfetto_rows(trace: Path, trace_id: str) -> list[dict]:
    # One query (each call boots the WebAssembly trace processor): kind, a, b, n rows.
    sql = f"""
    select 'category' as kind, category as a, '' as b, count(*) as n from slice
      where extract_arg(arg_set_id, 'debug.trace_id') = '{trace_id}' group by category
    union all
    select 'flow', o.category, i.category, count(*) from flow f
      join slice o on o.id = f.slice_out join slice i on i.id = f.slice_in group by 2, 3
    union all
    select 'step', p.name, t.name, count(*) from slice s join thread_track tt on s.track_id = tt.id
      join thread t using (utid) join process p using (upid) where s.name = 'engine_step' group by 2, 3
    union all
    select 'counter', ct.name, '', count(*) from counter c join counter_track ct on c.track_id = ct.id group by 2
    """
    run = subprocess.run(
        [sys.executable, str(PERFETTO_QUERY), str(trace), sql, "--json"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.skipif(
    shutil.which("node") is None or not PERFETTO_QUERY.is_file(), reason="needs node and shared/tools/perfetto_query"
)
def test_exported_trace_loads_in_perfetto(
    served: Served, traced_stack: LocalStack, capsys: pytest.CaptureFixture
) -> None:
    trace = ARTIFACTS / "request.pftrace"
    trace.parent.mkdir(parents=True, exist_ok=True)
    code = shardline_cli(
        ["trace", "export", "--request", served.traced_id, "-o", str(trace), "--redis-url", traced_stack.redis_url]
    )
    assert code == 0 and f"wrote {trace}" in capsys.readouterr().out
    rows = _perfetto_rows(trace, served.trace_id)
    by_kind: dict[str, dict[tuple[str, str], int]] = {}
    for row in rows:
        by_kind.setdefault(row["kind"], {})[row["a"], row["b"]] = row["n"]
    # Slices from all four services in the request's trace.
    assert {category for category, _ in by_kind["category"]} == SERVICES
    # One flow follows the request across services: gateway -> scheduler -> worker -> gateway.
    assert {("gateway", "scheduler"), ("scheduler", "gpu_worker"), ("gpu_worker", "gateway")} <= set(by_kind["flow"])
    # Per-step slices on the worker's thread track, at least one per generated token.
    # Per-step slices on each rank's thread track of the worker, at least one per generated token.
    ranks = {thread: n for (process, thread), n in by_kind["step"].items() if process == "worker-0"}
    assert {t for t in ranks if t.startswith("rank ")} == {"rank 0", "rank 1", "rank 2"}, ranks
    assert all(n >= served.rows[served.traced_id]["output_tokens"] for t, n in ranks.items() if t.startswith("rank"))
    assert COUNTERS <= {name for name, _ in by_kind["counter"]}


def _dashboard_rendered(request_ids: list[str]) -> str:
    # Each request's row, with at least one stage drawn in its latency bar.
    return " && ".join(f"!!document.querySelector('tr[data-request-id=\"{rid}\"] .bar .stage')" for rid in request_ids)


@pytest.mark.skipif(find_chromium() is None, reason="needs chromium (scripts/setup.sh installs it)")
def test_dashboard_in_headless_chromium(served: Served) -> None:
    async def drive() -> tuple[str, str, int]:
        async with HeadlessChromium(find_chromium(), window=(1500, 700)) as browser:
            await browser.navigate(f"{served.dashboard}/")
            await browser.wait_for(_dashboard_rendered(served.request_ids))
            # The tenants table: without a tenants file every request is the default tenant's.
            await browser.wait_for("!!document.querySelector('#tenants tr[data-tenant=\"default\"]')")
            await browser.screenshot(ARTIFACTS / "dashboard.png")
            dom = await browser.dom()
            tenant_requests = await browser.evaluate(
                "Number(document.querySelector('#tenants tr[data-tenant=\"default\"]').cells[1].textContent)"
            )
            link = await browser.evaluate(
                f"document.querySelector('tr[data-request-id=\"{served.traced_id}\"] a[target=_blank]').href"
            )
            # The row's Perfetto link opens the request's trace in the UI served by the tracing service.
            await browser.navigate(link)
            await browser.wait_for(f"document.body.innerText.includes('request {served.traced_id}')", timeout_s=90)
            await asyncio.sleep(1)  # let the timeline paint its slices
            await browser.screenshot(ARTIFACTS / "perfetto.png")
            return dom, link, tenant_requests

    dom, link, tenant_requests = asyncio.run(drive())
    (ARTIFACTS / "dashboard.html").write_text(dom)
    for rid in served.request_ids:
        assert f'data-request-id="{rid}"' in dom
    assert link.startswith(f"{served.dashboard}/perfetto/#!/viewer?url=")
    assert tenant_requests >= len(served.request_ids)
    assert '<td class="tenant">default</td>' in dom  # the requests table's tenant column
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    assert (ARTIFACTS / "perfetto.png").stat().st_size > 10_000

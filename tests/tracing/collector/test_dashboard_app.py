"""The dashboard's HTTP API, page and local Perfetto UI, served on a real port from a real Redis."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from tests.tracing.collector.fake_request import T0, SpanFactory
from tests.tracing.collector.served_request import engine_steps, served_request, to_otlp
from tests.tracing.run_async import run_async
from tracing import attributes as attr
from tracing.collector import perfetto_ui
from tracing.collector.dashboard_app import build_app
from tracing.collector.span_store import SpanStore

TRACE_A, TRACE_B = "a1" * 16, "b2" * 16


@asynccontextmanager
async def dashboard(store: SpanStore) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    runner = web.AppRunner(build_app(store))
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as session:
            yield f"http://{host}:{port}", session
    finally:
        await runner.cleanup()


async def stored(redis_url: str) -> SpanStore:
    f = SpanFactory()
    spans = served_request(f, "r-a", TRACE_A) + served_request(f, "r-b", TRACE_B, at_ms=50) + engine_steps(f, 0, 160)
    store = SpanStore.from_url(redis_url, max_spans=10_000, max_age_s=1e12)
    await store.add(to_otlp(spans))
    return store


def track_names(data: bytes) -> set[str]:
    trace = pb.Trace.FromString(data)
    descriptors = [p.track_descriptor for p in trace.packet if p.HasField("track_descriptor")]
    return {d.name or d.process.process_name or d.thread.thread_name for d in descriptors}


@run_async
async def test_requests_api_lists_newest_first_with_latencies(redis_url: str) -> None:
    store = await stored(redis_url)
    try:
        async with dashboard(store) as (base, http):
            async with http.get(f"{base}/api/requests") as response:
                assert response.status == 200
                rows = (await response.json())["requests"]
            async with http.get(f"{base}/api/requests?limit=1") as response:
                limited = (await response.json())["requests"]
            for bad in ("0", "x", "100000"):
                async with http.get(f"{base}/api/requests?limit={bad}") as response:
                    assert response.status == 400
    finally:
        await store.close()
    assert [row["request_id"] for row in rows] == ["r-b", "r-a"]
    assert [row["request_id"] for row in limited] == ["r-b"]
    row_a = rows[1]
    assert (row_a["trace_id"], row_a["status"], row_a["output_tokens"]) == (TRACE_A, "stop", 8)
    assert (row_a["ttft_ms"], row_a["tpot_ms"], row_a["e2e_ms"]) == (22.0, 10.0, 100.0)
    assert row_a["stages_ms"] == {"tokenize": 3.0, "queue": 7.0, "prefill": 10.0, "decode": 70.0, "detokenize": 10.0}


@run_async
async def test_tenants_api_sums_the_stored_requests_by_tenant(redis_url: str) -> None:
    f = SpanFactory()
    slo = {attr.TTFT_TARGET_MS: 50.0}
    spans = (
        served_request(f, "r-1", "01" * 16, **{attr.TENANT: "acme", attr.SLO_OUTCOME: "met"}, **slo)
        + served_request(f, "r-2", "02" * 16, at_ms=50, **{attr.TENANT: "acme", attr.SLO_OUTCOME: "missed"}, **slo)
        + served_request(f, "r-3", "03" * 16, at_ms=100, output_tokens=4, **{attr.TENANT: "free"})
    )
    store = SpanStore.from_url(redis_url, max_spans=10_000, max_age_s=1e12)
    await store.add(to_otlp(spans))
    try:
        async with dashboard(store) as (base, http):
            async with http.get(f"{base}/api/tenants") as response:
                assert response.status == 200
                body = await response.json()
            async with http.get(f"{base}/api/tenants?limit=1") as response:
                newest = await response.json()
            async with http.get(f"{base}/api/tenants?limit=0") as response:
                assert response.status == 400
            async with http.get(f"{base}/api/requests?limit=1") as response:
                (row,) = (await response.json())["requests"]
    finally:
        await store.close()
    assert body["requests"] == 3
    acme, free = body["tenants"]
    assert (acme["tenant"], acme["requests"], acme["output_tokens"], acme["ttft_p50_ms"]) == ("acme", 2, 16, 22.0)
    assert (acme["slo"], acme["slo_attainment"]) == ({"met": 1, "missed": 1, "refused": 0}, 0.5)
    assert (free["tenant"], free["requests"], free["output_tokens"], free["slo_attainment"]) == ("free", 1, 4, None)
    assert [(t["tenant"], t["requests"]) for t in newest["tenants"]] == [("free", 1)]
    assert (row["tenant"], row["ttft_target_ms"], row["slo_outcome"]) == ("free", None, None)


@run_async
async def test_trace_api_selects_by_request_last_and_window(redis_url: str) -> None:
    store = await stored(redis_url)
    try:
        async with dashboard(store) as (base, http):
            async with http.get(f"{base}/api/trace?request=r-a") as response:
                assert response.status == 200
                assert response.headers["Content-Disposition"] == 'attachment; filename="r-a.pftrace"'
                one = await response.read()
            async with http.get(f"{base}/api/trace?last=2") as response:
                both = await response.read()
            since, until = T0 / 1e9, (T0 + 60_000_000) / 1e9
            async with http.get(f"{base}/api/trace", params={"since": str(since), "until": str(until)}) as response:
                assert response.status == 200
                window = await response.read()
            statuses = {}
            for query in ("", "?request=absent", "?since=soon", "?last=0", "?since=2&until=1"):
                async with http.get(f"{base}/api/trace{query}") as response:
                    statuses[query] = response.status
    finally:
        await store.close()
    names = track_names(one)
    assert "request r-a" in names and "request r-b" not in names
    # The engine steps in r-a's time span come with it, as counter tracks on the worker.
    assert {"worker-0", "batch size rank 0", "KV blocks used rank 0", "MFU rank 0", "MBU rank 0"} <= names
    assert {"request r-a", "request r-b"} <= track_names(both)
    # 0-60 ms: r-b began at 50 ms, so its first spans are in the window too.
    assert {"request r-a", "request r-b"} <= track_names(window)
    assert statuses == {"": 400, "?request=absent": 404, "?since=soon": 400, "?last=0": 400, "?since=2&until=1": 400}


@run_async
async def test_page_static_and_local_perfetto_ui(redis_url: str) -> None:
    store = await stored(redis_url)
    wasm = next(perfetto_ui.bundle_dir().glob("v*/trace_processor.wasm"))
    wasm_path = wasm.relative_to(perfetto_ui.bundle_dir()).as_posix()
    try:
        async with dashboard(store) as (base, http):
            async with http.get(f"{base}/") as response:
                page = await response.text()
            async with http.get(f"{base}/static/dashboard.js") as response:
                script = await response.text()
            async with http.get(f"{base}/perfetto", allow_redirects=False) as response:
                assert (response.status, response.headers["Location"]) == (302, "/perfetto/")
            async with http.get(f"{base}/perfetto/") as response:
                ui = await response.text()
            async with http.head(f"{base}/perfetto/{wasm_path}") as response:
                assert response.status == 200 and response.content_type == "application/wasm"
            async with http.get(f"{base}/health") as response:
                assert response.status == 200
    finally:
        await store.close()
    assert "<title>Shardline traces</title>" in page and "/static/dashboard.js" in page
    assert "/api/requests" in script and "/api/tenants" in script and "/perfetto/#!/viewer?url=" in script
    assert "<title>Perfetto UI</title>" in ui


@run_async
async def test_unreachable_store_answers_503() -> None:
    store = SpanStore.from_url("redis://127.0.0.1:1/0", max_spans=10, max_age_s=10)
    try:
        async with dashboard(store) as (base, http):
            async with http.get(f"{base}/api/requests") as response:
                assert response.status == 503
            async with http.get(f"{base}/health") as response:
                assert response.status == 503
    finally:
        await store.close()


def test_viewer_url_quotes_the_trace_url() -> None:
    url = perfetto_ui.viewer_url("http://h:1/perfetto/", "http://h:1/api/trace?request=r-a&x=1")
    assert url == "http://h:1/perfetto/#!/viewer?url=http%3A%2F%2Fh%3A1%2Fapi%2Ftrace%3Frequest%3Dr-a%26x%3D1"

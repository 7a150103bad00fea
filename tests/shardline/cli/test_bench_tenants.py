"""`shardline bench --tenants`: the workload file, Jain's index, and the per-tenant report of a real run.

The runs go through a tiny aiohttp server that plays an OpenAI server serving one request at a
time in arrival order (a FIFO queue), so who is backlogged and who gets what is known.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from shardline.bench.fairness import backlog_fraction, jain_index, served_in
from shardline.bench.metrics import RequestTiming
from shardline.bench.openai_backend import OpenAIBackend
from shardline.bench.tenant_load import SentRequest, arrival_offsets, run_tenants
from shardline.bench.tenant_report import workload_report
from shardline.bench.tenant_workload import TenantSpec, WorkloadError, load_workload, parse_workload
from shardline.cli.main import main

TOKEN_S = 0.005  # the fake server's time per output token


def _event(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


async def _serve():
    """A server that streams one request at a time, in arrival order; keeps each request's key and body.
    Key sk-throttled is answered 429; key sk-late has its stream end in a 503's error event."""
    seen: list[dict] = []
    turn = asyncio.Lock()  # FIFO: asyncio's lock wakes its waiters in the order they came

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        auth = request.headers.get("Authorization")
        seen.append({"auth": auth, "body": body})
        if auth == "Bearer sk-throttled":
            return web.json_response({"error": {"message": "over the limit", "type": "rate_limit_error"}}, status=429)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async with turn:
            if auth == "Bearer sk-late":
                error = {"message": "ttft target unmet", "type": "service_unavailable_error"}
                await response.write(_event({"error": error}))
                return response
            for i in range(body["max_tokens"]):
                await asyncio.sleep(TOKEN_S)
                await response.write(_event({"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}))
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await response.write(_event({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", seen


def _run(raw: dict):
    workload = parse_workload(raw)

    async def go():
        runner, url, seen = await _serve()
        backends = {t.name: OpenAIBackend(url, "m", t.api_key, extra_body=t.body_fields()) for t in workload.tenants}
        try:
            run = await run_tenants(workload, {n: b.send for n, b in backends.items()}, vocab_size=1000)
        finally:
            for backend in backends.values():
                await backend.close()
            await runner.cleanup()
        return workload_report(workload, run), run, seen

    return asyncio.run(go())


def test_a_fifo_server_gives_closed_loops_service_in_proportion_to_their_concurrency():
    # Heavy keeps 3 requests in flight, light 2: both always have one waiting in the server's queue,
    # so both are backlogged, and a FIFO serves them 3:2, whose Jain's index is 25/26.
    raw = {
        "duration_s": 1.6,
        "measure_from_s": 0.3,
        "drain": False,
        "tenants": {
            "heavy": {"api_key": "sk-heavy", "concurrency": 3, "input_len": 5, "output_len": 4},
            "light": {
                "api_key": "sk-light",
                "concurrency": 2,
                "input_len": 5,
                "output_len": 4,
                "priority": 1,
                "ttft_target_ms": 500,
                "refuse_late": True,
                "slo": {"ttft_ms": 60_000},
            },
        },
    }
    report, run, seen = _run(raw)
    heavy, light = report["tenants"]["heavy"], report["tenants"]["light"]
    assert report["backlogged"] == ["heavy", "light"]
    assert heavy["backlog_fraction"] > 0.95 and light["backlog_fraction"] > 0.95
    assert heavy["weighted_tokens"] / light["weighted_tokens"] == pytest.approx(1.5, rel=0.2)
    assert report["jain_index"] == pytest.approx(jain_index([3, 2]), abs=0.03)
    # Weighted tokens are the VTC's: input + 2 x output, input counted once its first token came.
    assert heavy["weighted_tokens"] == pytest.approx(heavy["input_tokens"] + 2 * heavy["output_tokens"])
    # The run stopped at duration_s: what was still in flight was cancelled, not failed.
    assert heavy["failed"] == light["failed"] == 0
    assert 0 < heavy["cancelled_at_end"] <= 3 and 0 < light["cancelled_at_end"] <= 2
    assert heavy["sent"] == heavy["completed"] + heavy["cancelled_at_end"]
    assert report["wall_s"] == pytest.approx(1.6, abs=0.3)
    # Each tenant's key, and its extension fields on its own requests only.
    bodies = {s["auth"]: s["body"] for s in seen}
    assert set(bodies) == {"Bearer sk-heavy", "Bearer sk-light"}
    assert {k: bodies["Bearer sk-light"][k] for k in ("priority", "ttft_target_ms", "refuse_late")} == {
        "priority": 1,
        "ttft_target_ms": 500,
        "refuse_late": True,
    }
    assert "priority" not in bodies["Bearer sk-heavy"]
    # Light's SLO holds for every request it completed; heavy gave none, so it has no goodput.
    assert light["slo_attainment"] == 1.0 and light["goodput"] == pytest.approx(light["completed"] / run.wall_s)
    assert heavy["goodput"] is None and heavy["ttft_ms"]["p50"] > 0 and heavy["tpot_ms"]["p99"] >= TOKEN_S * 1000


def test_refusals_are_counted_by_status_and_are_not_goodput():
    slo = {"ttft_ms": 60_000, "tpot_ms": 1000}
    raw = {
        "duration_s": 0.3,
        "tenants": {
            "throttled": {"api_key": "sk-throttled", "request_rate": 20, "input_len": 3, "output_len": 2, "slo": slo},
            "late": {"api_key": "sk-late", "request_rate": 20, "input_len": 3, "output_len": 2, "slo": slo},
            "served": {"api_key": "sk-ok", "concurrency": 1, "max_requests": 3, "input_len": 3, "output_len": 2},
            "strict": {
                "api_key": "sk-ok2",
                "concurrency": 1,
                "max_requests": 2,
                "output_len": 3,
                "slo": {"tpot_ms": 1},
            },
        },
    }
    report, _, _ = _run(raw)
    throttled, late = report["tenants"]["throttled"], report["tenants"]["late"]
    assert throttled["sent"] == throttled["throttled_429"] == throttled["failed"] > 0
    assert late["sent"] == late["refused_503"] == late["failed"] > 0
    assert throttled["good"] == late["good"] == 0 and throttled["slo_attainment"] == 0.0
    assert "RuntimeError: HTTP 429: over the limit" in throttled["errors"]
    assert report["tenants"]["served"]["completed"] == 3 and report["tenants"]["served"]["input_tokens"] == 9
    strict = report["tenants"]["strict"]  # a TPOT of 5 ms against an SLO of 1 ms
    assert strict["completed"] == 2 and strict["slo_attainment"] == 0.0
    assert report["good"] == 0 and report["goodput"] == 0.0


def test_the_cli_prints_the_report_as_json(tmp_path, capsys):
    ready, stop = threading.Event(), threading.Event()
    box: dict = {}

    def serve() -> None:  # the CLI runs its own event loop: the server gets one of its own
        async def go():
            runner, box["url"], _ = await _serve()
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)
            await runner.cleanup()

        asyncio.run(go())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(10)
    workload = tmp_path / "w.yaml"
    workload.write_text("duration_s: 0.4\ntenants:\n  a: {api_key: k, concurrency: 2, input_len: 4, output_len: 3}\n")
    try:
        flags = ["--backend", "openai", "--base-url", box["url"], "--model", "m", "--tenants", str(workload)]
        assert main(["bench", *flags, "--json", "--out", str(tmp_path / "out.json")]) == 0
    finally:
        stop.set()
        thread.join(10)
    out = json.loads(capsys.readouterr().out)  # stdout is the JSON alone: the table went to stderr
    a = out["report"]["tenants"]["a"]
    detail = json.loads((tmp_path / "out.json").read_text())["detail"]["a"]
    # Drained: every request sent completed, but only the tokens that came within duration_s count.
    assert a["completed"] == a["sent"] == len(detail) > 0 and all(len(d["chunk_ms"]) == 3 for d in detail)
    in_window = sum(d["sent_at_ms"] + c <= 400 for d in detail for c in d["chunk_ms"])
    assert a["output_tokens"] == in_window < 3 * a["completed"]


@pytest.mark.parametrize(
    "values, index",
    [([5, 5, 5, 5], 1.0), ([1, 0, 0, 0], 0.25), ([3, 2], 25 / 26), ([10, 1, 1, 1], 169 / 412), ([0, 0], 1.0)],
)
def test_jains_index_of_known_vectors(values, index):
    assert jain_index(values) == pytest.approx(index)


def test_jains_index_refuses_nothing_and_negatives():
    with pytest.raises(ValueError, match="no values"):
        jain_index([])
    with pytest.raises(ValueError, match="negative"):
        jain_index([1, -1])


def _sent(at: float, chunks: list[float], output_len: int = 0, **kw) -> SentRequest:
    return SentRequest(at, RequestTiming(input_len=10, chunk_times=chunks, output_len=output_len), **kw)


def test_backlog_is_the_union_of_waits_for_a_first_token_within_the_window():
    requests = [
        _sent(0.0, [2.0]),  # waits 0-2
        _sent(1.0, [2.0]),  # waits 1-3 (its chunks count from its send): overlaps the first
        _sent(5.0, [], ended_at=6.0),  # refused at 6: waited 5-6
        _sent(8.0, [], cancelled=True, ended_at=12.0),  # cut off by the benchmark: waited to the window's end
    ]
    assert backlog_fraction(requests, 0.0, 10.0) == pytest.approx((3 + 1 + 2) / 10)
    assert backlog_fraction(requests, 2.5, 4.5) == pytest.approx(0.5 / 2)


def test_service_counts_what_arrived_within_the_window():
    # Two chunks of a 4-token output (usage said 4): each chunk carried 2 tokens.
    service = served_in([_sent(1.0, [0.5, 1.5], output_len=4), _sent(0.0, [0.2])], 1.2, 3.0)
    assert (service.input_tokens, service.output_tokens) == (10, 4.0)
    assert served_in([_sent(1.0, [0.5, 1.5], output_len=4)], 2.0, 3.0).output_tokens == 2.0
    assert service.weighted == 10 + 2 * 4.0


def test_open_loop_arrivals_fill_the_duration_at_the_rate_and_stop_at_the_cap():
    tenant = TenantSpec("a", request_rate=50.0, burstiness=0.5)
    offsets = arrival_offsets(tenant, 100.0, seed=1)
    assert all(0 <= t < 100 for t in offsets) and offsets == sorted(offsets)
    assert len(offsets) == pytest.approx(5000, rel=0.1)
    assert arrival_offsets(tenant, 100.0, seed=1) == offsets  # the same seed, the same load
    assert len(arrival_offsets(TenantSpec("a", request_rate=50.0, max_requests=7), 100.0, 1)) == 7


def test_a_workload_file_parses_into_tenants(tmp_path, monkeypatch):
    monkeypatch.setenv("KEY_B", "sk-b")
    path = tmp_path / "w.yaml"
    path.write_text(
        "duration_s: 30\nmeasure_from_s: 5\ndrain: false\ntenants:\n"
        "  a: {api_key: sk-a, weight: 2, request_rate: 4, burstiness: 0.5, input_len: 64, output_len: 32,\n"
        "      priority: 0, ttft_target_ms: 1000, refuse_late: true, slo: {ttft_ms: 1000, tpot_ms: 200}}\n"
        "  b: {api_key_env: KEY_B, concurrency: 3}\n"
    )
    w = load_workload(path)
    assert (w.duration_s, w.measure_from_s, w.window_s, w.drain, w.backlog_threshold) == (30, 5, 25, False, 0.9)
    a, b = w.tenants
    assert (a.name, a.api_key, a.weight, a.request_rate, a.burstiness, a.input_len) == ("a", "sk-a", 2, 4, 0.5, 64)
    assert a.body_fields() == {"priority": 0, "ttft_target_ms": 1000, "refuse_late": True}
    assert (a.slos.ttft_ms, a.slos.tpot_ms) == (1000, 200)
    assert (b.api_key, b.concurrency, b.request_rate, b.body_fields(), b.slos.given()) == ("sk-b", 3, None, {}, False)
    as_json = tmp_path / "w.json"
    as_json.write_text(json.dumps({"tenants": {"c": {"request_rate": 1}}}))
    assert load_workload(as_json).tenants[0].request_rate == 1


@pytest.mark.parametrize(
    "text, error",
    [
        ("tenants: {a: {request_rate: 0}}", "tenants.a.request_rate: Input should be greater than 0"),
        ("tenants: {a: {}}", "tenants.a.request_rate: give request_rate (open loop) or concurrency"),
        ("tenants: {a: {request_rate: 1, concurrency: 2}}", "tenants.a.request_rate: give request_rate"),
        ("tenants: {a: {concurrency: 2, burstiness: 0.5}}", "tenants.a.burstiness: shapes request_rate's"),
        ("tenants: {a: {concurrency: 1, refuse_late: true}}", "tenants.a.refuse_late: needs ttft_target_ms"),
        ("tenants: {a: {concurrency: 1, rate: 3}}", "tenants.a.rate: is not a field of a workload"),
        ("tenants: {a: {concurrency: 1, slo: {ttft: 3}}}", "tenants.a.slo.ttft: is not a field"),
        ("tenants: {a: {concurrency: 1, input_len: 0}}", "tenants.a.input_len: Input should be greater than"),
        ("tenants: {a: {concurrency: 1, api_key_env: NO_SUCH_VAR_X}}", "tenants.a.api_key_env: $NO_SUCH_VAR_X"),
        ("tenants: {}", "tenants: needs at least one tenant"),
        ("duration_s: 5", "tenants: is required"),
        ("duration_s: 5\nmeasure_from_s: 5\ntenants: {a: {concurrency: 1}}", "measure_from_s: must be below"),
        ("- a\n- b", "must be a mapping with a 'tenants' mapping"),
        ("tenants: {a: [1", "not YAML or JSON (line 1)"),
    ],
)
def test_a_bad_workload_file_is_one_line_naming_the_field(tmp_path, text, error):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    with pytest.raises(WorkloadError) as exc:
        load_workload(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: ") and error in message and "\n" not in message


def test_a_missing_workload_file_and_a_bad_one_on_the_cli_exit_2_in_one_line(tmp_path, capsys):
    assert main(["bench", "--backend", "openai", "--launch", "--tenants", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: No such file or directory" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: {a: {concurrency: 1, ttft_target_ms: 100}}")
    assert main(["bench", "--url", "h:1", "--tenants", str(bad)]) == 2
    assert "ttft_target_ms and refuse_late go over HTTP only" in capsys.readouterr().out

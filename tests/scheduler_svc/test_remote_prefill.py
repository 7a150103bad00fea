"""Disaggregated prefill through a real scheduler: the decision on the dispatch span, the prefill
worker asked before the decode worker gets the request, and every failure falling back.

The workers are scripted (tests/scheduler_svc/scripted_worker.py): what is checked here is the
scheduler's side. tests/e2e/test_disaggregated_prefill.py runs the real workers and model."""

import asyncio

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from scheduler_svc import prefill_decision as pd
from shardline.proto import common_pb2, sampling_pb2
from tests.scheduler_svc.harness import cluster, eventually
from tests.scheduler_svc.scripted_worker import token_at
from tests.tracing.run_async import run_async
from tracing import attributes as attr

MIN_TOKENS = 16  # four blocks of the scripted workers' 4 tokens
LONG = list(range(100, 140))  # 40 tokens: ten blocks
SHORT = list(range(200, 208))


def _tracing() -> tuple[InMemorySpanExporter, TracerProvider]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider


def _span(exporter: InMemorySpanExporter, name: str, request_id: str):
    [span] = [
        s for s in exporter.get_finished_spans() if s.name == name and s.attributes.get(attr.REQUEST_ID) == request_id
    ]
    return span


@run_async
async def test_a_long_prompt_is_prefilled_remotely_and_a_short_or_cached_one_stays_local(redis_url: str) -> None:
    exporter, provider = _tracing()
    async with cluster(redis_url, tracer=provider.get_tracer("test"), remote_prefill_min_tokens=MIN_TOKENS) as c:
        gateway = await c.gateway("gw-1")
        prefill = await c.worker("p0", role="prefill")
        decode = await c.worker("d0", role="decode")
        prefill.kv.delay_s = 0.5  # a prefill takes time: the request must wait for it

        await c.submit("long", prompt=LONG)
        await eventually(lambda: len(prefill.kv.prefills) == 1, what="the remote prefill")
        [asked] = prefill.kv.prefills
        assert (list(asked.token_ids), asked.target_address, asked.request_id) == (LONG, decode.info.address, "long")
        assert not decode.received  # not before its blocks are in
        await gateway.wait_finished("long")
        assert [r.request_id for r in decode.received] == ["long"]
        assert gateway.tokens("long") == [token_at(7, i) for i in range(5)]

        await c.submit("short", prompt=SHORT)
        await c.submit("again", prompt=LONG + [1, 2])  # its 40 first tokens went to d0 already
        await gateway.wait_finished("short", "again")
        assert len(prefill.kv.prefills) == 1
        assert not prefill.received  # a prefill worker never runs a request

    dispatch = {rid: _span(exporter, "dispatch", rid).attributes for rid in ("long", "short", "again")}
    assert (dispatch["long"][attr.PREFILL_REMOTE], dispatch["long"][attr.PREFILL_REASON]) == (True, pd.REMOTE)
    assert (dispatch["short"][attr.PREFILL_REMOTE], dispatch["short"][attr.PREFILL_REASON]) == (False, pd.SHORT_PROMPT)
    assert dispatch["again"][attr.PREFILL_REASON] == pd.CACHED_ON_DECODE_WORKER
    assert (dispatch["long"][attr.PREFILL_CACHED_TOKENS], dispatch["again"][attr.PREFILL_CACHED_TOKENS]) == (0, 40)
    remote = _span(exporter, "remote_prefill", "long")
    assert remote.attributes[attr.PREFILL_OUTCOME] == "remote"
    assert remote.attributes[attr.PREFILL_WORKER_ID] == "p0"
    assert remote.attributes[attr.PREFILL_BLOCKS_SENT] == 10
    assert remote.parent.span_id == _span(exporter, "dispatch", "long").context.span_id


@run_async
async def test_a_failing_prefill_worker_falls_back_to_the_next_then_to_the_decode_worker(redis_url: str) -> None:
    exporter, provider = _tracing()
    async with cluster(redis_url, tracer=provider.get_tracer("test"), remote_prefill_min_tokens=MIN_TOKENS) as c:
        gateway = await c.gateway("gw-1")
        bad = await c.worker("p0", role="prefill")
        good = await c.worker("p1", role="prefill")
        decode = await c.worker("d0", role="decode")
        bad.kv.refuse = True
        await c.submit("next", prompt=LONG)
        await gateway.wait_finished("next")
        assert [len(bad.kv.prefills), len(good.kv.prefills)] == [1, 1]

        good.kv.refuse = True
        await c.submit("local", prompt=LONG[::-1], seed=9)
        await gateway.wait_finished("local")
        # Every prefill worker failed: the decode worker prefilled it, with the same tokens.
        assert gateway.tokens("local") == [token_at(9, i) for i in range(5)]
        assert gateway.final("local").finish_reason == gateway.final("next").finish_reason
        assert [r.request_id for r in decode.received] == ["next", "local"]
        info = await c.info("local")
        assert (info.worker_id, info.attempt) == ("d0", 1)  # not a failed attempt

    first, second = _span(exporter, "remote_prefill", "next"), _span(exporter, "remote_prefill", "local")
    assert (first.attributes[attr.PREFILL_OUTCOME], first.attributes[attr.PREFILL_WORKER_ID]) == ("remote", "p1")
    assert [(e.name, e.attributes[attr.PREFILL_WORKER_ID]) for e in first.events] == [("prefill_failed", "p0")]
    assert "UNAVAILABLE" in first.events[0].attributes[attr.PREFILL_ERROR]
    assert second.attributes[attr.PREFILL_OUTCOME] == "fallback_local"
    assert [e.attributes[attr.PREFILL_WORKER_ID] for e in second.events] == ["p0", "p1"]


@run_async
async def test_a_dead_prefill_worker_costs_the_request_nothing(redis_url: str) -> None:
    async with cluster(redis_url, remote_prefill_min_tokens=MIN_TOKENS) as c:
        gateway = await c.gateway("gw-1")
        prefill = await c.worker("p0", role="prefill")
        decode = await c.worker("d0", role="decode")
        prefill.kv.delay_s = 30.0
        await c.submit("r", prompt=LONG)
        await eventually(lambda: bool(prefill.kv.prefills), what="the remote prefill")
        await prefill.kill()  # mid-prefill: its rpc breaks
        await gateway.wait_finished("r")
        assert gateway.tokens("r") == [token_at(7, i) for i in range(5)]
        assert [r.request_id for r in decode.received] == ["r"]


@run_async
async def test_a_request_cancelled_during_its_remote_prefill_ends_at_once(redis_url: str) -> None:
    async with cluster(redis_url, remote_prefill_min_tokens=MIN_TOKENS) as c:
        gateway = await c.gateway("gw-1")
        prefill = await c.worker("p0", role="prefill")
        decode = await c.worker("d0", role="decode")
        prefill.kv.delay_s = 30.0
        await c.submit("r", prompt=LONG)
        await eventually(lambda: bool(prefill.kv.prefills), what="the remote prefill")
        response = await c.stub.Cancel(common_pb2.CancelRequest(request_id="r"))
        assert response.status == sampling_pb2.REQUEST_STATUS_CANCELLED
        await gateway.wait_finished("r", timeout_s=5)  # not after the prefill's 30 s
        assert gateway.final("r").finish_reason == sampling_pb2.FINISH_REASON_ABORT
        assert (await c.info("r")).status == sampling_pb2.REQUEST_STATUS_CANCELLED
        await asyncio.sleep(0.2)
        assert not decode.received
        assert c.server.dispatcher.running() == 0


@run_async
async def test_a_worker_of_role_both_prefills_its_own_requests(redis_url: str) -> None:
    exporter, provider = _tracing()
    async with cluster(redis_url, tracer=provider.get_tracer("test"), remote_prefill_min_tokens=MIN_TOKENS) as c:
        gateway = await c.gateway("gw-1")
        prefill = await c.worker("p0", role="prefill")
        await c.worker("w0")  # registered without a role: both
        await c.submit("r", prompt=LONG)
        await gateway.wait_finished("r")
        assert not prefill.kv.prefills
    assert _span(exporter, "dispatch", "r").attributes[attr.PREFILL_REASON] == pd.AGGREGATED_WORKER

"""Every answer the gateway gives to a generation request, over HTTP and gRPC, is one request span with its
status: the 429s of its admission gate (here, the hold after a full queue) and a 400 from a body it could
not parse included. The collector's series, fed those spans through a real Redis, count each client request
once with its outcome; a request of several choices refused before they all started counts once, as a 429."""

from __future__ import annotations

import time

import aiohttp
import grpc
import pytest
import redis
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from gateway.tenancy.tenants import DEFAULT_TENANT
from shardline.proto import generation_pb2
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import MODEL, Script
from tracing import attributes as attr
from tracing.collector.series_store import Resolution, SeriesStore
from tracing.collector.span_store import SpanStore


async def _post(stack: Stack, body: dict | str) -> int:
    async with aiohttp.ClientSession() as http:
        kwargs = {"json": body} if isinstance(body, dict) else {"data": body}
        async with http.post(f"{stack.base_url}/v1/completions", **kwargs) as response:
            await response.read()
            return response.status


async def _grpc_code(stack: Stack, stream: bool) -> grpc.StatusCode:
    request = generation_pb2.GenerateRequest(prompt="Hello there")
    try:
        if stream:
            async for _ in stack.generation.GenerateStream(request):
                pass
        else:
            await stack.generation.Generate(request)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def _series_totals(redis_url: str, stack: Stack, since_s: float) -> dict[tuple[str, tuple], float]:
    """The spans the gateway ended, through the collector's store, as totals per series and labels."""
    client = redis.asyncio.Redis.from_url(redis_url)
    series = SeriesStore(client, (Resolution(1, 600),))
    store = SpanStore(client, max_spans=100_000, max_age_s=3600, series=series)
    try:
        await store.add(encode_spans(stack.spans.get_finished_spans()).resource_spans)
        now = time.time()
        read = await series.read(["requests", "rejected", "errors"], since_s - 1, now + 1, None)
    finally:
        await store.close()
    totals: dict[tuple[str, tuple], float] = {}
    for row in read.to_json()["series"]:
        key = (row["name"], tuple(sorted(row["labels"].items())))
        totals[key] = totals.get(key, 0.0) + sum(v * read.step_s for v in row["values"])
    return totals


def test_every_answer_is_one_request_span_and_counts_once(tokenizer_address, text_ids, redis_url) -> None:
    async def body(stack: Stack) -> None:
        since = time.time()
        assert await _post(stack, {"model": MODEL, "prompt": "Hello there", "max_tokens": 2}) == 200
        assert await _post(stack, "{not json") == 400  # refused before the request was even parsed
        # Two of three choices are submitted, the third finds the queue full: one 429 for the client.
        stack.scheduler.accept_only = len(stack.scheduler.submitted) + 2
        assert await _post(stack, {"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "n": 3}) == 429
        # The full queue starts the gateway's hold: these are refused at its admission gate.
        assert await _post(stack, {"model": MODEL, "prompt": "Hello there", "max_tokens": 2}) == 429
        assert await _grpc_code(stack, stream=False) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await _grpc_code(stack, stream=True) == grpc.StatusCode.RESOURCE_EXHAUSTED

        spans = stack.spans.get_finished_spans()
        roots = [s for s in spans if s.name == "gateway.request"]
        assert len(roots) == 6  # one per client request, whatever its answer
        assert sorted(s.attributes.get(attr.HTTP_STATUS, 200) for s in roots) == [200, 400, 429, 429, 429, 429]
        assert all(s.attributes[attr.TENANT] == DEFAULT_TENANT.name for s in roots)
        choices = [s for s in spans if s.name == "gateway.choice"]
        assert len(choices) == 3 and all(s.attributes[attr.CHOICE_UNSTARTED] for s in choices)

        totals = await _series_totals(redis_url, stack, since)
        tenant = (("tenant", DEFAULT_TENANT.name),)
        assert totals[("rejected", tenant)] == 4
        assert sum(v for (name, _labels), v in totals.items() if name == "requests") == 6
        assert sum(v for (name, _labels), v in totals.items() if name == "errors") == 1
        assert totals[("requests", (("model", MODEL), *tenant))] == 1  # the one served knew its model

    run_on_stack(tokenizer_address, Script(text_ids[:2]), body, queue_full_hold_s=60.0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_grpc_request_is_a_request_span_with_its_status(tokenizer_address, text_ids, stream) -> None:
    async def body(stack: Stack) -> None:
        request = generation_pb2.GenerateRequest(prompt="Hello there", request_id="bad id!")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            if stream:
                async for _ in stack.generation.GenerateStream(request):
                    pass
            else:
                await stack.generation.Generate(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        [root] = [s for s in stack.spans.get_finished_spans() if s.name == "gateway.request"]
        assert root.attributes[attr.HTTP_STATUS] == 400 and not root.status.is_ok

    run_on_stack(tokenizer_address, Script(text_ids[:2]), body)

"""Spans, trace-context propagation to the worker, and the Prometheus gauges."""

import asyncio
import urllib.request

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from shardline.core.ports import free_port
from shardline.proto import sampling_pb2, scheduler_pb2
from tests.scheduler_svc.harness import cluster, eventually
from tests.tracing.run_async import run_async
from tracing import attributes as attr

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


@run_async
async def test_queue_and_dispatch_spans_join_the_callers_trace(redis_url: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with cluster(redis_url, tracer=provider.get_tracer("test")) as c:
        gateway = await c.gateway("gw-1")
        await c.submit("earlier", max_tokens=1)
        await c.stub.Submit(
            scheduler_pb2.SubmitRequest(
                request_id="r1",
                gateway_id="gw-1",
                model="test-model",
                prompt_token_ids=[1, 2],
                params=sampling_pb2.SamplingParameters(max_tokens=2, seed=1),
            ),
            metadata=(("traceparent", TRACEPARENT),),
        )
        worker = await c.worker("w0")
        await gateway.wait_finished("r1")

        [sent] = [r for r in worker.received if r.request_id == "r1"]
        assert sent.traceparent.split("-")[1] == TRACE_ID
        spans = {(s.name, s.attributes.get(attr.REQUEST_ID)): s for s in exporter.get_finished_spans()}
        queue, dispatch = spans[("queue", "r1")], spans[("dispatch", "r1")]
        submit = next(
            s
            for s in exporter.get_finished_spans()
            if s.name == "shardline.v1.Scheduler/Submit" and format(s.context.trace_id, "032x") == TRACE_ID
        )
        for span in (queue, dispatch):
            assert format(span.context.trace_id, "032x") == TRACE_ID
            assert span.parent.span_id == submit.context.span_id
        assert queue.attributes[attr.QUEUE_DEPTH] == 1  # "earlier" was waiting too
        # The requests in flight, which the collector's "running" series reads: none when r1 was queued,
        # "earlier" and r1 itself once both went to the worker that joined.
        assert (queue.attributes[attr.RUNNING_REQUESTS], dispatch.attributes[attr.RUNNING_REQUESTS]) == (0, 2)
        assert dispatch.attributes["shardline.worker_id"] == "w0"
        assert queue.end_time <= dispatch.end_time


@run_async
async def test_queue_and_running_gauges_are_served(redis_url: str) -> None:
    port = free_port()
    async with cluster(redis_url, metrics_port=port) as c:
        for i in range(3):
            await c.submit(f"r{i}", max_tokens=100)
        await eventually(lambda: REGISTRY.get_sample_value("shardline_queue_depth") == 3, what="queue gauge")
        worker = await c.worker("w0", max_num_seqs=2)
        worker.generating.clear()
        await eventually(lambda: REGISTRY.get_sample_value("shardline_running_requests") == 3, what="running gauge")
        assert REGISTRY.get_sample_value("shardline_queue_depth") == 0
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
        assert b"shardline_running_requests 3.0" in body

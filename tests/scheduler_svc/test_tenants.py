"""Tenants through a real scheduler and Redis: the tenant is kept and returned, spans carry it, and
one worker slot is shared between tenants by their virtual counters."""

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shardline.core.store.request_store import RequestStore
from tests.scheduler_svc.harness import cluster
from tests.tracing.run_async import run_async
from tracing import attributes as attr


@run_async
async def test_the_tenant_reaches_the_record_get_request_and_the_spans(redis_url: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with cluster(redis_url, tracer=provider.get_tracer("test")) as c:
        gateway = await c.gateway("gw-1")
        await c.worker("w0")
        await c.submit("r1", max_tokens=2, tenant="acme", tenant_weight=3.0)
        await c.submit("r2", max_tokens=2)  # a gateway that names no tenant
        await gateway.wait_finished("r1", "r2")
        assert (await c.info("r1")).tenant == "acme"
        assert (await c.info("r2")).tenant == ""
        async with RequestStore(redis_url) as store:
            record = await store.get("r1")
            assert (record.tenant, record.tenant_weight) == ("acme", 3.0)
        spans = {(s.name, s.attributes.get(attr.REQUEST_ID)): s for s in exporter.get_finished_spans()}
        for name in ("queue", "dispatch"):
            assert spans[(name, "r1")].attributes[attr.TENANT] == "acme"


@run_async
async def test_one_slot_is_shared_between_tenants_not_taken_by_the_flood(redis_url: str) -> None:
    async with cluster(redis_url, dispatch_overcommit=1.0) as c:
        gateway = await c.gateway("gw-1")
        flood = [f"a{i}" for i in range(6)]
        for request_id in flood:
            await c.submit(request_id, max_tokens=1, tenant="a")
        for request_id in ("b0", "b1"):
            await c.submit(request_id, max_tokens=1, tenant="b")
        worker = await c.worker("w0", max_num_seqs=1)
        await gateway.wait_finished(*flood, "b0", "b1")
        # Equal prompts and outputs: the tenants alternate while both wait, FIFO within each.
        order = [r.request_id for r in worker.received]
        assert order == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]

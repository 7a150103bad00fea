"""Worker roles as the scheduler sees them: prefill workers take no request, and roles are checked."""

import grpc
import pytest

from scheduler_svc.worker_registry import WorkerRegistry
from shardline.proto import scheduler_pb2, worker_pb2
from tests.scheduler_svc.harness import cluster
from tests.tracing.run_async import run_async


def test_a_prefill_worker_takes_no_request_and_is_listed_least_busy_first() -> None:
    registry = WorkerRegistry(overcommit=1.0, heartbeat_timeout_s=10)
    for worker_id, role in (("p0", "prefill"), ("p1", "prefill"), ("d", "decode"), ("old", "")):
        registry.add(worker_pb2.WorkerInfo(worker_id=worker_id, model="m", block_size=4, max_num_seqs=8, role=role))
    assert sorted(w.worker_id for w in registry.with_room("m")) == ["d", "old"]
    assert registry.get("old").role == "both"  # registered before roles
    registry.get("p0").prefills_in_flight = 2
    assert [w.worker_id for w in registry.prefill_workers("m")] == ["p1", "p0"]
    registry.get("p1").draining = True
    assert [w.worker_id for w in registry.prefill_workers("m")] == ["p0"]
    assert registry.prefill_workers("other") == []
    # One at TP > 1 would compute a prompt and then refuse to export it.
    registry.add(worker_pb2.WorkerInfo(worker_id="p3", model="m", max_num_seqs=8, tp_size=3, role="prefill"))
    assert [w.worker_id for w in registry.prefill_workers("m")] == ["p0"]


@run_async
async def test_a_prefill_worker_is_never_dispatched_to_and_is_listed_with_its_role(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        prefill = await c.worker("p0", role="prefill")
        await c.submit("r")
        decode = await c.worker("d0", role="decode")  # the request waited for a worker that runs requests
        await gateway.wait_finished("r")
        assert [r.request_id for r in decode.received] == ["r"] and not prefill.received
        listed = await c.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
        assert {w.worker.worker_id: w.worker.role for w in listed.workers} == {"p0": "prefill", "d0": "decode"}


@run_async
async def test_register_refuses_an_unknown_role(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.worker("w0", role="prefil")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("worker.role:")

"""TTFT targets through a real scheduler and Redis: kept in the record, served earliest deadline first,
and a request that asked to be refused when late is refused at its deadline while it still waits."""

import grpc
import pytest
from google.protobuf import duration_pb2

from shardline.core.errors import SLO_UNMET
from shardline.core.store.request_record import RequestStatus
from shardline.core.store.request_store import RequestStore
from shardline.proto import sampling_pb2, scheduler_pb2
from tests.scheduler_svc.harness import cluster
from tests.tracing.run_async import run_async


def _target(seconds: float) -> duration_pb2.Duration:
    target = duration_pb2.Duration()
    target.FromNanoseconds(round(seconds * 1e9))
    return target


@run_async
async def test_a_late_request_is_refused_while_one_not_asking_waits_on(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        # No worker: both wait past their target.
        await c.submit("refused", ttft_target=_target(0.3), refuse_late=True)
        await c.submit("patient", ttft_target=_target(0.3))
        await gateway.wait_finished("refused", timeout_s=10)
        final = gateway.final("refused")
        assert final.finish_reason == sampling_pb2.FINISH_REASON_ERROR
        assert final.error.startswith(SLO_UNMET) and "0.3s TTFT target" in final.error
        async with RequestStore(redis_url) as store:
            refused, patient = await store.get("refused"), await store.get("patient")
        assert refused.status == RequestStatus.FAILED and refused.refuse_late
        assert patient.status == RequestStatus.QUEUED and not patient.refuse_late
        assert patient.ttft_deadline_ts == pytest.approx(patient.arrival_ts + 0.3)
        stats = await c.stub.GetStats(scheduler_pb2.GetStatsRequest())
        assert dict(stats.queue_depth_by_tenant) == {"": 1}  # the patient one, from a gateway naming none
        # A worker arrives: the patient request is served late, as it asked.
        await c.worker("w0")
        await gateway.wait_finished("patient")
        assert gateway.final("patient").finish_reason == sampling_pb2.FINISH_REASON_LENGTH


@run_async
async def test_the_tighter_target_is_dispatched_first(redis_url: str) -> None:
    async with cluster(redis_url, dispatch_overcommit=1.0) as c:
        gateway = await c.gateway("gw-1")
        await c.submit("loose", ttft_target=_target(30.0))
        await c.submit("none")
        await c.submit("tight", ttft_target=_target(5.0))
        worker = await c.worker("w0", max_num_seqs=1)
        await gateway.wait_finished("loose", "none", "tight")
        assert [r.request_id for r in worker.received] == ["tight", "loose", "none"]


@run_async
async def test_bad_targets_are_invalid_arguments_naming_the_field(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        with pytest.raises(grpc.aio.AioRpcError) as bad_target:
            await c.submit("zero", ttft_target=_target(0.0))
        assert bad_target.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ttft_target" in bad_target.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as no_target:
            await c.submit("alone", refuse_late=True)
        assert no_target.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "refuse_late" in no_target.value.details()

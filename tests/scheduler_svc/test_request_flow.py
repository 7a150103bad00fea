"""Submit, dispatch, relay and cancel through a real scheduler, Redis and scripted workers."""

import asyncio
import socket
import time

import grpc
import pytest
import redis

from shardline.core.store.request_store import RequestStore
from shardline.proto import common_pb2, sampling_pb2, scheduler_pb2, worker_pb2
from tests.scheduler_svc.harness import by_gateway_and_step, cluster, eventually
from tests.scheduler_svc.scripted_worker import token_at
from tests.tracing.run_async import run_async


@run_async
async def test_tokens_reach_the_owning_gateway_one_batch_per_step(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gw1, gw2 = await c.gateway("gw-1"), await c.gateway("gw-2")
        # Interleaved owners, queued before the worker comes so they share every engine step.
        owners = {"a": "gw-1", "b": "gw-2", "c": "gw-1", "d": "gw-2"}
        for request_id, gateway_id in owners.items():
            await c.submit(request_id, gateway_id, max_tokens=4, seed=ord(request_id))
        worker = await c.worker("w0", max_num_seqs=8)
        await gw1.wait_finished("a", "c")
        await gw2.wait_finished("b", "d")

        for request_id, gateway_id in owners.items():
            gateway, other = (gw1, gw2) if gateway_id == "gw-1" else (gw2, gw1)
            assert gateway.tokens(request_id) == [token_at(ord(request_id), i) for i in range(4)]
            assert [d.offset for d in gateway.deltas(request_id)] == [0, 1, 2, 3]
            assert other.deltas(request_id) == []
            final = gateway.final(request_id)
            assert final.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.total_tokens) == (3, 4, 7)
        # One TokenBatch per gateway per worker step, each holding both of its requests.
        for gateway in (gw1, gw2):
            assert set(by_gateway_and_step(gateway).values()) == {1}
            assert all(len(batch.deltas) == 2 for batch in gateway.batches)
            assert {batch.worker_id for batch in gateway.batches} == {"w0"}
        assert worker.add_sizes == [4]  # one WorkerCommand for the whole dispatch round


@run_async
async def test_redis_holds_record_tokens_and_timings(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        await c.worker("w0")
        before = time.time()
        await c.submit("r1", prompt=[5, 6, 7, 8, 9], max_tokens=3, seed=11)
        await gateway.wait_finished("r1")
        info = await c.info("r1")
        assert info.status == sampling_pb2.REQUEST_STATUS_FINISHED
        assert info.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert list(info.output_token_ids) == [token_at(11, i) for i in range(3)]
        assert (info.worker_id, info.attempt, info.model) == ("w0", 1, "test-model")
        assert (info.usage.prompt_tokens, info.usage.completion_tokens) == (5, 3)
        assert (info.params.seed, info.params.max_tokens) == (11, 3)
        times = [
            t.ToNanoseconds() / 1e9
            for t in (info.arrival_time, info.dispatch_time, info.first_token_time, info.finish_time)
        ]
        assert before - 1 <= times[0] <= times[1] <= times[2] <= times[3] <= time.time()
        async with RequestStore(redis_url) as store:
            assert await store.get_prompt("r1") == [5, 6, 7, 8, 9]
            record = await store.get("r1")
            assert (record.gateway_id, record.eos_token_ids) == ("gw-1", [2])
            assert await store.list_active() == []


@run_async
async def test_full_queue_is_refused_at_once_and_not_persisted(redis_url: str) -> None:
    async with cluster(redis_url, queue_capacity=2) as c:
        await c.submit("q1")
        await c.submit("q2")
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.submit("q3")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - started < 1.0
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await c.info("q3")
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        stats = await c.stub.GetStats(scheduler_pb2.GetStatsRequest())
        assert (dict(stats.queue_depth), stats.running, stats.workers) == ({0: 2}, 0, 0)


@run_async
async def test_lower_priority_value_first_fifo_within_a_class(redis_url: str) -> None:
    async with cluster(redis_url, dispatch_overcommit=1.0) as c:
        gateway = await c.gateway("gw-1")
        positions = {}
        for request_id, priority in [("low-1", 5), ("high-1", 0), ("low-2", 5), ("high-2", 0), ("mid", 1)]:
            positions[request_id] = (await c.submit(request_id, priority=priority, max_tokens=1)).queue_position
        assert positions == {"low-1": 0, "high-1": 0, "low-2": 2, "high-2": 1, "mid": 2}
        stats = await c.stub.GetStats(scheduler_pb2.GetStatsRequest())
        assert dict(stats.queue_depth) == {0: 2, 1: 1, 5: 2}
        # One slot and no overcommit: the dispatch order is the queue order.
        worker = await c.worker("w0", max_num_seqs=1)
        await gateway.wait_finished("low-1", "low-2", "high-1", "high-2", "mid")
        assert [r.request_id for r in worker.received] == ["high-1", "high-2", "mid", "low-1", "low-2"]


@run_async
async def test_cancel_queued_request(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        await c.submit("r1", max_tokens=3)
        response = await c.stub.Cancel(common_pb2.CancelRequest(request_id="r1"))
        assert response.status == sampling_pb2.REQUEST_STATUS_CANCELLED
        await gateway.wait_finished("r1")
        assert gateway.final("r1").finish_reason == sampling_pb2.FINISH_REASON_ABORT
        info = await c.info("r1")
        assert (info.status, info.finish_reason) == (
            sampling_pb2.REQUEST_STATUS_CANCELLED,
            sampling_pb2.FINISH_REASON_ABORT,
        )
        # It never reaches a worker, and cancelling again is a no-op that reports the final status.
        worker = await c.worker("w0")
        again = await c.stub.Cancel(common_pb2.CancelRequest(request_id="r1"))
        assert again.status == sampling_pb2.REQUEST_STATUS_CANCELLED
        assert worker.received == []


@run_async
async def test_cancel_running_request_aborts_it_on_its_worker(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        worker = await c.worker("w0")
        await c.submit("r1", max_tokens=1000)
        await eventually(lambda: len(gateway.tokens("r1")) >= 2, what="tokens")
        await c.stub.Cancel(common_pb2.CancelRequest(request_id="r1"))
        await gateway.wait_finished("r1")
        assert worker.aborted == ["r1"]
        final = gateway.final("r1")
        assert final.finish_reason == sampling_pb2.FINISH_REASON_ABORT
        info = await c.info("r1")
        assert info.status == sampling_pb2.REQUEST_STATUS_CANCELLED
        assert final.usage.completion_tokens == len(info.output_token_ids) == len(gateway.tokens("r1"))
        stats = await c.stub.GetStats(scheduler_pb2.GetStatsRequest())
        assert stats.running == 0


@run_async
async def test_finished_request_cancel_is_a_no_op_and_unknown_is_not_found(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        await c.worker("w0")
        await c.submit("done", max_tokens=2)
        await gateway.wait_finished("done")
        response = await c.stub.Cancel(common_pb2.CancelRequest(request_id="done"))
        assert response.status == sampling_pb2.REQUEST_STATUS_FINISHED
        assert (await c.info("done")).status == sampling_pb2.REQUEST_STATUS_FINISHED
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await c.stub.Cancel(common_pb2.CancelRequest(request_id="nope"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


@run_async
async def test_bad_input_gets_clear_codes(redis_url: str) -> None:
    async with cluster(redis_url, worker_connect_timeout_s=0.3) as c:

        async def code_and_details(call) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call
            return failed.value.code(), failed.value.details()

        invalid = grpc.StatusCode.INVALID_ARGUMENT
        # An empty prompt and max_tokens 0 are the gateway's to refuse (tests/gateway/test_bad_params_*.py).
        code, details = await code_and_details(c.submit("bad id"))
        assert code == invalid and "request_id" in details
        code, details = await code_and_details(c.submit(""))
        assert code == invalid and "request_id" in details
        # Redis keys are joined by ':': `X:tokens` would name request X's token list, and `X:prompt`
        # overwrite its prompt. Such ids are refused, and so no request can reach another's keys.
        for colliding in ("X:tokens", "X:prompt", "X:"):
            code, details = await code_and_details(c.submit(colliding))
            assert code == invalid and "request_id" in details and "':'" in details
        code, details = await code_and_details(c.info("X:tokens"))
        assert code == invalid and "request_id" in details
        code, details = await code_and_details(c.submit("r1", gateway_id=""))
        assert code == invalid and "gateway_id" in details
        code, details = await code_and_details(c.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest()))
        assert code == invalid and "worker.worker_id" in details
        code, _ = await code_and_details(c.info("missing"))
        assert code == grpc.StatusCode.NOT_FOUND
        # A worker whose advertised address does not answer is refused, not registered.
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            unreachable = worker_pb2.WorkerInfo(
                worker_id="w9", address=f"127.0.0.1:{closed.getsockname()[1]}", max_num_seqs=4
            )
            code, details = await code_and_details(
                c.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=unreachable))
            )
        assert code == grpc.StatusCode.UNAVAILABLE and "worker.address" in details
        assert not (await c.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())).workers

        await c.submit("r1")
        code, details = await code_and_details(c.submit("r1"))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "r1" in details
        # None of the refused submits left anything behind.
        client = redis.Redis.from_url(redis_url)
        try:
            assert sorted(k.decode() for k in client.keys("shardline:req:*")) == [
                "shardline:req:r1",
                "shardline:req:r1:prompt",
            ]
        finally:
            client.close()


@run_async
async def test_submit_without_seed_gets_one_fixed(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        await c.stub.Submit(
            scheduler_pb2.SubmitRequest(
                request_id="r1",
                gateway_id="gw-1",
                prompt_token_ids=[1, 2],
                params=sampling_pb2.SamplingParameters(max_tokens=2),
            )
        )
        info = await c.info("r1")
        assert info.params.HasField("seed")
        assert info.status == sampling_pb2.REQUEST_STATUS_QUEUED


@run_async
async def test_attach_moves_a_live_request_to_another_gateway(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        old, new = await c.gateway("gw-old"), await c.gateway("gw-new")
        worker = await c.worker("w0")
        await c.submit("r1", gateway_id="gw-old", max_tokens=12, seed=3)
        await eventually(lambda: len(old.tokens("r1")) >= 2, what="tokens on the old gateway")
        worker.generating.clear()
        old.close()
        info = await c.stub.Attach(scheduler_pb2.AttachRequest(request_id="r1", gateway_id="gw-new"))
        so_far = list(info.output_token_ids)
        assert info.status == sampling_pb2.REQUEST_STATUS_RUNNING
        assert so_far == [token_at(3, i) for i in range(len(so_far))]
        worker.generating.set()
        await new.wait_finished("r1")
        # The new gateway continues exactly where the record left off.
        assert new.deltas("r1")[0].offset == len(so_far)
        assert so_far + new.tokens("r1") == [token_at(3, i) for i in range(12)]
        async with RequestStore(redis_url) as store:
            assert (await store.get("r1")).gateway_id == "gw-new"
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await c.stub.Attach(scheduler_pb2.AttachRequest(request_id="nope", gateway_id="gw-new"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


@run_async
async def test_a_resumed_request_is_safe_from_its_old_gateway(redis_url: str) -> None:
    # A client resumed its stream on another gateway while the first one still had it: the first
    # gateway's stream ends, and its late cancel (its own client left) does not kill the request.
    async with cluster(redis_url) as c:
        old, new = await c.gateway("gw-old"), await c.gateway("gw-new")
        await c.worker("w0")
        await c.submit("r1", gateway_id="gw-old", max_tokens=12, seed=3)
        await eventually(lambda: len(old.tokens("r1")) >= 2, what="tokens on the old gateway")
        await c.stub.Attach(scheduler_pb2.AttachRequest(request_id="r1", gateway_id="gw-new"))
        await old.wait_finished("r1")
        assert old.final("r1").finish_reason == sampling_pb2.FINISH_REASON_ABORT
        assert "gw-new" in old.final("r1").error
        ignored = await c.stub.Cancel(common_pb2.CancelRequest(request_id="r1", gateway_id="gw-old"))
        assert ignored.status == sampling_pb2.REQUEST_STATUS_RUNNING
        await new.wait_finished("r1")
        assert new.final("r1").finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        # The new owner's cancel, or an explicit one naming no gateway, still works.
        await c.submit("r2", gateway_id="gw-new", max_tokens=500, seed=4)
        await eventually(lambda: len(new.tokens("r2")) >= 1, what="tokens of r2")
        cancelled = await c.stub.Cancel(common_pb2.CancelRequest(request_id="r2", gateway_id="gw-new"))
        assert cancelled.status == sampling_pb2.REQUEST_STATUS_CANCELLED
        await new.wait_finished("r2")


@run_async
async def test_a_request_no_worker_can_hold_is_refused_naming_the_field(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        await c.submit("early", prompt=list(range(3, 23)), max_tokens=5)  # no worker says yet: queued
        await c.worker("small", max_model_len=8)
        await c.worker("large", max_model_len=12)
        for prompt, max_tokens, field in (
            (list(range(3, 15)), 1, "prompt_token_ids"),
            (list(range(3, 11)), 5, "params.max_tokens"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await c.submit(f"too-long-{field}", prompt=prompt, max_tokens=max_tokens)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(f"{field}:") and "12 tokens" in refused.value.details()
        await c.submit("fits", prompt=list(range(3, 11)), max_tokens=4)  # the larger worker holds 12


@run_async
async def test_deadline_aborts_the_request(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        worker = await c.worker("w0")
        deadline = scheduler_pb2.SubmitRequest().deadline
        deadline.FromNanoseconds(int((time.time() + 0.3) * 1e9))
        await c.submit("r1", max_tokens=100_000, deadline=deadline)
        await gateway.wait_finished("r1")
        assert gateway.final("r1").finish_reason == sampling_pb2.FINISH_REASON_ABORT
        assert worker.aborted == ["r1"]
        assert (await c.info("r1")).status == sampling_pb2.REQUEST_STATUS_CANCELLED


@run_async
async def test_a_submit_cancelled_mid_write_leaves_nothing_running(redis_url: str) -> None:
    # The client (a gateway) gave up while the request was being written; it cancels "to be sure".
    # The write used to land with the request held nowhere: Cancel could not end it, and the next
    # scheduler recovered and ran it for no one.
    async with cluster(redis_url) as c:
        store = c.server.dispatcher._store
        create = store.create

        async def slow_create(*args, **kwargs):
            await asyncio.sleep(0.4)
            return await create(*args, **kwargs)

        store.create = slow_create
        submit = scheduler_pb2.SubmitRequest(
            request_id="orphan",
            gateway_id="gw-1",
            model="test-model",
            prompt_token_ids=[1, 2, 3],
            params=sampling_pb2.SamplingParameters(max_tokens=5),
        )
        with pytest.raises(grpc.aio.AioRpcError) as gave_up:
            await c.stub.Submit(submit, timeout=0.1)
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        cancelled = await c.stub.Cancel(common_pb2.CancelRequest(request_id="orphan"))
        assert cancelled.status == sampling_pb2.REQUEST_STATUS_CANCELLED
        worker = await c.worker("w0")
        await asyncio.sleep(0.3)
        assert worker.received == [] and (await c.info("orphan")).status == sampling_pb2.REQUEST_STATUS_CANCELLED
        async with RequestStore(redis_url) as check:
            assert await check.list_active() == []

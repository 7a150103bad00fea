"""Worker death, heartbeat expiry, re-registration and scheduler restarts, at the gRPC boundary."""

import asyncio
import gc
import logging

import grpc
from prometheus_client import REGISTRY

from scheduler_svc.server import start_scheduler
from shardline.proto import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.scheduler_svc.harness import Gateway, cluster, eventually, make_settings
from tests.scheduler_svc.scripted_worker import ScriptedWorker, token_at
from tests.tracing.run_async import run_async


@run_async
async def test_worker_death_mid_stream_resumes_on_another_worker(redis_url: str) -> None:
    failovers = REGISTRY.get_sample_value("shardline_failovers_total")
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        doomed = await c.worker("w0")
        await c.submit("r1", max_tokens=10, seed=5, prompt=[9, 8, 7])
        await eventually(lambda: len(gateway.tokens("r1")) >= 3, what="first tokens")
        doomed.generating.clear()
        await asyncio.sleep(0.05)  # let the last step land
        so_far = gateway.tokens("r1")
        survivor = await c.worker("w1")
        await doomed.kill()
        await gateway.wait_finished("r1")

        # The new worker got the prompt plus everything generated before the death.
        [resumed] = survivor.received
        assert list(resumed.prompt_token_ids) == [9, 8, 7]
        assert list(resumed.output_token_ids) == so_far
        assert (resumed.params.seed, resumed.params.max_tokens, list(resumed.eos_token_ids)) == (5, 10, [2])
        # The gateway's stream just carries on: contiguous offsets, and the unbroken run's tokens.
        assert [d.offset for d in gateway.deltas("r1")] == list(range(10))
        assert gateway.tokens("r1") == [token_at(5, i) for i in range(10)]
        assert gateway.final("r1").usage.completion_tokens == 10
        info = await c.info("r1")
        assert (info.status, info.worker_id, info.attempt) == (sampling_pb2.REQUEST_STATUS_FINISHED, "w1", 2)
        assert list(info.output_token_ids) == gateway.tokens("r1")
        # Its second dispatch is the one failover Grafana's failures panel counts.
        assert REGISTRY.get_sample_value("shardline_failovers_total") == failovers + 1
        workers = await c.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
        assert [w.worker.worker_id for w in workers.workers] == ["w1"]


@run_async
async def test_a_redispatch_does_not_ask_for_the_prompt_logprobs_again(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        doomed = await c.worker("w0")
        params = sampling_pb2.SamplingParameters(max_tokens=10, seed=5, logprobs=True, prompt_logprobs=2)
        await c.stub.Submit(
            scheduler_pb2.SubmitRequest(
                request_id="r1",
                gateway_id="gw-1",
                model="test-model",
                prompt_token_ids=[9, 8, 7],
                params=params,
                eos_token_ids=[2],
            )
        )
        await eventually(lambda: len(gateway.tokens("r1")) >= 3, what="first tokens")
        doomed.generating.clear()
        await asyncio.sleep(0.05)
        survivor = await c.worker("w1")
        await doomed.kill()
        await gateway.wait_finished("r1")
        [first], [resumed] = doomed.received, survivor.received
        assert first.params.HasField("prompt_logprobs") and not resumed.params.HasField("prompt_logprobs")
        assert resumed.params.logprobs and resumed.params.seed == 5
        info = await c.info("r1")  # the stored request keeps what it asked for
        assert info.params.prompt_logprobs == 2


@run_async
async def test_queued_requests_go_first_after_a_failure(redis_url: str) -> None:
    async with cluster(redis_url, dispatch_overcommit=1.0) as c:
        gateway = await c.gateway("gw-1")
        doomed = await c.worker("w0", max_num_seqs=1)
        await c.submit("first", max_tokens=50)
        await eventually(lambda: len(gateway.tokens("first")) >= 1, what="a token")
        await c.submit("second", max_tokens=2)
        doomed.generating.clear()
        await doomed.kill()
        await eventually(lambda: len(c.server.dispatcher.queue) == 2, what="the dead worker's request re-queued")
        survivor = await c.worker("w1", max_num_seqs=1)
        await gateway.wait_finished("first", "second", timeout_s=20)
        # Re-queued at the front of its class: ahead of the request that arrived after it.
        assert [r.request_id for r in survivor.received] == ["first", "second"]


@run_async
async def test_heartbeat_expiry_declares_a_silent_worker_dead(redis_url: str) -> None:
    async with cluster(redis_url, heartbeat_timeout_s=0.5) as c:
        gateway = await c.gateway("gw-1")
        silent = await c.worker("w0", heartbeat_s=None)
        await c.submit("r1", max_tokens=8, seed=2)
        await eventually(lambda: len(gateway.tokens("r1")) >= 2, what="first tokens")
        # Hung, not crashed: no steps and no heartbeats, but the stream stays open.
        silent.generating.clear()
        await asyncio.sleep(0.05)
        so_far = gateway.tokens("r1")
        survivor = await c.worker("w1")
        await gateway.wait_finished("r1")
        assert silent.session_ended.is_set()  # the scheduler broke the stream itself
        assert survivor.received[0].output_token_ids == so_far
        assert gateway.tokens("r1") == [token_at(2, i) for i in range(8)]
        # The dead worker is told to register again.
        late = await silent.scheduler.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="w0"))
        assert not late.registered
        assert (await c.info("r1")).attempt == 2


@run_async
async def test_request_fails_after_max_attempts(redis_url: str) -> None:
    async with cluster(redis_url, max_attempts=2) as c:
        gateway = await c.gateway("gw-1")
        for worker_id in ("w0", "w1"):
            worker = await c.worker(worker_id)
            if worker_id == "w0":
                await c.submit("r1", max_tokens=1000)
            await eventually(lambda: worker.running, what=f"r1 on {worker_id}")
            await worker.kill()
        await gateway.wait_finished("r1")
        final = gateway.final("r1")
        assert final.finish_reason == sampling_pb2.FINISH_REASON_ERROR
        assert "w1" in final.error and "attempt 2 of 2" in final.error
        info = await c.info("r1")
        assert (info.status, info.attempt) == (sampling_pb2.REQUEST_STATUS_FAILED, 2)
        assert final.usage.completion_tokens == len(info.output_token_ids)


@run_async
async def test_reregistration_is_treated_as_a_restart(redis_url: str) -> None:
    async with cluster(redis_url) as c:
        gateway = await c.gateway("gw-1")
        old = await c.worker("w0")
        await c.submit("r1", max_tokens=6, seed=4)
        await eventually(lambda: len(gateway.tokens("r1")) >= 2, what="first tokens")
        old.generating.clear()
        await asyncio.sleep(0.05)
        so_far = gateway.tokens("r1")
        old.stop_heartbeats()
        restarted = await c.worker("w0")  # same id, new process and address
        await gateway.wait_finished("r1")
        assert restarted.received[0].output_token_ids == so_far
        assert old.session_ended.is_set()
        assert gateway.tokens("r1") == [token_at(4, i) for i in range(6)]
        assert (await c.info("r1")).attempt == 2


@run_async
async def test_scheduler_restart_recovers_unfinished_requests_from_redis(redis_url: str) -> None:
    # First scheduler: two requests wait, one runs; then it stops (a crash, as far as Redis knows).
    first = await start_scheduler(make_settings(redis_url, dispatch_overcommit=1.0))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{first.port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    gateway = await Gateway(stub, "gw-1").start()
    worker = await ScriptedWorker("w0", max_num_seqs=1).start(first.port)
    for request_id, priority in (("running", 0), ("waiting-low", 3), ("waiting-high", 1)):
        await stub.Submit(
            scheduler_pb2.SubmitRequest(
                request_id=request_id,
                gateway_id="gw-1",
                model="test-model",
                prompt_token_ids=[4, 5, 6],
                params=sampling_pb2.SamplingParameters(max_tokens=6, seed=9),
                eos_token_ids=[2, 3],
                priority=priority,
            )
        )
    await eventually(lambda: len(gateway.tokens("running")) >= 2, what="first tokens")
    worker.generating.clear()
    await asyncio.sleep(0.05)
    so_far = gateway.tokens("running")
    await first.stop(grace_s=0)
    await worker.kill()
    await channel.close()

    failovers = REGISTRY.get_sample_value("shardline_failovers_total")
    async with cluster(redis_url, dispatch_overcommit=1.0) as c:
        stats = await c.stub.GetStats(scheduler_pb2.GetStatsRequest())
        assert dict(stats.queue_depth) == {0: 1, 1: 1, 3: 1}
        gateway = await c.gateway("gw-1")
        survivor = await c.worker("w1", max_num_seqs=1)
        await gateway.wait_finished("running", "waiting-high", "waiting-low", timeout_s=20)
        assert [r.request_id for r in survivor.received] == ["running", "waiting-high", "waiting-low"]
        resumed = survivor.received[0]
        assert list(resumed.output_token_ids) == so_far
        assert list(resumed.eos_token_ids) == [2, 3] and resumed.params.seed == 9
        assert so_far + gateway.tokens("running") == [token_at(9, i) for i in range(6)]
        # A scheduler restart is not the request's failure: the re-dispatch resumes attempt 1.
        assert (await c.info("running")).attempt == 1
        assert REGISTRY.get_sample_value("shardline_failovers_total") == failovers
        assert (await c.info("waiting-low")).status == sampling_pb2.REQUEST_STATUS_FINISHED


@run_async
async def test_a_request_redispatched_at_once_is_recorded_running(redis_url: str) -> None:
    # The re-queue's QUEUED write used to land after the RUNNING of the dispatch that beat it, so the
    # record said QUEUED while the request ran (and a restart then counted that run as a failure).
    async with cluster(redis_url) as c:
        await c.gateway("gw-1")
        doomed = await c.worker("w1", max_num_seqs=4)
        doomed.generating.clear()
        for i in range(4):
            await c.submit(f"r{i}", max_tokens=50)
        await eventually(lambda: len(doomed.received) == 4, what="dispatch to w1")
        survivor = await c.worker("w2", max_num_seqs=8)
        survivor.generating.clear()
        await doomed.kill()
        await eventually(lambda: len(survivor.received) == 4, what="re-dispatch to w2")
        await asyncio.sleep(0.2)
        infos = [await c.info(f"r{i}") for i in range(4)]
        assert [(i.status, i.worker_id, i.attempt) for i in infos] == [
            (sampling_pb2.REQUEST_STATUS_RUNNING, "w2", 2)
        ] * 4


@run_async
async def test_a_broken_session_leaves_no_task_pending(redis_url: str, caplog) -> None:
    """A worker's stream that breaks ends every task of its session: none is left pending for the
    garbage collector to destroy, and no async generator is closed while it runs."""
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        async with cluster(redis_url) as c:
            gateway = await c.gateway("gw-1")
            worker = await c.worker("w0")
            await c.submit("r1", max_tokens=1000)
            await eventually(lambda: worker.running, what="r1 on w0")
            await worker.kill()
            await eventually(lambda: not c.server.dispatcher.registry.get("w0"), what="w0 declared dead")
            await asyncio.sleep(0.2)
            gc.collect()
            await asyncio.sleep(0.1)
            gateway.close()
    problems = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert not problems, problems

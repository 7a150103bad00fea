"""RequestTable.handle_steps against a real Redis: batching, ownership and repeated tokens."""

from scheduler_svc.live_request import LiveRequest
from scheduler_svc.relay import Relay
from scheduler_svc.request_table import RequestTable
from scheduler_svc.worker_registry import WorkerRegistry
from shardline.core.store.request_record import FinishReason, RequestStatus
from shardline.core.store.request_store import RequestStore
from shardline.proto import common_pb2, sampling_pb2, scheduler_pb2, worker_pb2
from tests.scheduler_svc.harness import cluster
from tests.tracing.run_async import run_async


def _delta(
    request_id: str, tokens: list[int], offset: int, finish: int = 0, usage: sampling_pb2.Usage | None = None
) -> common_pb2.RequestDelta:
    return common_pb2.RequestDelta(
        request_id=request_id, token_ids=tokens, offset=offset, finish_reason=finish, usage=usage
    )


@run_async
async def test_steps_are_persisted_in_one_pipeline_and_relayed_per_step(redis_url: str) -> None:
    async with RequestStore(redis_url) as store:
        relay, registry = Relay(queue_size=16), WorkerRegistry(overcommit=1.0, heartbeat_timeout_s=10)
        worker = registry.add(worker_pb2.WorkerInfo(worker_id="w0", max_num_seqs=4))
        table = RequestTable(store, relay, registry, on_change=lambda: None)
        for request_id in ("a", "b"):
            request = LiveRequest(
                request_id=request_id,
                gateway_id="gw",
                model="m",
                priority=0,
                prompt_token_ids=[1, 2],
                params=sampling_pb2.SamplingParameters(),
                eos_token_ids=[],
                arrival_ts=0.0,
                worker_id="w0",
                attempt=1,
            )
            assert await store.create(request.to_record(), request.prompt_token_ids)
            table.add(request)
            worker.in_flight.add(request_id)
        calls = []
        append_step = store.append_step

        async def counting_append_step(*args, **kwargs):
            calls.append(args)
            await append_step(*args, **kwargs)

        store.append_step = counting_append_step
        subscription = relay.subscribe("gw")
        steps = [
            # A worker's first delta of a request says how many prompt tokens its prefix cache served.
            worker_pb2.StepOutput(
                step=1,
                deltas=[_delta("a", [10, 11], 0, usage=sampling_pb2.Usage(cached_tokens=2)), _delta("b", [20], 0)],
            ),
            # "a" repeats token 11; "ghost" belongs to no live request.
            worker_pb2.StepOutput(step=2, deltas=[_delta("a", [11, 12], 1), _delta("ghost", [9], 0)]),
            worker_pb2.StepOutput(step=3, deltas=[_delta("b", [21], 1, sampling_pb2.FINISH_REASON_STOP)]),
        ]
        await table.handle_steps("w0", steps)
        relay.close_all()
        batches = [batch async for batch in subscription]

        assert len(calls) == 1  # three steps that piled up, one Redis round trip, the finish of "b" in it
        assert calls[0][2] == [("b", RequestStatus.FINISHED, FinishReason.STOP, None)]
        assert await store.get_tokens("a") == [10, 11, 12]
        assert await store.get_tokens("b") == [20, 21]
        assert [batch.step for batch in batches] == [1, 2, 3]
        assert [(d.request_id, list(d.token_ids), d.offset) for d in batches[1].deltas] == [("a", [12], 2)]
        final = batches[2].deltas[0]
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (2, 2)
        assert (await store.get("b")).status == RequestStatus.FINISHED
        assert "b" not in table and worker.in_flight == {"a"}
        record = await store.get("a")
        assert record.first_token_ts is not None and record.status == RequestStatus.QUEUED
        assert record.cached_tokens == 2  # kept for GetRequest's usage


@run_async
async def test_logprobs_are_persisted_token_for_token_and_read_back(redis_url: str) -> None:
    def lp(token_id: int) -> sampling_pb2.TokenLogprob:
        return sampling_pb2.TokenLogprob(token_id=token_id, logprob=-float(token_id), rank=token_id % 7 + 1)

    async with cluster(redis_url) as running:
        params = sampling_pb2.SamplingParameters(max_tokens=8, seed=1, logprobs=True, prompt_logprobs=0)
        for request_id in ("kept", "old"):
            await running.stub.Submit(
                scheduler_pb2.SubmitRequest(
                    request_id=request_id,
                    gateway_id="gw",
                    model="test-model",
                    prompt_token_ids=[1, 2, 3],
                    params=params,
                    eos_token_ids=[2],
                )
            )
        table = running.server.dispatcher.requests
        kept = table.get("kept")
        kept.worker_id = "w0"
        steps = [  # the second repeats token 11, with its logprob: both are dropped together
            worker_pb2.StepOutput(
                step=1,
                deltas=[
                    common_pb2.RequestDelta(
                        request_id="kept",
                        token_ids=[10, 11],
                        offset=0,
                        logprobs=[lp(10), lp(11)],
                        prompt_logprobs=[lp(2), lp(3)],
                    )
                ],
            ),
            worker_pb2.StepOutput(
                step=2,
                deltas=[
                    common_pb2.RequestDelta(request_id="kept", token_ids=[11, 12], offset=1, logprobs=[lp(11), lp(12)])
                ],
            ),
        ]
        await table.handle_steps("w0", steps)
        info = await running.info("kept")
        assert list(info.output_token_ids) == [10, 11, 12]
        assert list(info.output_logprobs) == [lp(10), lp(11), lp(12)]
        assert list(info.prompt_logprobs) == [lp(2), lp(3)]
        # Fewer logprobs than tokens (a record written before they were kept) pair with none.
        async with RequestStore(redis_url) as store:
            await store.append_step({"old": (0, [5, 6])}, logprobs={"old": [lp(6).SerializeToString()]})
        info = await running.info("old")
        assert list(info.output_token_ids) == [5, 6] and not info.output_logprobs

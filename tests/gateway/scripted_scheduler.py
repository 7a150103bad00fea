"""A scheduler that plays scripted outputs, for gateway tests.

The real scheduler and workers run in the end-to-end tests; here the gateway meets a Scheduler
servicer that emits deterministic TokenBatches (real token ids of a known text), one per "step"
holding the deltas of every running request, and records what the gateway asked of it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from shardline.proto import common_pb2, sampling_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Script:
    """What every request submitted from now on generates."""

    token_ids: list[int]  # the output, in order
    tokens_per_step: int = 1  # tokens in each delta
    finish_reason: int = sampling_pb2.FINISH_REASON_STOP  # when the script runs out (as on EOS)
    hold_after: int | None = None  # emit this many tokens, then wait for `release()` or a cancel
    logprobs: bool = False  # attach made-up logprobs with two alternatives per token
    cached_tokens: int = 0  # prompt tokens the "worker" found cached, in the first and last deltas' usage
    error: str = "worker-0 failed"  # a FINISH_REASON_ERROR's message


@dataclass
class Record:
    submit: scheduler_pb2.SubmitRequest
    script: Script
    gateway_id: str
    output: list[int] = field(default_factory=list)
    status: int = sampling_pb2.REQUEST_STATUS_RUNNING
    finish_reason: int = sampling_pb2.FINISH_REASON_UNSPECIFIED
    cancel_pending: bool = False


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, script: Script, step_s: float = 0.003) -> None:
        self.script = script
        self.step_s = step_s
        self.records: dict[str, Record] = {}
        self.submitted: list[scheduler_pb2.SubmitRequest] = []
        self.submit_metadata: list[dict[str, str]] = []
        self.cancelled: list[str] = []
        self.reject_with: grpc.StatusCode | None = None
        self.reject_details = "the queue is full"  # what a refused Submit says
        self.accept_only: int | None = None  # Submits past this many are refused as a full queue
        self.refuse_cancels: grpc.StatusCode | None = None  # answer Cancel with this, as a scheduler going down
        self.honour_cancels = True  # False: record cancels but keep generating (a gateway lost without cancelling)
        self.workers_alive = True  # False: ListWorkers reports the one worker dead
        self.batches_sent = 0
        self._subscribers: dict[str, asyncio.Queue[scheduler_pb2.TokenBatch | None]] = {}
        self._released = False
        self._task: asyncio.Task[None] | None = None
        self._step = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.drop_subscribers()

    def release(self) -> None:
        """Let held requests run to the end of their script."""
        self._released = True

    def drop_subscribers(self) -> None:
        """End every Subscribe stream, as a scheduler restart would."""
        for queue in self._subscribers.values():
            queue.put_nowait(None)
        self._subscribers.clear()

    async def wait_cancelled(self, request_id: str, timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            while request_id not in self.cancelled:
                await asyncio.sleep(0.01)

    async def Submit(self, request, context):
        if self.reject_with is not None or (self.accept_only is not None and len(self.submitted) >= self.accept_only):
            await context.abort(self.reject_with or grpc.StatusCode.RESOURCE_EXHAUSTED, self.reject_details)
        self.submitted.append(request)
        self.submit_metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        self.records[request.request_id] = Record(request, self.script, request.gateway_id)
        return scheduler_pb2.SubmitResponse(queue_position=0)

    async def Subscribe(self, request, context):
        queue: asyncio.Queue[scheduler_pb2.TokenBatch | None] = asyncio.Queue()
        self._subscribers[request.gateway_id] = queue
        await context.send_initial_metadata(())  # registered: as the real scheduler says so
        while (batch := await queue.get()) is not None:
            yield batch

    async def Cancel(self, request, context):
        if self.refuse_cancels is not None:
            await context.abort(self.refuse_cancels, "the scheduler is going down")
        self.cancelled.append(request.request_id)
        record = self.records.get(request.request_id)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id}")
        if record.status == sampling_pb2.REQUEST_STATUS_RUNNING and self.honour_cancels:
            record.cancel_pending = True
            return common_pb2.CancelResponse(status=sampling_pb2.REQUEST_STATUS_CANCELLED)
        return common_pb2.CancelResponse(status=record.status)

    async def GetRequest(self, request, context):
        record = self.records.get(request.request_id)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id}")
        return self._info(record)

    async def Attach(self, request, context):
        record = self.records.get(request.request_id)
        if record is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id}")
        record.gateway_id = request.gateway_id
        return self._info(record)

    async def GetStats(self, request, context):
        running = sum(r.status == sampling_pb2.REQUEST_STATUS_RUNNING for r in self.records.values())
        return scheduler_pb2.SchedulerStats(
            queue_depth={0: 2, 5: 1},
            running=running,
            workers=int(self.workers_alive),
            queue_depth_by_tenant={"": 1, "acme": 2},  # "": from a gateway that names no tenant
            scale=[scheduler_pb2.ModelScale(model="test-model", policy="lt-ua", desired=3, ready=2, forecast_rps=1.5)],
        )

    async def ListWorkers(self, request, context):
        worker = worker_pb2.WorkerInfo(worker_id="worker-0", model=MODEL, tp_size=1, kv_blocks_total=64)
        state = scheduler_pb2.WorkerState(worker=worker, alive=self.workers_alive, kv_blocks_used=16)
        return scheduler_pb2.ListWorkersResponse(workers=[state])

    def _info(self, record: Record) -> common_pb2.RequestInfo:
        submit = record.submit
        usage = sampling_pb2.Usage(
            prompt_tokens=len(submit.prompt_token_ids),
            completion_tokens=len(record.output),
            total_tokens=len(submit.prompt_token_ids) + len(record.output),
        )
        return common_pb2.RequestInfo(
            request_id=submit.request_id,
            model=submit.model,
            status=record.status,
            params=submit.params,
            finish_reason=record.finish_reason,
            usage=usage,
            output_token_ids=record.output,
            attempt=1,
            owner=submit.owner,
        )

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self._step += 1
            deltas: dict[str, list[common_pb2.RequestDelta]] = {}
            for record in self.records.values():
                delta = self._advance(record)
                if delta is not None:
                    deltas.setdefault(record.gateway_id, []).append(delta)
            for gateway_id, batch in deltas.items():
                queue = self._subscribers.get(gateway_id)
                if queue is not None:  # an unsubscribed gateway misses the batch, as after a restart
                    self.batches_sent += 1
                    queue.put_nowait(scheduler_pb2.TokenBatch(worker_id="worker-0", step=self._step, deltas=batch))

    def _advance(self, record: Record) -> common_pb2.RequestDelta | None:
        if record.status != sampling_pb2.REQUEST_STATUS_RUNNING:
            return None
        delta = common_pb2.RequestDelta(request_id=record.submit.request_id, offset=len(record.output))
        submit = record.submit
        past_deadline = submit.HasField("deadline") and submit.deadline.ToNanoseconds() <= time.time_ns()
        if record.cancel_pending or past_deadline:  # the real scheduler cancels a request at its deadline
            return self._end(record, delta, sampling_pb2.REQUEST_STATUS_CANCELLED, sampling_pb2.FINISH_REASON_ABORT)
        script, done = record.script, len(record.output)
        if script.hold_after is not None and done >= script.hold_after and not self._released:
            return None
        params = record.submit.params
        limit = (
            min(len(script.token_ids), params.max_tokens) if params.HasField("max_tokens") else len(script.token_ids)
        )
        new = script.token_ids[done : min(limit, done + script.tokens_per_step)]
        first = not record.output
        record.output += new
        delta.token_ids.extend(new)
        if first and new:  # as a worker does: the first delta says what the prefix cache served
            delta.usage.CopyFrom(self._usage(record))
        if first and new and params.HasField("prompt_logprobs"):  # one per prompt token after the first
            delta.prompt_logprobs.extend(
                sampling_pb2.TokenLogprob(token_id=token_id, logprob=-1.0) for token_id in submit.prompt_token_ids[1:]
            )
        if script.logprobs:
            for token_id in new:
                top = [
                    sampling_pb2.TopLogprob(token_id=token_id, logprob=-0.25),
                    sampling_pb2.TopLogprob(token_id=token_id + 1, logprob=-2.5),
                ]
                delta.logprobs.append(sampling_pb2.TokenLogprob(token_id=token_id, logprob=-0.25, top=top))
        if len(record.output) >= limit:
            reason = script.finish_reason if limit == len(script.token_ids) else sampling_pb2.FINISH_REASON_LENGTH
            return self._end(record, delta, sampling_pb2.REQUEST_STATUS_FINISHED, reason)
        return delta

    def _end(self, record: Record, delta: common_pb2.RequestDelta, status: int, reason: int) -> common_pb2.RequestDelta:
        record.status, record.finish_reason = status, reason
        delta.finish_reason = reason
        if reason == sampling_pb2.FINISH_REASON_ERROR:
            delta.error = record.script.error
        delta.usage.CopyFrom(self._usage(record))
        return delta

    @staticmethod
    def _usage(record: Record) -> sampling_pb2.Usage:
        prompt = len(record.submit.prompt_token_ids)
        return sampling_pb2.Usage(
            prompt_tokens=prompt,
            completion_tokens=len(record.output),
            total_tokens=prompt + len(record.output),
            cached_tokens=record.script.cached_tokens,
        )

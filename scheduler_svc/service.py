"""The Scheduler gRPC servicer: validation and message conversion around the Dispatcher."""

import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from scheduler_svc.dispatcher import Dispatcher
from scheduler_svc.live_request import LiveRequest, params_from_json
from scheduler_svc.lora_rollout import load_adapter, unload_adapter
from scheduler_svc.relay import Relay
from scheduler_svc.settings import SchedulerSettings
from shardline.core.errors import InvalidArgument, NotFound
from shardline.core.ids import require_id
from shardline.core.store.request_record import RequestRecord
from shardline.core.store.request_store import RequestStore
from shardline.core.worker_role import role_of
from shardline.proto import common_pb2, sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from tracing.grpc_context import inject_metadata

if TYPE_CHECKING:  # imported by the server only when autoscaling is on
    from scheduler_svc.pool_scaler import PoolScaler


# DrainWorker: how long before the caller's deadline the hand-off stops, for the requests to move and
# the answer to get back; and the hand-off's bound when the caller set no deadline.
_DRAIN_MARGIN_S = 0.5
_DRAIN_DEFAULT_S = 5.0


def _seconds(ts: timestamp_pb2.Timestamp) -> float:
    return ts.ToNanoseconds() / 1e9


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """Serves shardline.v1.Scheduler; bad input raises shardline.core.errors, which the server maps to codes."""

    def __init__(
        self,
        settings: SchedulerSettings,
        dispatcher: Dispatcher,
        store: RequestStore,
        relay: Relay,
        scaler: "PoolScaler | None" = None,
    ) -> None:
        self._settings = settings
        self._dispatcher = dispatcher
        self._store = store
        self._relay = relay
        self._scaler = scaler

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitResponse:
        require_id(request.request_id, "request_id")
        require_id(request.gateway_id, "gateway_id")
        params = request.params
        # Only gateways submit, and they check the values (docs/architecture.md, "Where each check
        # lives"). What the scheduler alone can tell is whether any worker it routes to can hold it.
        longest = self._dispatcher.registry.longest_sequence(request.model)
        if longest is not None:
            # Refused here, with the field at fault, rather than failed by the worker it reaches.
            prompt = len(request.prompt_token_ids)
            if prompt >= longest:
                raise InvalidArgument(
                    "prompt_token_ids",
                    f"{prompt} tokens leave no room in the longest sequence "
                    f"the workers of this model hold ({longest} tokens)",
                )
            if params.HasField("max_tokens") and prompt + params.max_tokens > longest:
                raise InvalidArgument(
                    "params.max_tokens",
                    f"the prompt ({prompt} tokens) plus max_tokens "
                    f"({params.max_tokens}) exceeds the longest sequence the workers of this "
                    f"model hold ({longest} tokens)",
                )
        if not params.HasField("seed"):
            # Resuming after a worker failure replays (seed, index): the seed must be fixed now.
            params.seed = secrets.randbits(63)
        # The Submit call's context, so the worker's engine spans join the caller's trace.
        traceparent = dict(inject_metadata()).get("traceparent", "")
        arrival_ts = _seconds(request.arrival_time) if request.HasField("arrival_time") else time.time()
        ttft_deadline_ts = None
        if request.HasField("ttft_target"):
            target_s = request.ttft_target.ToNanoseconds() / 1e9
            if target_s <= 0:
                raise InvalidArgument("ttft_target", f"must be positive, got {target_s:g}s")
            ttft_deadline_ts = arrival_ts + target_s
        elif request.refuse_late:
            raise InvalidArgument("refuse_late", "needs a ttft_target to be late against")
        live = LiveRequest(
            request_id=request.request_id,
            gateway_id=request.gateway_id,
            model=request.model,
            priority=request.priority,
            prompt_token_ids=list(request.prompt_token_ids),
            params=params,
            eos_token_ids=list(request.eos_token_ids),
            arrival_ts=arrival_ts,
            deadline_ts=_seconds(request.deadline) if request.HasField("deadline") else None,
            traceparent=traceparent,
            owner=request.owner,
            tenant=request.tenant,
            # Unset (a gateway without tenants) or nonsense weighs as 1: the gateway checks the file's.
            tenant_weight=request.tenant_weight if 0 < request.tenant_weight < math.inf else 1.0,
            ttft_deadline_ts=ttft_deadline_ts,
            refuse_late=request.refuse_late,
        )
        position = await self._dispatcher.submit(live)
        return scheduler_pb2.SubmitResponse(queue_position=position)

    async def Cancel(
        self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.CancelResponse:
        status = await self._dispatcher.cancel(require_id(request.request_id, "request_id"), request.gateway_id)
        return common_pb2.CancelResponse(status=int(status))

    async def Subscribe(
        self, request: scheduler_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenBatch]:
        subscription = self._relay.subscribe(require_id(request.gateway_id, "gateway_id"))
        try:
            # Tells the gateway its stream is live, so it knows when submitting is safe.
            await context.send_initial_metadata(())
            async for batch in subscription:
                yield batch
        finally:
            self._relay.unsubscribe(subscription)

    async def Attach(
        self, request: scheduler_pb2.AttachRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.RequestInfo:
        request_id = require_id(request.request_id, "request_id")
        gateway_id = require_id(request.gateway_id, "gateway_id")
        return await self._dispatcher.attach(request_id, gateway_id, lambda: self._request_info(request_id))

    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerResponse:
        info = request.worker
        require_id(info.worker_id, "worker.worker_id")
        if not info.address:
            raise InvalidArgument("worker.address", "must be the host:port of its Worker service")
        if info.max_num_seqs == 0:
            raise InvalidArgument("worker.max_num_seqs", "must be at least 1")
        try:
            role_of(info.role)
        except ValueError as exc:
            raise InvalidArgument("worker.role", str(exc)) from None
        await self._dispatcher.register_worker(info)
        if self._scaler is not None:
            self._scaler.registered(info)
        interval = duration_pb2.Duration()
        interval.FromNanoseconds(round(self._settings.heartbeat_interval_s * 1e9))
        return scheduler_pb2.RegisterWorkerResponse(heartbeat_interval=interval)

    async def Heartbeat(
        self, request: scheduler_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.HeartbeatResponse:
        if self._scaler is not None and self._scaler.retired(request.worker_id):
            return scheduler_pb2.HeartbeatResponse(registered=False, retired=True)
        registered = self._dispatcher.heartbeat(
            request.worker_id, request.running, request.waiting, request.kv_blocks_used
        )
        return scheduler_pb2.HeartbeatResponse(registered=registered)

    async def DrainWorker(
        self, request: scheduler_pb2.DrainWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.DrainWorkerResponse:
        worker_id = require_id(request.worker_id, "worker_id")
        # The hand-off ends early enough for the answer and the move to reach the worker before the
        # deadline it gave; without one, the most a stopping worker waits by default.
        left_s = context.time_remaining()
        budget_s = _DRAIN_DEFAULT_S if left_s is None else max(0.0, left_s - _DRAIN_MARGIN_S)
        moved, sent = await self._dispatcher.drain_worker(worker_id, time.monotonic() + budget_s)
        return scheduler_pb2.DrainWorkerResponse(moved=moved, handed_off=sent)

    async def GetRequest(
        self, request: common_pb2.GetRequestRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.RequestInfo:
        return await self._request_info(require_id(request.request_id, "request_id"))

    async def LoadLoraAdapter(
        self, request: common_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoraAdaptersResponse:
        return common_pb2.LoraAdaptersResponse(adapters=await load_adapter(self._dispatcher.registry, request))

    async def UnloadLoraAdapter(
        self, request: common_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoraAdaptersResponse:
        return common_pb2.LoraAdaptersResponse(adapters=await unload_adapter(self._dispatcher.registry, request))

    async def ListWorkers(
        self, request: scheduler_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListWorkersResponse:
        states = []
        for worker in self._dispatcher.registry:
            state = scheduler_pb2.WorkerState(
                worker=worker.info,
                running=worker.running,
                waiting=worker.waiting,
                kv_blocks_used=worker.kv_blocks_used,
                alive=True,
                draining=worker.draining,
            )
            state.last_seen.FromNanoseconds(round(worker.last_seen_wall * 1e9))
            states.append(state)
        return scheduler_pb2.ListWorkersResponse(workers=states)

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        return scheduler_pb2.SchedulerStats(
            queue_depth=self._dispatcher.queue.depth_by_priority(),
            running=self._dispatcher.running(),
            workers=len(self._dispatcher.registry),
            scale=self._scaler.stats() if self._scaler is not None else [],
            queue_depth_by_tenant=self._dispatcher.queue.depth_by_tenant(),
        )

    async def _request_info(self, request_id: str) -> common_pb2.RequestInfo:
        record = await self._store.get(request_id)
        if record is None:
            raise NotFound(f"request_id: no request {request_id!r} (never submitted, or expired)")
        info = _to_request_info(record, await self._store.get_tokens(request_id))
        if info.params.logprobs or info.params.HasField("prompt_logprobs"):
            output, prompt = await self._store.get_logprobs(request_id)
            # A step may have landed between the two reads: its logprobs go with tokens not read yet.
            # Fewer than the tokens (a record from before they were kept) pair with none of them.
            if len(output) >= len(info.output_token_ids):
                info.output_logprobs.extend(
                    sampling_pb2.TokenLogprob.FromString(lp) for lp in output[: len(info.output_token_ids)]
                )
            info.prompt_logprobs.extend(sampling_pb2.TokenLogprob.FromString(lp) for lp in prompt)
        return info


def _to_request_info(record: RequestRecord, tokens: list[int]) -> common_pb2.RequestInfo:
    info = common_pb2.RequestInfo(
        request_id=record.request_id,
        model=record.model,
        status=int(record.status),
        priority=record.priority,
        params=params_from_json(record.params),
        worker_id=record.worker_id or "",
        attempt=record.attempt,
        finish_reason=int(record.finish_reason or 0),
        error=record.error or "",
        usage=sampling_pb2.Usage(
            prompt_tokens=record.prompt_len,
            completion_tokens=len(tokens),
            total_tokens=record.prompt_len + len(tokens),
            cached_tokens=record.cached_tokens,
        ),
        output_token_ids=tokens,
        owner=record.owner,
        tenant=record.tenant,
    )
    for name, ts in (
        ("arrival_time", record.arrival_ts),
        ("dispatch_time", record.dispatch_ts),
        ("first_token_time", record.first_token_ts),
        ("finish_time", record.finish_ts),
    ):
        if ts is not None:
            getattr(info, name).FromNanoseconds(round(ts * 1e9))
    return info

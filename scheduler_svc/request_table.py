"""Live requests, their step-by-step output, and how they end."""

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from scheduler_svc.fair_share import VirtualCounters
from scheduler_svc.live_request import LiveRequest
from scheduler_svc.load_meter import LoadMeter
from scheduler_svc.relay import Relay
from scheduler_svc.store_outage import StoreOutage
from scheduler_svc.worker_registry import WorkerRegistry
from shardline.core.errors import STREAM_INTERRUPTED
from shardline.core.store.request_record import FinishReason, RequestStatus
from shardline.core.store.request_store import RequestStore
from shardline.proto import common_pb2, sampling_pb2, scheduler_pb2, worker_pb2

log = logging.getLogger(__name__)

# What a worker's finish reason means for the request's status.
_STATUS_FOR_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED,
    FinishReason.LENGTH: RequestStatus.FINISHED,
    FinishReason.ABORT: RequestStatus.CANCELLED,
    FinishReason.ERROR: RequestStatus.FAILED,
}


@dataclass(slots=True)
class Outcome:
    """How one request ends."""

    request: LiveRequest  # the request
    status: RequestStatus  # its terminal status
    reason: FinishReason  # the finish reason its gateway sees
    error: str | None = None  # why it failed, when it did

    def stored(self) -> tuple[str, RequestStatus, FinishReason, str | None]:
        """As RequestStore.finish_many takes it."""
        return self.request.request_id, self.status, self.reason, self.error


class RequestTable:
    """Every unfinished request the scheduler holds, queued or running.

    It turns each batch of worker steps into one Redis pipeline and one
    TokenBatch per gateway per step, and it is where requests end: their
    terminal state goes to Redis and their worker slot is given back.
    """

    def __init__(
        self,
        store: RequestStore,
        relay: Relay,
        registry: WorkerRegistry,
        on_change: Callable[[], None],
        outage: StoreOutage | None = None,
        counters: VirtualCounters | None = None,
        meter: LoadMeter | None = None,
    ) -> None:
        self._store = store
        self._relay = relay
        self._registry = registry
        self._on_change = on_change  # wakes the dispatch loop: a slot freed up
        self._outage = outage or StoreOutage()
        self._counters = counters or VirtualCounters()  # the queue's: charged for output as it is recorded
        self._meter = meter or LoadMeter()  # the autoscaler's: told of first tokens and finishes
        self._live: dict[str, LiveRequest] = {}
        # Per worker, held from a batch of steps' Redis write to its relay (see steps_held).
        self._persisting: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def get(self, request_id: str) -> LiveRequest | None:
        return self._live.get(request_id)

    def add(self, request: LiveRequest) -> None:
        self._live[request.request_id] = request

    @contextlib.asynccontextmanager
    async def steps_held(self, request_id: str) -> AsyncIterator[None]:
        """No step of the request's worker is between its Redis write and its relay meanwhile.

        A record read inside then holds exactly the tokens relayed so far, so a gateway that
        Attaches gets the rest as deltas that start where the record ends.
        """
        request = self._live.get(request_id)
        if request is None or request.worker_id is None:
            yield
            return
        async with self._persisting[request.worker_id]:
            yield

    async def handle_steps(
        self, worker_id: str, steps: list[worker_pb2.StepOutput], backlog: Callable[[], int] = lambda: 0
    ) -> None:
        """Persists, relays and finalises what consecutive steps of one worker produced.

        Nothing is relayed before it is in Redis. While Redis does not answer, the write is retried
        with backoff and the worker's later steps wait behind it (`backlog` counts them); once the
        outage outlasts the StoreOutage bounds, StoreUnavailable is raised, the steps' tokens are
        neither recorded nor relayed, and each request's output stays where Redis has it.
        """
        async with self._persisting[worker_id]:
            await self._handle_steps(worker_id, steps, backlog)

    async def _handle_steps(
        self, worker_id: str, steps: list[worker_pb2.StepOutput], backlog: Callable[[], int]
    ) -> None:
        now = time.time()
        offsets: dict[str, int] = {}  # each request's output length before these steps
        new_tokens: dict[str, list[int]] = defaultdict(list)
        first_token_ts: dict[str, float] = {}
        cached_tokens: dict[str, int] = {}
        logprobs: dict[str, list[bytes]] = defaultdict(list)
        prompt_logprobs: dict[str, list[bytes]] = {}
        finished: list[Outcome] = []
        kept_per_step: list[list[tuple[LiveRequest, common_pb2.RequestDelta]]] = []
        for step in steps:
            kept = []
            for delta in step.deltas:
                request = self._live.get(delta.request_id)
                # A request re-dispatched elsewhere may still trail deltas from its old worker.
                if request is None or request.worker_id != worker_id or not _drop_repeats(request, delta):
                    continue
                if delta.HasField("usage") and delta.usage.cached_tokens:
                    cached_tokens[request.request_id] = delta.usage.cached_tokens
                offsets.setdefault(request.request_id, request.num_output_tokens)
                if delta.token_ids:
                    if request.num_output_tokens == 0:
                        first_token_ts[request.request_id] = now
                        self._meter.first_token(request.model, now - request.arrival_ts)
                    new_tokens[request.request_id].extend(delta.token_ids)
                    request.num_output_tokens += len(delta.token_ids)
                    # Kept beside the tokens, so a stream rebuilt from Redis (Resume, a gateway's
                    # catch-up after a reconnection) has its logprobs too.
                    if delta.logprobs:
                        logprobs[request.request_id] += [lp.SerializeToString() for lp in delta.logprobs]
                    if delta.offset == 0 and delta.prompt_logprobs:
                        prompt_logprobs[request.request_id] = [lp.SerializeToString() for lp in delta.prompt_logprobs]
                if delta.finish_reason:
                    _fill_usage(request, delta.usage)
                    reason = FinishReason(delta.finish_reason)
                    finished.append(Outcome(request, _STATUS_FOR_REASON[reason], reason, delta.error or None))
                kept.append((request, delta))
            kept_per_step.append(kept)
        stats = steps[-1].stats
        self._registry.report(worker_id, stats.num_running, stats.num_waiting, stats.kv_blocks_used)
        # Persist before relaying, so whatever a gateway has seen can be read back from Redis. The
        # step's tokens and its finishes land together: recovery never sees a complete output RUNNING.
        runs = {rid: (offsets[rid], tokens) for rid, tokens in new_tokens.items()}
        try:
            await self._outage.retry(
                lambda: self._store.append_step(
                    runs, first_token_ts, [o.stored() for o in finished], cached_tokens, logprobs, prompt_logprobs
                ),
                f"worker {worker_id}: recording {len(steps)} steps",
                backlog,
            )
        except Exception:
            # Not recorded, so not relayed: the requests' outputs end where Redis has them.
            for request_id, offset in offsets.items():
                if (request := self._live.get(request_id)) is not None:
                    request.num_output_tokens = offset
            raise
        self._end(finished)
        for step, kept in zip(steps, kept_per_step):
            for request, delta in kept:
                if delta.token_ids:
                    self._counters.generated(request.tenant, request.tenant_weight, len(delta.token_ids))
            self._publish(worker_id, step.step, kept)

    async def finish(self, outcomes: Iterable[Outcome]) -> None:
        """Ends requests that no worker step ended (a cancel, a failure): frees their worker slot,
        records their terminal state, and sends their gateways a final delta (one TokenBatch per gateway)."""
        outcomes = list(outcomes)
        if not outcomes:
            return
        for outcome in outcomes:
            self._forget(outcome.request)
        await self._outage.retry(
            lambda: self._store.finish_many([o.stored() for o in outcomes]), f"finishing {len(outcomes)} requests"
        )
        finals = []
        for outcome in outcomes:
            delta = common_pb2.RequestDelta(
                request_id=outcome.request.request_id,
                offset=outcome.request.num_output_tokens,
                finish_reason=outcome.reason,
                error=outcome.error or "",
            )
            _fill_usage(outcome.request, delta.usage)
            finals.append((outcome.request, delta))
        # Not from any worker step: worker_id and step stay empty.
        self._publish("", 0, finals)
        self._on_change()

    def interrupt(self, requests: Iterable[LiveRequest], reason: str) -> None:
        """Ends the gateways' streams of requests that live on but cannot stream now, each at the
        offset Redis holds: their clients get UNAVAILABLE and resume from there."""
        deltas = []
        for request in requests:
            offset = request.num_output_tokens
            deltas.append(
                (
                    request,
                    common_pb2.RequestDelta(
                        request_id=request.request_id,
                        offset=offset,
                        finish_reason=sampling_pb2.FINISH_REASON_ERROR,
                        error=f"{STREAM_INTERRUPTED} ({reason}): the request runs on; resume it at offset {offset}",
                    ),
                )
            )
        self._publish("", 0, deltas)

    def moved(self, request: LiveRequest, previous_gateway: str) -> None:
        """Ends `previous_gateway`'s stream of a request that now streams to another gateway."""
        delta = common_pb2.RequestDelta(
            request_id=request.request_id,
            offset=request.num_output_tokens,
            finish_reason=sampling_pb2.FINISH_REASON_ABORT,
            error=f"resumed on gateway {request.gateway_id}",
        )
        _fill_usage(request, delta.usage)
        self._relay.publish(previous_gateway, scheduler_pb2.TokenBatch(deltas=[delta]))

    def _end(self, outcomes: list[Outcome]) -> None:
        """Ends requests whose terminal state is already in Redis."""
        for outcome in outcomes:
            self._forget(outcome.request)
        if outcomes:
            self._on_change()

    def _forget(self, request: LiveRequest) -> None:
        self._live.pop(request.request_id, None)
        self._meter.finished(request.model, request.dispatched_at)
        worker = self._registry.get(request.worker_id or "")
        if worker is not None:
            worker.release(request.request_id, request.priority)
        if request.queue_span is not None:
            request.queue_span.end()
            request.queue_span = None
        for timer in (request.deadline_timer, request.ttft_timer):
            if timer is not None:
                timer.cancel()

    def _publish(self, worker_id: str, step: int, deltas: list[tuple[LiveRequest, common_pb2.RequestDelta]]) -> None:
        by_gateway: dict[str, list[common_pb2.RequestDelta]] = defaultdict(list)
        for request, delta in deltas:
            by_gateway[request.gateway_id].append(delta)
        for gateway_id, gateway_deltas in by_gateway.items():
            self._relay.publish(
                gateway_id, scheduler_pb2.TokenBatch(worker_id=worker_id, step=step, deltas=gateway_deltas)
            )


def _drop_repeats(request: LiveRequest, delta: common_pb2.RequestDelta) -> bool:
    """Cuts tokens the request already has, which would corrupt its append-only output in
    Redis; False when nothing is left to handle."""
    repeated = min(request.num_output_tokens - delta.offset, len(delta.token_ids))
    if repeated > 0:
        log.warning("request %s: dropping %d repeated tokens at offset %d", request.request_id, repeated, delta.offset)
        del delta.token_ids[:repeated]
        del delta.logprobs[:repeated]
        delta.offset += repeated
    return bool(delta.token_ids or delta.finish_reason)


def _fill_usage(request: LiveRequest, usage: sampling_pb2.Usage) -> None:
    """Token counts over every attempt; the worker only knows its own (cached_tokens is kept)."""
    usage.prompt_tokens = len(request.prompt_token_ids)
    usage.completion_tokens = request.num_output_tokens
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens

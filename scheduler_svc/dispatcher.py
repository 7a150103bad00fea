"""Admission, the dispatch loop, and what happens when a worker comes or goes."""

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from opentelemetry import trace

from scheduler_svc.deadlines import Deadlines
from scheduler_svc.kv_handoff import hand_off_kv
from scheduler_svc.live_request import LiveRequest, queue_span
from scheduler_svc.load_meter import LoadMeter
from scheduler_svc.model_coverage import ModelCoverage
from scheduler_svc.prefill_decision import decide_prefill
from scheduler_svc.relay import Relay
from scheduler_svc.remote_prefill import RemotePrefills
from scheduler_svc.request_queue import RequestQueue
from scheduler_svc.request_table import Outcome, RequestTable
from scheduler_svc.router import Router
from scheduler_svc.settings import SchedulerSettings
from scheduler_svc.store_outage import StoreOutage
from scheduler_svc.worker_registry import RegisteredWorker, WorkerRegistry
from scheduler_svc.worker_session import WorkerSession
from shardline.core.errors import NotFound, ShardlineError, Unavailable
from shardline.core.store.request_record import FinishReason, RequestStatus
from shardline.core.store.request_store import RequestStore, StoreUnavailable
from shardline.proto import worker_pb2
from tracing import attributes as attr
from tracing.grpc_context import extract_context
from tracing.metrics import FAILOVERS, QUEUE_DEPTH, RUNNING_REQUESTS

log = logging.getLogger(__name__)

T = TypeVar("T")

_STOP_TIMEOUT_S = 5.0  # how long stop() waits for its tasks and worker streams


class DuplicateSubmit(ShardlineError):
    """A request id that is live or still retained was submitted again."""

    code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class Dispatcher:
    """Admits requests, hands them to workers with room, and takes them back from workers that die."""

    def __init__(self, settings: SchedulerSettings, store: RequestStore, relay: Relay, tracer: trace.Tracer) -> None:
        self._settings = settings
        self._store = store
        self._tracer = tracer
        self._wake = asyncio.Event()  # set whenever a request or a worker slot may be dispatchable
        self.queue = RequestQueue(settings.queue_capacity, settings.queue_order)
        self.registry = WorkerRegistry(settings.dispatch_overcommit, settings.heartbeat_timeout_s)
        self._outage = StoreOutage(settings.redis_outage_s, settings.redis_outage_max_steps)
        self.meter = LoadMeter()  # what the autoscaler reads of each model's load
        self.requests = RequestTable(
            store, relay, self.registry, self._wake.set, self._outage, self.queue.counters, self.meter
        )
        self._deadlines = Deadlines(self.queue, self.requests, self.cancel)
        no_worker_s = settings.no_worker_timeout_s
        if settings.autoscale_policy != "static":
            no_worker_s += settings.autoscale_cold_start_s
        self.coverage = ModelCoverage(self.registry, self.queue, self.requests, no_worker_s)
        self.store_up = True  # Redis answered its last ping; nothing is dispatched while it does not
        self.on_store_health: Callable[[bool], Awaitable[None]] | None = None  # told when that changes
        self._parked: list[LiveRequest] = []  # held by no worker, waiting for Redis to re-queue them
        self._router = Router(settings.affinity_load_slack)
        self._sessions: dict[str, WorkerSession] = {}
        self._tasks: list[asyncio.Task] = []
        self._admitting: dict[str, asyncio.Future[int]] = {}  # Submits still writing their request
        self._releases: dict[str, asyncio.Task[tuple[int, int]]] = {}  # workers leaving the pool now
        self._prefills = RemotePrefills(tracer, settings.remote_prefill_timeout_s, self._prefilled)

    async def start(self) -> None:
        """Re-queues every unfinished request found in Redis, then starts dispatching."""
        await self._recover()
        self._tasks = [
            asyncio.create_task(self._dispatch_loop(), name="dispatch"),
            asyncio.create_task(self._watch_heartbeats(), name="heartbeats"),
            asyncio.create_task(self._watch_store(), name="store"),
            asyncio.create_task(self._watch_coverage(), name="coverage"),
        ]

    async def stop(self) -> None:
        """Stops dispatching and drops the worker streams; Redis keeps every request for the next start."""
        # A worker's release still handing off KV ends too: the requests it held stay RUNNING in Redis.
        # So does a remote prefill: its request stays RUNNING in Redis, and the next scheduler re-queues it.
        tasks = [*self._tasks, *self._deadlines.tasks, *self._releases.values(), *self._prefills.tasks]
        for task in tasks:
            task.cancel()
        # Bounded: a task stuck in an rpc or a Redis call must not turn a SIGTERM into a hang.
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=_STOP_TIMEOUT_S)
            if stuck:
                log.warning("dispatcher stop: %d tasks did not finish: %s", len(stuck), [t.get_name() for t in stuck])
        sessions = [asyncio.ensure_future(session.stop()) for session in self._sessions.values()]
        if sessions:
            await asyncio.wait(sessions, timeout=_STOP_TIMEOUT_S)
        self._sessions.clear()

    def running(self) -> int:
        """Requests dispatched and not finished."""
        return sum(len(worker.in_flight) for worker in self.registry)

    async def submit(self, request: LiveRequest) -> int:
        """Persists and queues a new request; returns how many requests are ahead of it."""
        if request.request_id in self.requests:
            raise DuplicateSubmit(f"request_id: {request.request_id!r} is already in use")
        if (refusal := self.coverage.refusal(request.model)) is not None:
            raise Unavailable(refusal)
        self.queue.reserve()  # before any write: a full queue leaves nothing behind in Redis
        # Shielded: a Submit cancelled mid-write (its client left, a deadline) must still end with the
        # request either written and held (queued, so a Cancel finds it) or not written at all.
        admission = asyncio.ensure_future(self._admit(request))
        self._admitting[request.request_id] = admission
        admission.add_done_callback(lambda _: self._admitting.pop(request.request_id, None))
        return await asyncio.shield(admission)

    async def _admit(self, request: LiveRequest) -> int:
        try:
            created = await self._store.create(request.to_record(), request.prompt_token_ids)
        except BaseException:
            self.queue.release()
            raise
        if not created:
            self.queue.release()
            raise DuplicateSubmit(f"request_id: {request.request_id!r} is already in use")
        self.requests.add(request)
        self.meter.arrived(request.model)
        self._open_queue_span(request)
        position = self.queue.push(request)
        self._deadlines.arm(request)
        self._wake.set()
        return position

    async def cancel(self, request_id: str, gateway_id: str = "") -> RequestStatus:
        """Dequeues a queued request, or asks its worker to abort it; returns the status it ends in.

        With `gateway_id` (a gateway whose stream of it ended), a request now streaming to another
        gateway, which a client resumed it on, is left alone.
        """
        admission = self._admitting.get(request_id)
        if admission is not None:  # its Submit is still writing it: cancel what that leaves
            await asyncio.wait([admission])
        request = self.requests.get(request_id)
        if request is None:
            record = await self._store.get(request_id)
            if record is None:
                raise NotFound(f"request_id: no request {request_id!r}")
            if not record.status.is_finished and await self._store.finish(
                request_id, RequestStatus.CANCELLED, FinishReason.ABORT
            ):
                # Live in Redis but held by no one here (left by a crash mid-write): nothing runs it.
                log.warning("request %s was live in Redis only: cancelled there", request_id)
                return RequestStatus.CANCELLED
            return record.status
        if gateway_id and request.gateway_id != gateway_id:
            log.info(
                "request %s: cancel from %s ignored, %s streams it now", request_id, gateway_id, request.gateway_id
            )
            return RequestStatus.RUNNING if request.worker_id is not None else RequestStatus.QUEUED
        if self.queue.remove(request) or self._prefills.cancel(request_id):
            # Queued, or waiting for its remote prefill: no worker has it yet.
            await self.requests.finish([Outcome(request, RequestStatus.CANCELLED, FinishReason.ABORT)])
        elif not request.cancelled:
            # The worker frees its KV blocks and answers with an ABORT delta, which finishes it;
            # if the worker dies first (or is dying now), the death handler finishes it instead.
            request.cancelled = True
            session = self._sessions.get(request.worker_id or "")
            if session is not None:
                session.send(worker_pb2.WorkerCommand(abort=[request_id]))
        return RequestStatus.CANCELLED

    async def attach(self, request_id: str, gateway_id: str, read_record: Callable[[], Awaitable[T]]) -> T:
        """Sends a live request's later deltas to another gateway (a finished one is left as is), and
        returns `read_record()`, read so that those deltas start exactly where the record ends."""
        async with self.requests.steps_held(request_id):
            request = self.requests.get(request_id)
            if request is not None and request.gateway_id != gateway_id:
                previous, request.gateway_id = request.gateway_id, gateway_id
                await self._store.set_gateway(request_id, gateway_id)
                # The previous gateway's stream of it (a client gone, or one that lost track) ends.
                self.requests.moved(request, previous)
            return await read_record()

    async def register_worker(self, info: worker_pb2.WorkerInfo) -> None:
        """Adds a worker and opens its Session; a known id is a restarted worker, so its old run dies first."""
        old = self._sessions.get(info.worker_id)
        if old is not None:
            log.warning("worker %s registered again: re-queueing what its previous run held", info.worker_id)
            await old.close("its worker registered again")
        self._sessions[info.worker_id] = await WorkerSession.open(
            info, self.requests.handle_steps, self._on_worker_lost, self._settings.worker_connect_timeout_s
        )
        self.registry.add(info)
        log.info(
            "worker %s registered at %s (%s, max_num_seqs=%d)",
            info.worker_id,
            info.address,
            info.model,
            info.max_num_seqs,
        )
        self._wake.set()

    async def release_worker(self, worker_id: str, reason: str, deadline: float | None = None) -> tuple[int, int]:
        """Takes a drained worker out of the pool; what it still runs is re-queued with its tokens, not as a
        failure, after its KV blocks were sent to the workers it moves to (kv_handoff.py), within
        `deadline` (time.monotonic()) if given. Returns how many requests moved and how many of
        those took their blocks along. A second call while one runs waits for that one."""
        running = self._releases.get(worker_id)
        if running is not None:
            return await asyncio.shield(running)
        release = asyncio.create_task(self._release(worker_id, reason, deadline), name=f"release-{worker_id}")
        self._releases[worker_id] = release
        release.add_done_callback(lambda _: self._releases.pop(worker_id, None))
        # Shielded: a caller that gives up (a DrainWorker past its deadline) must not leave the
        # worker half released, its requests neither moved nor failed.
        return await asyncio.shield(release)

    async def _release(self, worker_id: str, reason: str, deadline: float | None) -> tuple[int, int]:
        session = self._sessions.get(worker_id)
        worker = self.registry.get(worker_id)
        moved = sent = 0
        if session is not None and worker is not None and worker.in_flight:
            held = [request for rid in worker.in_flight if (request := self.requests.get(rid)) is not None]
            moved = len(held)
            # Longest context first: within a deadline, the sends that save the most prefill go first.
            held.sort(key=lambda r: len(r.prompt_token_ids) + r.num_output_tokens, reverse=True)
            # The worker is alive: its blocks go ahead of its requests, which then skip their prefill.
            # (Not those still waiting for a remote prefill: the worker has computed nothing of them.)
            computed = [request for request in held if request.request_id not in self._prefills]
            sent = await hand_off_kv(
                worker, computed, lambda r: self.registry.with_room(r.model, r.priority), self._router, deadline
            )
        if session is not None:
            await session.close(reason, migrate=True)
        return moved, sent

    async def drain_worker(self, worker_id: str, deadline: float) -> tuple[int, int]:
        """A worker that is stopping leaves the pool at once: no new requests, and what it runs moves
        elsewhere with its KV blocks sent ahead until `deadline` (time.monotonic()), as an autoscaler
        drain past its timeout does. Returns (moved, handed off); NotFound for a worker not in the pool."""
        worker = self.registry.get(worker_id)
        if worker is None or worker_id not in self._sessions:
            raise NotFound(f"worker_id: no worker {worker_id!r} in the pool")
        worker.draining = True  # nothing new is dispatched to it from now on
        log.info("worker %s is stopping: moving its %d requests with their KV", worker_id, len(worker.in_flight))
        moved, sent = await self.release_worker(worker_id, "stopping (SIGTERM)", deadline)
        if sent < moved:
            log.warning(
                "worker %s stopped: %d of %d requests moved without their KV blocks and re-prefill",
                worker_id,
                moved - sent,
                moved,
            )
        return moved, sent

    def heartbeat(self, worker_id: str, running: int, waiting: int, kv_blocks_used: int) -> bool:
        """Records a worker's load; False when it is unknown and must register again."""
        return self.registry.report(worker_id, running, waiting, kv_blocks_used)

    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._dispatch_ready()
            except Exception:
                # Only the Redis bookkeeping can fail here; the loop must outlive it.
                log.exception("dispatch round failed")
            QUEUE_DEPTH.set(len(self.queue))
            RUNNING_REQUESTS.set(self.running())

    async def _dispatch_ready(self) -> None:
        """Hands queued requests to workers while any has room: one WorkerCommand per worker."""
        if not self.store_up:  # their tokens could not be recorded; _watch_store wakes the loop
            return
        adds: dict[str, list[worker_pb2.NewRequest]] = defaultdict(list)
        dispatched: list[tuple[LiveRequest, trace.Span]] = []
        remote: list[tuple[LiveRequest, RegisteredWorker, worker_pb2.NewRequest, trace.Span]] = []
        # A full worker still takes a class better than the worst it holds, for its engine to preempt.
        while self.registry.has_room(self.queue.best_priority()):
            request = self.queue.pop(lambda r: bool(self.registry.with_room(r.model, r.priority)))
            if request is None:
                break
            route = self._router.route(request, self.registry.with_room(request.model, request.priority))
            worker = route.worker
            prefill_workers = self.registry.prefill_workers(request.model)
            decision = decide_prefill(
                worker.role,
                len(request.prompt_token_ids) + len(request.output_token_ids),
                route.cached_tokens,
                len(prefill_workers),
                self._settings.remote_prefill_min_tokens,
                request.params.HasField("prompt_logprobs") and not request.output_token_ids,
                worker.info.tp_size,
            )
            worker.hold(request.request_id, request.priority)
            request.worker_id, request.attempt = worker.worker_id, request.attempt + 1
            if request.attempt > 1:
                FAILOVERS.inc()
            request.dispatched_at = self.meter.now()
            span = self._tracer.start_span(
                "dispatch",
                context=extract_context({"traceparent": request.traceparent}),
                attributes={
                    attr.REQUEST_ID: request.request_id,
                    attr.TENANT: request.tenant,
                    attr.WORKER_ID: worker.worker_id,
                    attr.ATTEMPT: request.attempt,
                    attr.QUEUE_DEPTH: len(self.queue),
                    # A sum over the workers, a few each dispatch: the series' "running" reads it.
                    attr.RUNNING_REQUESTS: self.running(),
                    attr.PREFILL_REMOTE: decision.remote,
                    attr.PREFILL_REASON: decision.reason,
                    attr.PREFILL_CACHED_TOKENS: route.cached_tokens,
                },
            )
            if decision.remote:  # the worker gets it once a prefill worker has sent it the prompt's blocks
                remote.append((request, worker, request.new_request(), span))
            else:
                adds[worker.worker_id].append(request.new_request())
            # Redis has these; a later re-dispatch reads them back with whatever came after.
            request.output_token_ids = []
            if request.queue_span is not None:
                request.queue_span.end()
                request.queue_span = None
            dispatched.append((request, span))
        for worker_id, new_requests in adds.items():
            self._sessions[worker_id].send(worker_pb2.WorkerCommand(add=new_requests))
        if dispatched:
            await self._store.mark_dispatched_many([(r.request_id, r.worker_id, r.attempt) for r, _ in dispatched])
        for request, worker, new, span in remote:  # RUNNING in Redis first, as for the others
            self._prefills.start(
                request, worker, new, self.registry.prefill_workers(request.model), trace.set_span_in_context(span)
            )
        for _, span in dispatched:
            span.end()

    def _prefilled(self, request: LiveRequest, worker: RegisteredWorker, new: worker_pb2.NewRequest) -> None:
        """A remote prefill is settled: the request goes to its worker, unless it left it meanwhile
        (the worker died or was drained, and the request was re-queued, or it was cancelled)."""
        session = self._sessions.get(worker.worker_id)
        if self.requests.get(request.request_id) is not request or request.worker_id != worker.worker_id:
            log.info("request %s left %s during its remote prefill", request.request_id, worker.worker_id)
            return
        if session is None:  # its worker is gone and its death handler about to re-queue it
            return
        session.send(worker_pb2.WorkerCommand(add=[new]))

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._settings.heartbeat_interval_s)
            for worker_id in self.registry.expired():
                session = self._sessions.get(worker_id)
                if session is not None:
                    await session.close(f"silent for over {self._settings.heartbeat_timeout_s:.1f}s")

    async def _watch_coverage(self) -> None:
        """Fails the queued requests of models that no live worker has served for too long."""
        while True:
            await asyncio.sleep(min(1.0, self.coverage.timeout_s / 4))
            try:
                await self.coverage.sweep()
            except Exception:  # a Redis write; the next sweep tries again
                log.exception("no-worker sweep failed")

    async def _on_worker_lost(self, worker_id: str, reason: str) -> None:
        """Re-queues what a dead worker held, with the tokens it generated, or fails it after max_attempts."""
        session = self._sessions.pop(worker_id, None)
        worker = self.registry.remove(worker_id)
        if worker is None:
            return
        held = [request for rid in worker.in_flight if (request := self.requests.get(rid)) is not None]
        for request in held:  # re-queued below: a remote prefill for this worker is of no use now
            self._prefills.cancel(request.request_id)
        if session is not None and (session.unrecorded or session.migrated):
            # Redis failed it, or the autoscaler moved its requests, not the worker: the next
            # dispatch resumes the same attempt.
            for request in held:
                request.attempt = max(0, request.attempt - 1)
        lost = f"worker {worker_id} lost ({reason})"
        try:
            outputs = await self._outage.retry(lambda: self._read_outputs(held), f"re-queueing {lost}")
            ended, requeued = await self._resume(held, outputs, lost)
        except StoreUnavailable:
            self._park(held, "redis unavailable")
            return
        log.warning("%s: re-queueing %d requests, ending %d", lost, requeued, ended)

    async def _read_outputs(self, requests: list[LiveRequest]) -> list[list[int]]:
        return list(await asyncio.gather(*(self._store.get_tokens(r.request_id) for r in requests)))

    async def _resume(self, requests: list[LiveRequest], outputs: list[list[int]], lost: str) -> tuple[int, int]:
        """Re-queues requests no worker holds, with the outputs Redis has, or ends those cancelled or
        out of attempts; returns how many it ended and how many it re-queued."""
        outcomes, retry = [], []
        for request, output in zip(requests, outputs):
            request.output_token_ids, request.num_output_tokens = output, len(output)
            if request.cancelled:
                outcomes.append(Outcome(request, RequestStatus.CANCELLED, FinishReason.ABORT))
            elif request.attempt >= self._settings.max_attempts:
                error = f"{lost} on attempt {request.attempt} of {self._settings.max_attempts}"
                outcomes.append(Outcome(request, RequestStatus.FAILED, FinishReason.ERROR, error))
            else:
                retry.append(request)
        await self._requeue(retry)
        await self.requests.finish(outcomes)
        return len(outcomes), len(retry)

    def _park(self, requests: list[LiveRequest], reason: str) -> None:
        """Holds requests whose output Redis cannot give now: their streams end resumably at what
        Redis has, and _watch_store re-queues them once it answers."""
        for request in requests:
            request.worker_id = None
        self.requests.interrupt(requests, reason)
        self._parked += requests
        if requests:
            log.warning("%d requests wait for redis to come back (%s)", len(requests), reason)

    async def _watch_store(self) -> None:
        """Pings Redis: reports when it stops or starts answering, and re-queues parked requests."""
        while True:
            await asyncio.sleep(self._settings.redis_check_interval_s)
            try:
                await self._store_checked()
            except Exception:
                log.exception("redis check failed")

    async def _store_checked(self) -> None:
        try:
            await self._store.ping()
            up, problem = True, ""
        except StoreUnavailable as exc:
            up, problem = False, str(exc)
        if up != self.store_up:
            if up:
                log.info("redis answers again: dispatching")
            else:
                log.error("%s: not serving, nothing dispatched until it answers", problem)
            self.store_up = up
            self._wake.set()
            if self.on_store_health is not None:
                await self.on_store_health(up)
        if up and self._parked:
            parked, self._parked = self._parked, []
            live = [request for request in parked if self.requests.get(request.request_id) is request]
            try:
                ended, requeued = await self._resume(live, await self._read_outputs(live), "redis outage")
            except StoreUnavailable:
                self._parked = live + self._parked
                return
            log.info("redis is back: re-queued %d requests, ended %d", requeued, ended)

    async def _recover(self) -> None:
        """Rebuilds the queue from Redis after a restart: every QUEUED or RUNNING request goes back in."""
        records = await self._store.get_many(await self._store.list_active())
        prompts = await asyncio.gather(*(self._store.get_prompt(record.request_id) for record in records))
        outputs = await asyncio.gather(*(self._store.get_tokens(record.request_id) for record in records))
        recovered = []
        for record, prompt, output in zip(records, prompts, outputs):
            if prompt is None:
                continue
            request = LiveRequest.from_record(record, prompt, output)
            if record.status == RequestStatus.RUNNING and request.attempt:
                # Running when this scheduler's predecessor stopped: its next dispatch resumes that
                # attempt. Only worker failures count toward max_attempts, not scheduler restarts.
                request.attempt -= 1
            recovered.append(request)
            self.requests.add(request)
        await self._requeue(recovered)
        if recovered:
            log.info("recovered %d unfinished requests from Redis", len(recovered))

    async def _requeue(self, requests: list[LiveRequest]) -> None:
        # QUEUED is written before they can be dispatched: written after, it could land on top of
        # the RUNNING of a dispatch that came first (and a restart would then count that run again).
        await asyncio.gather(*(self._store.set_status(r.request_id, RequestStatus.QUEUED) for r in requests))
        # Latest arrival pushed first, so each class's front ends up in arrival order.
        for request in sorted(requests, key=lambda r: r.arrival_ts, reverse=True):
            request.worker_id = None
            self._open_queue_span(request)
            self.queue.push_front(request)
            self._deadlines.arm(request)
        self._wake.set()

    def _open_queue_span(self, request: LiveRequest) -> None:
        request.queue_span = queue_span(self._tracer, request, len(self.queue), self.running())

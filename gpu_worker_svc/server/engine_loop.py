"""The engine thread: the only code that touches the LLMEngine.

Commands from the Session stream queue up in an inbox and are applied in a
batch before each step. Each step becomes ONE StepOutput message (none for a
step that ran nothing and reported nothing), handed to the asyncio side with
`call_soon_threadsafe`, so the loop never waits on the network. When there is
no work the thread sleeps on the inbox.

One Session is live at a time and owns every request in the engine: a new
session, or the end of the current one, aborts them without a final delta
(the scheduler re-dispatches them). Remote prefills (KvTransfer.PrefillBlocks) are
the one exception: they run in the engine beside the session's requests, belong to
no session, and end with their KV exported instead of any delta.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from gpu_worker_svc.engine.kv_transfer import KvBlocks
from gpu_worker_svc.engine.llm_engine import LLMEngine
from gpu_worker_svc.engine.lora_adapters import UnknownAdapterError
from gpu_worker_svc.engine.model_runner import EngineDeadError
from gpu_worker_svc.engine.outputs import StepResult
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.engine.torch_thread import TorchThread
from gpu_worker_svc.server.grammar_gate import GrammarGate
from gpu_worker_svc.server.request_params import EngineLimits, engine_request
from gpu_worker_svc.server.step_message import abort_delta, error_delta, request_delta, stats_message
from gpu_worker_svc.server.telemetry import StepTelemetry
from shardline.proto import common_pb2, worker_pb2

log = logging.getLogger(__name__)

# How often an idle engine checks that its tensor-parallel ranks are alive.
_IDLE_CHECK_S = 0.5


@dataclass(slots=True)
class SessionEnd:
    """Queued last on a session's stream: why the worker ends it (None: the client ended it)."""

    error: str | None


@dataclass(slots=True)
class SessionLink:
    """The asyncio end of one Session stream, reachable from the engine thread."""

    id: int  # unique per stream
    loop: asyncio.AbstractEventLoop  # the loop serving the stream
    queue: asyncio.Queue  # StepOutput messages, then one SessionEnd

    def send(self, item: worker_pb2.StepOutput | SessionEnd) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the process is exiting anyway
            pass


@dataclass(slots=True, frozen=True)
class WorkerLoad:
    """Occupancy after the latest step, for heartbeats; replaced whole, so reads need no lock."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0


@dataclass(slots=True)
class _Open:
    link: SessionLink


@dataclass(slots=True)
class _Close:
    session_id: int


@dataclass(slots=True)
class _Commands:
    session_id: int
    command: worker_pb2.WorkerCommand


class _Stop:
    pass


@dataclass(slots=True)
class _Call:
    """Work on the engine itself between steps (a KV export or import), answered through `future`."""

    fn: Callable[[LLMEngine], Any]
    future: Future[Any]


@dataclass(slots=True)
class _Prefill:
    """A remote prefill: the KV of `token_ids`, computed for another worker; its sampled token is dropped."""

    job_id: str  # its id in the engine, never one a session's request can take
    token_ids: list[int]
    priority: int
    future: Future[KvBlocks]  # the prefix cache's blocks of token_ids once the prefill is done


@dataclass(slots=True)
class _CancelPrefill:
    job_id: str


class PrefillFailed(Exception):
    """A remote prefill ended without its KV: aborted, refused by the engine, or the worker stopping."""


# Its one sampled token is dropped, so the cheapest: greedy, and nothing that could stop it early.
_PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, seed=0)

T = TypeVar("T")


class _GrammarsCompiled:
    """A compile thread is done: hand the structured output requests it was holding to the engine."""


class Inbox:
    """Items for the engine thread, taken all at once."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: list[object] = []

    def put(self, item: object) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def drain(self, wait_s: float) -> list[object]:
        """Everything queued; when empty, waits up to `wait_s` for the first item."""
        with self._cond:
            if not self._items and wait_s > 0:
                self._cond.wait(wait_s)
            items, self._items = self._items, []
        return items


def prefill_lengths(items: list[object]) -> list[int]:
    """Tokens each request added by `items` prefills: its prompt, and a resumed one's earlier output."""
    return [
        len(r.prompt_token_ids) + len(r.output_token_ids)
        for item in items
        if isinstance(item, _Commands)
        for r in item.command.add
    ]


def collect_burst(
    inbox: Inbox, items: list[object], gap_s: float, fills_a_step: Callable[[list[object]], bool]
) -> list[object]:
    """`items` plus what keeps arriving within `gap_s` of the previous arrival, up to 10 gaps in all.

    A burst of requests reaches an idle worker over a few milliseconds (each is tokenized and
    dispatched on its own). Starting the first prefill at once would leave the rest waiting a
    whole step, which on a CPU can take seconds; a few milliseconds' wait lets them share it.
    The wait ends as soon as the burst fills a step, since waiting longer could add nothing to it.
    (Prompt tokens are counted whole: with prefix-cache hits a step holds more, and the wait may
    end early.)
    """
    deadline = time.monotonic() + 10 * gap_s
    while time.monotonic() < deadline and not fills_a_step(items):
        more = inbox.drain(gap_s)
        if not more:
            break
        items += more
    return items


class EngineLoop:
    """Runs the engine in one dedicated thread; every other method is safe to call from any thread."""

    def __init__(
        self,
        engine: LLMEngine,
        telemetry: StepTelemetry,
        on_fatal: Callable[[BaseException], None],
        admission_gap_s: float = 0.0,
        thread: TorchThread | None = None,
        model: str = "",
    ) -> None:
        self._engine = engine
        self._model = model  # the served model's name: a request naming another names a LoRA adapter
        # The thread that built the engine, where there is one: a second thread of OpenMP work in a
        # process slows every step (engine/torch_thread.py).
        self._torch = thread or TorchThread("engine-loop")
        self._admission_gap_s = admission_gap_s
        self._telemetry = telemetry
        self._limits = EngineLimits.of(engine)
        self._on_fatal = on_fatal
        self._inbox = Inbox()
        self._done: Future[None] | None = None  # the loop's run on the torch thread, once started
        self._session: SessionLink | None = None
        self._requests: set[str] = set()  # ids in the engine, all owned by the live session
        self._grammar_gate = GrammarGate(engine, lambda: self._inbox.put(_GrammarsCompiled()))
        self._errors: list[common_pb2.RequestDelta] = []  # refused requests, sent with the next step
        self._prefills: dict[str, _Prefill] = {}  # remote prefills in the engine, by job id
        self._prefill_ids = itertools.count(1)
        self._step = 0
        self.load = WorkerLoad()

    @property
    def engine(self) -> LLMEngine:
        """The engine, for what is safe off its thread (reading an adapter's files); the rest goes through call()."""
        return self._engine

    def start(self) -> None:
        self._done = self._torch.submit(self._run)

    def open_session(self, link: SessionLink) -> None:
        self._inbox.put(_Open(link))

    def close_session(self, session_id: int) -> None:
        self._inbox.put(_Close(session_id))

    def submit(self, session_id: int, command: worker_pb2.WorkerCommand) -> None:
        self._inbox.put(_Commands(session_id, command))

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Runs `fn(engine)` on the engine thread between two steps, so it never races a step."""
        future: Future[T] = Future()
        self._inbox.put(_Call(fn, future))
        return future

    @property
    def limits(self) -> EngineLimits:
        """What a sequence must fit in this engine: its context length and vocabulary."""
        return self._limits

    def prefill(self, request_id: str, token_ids: list[int], priority: int = 0) -> tuple[str, Future[KvBlocks]]:
        """Starts a remote prefill of `token_ids` (checked against `limits` by the caller); returns its
        job id (for cancel_prefill) and a future of the full blocks' KV, or PrefillFailed."""
        job = _Prefill(f"prefill/{request_id}/{next(self._prefill_ids)}", token_ids, priority, Future())
        self._inbox.put(job)
        return job.job_id, job.future

    def cancel_prefill(self, job_id: str) -> None:
        """Drops a remote prefill whose caller has gone; a finished one is left alone."""
        self._inbox.put(_CancelPrefill(job_id))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort every request, end the live session and wait for the thread to exit."""
        self._inbox.put(_Stop())
        if self._done is not None:
            wait([self._done], timeout_s)

    # -- the engine thread -----------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # EngineDeadError, or a bug: either way the engine's state is lost
            log.exception("engine loop died")
            try:
                self._end_session(f"engine died: {exc}")
            finally:
                self._on_fatal(exc)  # whatever happens, the process must exit
            return
        finally:
            self._fail_prefills("the worker is stopping")
        self._drop_requests()
        self._end_session("worker is shutting down")

    def _loop(self) -> None:
        while True:
            idle = not (self._engine.has_unfinished or self._errors)
            items = self._inbox.drain(_IDLE_CHECK_S if idle else 0.0)
            if idle and items and self._admission_gap_s > 0:
                items = collect_burst(self._inbox, items, self._admission_gap_s, self._fills_a_step)
            for item in items:
                if isinstance(item, _Stop):
                    return
                self._apply(item)
            if self._engine.is_dead:
                raise EngineDeadError("a tensor-parallel rank died")
            if self._engine.has_unfinished or self._errors:
                self._step_once()

    def _fills_a_step(self, items: list[object]) -> bool:
        return self._engine.scheduler.config.fills_a_step(prefill_lengths(items))

    def _step_once(self) -> None:
        start_ns = time.time_ns()
        out = self._engine.step()
        end_ns = time.time_ns()
        self._finish_prefills(out)
        deltas, self._errors = self._errors, []
        deltas += [request_delta(o) for o in out.outputs]
        self._requests.difference_update(o.request_id for o in out.outputs if o.finish_reason)
        if self._session is not None and (deltas or out.stats is not None):
            self._session.send(
                worker_pb2.StepOutput(step=self._step, deltas=deltas, stats=stats_message(self._engine, out.stats))
            )
        self._refresh_load()
        self._telemetry.step(self._step, out, start_ns, end_ns)
        self._step += 1

    def _apply(self, item: object) -> None:
        match item:
            case _Open(link):
                if self._session is not None:
                    log.warning("session %d replaced by session %d", self._session.id, link.id)
                    self._drop_requests()
                    self._end_session("replaced by a newer session")
                self._session = link
            case _Close(session_id) if self._session is not None and self._session.id == session_id:
                self._drop_requests()
                self._session = None
            case _Commands(session_id, command) if self._session is not None and self._session.id == session_id:
                for new in command.add:
                    self._add(new)
                for request_id in command.abort:
                    held = self._grammar_gate.remove(request_id)
                    if held is not None:
                        self._errors.append(abort_delta(held))
                    self._engine.abort_request(request_id)  # its final delta comes with the next step
            case _Call(fn, future) if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self._engine))
                except Exception as exc:  # the caller's to report: the engine is as it was
                    future.set_exception(exc)
            case _Prefill() as job if job.future.set_running_or_notify_cancel():
                self._engine.add_request(job.job_id, job.token_ids, _PREFILL_PARAMS, priority=job.priority)
                self._prefills[job.job_id] = job
            case _CancelPrefill(job_id) if job_id in self._prefills:
                self._engine.abort_request(job_id, report=False)
                self._prefills.pop(job_id).future.set_exception(PrefillFailed("cancelled by its caller"))
            case _GrammarsCompiled():
                for new, compiled in self._grammar_gate.release():
                    self._add(new, compiled)

    def _add(self, new: worker_pb2.NewRequest, compiled_grammar: object = None) -> None:
        if compiled_grammar is None:  # a released request was checked on its way in
            if new.request_id in self._requests or new.request_id in self._grammar_gate:
                log.warning("request %s is already running: duplicate add ignored", new.request_id)
                return
            if self._grammar_gate.holds(new):
                self._refresh_load()  # an idle engine may not step for seconds: show it waiting now
                return
        adapter = None if new.model in ("", self._model) else new.model
        try:
            req = engine_request(new, self._limits)
            self._engine.add_request(
                new.request_id,
                list(new.prompt_token_ids),
                req.params,
                priority=new.priority,
                output_token_ids=list(new.output_token_ids),
                eos_token_id=req.eos_token_id,
                compiled_grammar=compiled_grammar,
                adapter=adapter,
            )
        except (ValueError, UnknownAdapterError) as exc:
            log.warning("request %s refused: %s", new.request_id, exc)
            self._errors.append(error_delta(new, str(exc)))
            return
        self._requests.add(new.request_id)
        self._telemetry.request_added(
            new.request_id,
            new.traceparent,
            len(new.prompt_token_ids),
            req.params.max_tokens,
            req.params.temperature,
            adapter,
        )

    def _finish_prefills(self, out: StepResult) -> None:
        """Takes the remote prefills' outputs out of the step (no session may see them) and hands each
        finished one its KV, exported before any later step can evict a block of it."""
        if not self._prefills:
            return
        kept = []
        for o in out.outputs:
            job = self._prefills.get(o.request_id)
            if job is None:
                kept.append(o)
            elif o.finish_reason is not None:
                del self._prefills[o.request_id]
                if o.finish_reason in ("stop", "length"):
                    job.future.set_result(self._engine.export_prefix(job.token_ids))
                else:
                    job.future.set_exception(PrefillFailed(o.error or o.finish_reason))
        out.outputs = kept

    def _fail_prefills(self, why: str) -> None:
        for job in self._prefills.values():
            job.future.set_exception(PrefillFailed(why))
        self._prefills.clear()

    def _drop_requests(self) -> None:
        """Abort every request without final deltas: their session is gone."""
        if self._requests:
            log.info("aborting %d requests of a closed session", len(self._requests))
        now_ns = time.time_ns()
        for request_id in self._requests:
            self._engine.abort_request(request_id, report=False)
            self._telemetry.request_dropped(request_id, now_ns)
        self._requests.clear()
        self._grammar_gate.clear()
        self._errors.clear()
        self._refresh_load()

    def _end_session(self, reason: str) -> None:
        if self._session is not None:
            self._session.send(SessionEnd(reason))
            self._session = None

    def _refresh_load(self) -> None:
        engine = self._engine
        # Requests held for their grammar wait too: the scheduler's routing counts them.
        self.load = WorkerLoad(
            engine.scheduler.num_running,
            engine.scheduler.num_waiting + len(self._grammar_gate),
            engine.block_pool.num_used_blocks,
        )
        self._telemetry.occupancy(self.load.running, self.load.kv_blocks_used, engine.block_pool.num_blocks)

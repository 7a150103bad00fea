"""The worker pool: who is registered, what each one holds, and who has gone quiet."""

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from shardline.core.worker_role import WorkerRole, role_of
from shardline.proto import worker_pb2


@dataclass(slots=True)
class RegisteredWorker:
    """One worker as the scheduler sees it."""

    info: worker_pb2.WorkerInfo  # identity, address, model and capacity, as registered
    capacity: int  # most requests the scheduler keeps in flight on it
    last_seen: float  # monotonic time of its last heartbeat or step
    last_seen_wall: float  # the same instant as unix time, for ListWorkers
    in_flight: set[str] = field(default_factory=set)  # requests dispatched to it and not finished
    classes: Counter[int] = field(default_factory=Counter)  # how many of those per priority class
    running: int = 0  # requests it reported running
    waiting: int = 0  # requests it reported waiting inside it
    kv_blocks_used: int = 0  # KV blocks it reported in use
    draining: bool = False  # the autoscaler is removing it: no new requests
    prefills_in_flight: int = 0  # remote prefills asked of it and not answered (a prefill worker)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> WorkerRole:
        """prefill, decode or both; RegisterWorker refused any other name."""
        return role_of(self.info.role)

    @property
    def runs_requests(self) -> bool:
        """False for a prefill worker: it only computes KV for the others, and is never dispatched to."""
        return self.role != "prefill"

    @property
    def load(self) -> float:
        """In-flight requests over max_num_seqs, so workers of different sizes compare."""
        return len(self.in_flight) / max(1, self.info.max_num_seqs)

    @property
    def has_room(self) -> bool:
        return self.runs_requests and not self.draining and len(self.in_flight) < self.capacity

    def has_room_for(self, priority: int) -> bool:
        """Room for a request of class `priority`: a free place, or, for a class strictly better than
        the worst it holds, one of max_num_seqs more, so that its engine can preempt that class
        instead of the request waiting here for one of them to finish."""
        if self.has_room:
            return True
        headroom = self.capacity + max(1, self.info.max_num_seqs)
        return (
            self.runs_requests
            and not self.draining
            and len(self.in_flight) < headroom
            and priority < max(self.classes, default=priority)
        )

    def hold(self, request_id: str, priority: int) -> None:
        """Counts a request dispatched to it."""
        self.in_flight.add(request_id)
        self.classes[priority] += 1

    def release(self, request_id: str, priority: int) -> None:
        """Forgets a request it held, finished or moved; one it does not hold is left alone."""
        if request_id not in self.in_flight:
            return
        self.in_flight.discard(request_id)
        if self.classes[priority] > 1:
            self.classes[priority] -= 1
        else:
            del self.classes[priority]

    def serves(self, model: str) -> bool:
        """True when it serves `model`, its own or one of its LoRA adapters; an empty model name takes any worker."""
        return not model or self.info.model == model or model in self.info.adapters


class WorkerRegistry:
    """Registered workers, with their in-flight requests and liveness.

    A worker's capacity is max_num_seqs times `overcommit`: a few requests
    beyond what it runs at once wait in its engine, so a freed slot is refilled
    in the same engine step instead of after a round trip to the scheduler.
    """

    def __init__(
        self, overcommit: float, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._overcommit = overcommit
        self._timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._workers: dict[str, RegisteredWorker] = {}

    def __iter__(self) -> Iterator[RegisteredWorker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def get(self, worker_id: str) -> RegisteredWorker | None:
        return self._workers.get(worker_id)

    def add(self, info: worker_pb2.WorkerInfo) -> RegisteredWorker:
        """Registers a worker; the caller has removed any earlier one with the same id."""
        capacity = max(1, math.ceil(info.max_num_seqs * self._overcommit))
        worker = RegisteredWorker(info=info, capacity=capacity, last_seen=self._clock(), last_seen_wall=time.time())
        self._workers[info.worker_id] = worker
        return worker

    def remove(self, worker_id: str) -> RegisteredWorker | None:
        """Drops a worker; the requests in its in_flight are the caller's to re-queue."""
        return self._workers.pop(worker_id, None)

    def report(self, worker_id: str, running: int, waiting: int, kv_blocks_used: int) -> bool:
        """Records a heartbeat's or step's load figures; False for an unknown worker."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.running, worker.waiting, worker.kv_blocks_used = running, waiting, kv_blocks_used
        worker.last_seen, worker.last_seen_wall = self._clock(), time.time()
        return True

    def expired(self) -> list[str]:
        """Workers silent for longer than the heartbeat timeout."""
        deadline = self._clock() - self._timeout_s
        return [worker_id for worker_id, worker in self._workers.items() if worker.last_seen < deadline]

    def with_room(self, model: str, priority: int | None = None) -> list[RegisteredWorker]:
        """Workers serving `model` that can take another request; with a `priority`, when none has
        a free place, those whose engine can preempt a worse class for it (has_room_for)."""
        serving = [worker for worker in self._workers.values() if worker.serves(model)]
        free = [worker for worker in serving if worker.has_room]
        if free or priority is None:
            return free
        return [worker for worker in serving if worker.has_room_for(priority)]

    def prefill_workers(self, model: str) -> list[RegisteredWorker]:
        """The prefill workers of `model` that take work now (not draining), the least busy first. Not those at
        TP > 1: they refuse to export KV, so they would only compute a prompt to no use."""
        ready = [
            w
            for w in self._workers.values()
            if w.role == "prefill" and not w.draining and w.info.tp_size <= 1 and w.serves(model)
        ]
        return sorted(ready, key=lambda w: (w.prefills_in_flight, w.worker_id))

    def longest_sequence(self, model: str) -> int | None:
        """The longest sequence any registered worker of `model` holds; None when none says."""
        lengths = [w.info.max_model_len for w in self._workers.values() if w.serves(model) and w.info.max_model_len]
        return max(lengths) if lengths else None

    def has_room(self, priority: int | None = None) -> bool:
        """True when any worker can take another request (of class `priority`: has_room_for)."""
        if priority is None:
            return any(worker.has_room for worker in self._workers.values())
        return any(worker.has_room_for(priority) for worker in self._workers.values())

"""The global queue: bounded; lower priority value first; within a class, the tenant with the least
virtual counter first (fair_share.py); within a tenant, earliest deadline first, then arrival."""

import bisect
import itertools
from collections import Counter
from collections.abc import Callable, Iterator

from scheduler_svc.fair_share import VirtualCounters
from scheduler_svc.live_request import LiveRequest
from shardline.core.errors import ResourceExhausted

_sequence = itertools.count()  # breaks ties between equal keys in push order


class _Lane:
    """One tenant's requests in one class, in serving order: the requests that come back (they ran
    before) by arrival, then the others earliest deadline first (LiveRequest.due_ts), then by arrival.
    Without deadlines that is arrival order. Kept sorted by bisection: a lane holds at most the
    queue's capacity, so an insertion's memmove costs less than a heap's bookkeeping would save."""

    def __init__(self, by_deadline: bool = True) -> None:
        self._by_deadline = by_deadline  # False: arrival order only (the fifo baseline)
        self._keys: list[tuple[int, float, float, int, str]] = []
        self._by_id: dict[str, tuple[tuple[int, float, float, int, str], LiveRequest]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __iter__(self) -> Iterator[LiveRequest]:
        # No copy: the only caller that changes the lane on the way (pop) stops right after.
        for key in self._keys:
            yield self._by_id[key[-1]][1]

    def add(self, request: LiveRequest, returning: bool) -> None:
        due = request.due_ts if self._by_deadline and not returning else request.arrival_ts
        key = (0 if returning else 1, due, request.arrival_ts, next(_sequence), request.request_id)
        bisect.insort(self._keys, key)
        self._by_id[request.request_id] = (key, request)

    def discard(self, request_id: str) -> None:
        key, _ = self._by_id.pop(request_id)
        del self._keys[bisect.bisect_left(self._keys, key)]

    def head(self) -> LiveRequest:
        return self._by_id[self._keys[0][-1]][1]


class RequestQueue:
    """Requests waiting for a worker.

    Submit reserves a slot before it persists anything, so a full queue is
    refused at once and leaves no trace in Redis. Requests that come back
    (their worker died, the scheduler restarted) skip the capacity check: they
    were admitted once and must not be dropped.

    Across classes the order is strict. Within one, tenants share service by
    VTC: `counters` is charged a request's prompt when it is popped, and its
    output tokens as the steps report them (RequestTable). Within a tenant, the
    earliest deadline goes first (a TTFT target's, else the request's own), and
    requests without one in arrival order, after those with one. With a single
    tenant and no deadlines (no tenants file, no SLOs), a class is served in plain
    arrival order; `order="fifo"` serves every class so whatever the tenants and
    deadlines, the baseline the benchmarks compare against.
    """

    def __init__(self, capacity: int, order: str = "fair") -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if order not in ("fair", "fifo"):
            raise ValueError(f"order must be fair or fifo, got {order!r}")
        self.capacity = capacity
        self._fair = order == "fair"  # fifo: one lane per class, arrival order (a benchmark's baseline)
        self.counters = VirtualCounters()
        self._classes: dict[int, dict[str, _Lane]] = {}  # priority -> tenant -> its requests
        self._queued: Counter[str] = Counter()  # requests queued per tenant, over every class
        self._size = 0
        self._reserved = 0

    def __len__(self) -> int:
        return self._size

    def reserve(self) -> None:
        """Claims a slot for a request about to be pushed; ResourceExhausted when none is left."""
        if self._size + self._reserved >= self.capacity:
            raise ResourceExhausted(f"the scheduler queue is full ({self.capacity} requests): retry later")
        self._reserved += 1

    def release(self) -> None:
        """Gives back a reserved slot whose request was not pushed."""
        self._reserved -= 1

    def push(self, request: LiveRequest) -> int:
        """Queues a request that holds a reservation, behind its tenant's in its class; returns how many
        are ahead of it in arrival order (exact with one tenant, at most that with several)."""
        self._reserved -= 1
        ahead = sum(self._depth(tenants) for priority, tenants in self._classes.items() if priority <= request.priority)
        self._lane(request).add(request, returning=False)
        return ahead

    def push_front(self, request: LiveRequest) -> None:
        """Queues a returning request ahead of its tenant's others in its class, whatever the capacity."""
        self._lane(request).add(request, returning=True)

    def pop(self, accept: Callable[[LiveRequest], bool]) -> LiveRequest | None:
        """Removes the first request that `accept` takes: by class, then tenant by least counter, then
        the tenant's lane order (deadline, arrival).

        `accept` lets a request for a model without free workers be skipped
        instead of blocking everything behind it.
        """
        for priority in sorted(self._classes):
            tenants = self._classes[priority]
            # Ties (tenants new alike, or one tenant alone) go to the earliest head: arrival order.
            for tenant in sorted(tenants, key=lambda t: (self.counters[t], tenants[t].head().arrival_ts)):
                for request in tenants[tenant]:
                    if accept(request):
                        self._discard(request)
                        # A re-dispatch is not charged again: the tenant did not lose the worker.
                        self.counters.served(
                            request.tenant,
                            request.tenant_weight,
                            len(request.prompt_token_ids) if not request.attempt else 0,
                        )
                        return request
        return None

    def best_priority(self) -> int | None:
        """The best (lowest) class with a request queued; None when the queue is empty."""
        return min(self._classes, default=None)

    def remove(self, request: LiveRequest) -> bool:
        """Takes a request out of the queue (Cancel, deadline); False if it was not queued."""
        lane = self._classes.get(request.priority, {}).get(self._tenant(request))
        if lane is None or request.request_id not in lane:
            return False
        self._discard(request)
        return True

    def depth_by_priority(self) -> dict[int, int]:
        """Queued requests per priority class, for GetStats."""
        return {priority: self._depth(tenants) for priority, tenants in sorted(self._classes.items())}

    def depth_by_tenant(self) -> dict[str, int]:
        """Queued requests per tenant, over every class, for GetStats."""
        return dict(self._queued)

    def depth_for(self, model: str) -> int:
        """Queued requests for `model`, for the autoscaler (a walk of the queue, once an interval)."""
        return sum(1 for r in self.waiting() if r.model == model)

    def waiting(self) -> list[LiveRequest]:
        """Every queued request, in no particular order (a copy: the caller may remove them)."""
        return [r for tenants in self._classes.values() for lane in tenants.values() for r in lane]

    @staticmethod
    def _depth(tenants: dict[str, _Lane]) -> int:
        return sum(len(lane) for lane in tenants.values())

    def _tenant(self, request: LiveRequest) -> str:
        """The lane a request queues in within its class: its tenant's, or the one lane of fifo."""
        return request.tenant if self._fair else ""

    def _lane(self, request: LiveRequest) -> _Lane:
        """The request's tenant's queue in its class, lifting the tenant's counter if it had none queued."""
        if not self._queued[request.tenant]:
            self.counters.activate(request.tenant, (tenant for tenant, n in self._queued.items() if n))
        self._queued[request.tenant] += 1
        self._size += 1
        lanes = self._classes.setdefault(request.priority, {})
        return lanes.setdefault(self._tenant(request), _Lane(by_deadline=self._fair))

    def _discard(self, request: LiveRequest) -> None:
        tenants = self._classes[request.priority]
        lane = tenants[self._tenant(request)]
        lane.discard(request.request_id)
        if not lane:
            del tenants[self._tenant(request)]
            if not tenants:
                del self._classes[request.priority]
        self._queued[request.tenant] -= 1
        if not self._queued[request.tenant]:
            del self._queued[request.tenant]
        self._size -= 1

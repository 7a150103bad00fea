"""The global queue: bounded; lower priority value first; within a class, the tenant with the least
virtual counter first (fair_share.py); FIFO within a tenant."""

from collections import Counter, OrderedDict
from collections.abc import Callable

from scheduler_svc.fair_share import VirtualCounters
from scheduler_svc.live_request import LiveRequest
from shardline.errors import ResourceExhausted

# One tenant's requests in one class: arrival order, O(1) removal by id for Cancel.
_Fifo = OrderedDict[str, LiveRequest]


class RequestQueue:
    """Requests waiting for a worker.

    Submit reserves a slot before it persists anything, so a full queue is
    refused at once and leaves no trace in Redis. Requests that come back
    (their worker died, the scheduler restarted) skip the capacity check: they
    were admitted once and must not be dropped.

    Across classes the order is strict. Within one, tenants share service by
    VTC: `counters` is charged a request's prompt when it is popped, and its
    output tokens as the steps report them (RequestTable). With a single tenant
    (no tenants file), a class is served in plain arrival order.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.counters = VirtualCounters()
        self._classes: dict[int, dict[str, _Fifo]] = {}  # priority -> tenant -> its requests
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
        self._fifo(request)[request.request_id] = request
        return ahead

    def push_front(self, request: LiveRequest) -> None:
        """Queues a returning request ahead of its tenant's others in its class, whatever the capacity."""
        fifo = self._fifo(request)
        fifo[request.request_id] = request
        fifo.move_to_end(request.request_id, last=False)

    def pop(self, accept: Callable[[LiveRequest], bool]) -> LiveRequest | None:
        """Removes the first request that `accept` takes: by class, then tenant by least counter, then arrival.

        `accept` lets a request for a model without free workers be skipped
        instead of blocking everything behind it.
        """
        for priority in sorted(self._classes):
            tenants = self._classes[priority]
            # Ties (tenants new alike, or one tenant alone) go to the earliest head: arrival order.
            for tenant in sorted(tenants, key=lambda t: (self.counters[t], next(iter(tenants[t].values())).arrival_ts)):
                for request in tenants[tenant].values():
                    if accept(request):
                        self._discard(request)
                        # A re-dispatch is not charged again: the tenant did not lose the worker.
                        self.counters.served(
                            tenant, request.tenant_weight, len(request.prompt_token_ids) if not request.attempt else 0
                        )
                        return request
        return None

    def remove(self, request: LiveRequest) -> bool:
        """Takes a request out of the queue (Cancel, deadline); False if it was not queued."""
        fifo = self._classes.get(request.priority, {}).get(request.tenant)
        if fifo is None or request.request_id not in fifo:
            return False
        self._discard(request)
        return True

    def depth_by_priority(self) -> dict[int, int]:
        """Queued requests per priority class, for GetStats."""
        return {priority: self._depth(tenants) for priority, tenants in sorted(self._classes.items())}

    @staticmethod
    def _depth(tenants: dict[str, _Fifo]) -> int:
        return sum(len(fifo) for fifo in tenants.values())

    def _fifo(self, request: LiveRequest) -> _Fifo:
        """The request's tenant's queue in its class, lifting the tenant's counter if it had none queued."""
        if not self._queued[request.tenant]:
            self.counters.activate(request.tenant, (tenant for tenant, n in self._queued.items() if n))
        self._queued[request.tenant] += 1
        self._size += 1
        return self._classes.setdefault(request.priority, {}).setdefault(request.tenant, OrderedDict())

    def _discard(self, request: LiveRequest) -> None:
        tenants = self._classes[request.priority]
        fifo = tenants[request.tenant]
        del fifo[request.request_id]
        if not fifo:
            del tenants[request.tenant]
            if not tenants:
                del self._classes[request.priority]
        self._queued[request.tenant] -= 1
        if not self._queued[request.tenant]:
            del self._queued[request.tenant]
        self._size -= 1

"""The global queue: bounded, lower priority value first, FIFO within a priority class."""

from collections import OrderedDict
from collections.abc import Callable

from scheduler_svc.live_request import LiveRequest
from shardline.errors import ResourceExhausted


class RequestQueue:
    """Requests waiting for a worker.

    Submit reserves a slot before it persists anything, so a full queue is
    refused at once and leaves no trace in Redis. Requests that come back
    (their worker died, the scheduler restarted) skip the capacity check: they
    were admitted once and must not be dropped.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # An OrderedDict per class: FIFO order, O(1) removal by id for Cancel.
        self._classes: dict[int, OrderedDict[str, LiveRequest]] = {}
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
        """Queues a request that holds a reservation, behind its class; returns how many are ahead of it."""
        self._reserved -= 1
        ahead = sum(len(queue) for priority, queue in self._classes.items() if priority <= request.priority)
        self._class(request.priority)[request.request_id] = request
        self._size += 1
        return ahead

    def push_front(self, request: LiveRequest) -> None:
        """Queues a returning request ahead of its whole class, whatever the capacity."""
        queue = self._class(request.priority)
        queue[request.request_id] = request
        queue.move_to_end(request.request_id, last=False)
        self._size += 1

    def pop(self, accept: Callable[[LiveRequest], bool]) -> LiveRequest | None:
        """Removes the first request, in priority then arrival order, that `accept` takes.

        `accept` lets a request for a model without free workers be skipped
        instead of blocking everything behind it.
        """
        for priority in sorted(self._classes):
            for request in self._classes[priority].values():
                if accept(request):
                    self._discard(request)
                    return request
        return None

    def remove(self, request: LiveRequest) -> bool:
        """Takes a request out of the queue (Cancel, deadline); False if it was not queued."""
        queue = self._classes.get(request.priority)
        if queue is None or request.request_id not in queue:
            return False
        self._discard(request)
        return True

    def depth_by_priority(self) -> dict[int, int]:
        """Queued requests per priority class, for GetStats."""
        return {priority: len(queue) for priority, queue in sorted(self._classes.items())}

    def _class(self, priority: int) -> OrderedDict[str, LiveRequest]:
        return self._classes.setdefault(priority, OrderedDict())

    def _discard(self, request: LiveRequest) -> None:
        queue = self._classes[request.priority]
        del queue[request.request_id]
        if not queue:
            del self._classes[request.priority]
        self._size -= 1

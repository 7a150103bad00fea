"""A request's timers: its deadline, at which it is cancelled, and its TTFT deadline, at which a
request that asked to be refused when late, and still waits for its first token, is refused."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine

from scheduler_svc.live_request import LiveRequest
from scheduler_svc.request_queue import RequestQueue
from scheduler_svc.request_table import Outcome, RequestTable
from shardline.core.errors import SLO_UNMET
from shardline.core.store.request_record import FinishReason, RequestStatus

log = logging.getLogger(__name__)


class Deadlines:
    """Arms each request's timers once; the request table cancels them when the request ends."""

    def __init__(self, queue: RequestQueue, requests: RequestTable, cancel: Callable[[str], Awaitable[object]]) -> None:
        self._queue = queue
        self._requests = requests
        self._cancel = cancel
        self.tasks: set[asyncio.Task] = set()  # what the timers started, kept referenced until done

    def arm(self, request: LiveRequest) -> None:
        loop = asyncio.get_running_loop()
        request_id = request.request_id
        if request.deadline_ts is not None and request.deadline_timer is None:
            request.deadline_timer = loop.call_later(
                max(0.0, request.deadline_ts - time.time()), lambda: self._spawn(self._expire(request_id))
            )
        if request.refuse_late and request.ttft_deadline_ts is not None and request.ttft_timer is None:
            request.ttft_timer = loop.call_later(
                max(0.0, request.ttft_deadline_ts - time.time()), lambda: self._spawn(self._refuse(request))
            )

    async def _expire(self, request_id: str) -> None:
        log.info("request %s passed its deadline: cancelling it", request_id)
        await self._cancel(request_id)

    async def _refuse(self, request: LiveRequest) -> None:
        """Fails a request still queued without a first token at its TTFT deadline: it is late
        already, and its client asked for an answer it can act on rather than a late one."""
        if self._requests.get(request.request_id) is not request or request.num_output_tokens:
            return
        if not self._queue.remove(request):  # running: it makes its first token soon
            return
        target_s = (request.ttft_deadline_ts or request.arrival_ts) - request.arrival_ts
        log.info("request %s missed its %.2fs TTFT target while queued: refusing it", request.request_id, target_s)
        error = f"{SLO_UNMET}: no worker could start it within its {target_s:g}s TTFT target; refused, not served late"
        await self._requests.finish([Outcome(request, RequestStatus.FAILED, FinishReason.ERROR, error)])

    def _spawn(self, coroutine: Coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

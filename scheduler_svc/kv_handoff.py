"""A drained worker's running requests take their KV blocks to the worker they move to.

Before the scheduler ends a drained worker's session and re-queues what it still runs, it picks
each request's next worker with the router (which remembers the choice, so the re-dispatch goes
there while that worker has room) and asks the drained worker to send the request's computed
blocks there (`KvTransfer.SendBlocks`). The next worker then finds them in its prefix cache and
prefills only the rest. A send that fails costs nothing but that: the request re-prefills from
its tokens in Redis, as a killed worker's requests always do (docs/kv_transfer.md).

Two paths use it: a drain past its timeout (the autoscaler's), and a worker stopping on SIGTERM
(`Scheduler.DrainWorker`), which bounds it with a deadline so that the worker exits within its
orchestrator's grace: requests whose turn comes after the deadline move without their blocks.
"""

import logging
import time
from collections.abc import Callable, Sequence

import grpc

from scheduler_svc.live_request import LiveRequest
from scheduler_svc.router import Router
from scheduler_svc.worker_registry import RegisteredWorker
from shardline.proto import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# One request's blocks: 94 MB for a 2k-token context of the default model, about half a second.
SEND_TIMEOUT_S = 30.0


async def hand_off_kv(
    source: RegisteredWorker,
    requests: Sequence[LiveRequest],
    targets: Callable[[LiveRequest], list[RegisteredWorker]],
    router: Router,
    deadline: float | None = None,
) -> int:
    """Sends each request's blocks from `source` to the worker the router picks among `targets(request)`;
    returns how many sends succeeded. One at a time: the source exports on its engine thread anyway.

    `deadline` (time.monotonic()): no send runs past it; the requests left re-prefill, loudly logged."""
    sent = 0
    async with grpc.aio.insecure_channel(source.info.address) as channel:
        stub = worker_pb2_grpc.KvTransferStub(channel)
        for index, request in enumerate(requests):
            left_s = SEND_TIMEOUT_S if deadline is None else min(SEND_TIMEOUT_S, deadline - time.monotonic())
            if left_s <= 0:
                log.warning(
                    "KV hand-off from %s out of time: %d requests move without their blocks and re-prefill (%s)",
                    source.worker_id,
                    len(requests) - index,
                    ", ".join(r.request_id for r in requests[index:]),
                )
                break
            candidates = [w for w in targets(request) if w.worker_id != source.worker_id]
            if not candidates:
                log.warning(
                    "request %s: no other worker of %r has room for its KV hand-off from %s; it re-prefills",
                    request.request_id,
                    request.model,
                    source.worker_id,
                )
                continue
            target = router.choose(request, candidates)
            try:
                result = await stub.SendBlocks(
                    worker_pb2.SendBlocksRequest(target_address=target.info.address, request_id=request.request_id),
                    timeout=left_s,
                )
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "request %s: KV hand-off %s -> %s failed (%s %s); it re-prefills",
                    request.request_id,
                    source.worker_id,
                    target.worker_id,
                    exc.code().name,
                    exc.details(),
                )
                continue
            sent += 1
            log.info(
                "request %s: %d KV blocks handed from %s to %s",
                request.request_id,
                result.imported + result.already_cached,
                source.worker_id,
                target.worker_id,
            )
    return sent

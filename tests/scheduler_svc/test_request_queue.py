"""RequestQueue: priority classes, FIFO, bounded admission."""

import pytest

from scheduler_svc.live_request import LiveRequest
from scheduler_svc.request_queue import RequestQueue
from shardline.errors import ResourceExhausted
from shardline.proto import sampling_pb2


def _request(request_id: str, priority: int = 0, model: str = "m") -> LiveRequest:
    return LiveRequest(
        request_id=request_id,
        gateway_id="gw",
        model=model,
        priority=priority,
        prompt_token_ids=[1],
        params=sampling_pb2.SamplingParameters(),
        eos_token_ids=[],
        arrival_ts=0.0,
    )


def _admit(queue: RequestQueue, request: LiveRequest) -> int:
    queue.reserve()
    return queue.push(request)


def _drain(queue: RequestQueue) -> list[str]:
    order = []
    while (request := queue.pop(lambda r: True)) is not None:
        order.append(request.request_id)
    return order


def test_lower_priority_first_then_fifo() -> None:
    queue = RequestQueue(capacity=10)
    positions = [_admit(queue, _request(rid, p)) for rid, p in [("a", 2), ("b", 0), ("c", 2), ("d", 0), ("e", -1)]]
    assert positions == [0, 0, 2, 1, 0]
    assert queue.depth_by_priority() == {-1: 1, 0: 2, 2: 2}
    assert _drain(queue) == ["e", "b", "d", "a", "c"]
    assert len(queue) == 0 and queue.depth_by_priority() == {}


def test_full_queue_refuses_and_reservations_count() -> None:
    queue = RequestQueue(capacity=2)
    _admit(queue, _request("a"))
    queue.reserve()  # a submit in flight holds the last slot
    with pytest.raises(ResourceExhausted):
        queue.reserve()
    queue.release()
    _admit(queue, _request("b"))
    with pytest.raises(ResourceExhausted):
        queue.reserve()


def test_returning_requests_go_first_in_their_class_past_capacity() -> None:
    queue = RequestQueue(capacity=1)
    _admit(queue, _request("new", 0))
    queue.push_front(_request("retry", 0))
    queue.push_front(_request("retry-low", 5))
    assert len(queue) == 3
    assert _drain(queue) == ["retry", "new", "retry-low"]


def test_remove_and_skip_unservable_models() -> None:
    queue = RequestQueue(capacity=10)
    for request in (_request("x", model="other"), _request("a"), _request("b")):
        _admit(queue, request)
    b = queue.pop(lambda r: r.request_id == "b")
    assert b is not None and b.request_id == "b"
    assert queue.pop(lambda r: r.model == "m").request_id == "a"
    assert queue.pop(lambda r: r.model == "m") is None
    other = queue.pop(lambda r: True)
    assert not queue.remove(other)
    _admit(queue, other)
    assert queue.remove(other) and len(queue) == 0

"""RequestQueue: priority classes, arrival order, deadlines, bounded admission."""

import pytest

from scheduler_svc.live_request import LiveRequest
from scheduler_svc.request_queue import RequestQueue
from shardline.core.errors import ResourceExhausted
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


def _timed(request_id: str, arrival: float, ttft_due: float | None = None, tenant: str = "t") -> LiveRequest:
    request = _request(request_id)
    request.arrival_ts, request.ttft_deadline_ts, request.tenant = arrival, ttft_due, tenant
    return request


def test_earliest_deadline_first_within_a_tenant_then_arrival() -> None:
    """A tight TTFT target overtakes a loose one that came earlier; no target goes after any target,
    in arrival order; a request's own deadline counts when it has no TTFT target."""
    queue = RequestQueue(capacity=10)
    loose = _timed("loose", arrival=0.0, ttft_due=10.0)
    tight = _timed("tight", arrival=1.0, ttft_due=2.0)
    plain_1, plain_2 = _timed("plain-1", arrival=0.5), _timed("plain-2", arrival=0.7)
    timed_out = _timed("own-deadline", arrival=3.0)
    timed_out.deadline_ts = 5.0
    for request in (loose, plain_1, tight, plain_2, timed_out):
        _admit(queue, request)
    assert _drain(queue) == ["tight", "own-deadline", "loose", "plain-1", "plain-2"]


def test_fifo_order_ignores_deadlines_and_tenants() -> None:
    queue = RequestQueue(capacity=10, order="fifo")
    for request in (
        _timed("a", arrival=0.0, ttft_due=10.0, tenant="x"),
        _timed("b", arrival=1.0, ttft_due=1.5, tenant="y"),
        _timed("c", arrival=2.0, tenant="x"),
    ):
        _admit(queue, request)
    queue.counters.served("x", 1.0, 10_000)  # would send x last under VTC
    assert _drain(queue) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="fair or fifo"):
        RequestQueue(capacity=1, order="lifo")


def test_returning_requests_keep_going_first_under_deadlines() -> None:
    queue = RequestQueue(capacity=10)
    _admit(queue, _timed("urgent", arrival=5.0, ttft_due=5.5))
    queue.push_front(_timed("retry-late", arrival=2.0, ttft_due=50.0))
    queue.push_front(_timed("retry-early", arrival=1.0))
    assert _drain(queue) == ["retry-early", "retry-late", "urgent"]


def test_depth_by_tenant_counts_every_class() -> None:
    queue = RequestQueue(capacity=10)
    for request_id, tenant, priority in (("a", "x", 0), ("b", "x", 5), ("c", "y", 0)):
        request = _timed(request_id, arrival=0.0, tenant=tenant)
        request.priority = priority
        _admit(queue, request)
    assert queue.depth_by_tenant() == {"x": 2, "y": 1}
    _drain(queue)
    assert queue.depth_by_tenant() == {}

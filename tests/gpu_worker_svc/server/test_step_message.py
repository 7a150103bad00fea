"""Engine outputs as the wire's deltas."""

from gpu_worker_svc.engine.outputs import RequestOutput
from gpu_worker_svc.server.step_message import request_delta
from shardline.proto import sampling_pb2


def test_usage_rides_on_the_first_and_the_last_delta():
    first = request_delta(RequestOutput("r", [5], 0, None, None, 7, 3))
    assert (first.usage.prompt_tokens, first.usage.cached_tokens, first.usage.completion_tokens) == (7, 3, 1)
    assert first.finish_reason == sampling_pb2.FINISH_REASON_UNSPECIFIED  # usage alone does not end it
    assert not request_delta(RequestOutput("r", [6], 1, None, None, 7, 3)).HasField("usage")
    last = request_delta(RequestOutput("r", [7], 2, None, "length", 7, 3))
    assert (last.usage.completion_tokens, last.usage.total_tokens, last.finish_reason) == (
        3,
        10,
        sampling_pb2.FINISH_REASON_LENGTH,
    )

"""How an idle worker admits a burst: it waits out short gaps between arrivals, unless a step is already full."""

import threading
import time

import pytest

from gpu_worker_svc.engine.batch_scheduler import SchedulerConfig
from gpu_worker_svc.server.engine_loop import Inbox, _Commands, collect_burst, prefill_lengths
from shardline.proto import worker_pb2

GAP_S = 0.2  # long, so that "it waited" and "it did not" are far apart on a noisy machine
CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)


def _adds(*prompt_lengths: int, output_len: int = 0) -> _Commands:
    return _Commands(
        1,
        worker_pb2.WorkerCommand(
            add=[
                worker_pb2.NewRequest(
                    request_id=f"r{i}-{n}", prompt_token_ids=[5] * n, output_token_ids=[6] * output_len
                )
                for i, n in enumerate(prompt_lengths)
            ]
        ),
    )


def _burst(first: list[object], later: _Commands | None = None) -> tuple[list[object], float]:
    """collect_burst on `first`, with `later` arriving a quarter gap in; (items, seconds it took)."""
    inbox = Inbox()
    sender = threading.Timer(GAP_S / 4, inbox.put, args=(later,)) if later is not None else None
    if sender is not None:
        sender.start()
    start = time.monotonic()
    items = collect_burst(inbox, first, GAP_S, lambda xs: CONFIG.fills_a_step(prefill_lengths(xs)))
    waited = time.monotonic() - start
    if sender is not None:
        sender.join()
    return items, waited


def test_prefill_lengths_count_a_resumed_requests_earlier_output():
    aborts = _Commands(1, worker_pb2.WorkerCommand(abort=["x"]))
    assert prefill_lengths([_adds(3, 4), aborts, _adds(5, output_len=2)]) == [3, 4, 7]


@pytest.mark.parametrize(
    "burst",
    [
        pytest.param(_adds(40, 24), id="token-budget"),
        pytest.param(_adds(30, output_len=34), id="resumed-output-counts"),
        pytest.param(_adds(2, 2, 2, 2), id="sequence-slots"),
    ],
)
def test_a_burst_that_fills_a_step_starts_it_at_once(burst):
    items, waited = _burst([burst])
    assert items == [burst]
    assert waited < GAP_S / 2


def test_a_burst_short_of_a_step_waits_for_requests_a_gap_apart():
    first, second = _adds(10), _adds(12)
    items, waited = _burst([first], second)
    assert items == [first, second]
    assert waited >= GAP_S  # the second arrival restarted the gap, then nothing more came


def test_the_wait_ends_when_later_arrivals_fill_the_step():
    first, second = _adds(10), _adds(60)
    items, waited = _burst([first], second)
    assert items == [first, second]
    assert waited < GAP_S  # no second gap: 70 tokens fill the step

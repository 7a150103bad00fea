"""Stop conditions applied by BatchScheduler.update()."""

from collections.abc import Callable

import pytest

from gpu_worker_svc.engine.batch_scheduler import BatchScheduler
from gpu_worker_svc.engine.sampling_params import SamplingParams
from gpu_worker_svc.engine.sequence import Sequence, SequenceStatus

EOS = 2


def generate(sched: BatchScheduler, seq: Sequence, tokens: Callable[[int], int]) -> list[Sequence]:
    """Run seq alone, feeding tokens(index) as each sampled token; return finished."""
    sched.add(seq)
    finished = []
    for _ in range(100):
        if not sched.has_unfinished:
            return finished
        out = sched.schedule()
        sampled = [tokens(s.seq.num_output_tokens) if s.needs_sample else None for s in out.scheduled]
        finished.extend(sched.update(out, sampled).finished)
    raise AssertionError("never finished")


def make_seq(output: list[int] | None = None, **params: object) -> Sequence:
    return Sequence(
        request_id="r",
        prompt_token_ids=[10, 11, 12, 13, 14],
        params=SamplingParams(seed=0, **params),
        eos_token_id=EOS,
        output_token_ids=output or [],
    )


def test_max_tokens_finishes_with_length(create_scheduler):
    seq = make_seq(max_tokens=3)
    assert generate(create_scheduler(), seq, lambda i: 50 + i) == [seq]
    assert seq.output_token_ids == [50, 51, 52]
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.finish_reason == "length"


def test_eos_stops_and_is_kept_in_output(create_scheduler):
    seq = make_seq(max_tokens=10)
    sched = create_scheduler()
    generate(sched, seq, lambda i: EOS if i == 2 else 50 + i)
    assert seq.output_token_ids == [50, 51, EOS]
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.finish_reason == "stop"
    assert sched.get("r") is None
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks


def test_ignore_eos_runs_to_max_tokens(create_scheduler):
    seq = make_seq(max_tokens=4, ignore_eos=True)
    generate(create_scheduler(), seq, lambda i: EOS)
    assert seq.output_token_ids == [EOS] * 4 and seq.finish_reason == "length"


def test_ignore_eos_still_honours_stop_token_ids(create_scheduler):
    seq = make_seq(max_tokens=4, ignore_eos=True, stop_token_ids=[77])
    generate(create_scheduler(), seq, lambda i: 77 if i == 1 else EOS)
    assert seq.output_token_ids == [EOS, 77] and seq.finish_reason == "stop"


@pytest.mark.parametrize("stop_token", [EOS, 77])
def test_min_tokens_defers_eos_and_stop_ids(create_scheduler, stop_token):
    # EOS or a stop id counts only from index min_tokens on, matching the
    # sampler, which masks them while fewer than min_tokens outputs exist.
    seq = make_seq(max_tokens=10, min_tokens=2, stop_token_ids=[77])
    generate(create_scheduler(), seq, lambda i: stop_token)
    assert seq.output_token_ids == [stop_token] * 3 and seq.finish_reason == "stop"


def test_stop_token_ids(create_scheduler):
    seq = make_seq(max_tokens=10, stop_token_ids=[60, 61])
    generate(create_scheduler(), seq, lambda i: 58 + i)
    assert seq.output_token_ids == [58, 59, 60] and seq.finish_reason == "stop"


def test_eos_on_the_last_allowed_token_is_a_stop(create_scheduler):
    seq = make_seq(max_tokens=2)
    generate(create_scheduler(), seq, lambda i: EOS if i == 1 else 50)
    assert seq.finish_reason == "stop"


def test_prefilled_output_counts_toward_max_tokens(create_scheduler):
    seq = make_seq(output=[40, 41, 42], max_tokens=5)
    sched = create_scheduler()
    sched.add(seq)
    out = sched.schedule()
    # The resumed output is prefilled with the prompt; sampling continues at index 3.
    assert [(s.num_new_tokens, s.needs_sample) for s in out.scheduled] == [(8, True)]
    sched.update(out, [50])
    out = sched.schedule()
    sched.update(out, [51])
    assert seq.output_token_ids == [40, 41, 42, 50, 51] and seq.finish_reason == "length"
    assert not sched.has_unfinished


def test_prefilled_output_counts_toward_min_tokens(create_scheduler):
    seq = make_seq(output=[40, 41], max_tokens=6, min_tokens=3)
    generate(create_scheduler(), seq, lambda i: EOS)
    assert seq.output_token_ids == [40, 41, EOS, EOS] and seq.finish_reason == "stop"


def test_update_requires_a_token_where_one_is_sampled(create_scheduler):
    sched = create_scheduler()
    seq = make_seq()
    sched.add(seq)
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(out, [None])
    assert seq.num_computed_tokens == 0  # a rejected update changes nothing
    with pytest.raises(ValueError, match="entries"):
        sched.update(out, [])

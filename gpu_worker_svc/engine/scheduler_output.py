"""What the batch scheduler hands the step (its plan) and gets back from it (the new tokens)."""

from dataclasses import dataclass, field

from gpu_worker_svc.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence  # the sequence to run
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    needs_sample: bool  # this chunk reaches the end of the known tokens: sample one
    # Guessed tokens computed after the sequence's last one (num_new_tokens counts them); the step
    # samples a token after each of them too, and keeps those that confirm the guesses.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # running sequences first, then admitted ones
    preempted_ids: list[str]  # request ids preempted this step
    num_batched_tokens: int  # sum of num_new_tokens
    num_prefix_cached_tokens: int  # prefix-cache hit tokens of sequences admitted this step


@dataclass(slots=True)
class StepUpdate:
    new_tokens: list[tuple[Sequence, list[int]]]  # (seq, its new tokens) in scheduled order
    finished: list[Sequence]  # sequences that finished this step


def step_tokens(item: ScheduledSeq, sampled: int | list[int] | None) -> list[int]:
    """A scheduled sequence's new tokens from update()'s argument, checked against its drafts."""
    if not item.needs_sample:
        return []
    if sampled is None:
        raise ValueError(f"no sampled token for {item.seq.request_id!r}")
    tokens = [sampled] if isinstance(sampled, int) else list(sampled)
    drafts = item.draft_token_ids
    # Every token but the last must confirm a draft: their KV was computed from the drafts.
    if not tokens or len(tokens) > 1 + len(drafts) or tokens[:-1] != drafts[: len(tokens) - 1]:
        raise ValueError(f"tokens {tokens} for {item.seq.request_id!r} do not follow its drafts {drafts}")
    return tokens

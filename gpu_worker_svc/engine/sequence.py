"""One request's state inside a worker's engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from gpu_worker_svc.engine.sampling_params import SamplingParams
from shardline.structured_output import DEAD_END

if TYPE_CHECKING:
    from gpu_worker_svc.engine.grammar import GrammarMatcher
    from gpu_worker_svc.engine.ngram_proposer import NgramIndex
    from gpu_worker_svc.engine.outputs import TokenLogprobs


class SequenceStatus(IntEnum):
    """Ordered so that every finished state compares >= FINISHED_STOPPED."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # its structured output's grammar allowed no token: see Sequence.error

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


# OpenAI-style finish_reason of each finished status.
FINISH_REASONS: dict[SequenceStatus, str] = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Sequence:
    """A request's tokens, KV blocks and progress.

    Compared by identity: a sequence is one live request, not a value.

    Append output tokens with `append_token`, which keeps `all_token_ids`
    current without copying the prompt every step.
    """

    request_id: str  # unique within the worker
    prompt_token_ids: list[int]  # the tokenized prompt, never empty
    params: SamplingParams  # how to sample and when to stop
    eos_token_id: int | None = None  # the model's EOS, None if it has none
    priority: int = 0  # lower value is served first, as in vLLM
    arrival_time: float = field(default_factory=time.monotonic)  # orders equal priorities
    # Pre-filled when a request resumes from a prefix of its own output: these
    # count toward max_tokens and penalties, and sampling continues at index
    # len(output_token_ids).
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING  # lifecycle state
    num_computed_tokens: int = 0  # leading tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)  # KV block table, in order
    num_cached_tokens: int = 0  # prefix-cache hit tokens at the last admission
    # Prompt tokens its first admission found in the prefix cache: what usage reports (a re-admission
    # after preemption or a resume also hits its own output, which is no prompt token).
    num_cached_prompt_tokens: int | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    # Hash chain of the sequence's full, computed blocks, so each new full
    # block is hashed once from its parent instead of rehashing the prefix.
    block_hashes: list[int] = field(default_factory=list)
    # The LoRA adapter it runs with (its name), None for the base model; and what its first block's
    # hash chains from (prefix_hash.chain_root of the adapter's identity), so adapters share no blocks.
    adapter: str | None = None
    chain_root: int | None = None
    # With params.prompt_logprobs: entry i is prompt token i + 1's, filled chunk by chunk until the
    # first output token goes out with them all.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With params.structured_output: the grammar's state after output_token_ids, advanced by append_token.
    grammar: GrammarMatcher | None = None
    error: str | None = None  # why it failed (FINISHED_ERROR), for the client
    # N-gram speculation: the tokens the engine guesses come after all_token_ids, for the scheduler
    # to run in its next decode; and the index of its n-grams they are looked up in.
    draft_token_ids: list[int] = field(default_factory=list)
    ngram_index: NgramIndex | None = None
    _all_token_ids: list[int] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output tokens; callers must not mutate the list."""
        # A length check is O(1) and catches outputs appended behind our back.
        if len(self._all_token_ids) != self.num_tokens:
            self._all_token_ids = self.prompt_token_ids + self.output_token_ids
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill must yield its prompt's logprobs: asked for, and none sent yet (a request
        resumed after output it generated sent them on its first run)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.grammar is not None and self.error is None and not self.grammar.accept(token_id):
            # The mask let only the grammar's tokens through, so a refusal means it allowed none: a
            # grammar with no way on from here ("a[^\s\S]", a rule that never ends). This request
            # fails; the batch runs on.
            self.error = (
                f"{DEAD_END} after {self.num_output_tokens - 1} output tokens (it has no valid completion from there)"
            )

    def stop_status(self) -> SequenceStatus | None:
        """Whether the token just appended ends the request, and how."""
        params = self.params
        token_id = self.output_token_ids[-1]
        if self.error is not None:
            return SequenceStatus.FINISHED_ERROR
        if self.grammar is not None and self.grammar.is_terminated:
            return SequenceStatus.FINISHED_STOPPED  # complete: EOS was the only token left to it
        # Like the sampler's mask: EOS and stop ids count only from output
        # index min_tokens on, so min_tokens ordinary tokens always come first.
        if self.num_output_tokens > params.min_tokens:
            is_eos = token_id == self.eos_token_id and not params.ignore_eos
            if is_eos or token_id in params.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def finish(self, status: SequenceStatus) -> None:
        self.status = status
        self.finish_reason = FINISH_REASONS[status]

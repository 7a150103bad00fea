"""Iteration-level (continuous) batching under a per-step token budget.

Each step, running sequences go first: a decode gets one token, a prefill
that is still in progress continues with its next chunk. Then waiting
sequences are admitted by (priority, arrival time) while the token budget,
max_num_seqs and free KV blocks allow. When a running sequence needs a block
and none is free, the lowest-priority, newest running sequence is preempted
by recompute: it loses its blocks and goes back to waiting. A waiting sequence
that cannot be admitted preempts running ones of a strictly worse class
(priority_preemption.py).

Background sequences (batch jobs) yield to the foreground (background_yield.py): a bounded
number of them run beside foreground ones. Those sent back keep their full blocks in the prefix
cache, so taking them up again recomputes little.

With n-gram speculation a decode also carries its sequence's draft tokens
(seq.draft_token_ids), but only from what the step leaves over: after every
running sequence has its tokens and the waiting ones are admitted, within the
rest of the budget and the free blocks. A guess never preempts, delays or
shrinks real work.

Sequences of at most max_loras_per_batch LoRA adapters run at once (each adapter takes a slot of the
model's). A waiting sequence of another adapter is passed over, and those behind it that fit are
admitted; it waits until a running adapter's last sequence leaves.
"""

import bisect
import logging
import random
import time
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from gpu_worker_svc.engine.background_yield import BackgroundYield
from gpu_worker_svc.engine.block_pool import BlockPool
from gpu_worker_svc.engine.priority_preemption import free_blocks_without, lowest_newest, worse_class
from gpu_worker_svc.engine.scheduler_output import ScheduledSeq, SchedulerOutput, StepUpdate, step_tokens
from gpu_worker_svc.engine.sequence import Sequence, SequenceStatus

__all__ = ["BatchScheduler", "ScheduledSeq", "SchedulerConfig", "SchedulerOutput", "StepUpdate"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # most sequences running at once
    max_num_batched_tokens: int = 2048  # token budget of one step
    enable_chunked_prefill: bool = True  # split long prefills across steps
    # Sequences of this priority or more (lower is served first) are background work: None, none are.
    background_priority: int | None = None
    background_max_seqs: int = 4  # background sequences running at most while foreground ones run or wait
    background_grace_s: float = 2.0  # ...and for this long after the last foreground sequence left
    # Most LoRA adapters among the running sequences: each takes one of the model's adapter slots.
    max_loras_per_batch: int = 4

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_loras_per_batch < 1:
            raise ValueError(f"max_loras_per_batch must be at least 1, got {self.max_loras_per_batch}")
        # Below this, a step could not give every running sequence its decode
        # token, and the later ones in the batch would starve.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_num_seqs={self.max_num_seqs}, got {self.max_num_batched_tokens}"
            )

    def fills_a_step(self, prompt_lengths: list[int]) -> bool:
        """New requests of these lengths take every sequence slot or the whole token budget of a step."""
        return len(prompt_lengths) >= self.max_num_seqs or sum(prompt_lengths) >= self.max_num_batched_tokens


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


class BatchScheduler:
    """Decides which tokens of which sequences run each step, and owns their blocks."""

    def __init__(
        self, config: SchedulerConfig, block_pool: BlockPool, clock: Callable[[], float] = time.monotonic
    ) -> None:
        config.validate()
        self._yield = BackgroundYield(
            config.background_priority, config.background_max_seqs, config.background_grace_s, clock
        )
        self.config = config
        self.block_pool = block_pool
        self.block_size = block_pool.block_size
        # Kept sorted by _queue_key, so admission and preemption reinsertion
        # are plain list operations.
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []  # in admission order
        self._requests: dict[str, Sequence] = {}  # every unfinished sequence
        self._rng = random.Random()

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> list[Sequence]:
        """The waiting sequences, in queue order; callers must not mutate the list."""
        return self._waiting

    @property
    def running(self) -> list[Sequence]:
        """The running sequences, in admission order; callers must not mutate the list."""
        return self._running

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    @property
    def longest_sequence(self) -> int:
        """The most tokens, prompt and output, a sequence can have and still run to completion: the
        KV cache's, and without chunked prefill one step's budget (a preempted sequence is then
        recomputed in a single prefill)."""
        longest = self.block_pool.num_blocks * self.block_size
        if not self.config.enable_chunked_prefill:
            longest = min(longest, self.config.max_num_batched_tokens)
        return longest

    def add(self, seq: Sequence) -> None:
        """Queue a sequence, checked at the engine's edge: one it could never run is a caller's bug."""
        assert seq.prompt_token_ids and seq.request_id not in self._requests, seq.request_id
        assert seq.num_output_tokens < seq.params.max_tokens, seq.request_id
        assert seq.num_prompt_tokens + seq.params.max_tokens <= self.longest_sequence, seq.request_id
        if seq.params.seed is None:
            # Fixed here so that every later sample, and a recompute after
            # preemption, draws from the same per-(seed, index) stream.
            seq.params.seed = self._rng.getrandbits(63)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self._requests[seq.request_id] = seq
        self._enqueue(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request at once and free all of its blocks."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        if seq.status == SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._release_blocks(seq)
        seq.finish(SequenceStatus.FINISHED_ABORTED)
        return seq

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledSeq] = {}
        preempted_ids: list[str] = []  # for want of blocks, or for a better class
        # A sequence preempted this step would otherwise be readmitted at once, only to be preempted
        # again: only classes better than every one preempted are admitted this step.
        floor = float("inf")
        foreground = self._yield.foreground_present(self._running, self._waiting)
        yielded = self._yield_to_foreground() if foreground else []

        for seq in list(self._running):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._allocate_slots(seq, num_new):
                victim = self._pick_victim()
                budget += self._preempt_now(victim, scheduled, preempted_ids)
                floor = min(floor, victim.priority)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            scheduled[seq.request_id] = self._scheduled(seq, num_new)
            budget -= num_new

        num_prefix_cached = 0
        background_running = self._yield.count(self._running) if foreground else 0
        while budget > 0:
            place = self._next_admissible()
            if place is None or self._waiting[place].priority >= floor:
                break
            head = self._waiting[place]
            background = foreground and self._yield.is_background(head)
            if background and background_running >= self.config.background_max_seqs:
                break  # the queue is in priority order: only background work is behind it
            item = self._admit(head, budget) if len(self._running) < self.config.max_num_seqs else None
            if item is None:
                displaced = self._class_victim(head, budget, scheduled)
                if displaced is None:
                    break  # strict order: nothing overtakes the head of the queue
                self._cache_full_blocks(displaced)
                budget += self._preempt_now(displaced, scheduled, preempted_ids)
                floor = min(floor, displaced.priority)
                if foreground and self._yield.is_background(displaced):
                    background_running -= 1
                continue
            if background:
                background_running += 1
            self._waiting.pop(place)
            self._running.append(item.seq)
            scheduled[item.seq.request_id] = item
            budget -= item.num_new_tokens
            num_prefix_cached += item.seq.num_cached_tokens

        for seq in self._running:  # drafts are for this step only: used now, or dropped
            drafts, seq.draft_token_ids = seq.draft_token_ids, []
            item = scheduled.get(seq.request_id)
            if drafts and budget > 0 and item is not None and self._is_decode(item):
                item.draft_token_ids = self._fitting_drafts(seq, drafts[:budget])
                item.num_new_tokens += len(item.draft_token_ids)
                budget -= len(item.draft_token_ids)

        items = list(scheduled.values())
        return SchedulerOutput(
            scheduled=items,
            preempted_ids=yielded + preempted_ids,
            num_batched_tokens=sum(item.num_new_tokens for item in items),
            num_prefix_cached_tokens=num_prefix_cached,
        )

    def update(self, output: SchedulerOutput, sampled_token_ids: abc.Sequence[int | list[int] | None]) -> StepUpdate:
        """Apply a step's results: progress, block caching, new tokens, stops.

        Per scheduled sequence: its sampled token; or, for one with drafts, the tokens the step
        gives it (the drafts it confirmed, then one sampled after them); None for a chunk that
        samples nothing.
        """
        if len(sampled_token_ids) != len(output.scheduled):
            raise ValueError(
                f"sampled_token_ids has {len(sampled_token_ids)} entries for "
                f"{len(output.scheduled)} scheduled sequences"
            )
        news = [step_tokens(item, sampled) for item, sampled in zip(output.scheduled, sampled_token_ids, strict=True)]
        new_tokens: list[tuple[Sequence, list[int]]] = []
        finished: list[Sequence] = []
        for item, tokens in zip(output.scheduled, news, strict=True):
            seq = item.seq
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted between schedule() and update()
            emitted: list[int] = []
            status = None
            for token_id in tokens:
                seq.append_token(token_id)
                emitted.append(token_id)
                status = seq.stop_status()
                if status is not None:
                    break
            # The KV of drafts past the first miss is stale: those positions count as not computed,
            # and the next step writes over them.
            seq.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids) + max(len(emitted) - 1, 0)
            self._cache_full_blocks(seq)
            if emitted:
                new_tokens.append((seq, emitted))
            if status is not None:
                seq.finish(status)
                self._running.remove(seq)
                del self._requests[seq.request_id]
                self._release_blocks(seq)
                finished.append(seq)
        return StepUpdate(new_tokens=new_tokens, finished=finished)

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        needs_sample = seq.num_computed_tokens + num_new == seq.num_tokens
        return ScheduledSeq(seq=seq, num_new_tokens=num_new, needs_sample=needs_sample)

    @staticmethod
    def _is_decode(item: ScheduledSeq) -> bool:
        """A sequence's one new token after its prompt: the step samples its next output token."""
        seq = item.seq
        return item.num_new_tokens == 1 and item.needs_sample and seq.num_computed_tokens >= seq.num_prompt_tokens

    def _fitting_drafts(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """The leading drafts that the sequence's blocks, and the free ones, have slots for."""
        slots = (len(seq.block_ids) + self.block_pool.num_free_blocks) * self.block_size
        drafts = drafts[: max(0, slots - seq.num_tokens)]  # its next token takes position num_tokens - 1
        return drafts if drafts and self._allocate_slots(seq, 1 + len(drafts)) else []

    def _next_admissible(self) -> int | None:
        """Where the first waiting sequence is whose LoRA adapter can run beside the running ones'
        (at most max_loras_per_batch adapters run at once); None: no such sequence. One of another
        adapter waits, passed over, until a running adapter's last sequence leaves: running
        sequences always finish, so it never waits for ever."""
        if not self._waiting:
            return None
        adapters = {seq.adapter for seq in self._running if seq.adapter is not None}
        if len(adapters) < self.config.max_loras_per_batch:
            return 0
        return next((i for i, seq in enumerate(self._waiting) if seq.adapter is None or seq.adapter in adapters), None)

    def _admission(self, seq: Sequence, budget: int) -> tuple[list[int], int, int, int]:
        """Admitting a waiting sequence within `budget`: its prefix-cache hits, the tokens it computes
        (over budget only without chunked prefill), the blocks it allocates, and the free ones it takes."""
        pool = self.block_pool
        # Leave at least one token to compute, so the step yields its logits.
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        # A prefix served from the cache yields no logits, and prompt logprobs need them all.
        hit_ids = [] if seq.wants_prompt_logprobs else pool.get_cached_prefix(seq.all_token_ids, seq.chain_root)
        hit_ids = hit_ids[:max_hit_blocks]
        num_cached = len(hit_ids) * self.block_size
        num_new = seq.num_tokens - num_cached
        if self.config.enable_chunked_prefill:
            num_new = min(num_new, budget)
        num_alloc = _cdiv(num_cached + num_new, self.block_size) - len(hit_ids)
        # Evictable hits count as free now but stop being free once acquired.
        num_evictable_hits = sum(1 for b in hit_ids if pool.ref_count(b) == 0)
        return hit_ids, num_new, num_alloc, num_alloc + num_evictable_hits

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """Give a waiting sequence its blocks and first chunk, or None if it can't fit."""
        pool = self.block_pool
        hit_ids, num_new, num_alloc, num_taken = self._admission(seq, budget)
        if num_new > budget or num_taken > pool.num_free_blocks:
            return None
        num_cached = len(hit_ids) * self.block_size
        pool.acquire(hit_ids)
        seq.block_ids = hit_ids + pool.allocate(num_alloc)
        # Prefix-cache hits are full blocks, each with its hash.
        seq.block_hashes = cast(list[int], [pool.block_hash(b) for b in hit_ids])
        seq.num_computed_tokens = num_cached
        seq.num_cached_tokens = num_cached
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
        seq.status = SequenceStatus.RUNNING
        pool.record_prefix_lookup(seq.num_tokens, num_cached)
        return self._scheduled(seq, num_new)

    def _class_victim(self, head: Sequence, budget: int, scheduled: dict[str, ScheduledSeq]) -> Sequence | None:
        """The running sequence the head of the queue preempts to be admitted, or None: one of a
        worse class, and only if all of those gone would give it a seat, its tokens and its blocks."""
        worse = worse_class(self._running, head)
        if not worse or len(self._running) - len(worse) >= self.config.max_num_seqs:
            return None
        # The least it needs: with chunked prefill a one-token chunk, else all of its uncached tokens.
        _, num_new, _, num_taken = self._admission(head, 1 if self.config.enable_chunked_prefill else head.num_tokens)
        refund = sum(item.num_new_tokens for s in worse if (item := scheduled.get(s.request_id)) is not None)
        if num_new > budget + refund or num_taken > free_blocks_without(worse, self.block_pool):
            return None
        return lowest_newest(worse)

    def _allocate_slots(self, seq: Sequence, num_new: int) -> bool:
        """Make sure seq has a slot for every position it computes this step."""
        needed = _cdiv(seq.num_computed_tokens + num_new, self.block_size)
        missing = needed - len(seq.block_ids)
        if missing <= 0:
            return True
        if missing > self.block_pool.num_free_blocks:
            return False
        seq.block_ids.extend(self.block_pool.allocate(missing))
        return True

    def _yield_to_foreground(self) -> list[str]:
        """Preempts the running background sequences beyond the yield's bound; their ids."""
        victims = self._yield.victims(self._running)
        for seq in victims:
            self._cache_full_blocks(seq)
            self._preempt(seq)
        return [seq.request_id for seq in victims]

    def _pick_victim(self) -> Sequence:
        return lowest_newest(self._running)

    def _preempt_now(self, victim: Sequence, scheduled: dict[str, ScheduledSeq], preempted_ids: list[str]) -> int:
        """Preempts a running sequence during schedule(); the budget it gives back if already scheduled."""
        self._preempt(victim)
        preempted_ids.append(victim.request_id)
        undone = scheduled.pop(victim.request_id, None)
        return undone.num_new_tokens if undone is not None else 0

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting %s to free %d blocks", seq.request_id, len(seq.block_ids))
        self._running.remove(seq)
        self._release_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.draft_token_ids = []
        self._enqueue(seq)

    def _release_blocks(self, seq: Sequence) -> None:
        # Full blocks keep their hash in the pool, so a recompute or another
        # request with the same prefix can reuse them until they are evicted.
        self.block_pool.free(seq.block_ids)
        seq.block_ids = []
        seq.block_hashes = []

    def _cache_full_blocks(self, seq: Sequence) -> None:
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= len(seq.block_hashes) or not self.block_pool.enable_prefix_caching:
            return  # most steps: no block filled up
        token_ids = seq.all_token_ids
        size = self.block_size
        for index in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.chain_root
            block_tokens = token_ids[index * size : (index + 1) * size]
            seq.block_hashes.append(self.block_pool.cache_full_block(seq.block_ids[index], parent, block_tokens))

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self._waiting, seq, key=_queue_key)


def _queue_key(seq: Sequence) -> tuple[int, float]:
    return (seq.priority, seq.arrival_time)

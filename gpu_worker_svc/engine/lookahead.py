"""Async scheduling: the next decode step is launched before this step's tokens reach the host.

On a GPU the host's share of a decode step (scheduling, the inputs, sampling's bookkeeping, the
outputs) ran after the step's kernels, not beside them (H200, Llama-3.2-1B shape, batch 64: 1.0 to
1.8 ms of host time after a 2.5 ms forward pass; benchmarks/host_overhead.py). A decode step
N+1 of the same sequences needs nothing from step N but its sampled tokens: its positions, slots
and context lengths are known one step ahead. So once step N's tokens are sampled on the device,
step N+1 is launched on them there, and the host applies step N's tokens while the device runs
step N+1. As in vLLM, the host then stays about one step ahead of the device.

The scheduler still decides every step. Step N+1's launched logits are used only when it
schedules the same decodes, at the positions launched; or, where a row's result does not depend
on its batch-mates (ModelRunner.rows_independent), a subset of them: the sequences that finished
or were aborted meanwhile drop out. Otherwise the launch is dropped and the step runs as it
would have. Nothing a dropped launch wrote is read: it wrote each sequence's KV at the position
the sequence computes next, from the token it sampled, so a step that runs it again writes the
same values there; a sequence that finished or was preempted had freed those blocks, and every
later write to them is queued after the launch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker_svc.engine.block_pool import BlockPool
from gpu_worker_svc.engine.model_runner import ModelRunner, StepInputs
from gpu_worker_svc.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from gpu_worker_svc.engine.sequence import Sequence
from gpu_worker_svc.model.attention_metadata import StepBatch


@dataclass(slots=True)
class NextStep:
    """The next step's inputs, prepared while the device runs this one."""

    seqs: list[Sequence]  # its rows, in order: this step's decodes that do not end at its length limit
    computed: list[int]  # each row's computed tokens when it runs: one more than now
    batch: StepBatch  # its token ids are placeholders, taken from the device at launch
    inputs: StepInputs
    keep: torch.Tensor | None  # on the device: the rows of this step that go on; None: all


@dataclass(slots=True)
class _Launched:
    seqs: list[Sequence]
    computed: list[int]
    logits: torch.Tensor  # [len(seqs), vocab] on the device, maybe not computed yet


class Lookahead:
    """Launches each decode step's successor early, and hands its logits to that step."""

    def __init__(self, runner: ModelRunner, block_pool: BlockPool, enabled: bool) -> None:
        self.runner = runner
        self.block_pool = block_pool
        self.enabled = enabled
        self._launched: _Launched | None = None
        self.num_used = self.num_dropped = 0  # launches taken by their step, and thrown away

    def take(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """This step's logits if the previous step launched it, one row per scheduled sequence."""
        launched, self._launched = self._launched, None
        if launched is None:
            return None
        place = {id(seq): i for i, seq in enumerate(launched.seqs)}
        rows: list[int] = []
        for item in sched.scheduled:
            i = place.get(id(item.seq))
            if i is None or not _plain_decode(item) or item.seq.num_computed_tokens != launched.computed[i]:
                rows = []
                break
            rows.append(i)
        whole = rows == list(range(len(launched.seqs)))
        if not rows or not (whole or self.runner.rows_independent):
            self.num_dropped += 1
            return None
        self.num_used += 1
        if whole:
            return launched.logits
        return launched.logits.index_select(0, self.runner.to_device(torch.tensor(rows, dtype=torch.long)))

    def prepare(self, sched: SchedulerOutput, step: int) -> NextStep | None:
        """The next step's inputs when every scheduled sequence is a plain decode that goes on.

        A sequence whose next position starts a block gets that block now. None: no lookahead
        (a prefill or drafts in the step, logprobs to return, too few free blocks, or every
        sequence ending at this step's token, a LoRA adapter in the step).
        """
        items = sched.scheduled
        if not self.enabled or not items or not all(_plain_decode(i) and _no_logprobs(i.seq) for i in items):
            return None
        if any(item.seq.adapter is not None for item in items):  # adapter slots are chosen per step, when it runs
            return None
        # A sequence that reaches max_tokens with this step's token has no next step (and its next
        # position may lie past the model's length).
        keep = [i for i, item in enumerate(items) if item.seq.num_output_tokens + 1 < item.seq.params.max_tokens]
        if not keep:
            return None
        seqs = [items[i].seq for i in keep]
        size = self.block_pool.block_size
        short = [seq for seq in seqs if (seq.num_computed_tokens + 1) // size >= len(seq.block_ids)]
        if len(short) > self.block_pool.num_free_blocks:
            return None
        for seq in short:
            seq.block_ids.extend(self.block_pool.allocate(1))
        computed = [seq.num_computed_tokens + 1 for seq in seqs]
        width = max(len(seq.block_ids) for seq in seqs)
        batch = StepBatch(
            token_ids=torch.zeros(len(seqs), dtype=torch.long),
            num_computed=torch.tensor(computed, dtype=torch.long),
            num_new=torch.ones(len(seqs), dtype=torch.long),
            block_tables=torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs], dtype=torch.long),
            step=step,
        )
        rows = None if len(keep) == len(items) else self.runner.to_device(torch.tensor(keep, dtype=torch.long))
        return NextStep(seqs, computed, batch, self.runner.prepare(batch), rows)

    def launch(self, next_step: NextStep, tokens: torch.Tensor) -> list[int]:
        """Launches the next step on this step's sampled `tokens` (on the device); returns them."""
        fetch = self.runner.fetch(tokens)  # queued before the launch, so waiting for it is not waiting for that
        ids = tokens if next_step.keep is None else tokens.index_select(0, next_step.keep)
        logits = self.runner.execute(next_step.batch, None, next_step.inputs, input_ids=ids)
        self._launched = _Launched(next_step.seqs, next_step.computed, logits)
        return fetch.wait()

    def drop(self) -> None:
        """Forget a launch (the engine stops or its requests are gone)."""
        self._launched = None


def _plain_decode(item: ScheduledSeq) -> bool:
    return item.num_new_tokens == 1 and item.needs_sample and not item.draft_token_ids


def _no_logprobs(seq: Sequence) -> bool:
    # Logprobs are read back after the sampled tokens, which would wait for the launched step.
    return seq.params.logprobs is None

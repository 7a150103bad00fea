"""Drives a ModelRunner over the paged KV cache without the engine: a test-only harness."""

from __future__ import annotations

import torch

from gpu_worker_svc.engine.model_runner import ModelRunner
from gpu_worker_svc.model.attention_metadata import StepBatch


class PagedDriver:
    """Gives each sequence its own blocks and runs prefill chunks and decodes on request."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.bs = runner.block_size
        self.next_block = 0
        self.tables: list[list[int]] = []
        self.tokens: list[list[int]] = []
        self.computed: list[int] = []

    def add(self, token_ids: list[int]) -> int:
        self.tables.append([])
        self.tokens.append(list(token_ids))
        self.computed.append(0)
        return len(self.tokens) - 1

    def step(self, work: dict[int, int]) -> torch.Tensor:
        """Compute `work[seq]` new tokens for each sequence (prefills must come first); logits [B, V]."""
        ids, num_computed, num_new = [], [], []
        for s, n in work.items():
            c = self.computed[s]
            while len(self.tables[s]) * self.bs < c + n:
                self.tables[s].append(self.next_block)
                self.next_block += 1
            ids += self.tokens[s][c : c + n]
            num_computed.append(c)
            num_new.append(n)
            self.computed[s] = c + n
        width = max(len(self.tables[s]) for s in work)
        tables = torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in work])
        batch = StepBatch(torch.tensor(ids), torch.tensor(num_computed), torch.tensor(num_new), tables)
        return self.runner.execute(batch)

    def greedy(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        """Prefill every prompt in one step, then decode them together greedily."""
        seqs = [self.add(p) for p in prompts]
        logits = self.step({s: len(p) for s, p in zip(seqs, prompts)})
        out: list[list[int]] = [[] for _ in seqs]
        for i in range(steps):
            for s, row in zip(seqs, logits):
                tok = int(row.argmax())
                out[s - seqs[0]].append(tok)
                self.tokens[s].append(tok)
            if i + 1 < steps:
                logits = self.step({s: 1 for s in seqs})
        return out

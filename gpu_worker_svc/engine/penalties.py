"""Repetition, presence and frequency penalties, batched over a step's rows.

Rebuilding each row's token statistics from its prompt and output every step
would cost O(prompt + output) host work per request per step. Instead each
penalised request keeps them on the device, and a step adds only the tokens
sampled since the previous one.
"""

from dataclasses import dataclass

import torch

from gpu_worker_svc.engine.sequence import Sequence


@dataclass(slots=True)
class _PenaltyRow:
    seq: Sequence  # the request the statistics belong to; identity, not id, is checked
    prompt_seen: torch.Tensor  # [vocab] bool: the token occurs in the prompt
    counts: torch.Tensor  # [vocab] float32: occurrences in output_token_ids[:num_counted]
    num_counted: int  # output tokens already in counts


class PenaltyState:
    """Applies penalties and caches per-request token statistics between steps.

    Only requests present in the latest call are kept: one that misses a step
    is rebuilt from its tokens when it comes back, so the results never depend
    on the cache.
    """

    def __init__(self) -> None:
        self._rows: dict[str, _PenaltyRow] = {}

    def forget(self) -> None:
        """A step without penalties: no statistics are kept for the next."""
        self._rows.clear()

    def apply(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """Repetition (HF/vLLM) over prompt + output, presence/frequency (OpenAI) over output.

        `drafts[r]`: draft tokens row r follows (n-gram speculation), counted as output of its
        own. A sequence may have several rows; its statistics are kept once.
        Returns logits unchanged (the same tensor) when no row has a penalty,
        else a new tensor; rows without penalties keep their exact values.
        """
        pen_rows = [i for i, seq in enumerate(seqs) if seq.params.has_penalties]
        if not pen_rows:
            self._rows.clear()
            return logits
        pen_seqs = [seqs[i] for i in pen_rows]
        places: dict[int, int] = {}  # id(seq) -> its state's place in `states`
        states: list[_PenaltyRow] = []
        for seq in pen_seqs:
            if id(seq) not in places:
                places[id(seq)] = len(states)
                states.append(self._row(seq, logits))
        self._rows = {state.seq.request_id: state for state in states}
        counts = self._advance_counts(states, logits)
        place = None  # each row's state, where a sequence has several rows or a row follows drafts
        if len(states) < len(pen_rows) or (drafts is not None and any(drafts[i] for i in pen_rows)):
            place = torch.tensor([places[id(seq)] for seq in pen_seqs], dtype=torch.long, device=logits.device)
            counts = self._with_drafts(counts, place, [drafts[i] if drafts else [] for i in pen_rows])
        rows = torch.tensor(pen_rows, dtype=torch.long, device=logits.device)
        sub = logits[rows]

        if any(s.params.repetition_penalty != 1.0 for s in pen_seqs):
            prompt_seen = torch.stack([state.prompt_seen for state in states])
            seen = (prompt_seen if place is None else prompt_seen[place]) | (counts > 0)
            rep = param_column([s.params.repetition_penalty for s in pen_seqs], sub)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        if any(s.params.presence_penalty or s.params.frequency_penalty for s in pen_seqs):
            freq = param_column([s.params.frequency_penalty for s in pen_seqs], sub)
            pres = param_column([s.params.presence_penalty for s in pen_seqs], sub)
            sub = sub - freq * counts - pres * (counts > 0).float()

        logits = logits.clone()
        logits[rows] = sub
        return logits

    def _row(self, seq: Sequence, like: torch.Tensor) -> _PenaltyRow:
        state = self._rows.get(seq.request_id)
        if state is not None and state.seq is seq and state.num_counted <= seq.num_output_tokens:
            return state
        vocab = like.shape[1]
        prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=like.device)
        prompt_ids = torch.tensor(seq.prompt_token_ids, dtype=torch.long, device=like.device)
        prompt_seen[prompt_ids] = True
        counts = torch.zeros(vocab, device=like.device)
        return _PenaltyRow(seq=seq, prompt_seen=prompt_seen, counts=counts, num_counted=0)

    @staticmethod
    def _with_drafts(counts: torch.Tensor, place: torch.Tensor, drafts: list[list[int]]) -> torch.Tensor:
        """Per row: its sequence's output counts (row place[r] of counts) plus its drafts."""
        counts = counts[place]  # a copy: the sequences' own counts stay as they are for the next step
        rows = [r for r, d in enumerate(drafts) for _ in d]
        if rows:
            tokens = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=counts.device)
            counts.index_put_(
                (torch.tensor(rows, dtype=torch.long, device=counts.device), tokens),
                torch.ones(len(rows), device=counts.device),
                accumulate=True,
            )
        return counts

    @staticmethod
    def _advance_counts(states: list[_PenaltyRow], like: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] output counts, after adding each row's new tokens in one op."""
        counts = torch.stack([state.counts for state in states])
        row_ids: list[int] = []
        token_ids: list[int] = []
        for i, state in enumerate(states):
            new = state.seq.output_token_ids[state.num_counted :]
            row_ids.extend([i] * len(new))
            token_ids.extend(new)
        if token_ids:
            device = like.device
            index = (
                torch.tensor(row_ids, dtype=torch.long, device=device),
                torch.tensor(token_ids, dtype=torch.long, device=device),
            )
            counts.index_put_(index, torch.ones(len(token_ids), device=device), accumulate=True)
        # Each row keeps a view of this step's stack, the base for the next step.
        for i, state in enumerate(states):
            state.counts = counts[i]
            state.num_counted = state.seq.num_output_tokens
        return counts


def param_column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row parameters as a [rows, 1] float32 column, to broadcast over the vocabulary."""
    return torch.tensor(values, dtype=torch.float32, device=like.device).unsqueeze(1)

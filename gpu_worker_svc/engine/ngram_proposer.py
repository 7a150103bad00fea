"""Draft tokens by prompt lookup (n-gram speculation, as TGI's `--speculate` and vLLM's "ngram").

A sequence's last n tokens are looked up among its earlier tokens (prompt and output); the
tokens that followed their latest earlier occurrence are the draft. The next step computes the
draft with the sequence's own next token, as one chunk, and keeps the drafted tokens that the
sampler would have picked anyway (llm_engine.py): text that copies its context (code edits,
quotes, summaries, and the loops of a small model) then runs several tokens per step. A
memory-bound decode step costs about the same at 1 row or 5, so a step of drafts that all miss
costs little at low batch; at high batch a CPU step is compute-bound, and every draft costs.

Each sequence keeps an index of its n-grams, extended by the tokens added since the last
lookup: a lookup is a few dict reads, not a scan of its context.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpeculativeConfig:
    """N-gram speculation; off at num_speculative_tokens=0 (the default)."""

    num_speculative_tokens: int = 0  # most draft tokens a sequence runs per step
    prompt_lookup_max: int = 3  # longest n-gram looked up (tried first)
    prompt_lookup_min: int = 1  # shortest n-gram looked up

    def validate(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram of a token list last ended, for n in [lo, hi].

    Only n-grams with a token after them are indexed: the list's own last n tokens are the key
    being looked up, and their continuation is what a draft guesses.
    """

    lo: int
    hi: int
    # latest[n - lo]: n-gram -> the index just past its latest indexed occurrence.
    latest: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    num_indexed: int = 0  # tokens [0, num_indexed) have been the continuation of every n-gram before them

    def __post_init__(self) -> None:
        self.latest = [{} for _ in range(self.hi - self.lo + 1)]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of `tokens`' longest matching tail."""
        self._extend(tokens)
        end = len(tokens)
        for n in range(min(self.hi, end - 1), self.lo - 1, -1):
            start = self.latest[n - self.lo].get(tuple(tokens[end - n :]))
            if start is not None:
                return tokens[start : start + k]
        return []

    def _extend(self, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (token p is the continuation of the
        n-grams ending at p), for the tokens added since the last call."""
        for p in range(max(self.num_indexed, 1), len(tokens)):
            for n in range(self.lo, min(self.hi, p) + 1):
                self.latest[n - self.lo][tuple(tokens[p - n : p])] = p
        self.num_indexed = max(self.num_indexed, len(tokens))

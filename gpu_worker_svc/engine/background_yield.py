"""Background work (batch jobs) yields to the foreground, in the batch scheduler.

Sequences of priority `background_priority` or more are background work. While a foreground
sequence runs or waits, and for `grace_s` after the last one left, at most `max_seqs` background
ones run: the newest beyond that go back to waiting, and no more are admitted. The grace is for a
client's next request, on its way: a batch that filled the gap would make it wait behind a step of
a whole batch's prefills, seconds on a CPU. Alone, background work fills the batch.
"""

from __future__ import annotations

from collections.abc import Callable

from gpu_worker_svc.engine.sequence import Sequence


class BackgroundYield:
    def __init__(self, priority: int | None, max_seqs: int, grace_s: float, clock: Callable[[], float]) -> None:
        self.priority = priority  # None: no sequence is background
        self.max_seqs = max_seqs
        self.grace_s = grace_s
        self._clock = clock
        self._foreground_seen = float("-inf")  # when a foreground sequence last ran or waited

    def is_background(self, seq: Sequence) -> bool:
        return self.priority is not None and seq.priority >= self.priority

    def count(self, running: list[Sequence]) -> int:
        return sum(1 for s in running if self.is_background(s))

    def foreground_present(self, running: list[Sequence], waiting: list[Sequence]) -> bool:
        """Whether a foreground sequence runs or waits, or did within the grace; once a step."""
        if self.priority is None:
            return False
        now = self._clock()
        if any(not self.is_background(s) for s in running) or any(not self.is_background(s) for s in waiting):
            self._foreground_seen = now
            return True
        return now - self._foreground_seen < self.grace_s

    def victims(self, running: list[Sequence]) -> list[Sequence]:
        """The newest running background sequences beyond max_seqs."""
        background = [s for s in running if self.is_background(s)]
        excess = len(background) - self.max_seqs
        return sorted(background, key=lambda s: s.arrival_time, reverse=True)[:excess] if excess > 0 else []

"""Across classes the order is strict: a waiting sequence preempts running ones of a worse class.

When the head of the queue cannot be admitted (the batch is at max_num_seqs, or its blocks or the
step's budget are short), the batch scheduler preempts, by recompute, the running sequence of the
lowest class, newest first, among those of a class strictly worse (a higher priority value) than
the head's, until the head fits. Never for an equal or a worse class: within a class arrival order
decides, and two sequences of one class would otherwise take turns throwing away each other's work.
Nor when even every worse-class sequence gone would leave the head unable to fit: their work would
be lost for nothing. Victims keep their full blocks in the prefix cache, so resuming them
recomputes little.
"""

from collections import Counter

from gpu_worker_svc.engine.block_pool import BlockPool
from gpu_worker_svc.engine.sequence import Sequence


def worse_class(running: list[Sequence], head: Sequence) -> list[Sequence]:
    """The running sequences `head` may preempt: those of a strictly worse class."""
    return [s for s in running if s.priority > head.priority]


def lowest_newest(seqs: list[Sequence]) -> Sequence:
    """The victim among non-empty `seqs`: the lowest class (highest value), then the newest arrival."""
    return max(seqs, key=lambda s: (s.priority, s.arrival_time))


def free_blocks_without(seqs: list[Sequence], pool: BlockPool) -> int:
    """The blocks free once `seqs` let go of theirs: those free now, and those only they hold."""
    held = Counter(b for s in seqs for b in s.block_ids)
    return pool.num_free_blocks + sum(1 for b, n in held.items() if pool.ref_count(b) == n)

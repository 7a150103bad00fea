"""Fairness measures of a multi-tenant run: Jain's index, service within a window, and who was backlogged.

Service is counted the way the scheduler's VTC charges it (scheduler_svc/fair_share.py): a prompt
token costs 1, a generated token 2. The client sees a prompt's tokens served when its first token
arrives (its prefill is done by then), and each output token when its chunk arrives; only what
arrives inside the window counts, so a run that ends with a backlog is measured fairly.

A tenant is backlogged over the window when, for at least the workload's backlog_threshold of it,
one of its requests had been sent and had not yet had its first token (it waited in a queue: the
scheduler's or an engine's). That is the paper's definition (a client with requests waiting is
backlogged) observed from the client, and a tenant whose offered load is below its fair share
fails it, because its requests are served as they come.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shardline.bench.tenant_load import SentRequest

INPUT_COST = 1.0  # the VTC's weight of a prompt token (the paper's w_in)
OUTPUT_COST = 2.0  # and of a generated token (w_out)


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one has it all."""
    xs = list(values)
    if not xs:
        raise ValueError("Jain's index of no values")
    if any(x < 0 for x in xs):
        raise ValueError("Jain's index of a negative value")
    squares = sum(x * x for x in xs)
    if squares == 0:  # nobody got anything: equally nothing
        return 1.0
    return sum(xs) ** 2 / (len(xs) * squares)


@dataclass(slots=True)
class Service:
    """Tokens a tenant was served within a window."""

    input_tokens: int = 0
    output_tokens: float = 0.0  # fractional where a chunk carried several tokens and the window cut it

    @property
    def weighted(self) -> float:
        """In the VTC's units: input + 2 x output."""
        return INPUT_COST * self.input_tokens + OUTPUT_COST * self.output_tokens


def served_in(requests: Iterable[SentRequest], start: float, end: float) -> Service:
    """What arrived at the client within [start, end] (seconds from the run's start)."""
    service = Service()
    for r in requests:
        chunks = r.timing.chunk_times
        if not chunks:
            continue
        if start <= r.sent_at + chunks[0] <= end:
            service.input_tokens += r.timing.input_len
        # The usage's count over the chunks, where it is known: a chunk may carry several tokens.
        per_chunk = r.timing.output_len / len(chunks) if r.timing.output_len >= len(chunks) else 1.0
        service.output_tokens += per_chunk * sum(start <= r.sent_at + t <= end for t in chunks)
    return service


def offered_in(requests: Iterable[SentRequest], input_len: int, output_len: int, start: float, end: float) -> float:
    """The weighted tokens a tenant asked for in requests sent within [start, end]."""
    sent = sum(start <= r.sent_at <= end for r in requests)
    return sent * (INPUT_COST * input_len + OUTPUT_COST * output_len)


def backlog_fraction(requests: Iterable[SentRequest], start: float, end: float) -> float:
    """The share of [start, end] during which at least one request was sent and still waiting for its
    first token (one that never had one waited until it ended, or to the window's end)."""
    intervals = []
    for r in requests:
        waited_until = r.first_token_at
        if waited_until is None:
            waited_until = r.ended_at if r.ended_at is not None and not r.cancelled else end
        low, high = max(r.sent_at, start), min(waited_until, end)
        if high > low:
            intervals.append((low, high))
    covered, reach = 0.0, start
    for low, high in sorted(intervals):
        if high > reach:
            covered += high - max(low, reach)
            reach = high
    return covered / (end - start) if end > start else 0.0

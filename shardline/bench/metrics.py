"""Client-side serving metrics with the same definitions as `vllm bench serve`."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestTiming:
    """What one streamed request saw, in seconds from just before it was sent."""

    input_len: int
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    output_len: int = 0
    cached_tokens: int = 0  # prompt tokens a worker's prefix cache served (0 where unknown)
    ok: bool = True
    error: str = ""
    status: int = 0  # the HTTP status that refused it (429, 503...), also for an error event; 0: none did

    @property
    def ttft(self) -> float:
        return self.chunk_times[0]

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1]

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def _summary(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, std (population, as numpy's), median and p99 (interpolated, as numpy's percentile)."""
    if not values:
        return {"mean": 0.0, "std": 0.0, "median": 0.0, "p99": 0.0}
    v = sorted(x * scale for x in values)
    return {
        "mean": statistics.fmean(v),
        "std": statistics.pstdev(v),
        "median": statistics.median(v),
        "p99": percentile(v, 99),
    }


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile of sorted values, interpolated linearly between ranks (numpy's default)."""
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class Slos:
    """Goodput's service-level objectives, in ms; a request is good when it meets every one given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def given(self) -> bool:
        return any(x is not None for x in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met_by(self, t: RequestTiming) -> bool:
        return (
            (self.ttft_ms is None or t.ttft * 1000 <= self.ttft_ms)
            and (self.tpot_ms is None or (t.tpot or 0) * 1000 <= self.tpot_ms)
            and (self.e2el_ms is None or t.e2el * 1000 <= self.e2el_ms)
        )


def summarize(timings: list[RequestTiming], wall_s: float, slos: Slos | None = None) -> dict:
    """The run's figures, as `vllm bench serve` defines them; goodput only when SLOs are given."""
    slos = slos or Slos()
    done = [t for t in timings if t.ok and t.chunk_times]
    out_tokens = sum(t.output_len for t in done)
    in_tokens = sum(t.input_len for t in done)
    errors: dict[str, int] = {}
    for t in timings:
        if not t.ok:
            errors[t.error] = errors.get(t.error, 0) + 1
    return {
        "errors": errors,
        "completed": len(done),
        "failed": len(timings) - len(done),
        "wall_s": wall_s,
        "request_throughput": len(done) / wall_s,
        "output_throughput": out_tokens / wall_s,
        "total_token_throughput": (in_tokens + out_tokens) / wall_s,
        "goodput": sum(slos.met_by(t) for t in done) / wall_s if slos.given() else None,
        "cached_prompt_tokens": sum(t.cached_tokens for t in done),
        "ttft_ms": _summary([t.ttft for t in done]),
        "tpot_ms": _summary([t.tpot for t in done if t.tpot is not None]),
        "itl_ms": _summary([x for t in done for x in t.itl]),
        "e2el_ms": _summary([t.e2el for t in done]),
        # Per request, in send order, failures included (like `vllm bench serve --save-detailed`):
        # where a median hides a pattern, and every figure above can be recomputed.
        "detail": [_detail(t) for t in timings],
    }


def _detail(t: RequestTiming) -> dict:
    ms = [round(x * 1000, 3) for x in t.chunk_times]
    return {
        "input_len": t.input_len,
        "output_len": t.output_len,
        "cached_tokens": t.cached_tokens,
        "ttft_ms": ms[0] if ms else None,
        "e2el_ms": ms[-1] if ms else None,
        "itl_ms": [round(b - a, 3) for a, b in zip(ms, ms[1:])],
        "error": t.error or None,
    }


def median_of_rounds(rounds: list[dict]) -> dict:
    """One summary from several rounds' `summarize` results: each figure's median over the rounds
    (completed and failed too, so they compare with one round's prompts).

    Errors are counted over all rounds; per-request detail stays with each round.
    """

    def median(values: list):
        if isinstance(values[0], dict):
            return {key: median([v[key] for v in values]) for key in values[0]}
        if values[0] is None:
            return None
        return statistics.median(values)

    out = {key: median([r[key] for r in rounds]) for key in rounds[0] if key not in ("errors", "detail")}
    errors: dict[str, int] = {}
    for r in rounds:
        for error, count in r["errors"].items():
            errors[error] = errors.get(error, 0) + count
    out["errors"] = errors
    return out

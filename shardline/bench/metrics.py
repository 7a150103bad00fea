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
    ok: bool = True
    error: str = ""

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
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    v = sorted(x * scale for x in values)
    return {"mean": statistics.fmean(v), "median": statistics.median(v), "p99": v[min(len(v) - 1, int(0.99 * len(v)))]}


def summarize(timings: list[RequestTiming], wall_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    done = [t for t in timings if t.ok and t.chunk_times]
    out_tokens = sum(t.output_len for t in done)
    in_tokens = sum(t.input_len for t in done)
    good = [t for t in done
            if (slo_ttft_ms is None or t.ttft * 1000 <= slo_ttft_ms)
            and (slo_tpot_ms is None or (t.tpot or 0) * 1000 <= slo_tpot_ms)]
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
        "goodput": len(good) / wall_s,
        "ttft_ms": _summary([t.ttft for t in done]),
        "tpot_ms": _summary([t.tpot for t in done if t.tpot is not None]),
        "itl_ms": _summary([x for t in done for x in t.itl]),
        "e2el_ms": _summary([t.e2el for t in done]),
        # Per request, in send order (like `vllm bench serve --save-detailed`): where a median hides a pattern.
        "detail": {"ttft_ms": [round(t.ttft * 1000, 1) for t in done],
                   "e2el_ms": [round(t.e2el * 1000, 1) for t in done]},
    }


def median_of_rounds(rounds: list[dict]) -> dict:
    """One summary from several rounds' `summarize` results: each figure's median over the rounds.

    Counts of completed and failed requests and of errors are totals; per-request detail stays
    with each round.
    """
    def median(values: list):
        if isinstance(values[0], dict):
            return {key: median([v[key] for v in values]) for key in values[0]}
        return statistics.median(values)

    out = {key: median([r[key] for r in rounds]) for key in rounds[0]
           if key not in ("errors", "completed", "failed", "detail")}
    out["completed"] = sum(r["completed"] for r in rounds)
    out["failed"] = sum(r["failed"] for r in rounds)
    errors: dict[str, int] = {}
    for r in rounds:
        for error, count in r["errors"].items():
            errors[error] = errors.get(error, 0) + count
    out["errors"] = errors
    return out

"""What `shardline top` shows, as text, from the tracing service's /api/series answers."""

from __future__ import annotations

import time
from dataclasses import dataclass

# The series top reads, and the two windows it reads them over: the last 10 s and the last minute.
NAMES = (
    "requests",
    "output_tokens",
    "ttft_ms",
    "tpot_ms",
    "queue_depth",
    "running",
    "errors",
    "rejected",
    "failovers",
    "batch_size",
    "step_time_ms",
    "kv_blocks_used",
    "mfu",
    "mbu",
    "worker_tokens",
)
WINDOWS_S = (10, 60)


@dataclass(slots=True)
class Window:
    """One /api/series answer over a window read as a single step: one value per series row."""

    rows: list[dict]

    def _values(self, name: str, stat: str, **labels: str) -> list[float]:
        return [
            row["values"][-1]
            for row in self.rows
            if row["name"] == name
            and row["stat"] == stat
            and row["values"]
            and row["values"][-1] is not None
            and all(row["labels"].get(k) == v for k, v in labels.items())
        ]

    def total(self, name: str, stat: str = "rate", **labels: str) -> float | None:
        """The series' rows summed (over tenants, models, workers); None when none has a value."""
        values = self._values(name, stat, **labels)
        return sum(values) if values else None

    def most(self, name: str, stat: str, **labels: str) -> float | None:
        """The largest of the series' rows: a percentile or maximum over several models or workers."""
        values = self._values(name, stat, **labels)
        return max(values) if values else None

    def workers(self) -> list[str]:
        return sorted({row["labels"]["worker"] for row in self.rows if row["name"] == "batch_size"})


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pair(a: float | None, b: float | None, digits: int = 0) -> str:
    return f"{_num(a, digits)} / {_num(b, digits)}"


def render(url: str, windows: dict[int, Window], now_s: float | None = None) -> str:
    """The screen: the stack's rates and latencies over each window, then a line per worker."""
    clock = time.strftime("%H:%M:%S", time.localtime(now_s if now_s is not None else time.time()))
    short, long = windows[WINDOWS_S[0]], windows[WINDOWS_S[1]]
    lines = [f"shardline top  {url}  {clock}  (q quits)", "", f"{'':<22}{'last 10 s':>14}{'last 60 s':>14}"]

    def row(label: str, cell) -> None:
        lines.append(f"{label:<22}{cell(short):>14}{cell(long):>14}")

    row("requests/s", lambda w: _num(w.total("requests"), 2))
    row("output tokens/s", lambda w: _num(w.total("output_tokens")))
    row("TTFT p50 / p99 ms", lambda w: _pair(w.most("ttft_ms", "p50"), w.most("ttft_ms", "p99")))
    row("TPOT p50 / p99 ms", lambda w: _pair(w.most("tpot_ms", "p50"), w.most("tpot_ms", "p99"), 1))
    row("queue mean / max", lambda w: _pair(w.total("queue_depth", "mean"), w.total("queue_depth", "max"), 1))
    row("running", lambda w: _num(w.total("running", "mean")))
    row("errors/s", lambda w: _num(w.total("errors") or 0.0, 2))
    row("429s/s", lambda w: _num(w.total("rejected") or 0.0, 2))
    row("failovers/s", lambda w: _num(w.total("failovers") or 0.0, 2))
    lines += [
        "",
        f"{'worker (last 10 s)':<22}{'batch':>7}{'step ms':>9}{'KV blocks':>11}{'MFU':>7}{'MBU':>7}{'tok/s':>9}",
    ]
    workers = short.workers() or long.workers()
    for worker in workers:
        lines.append(
            f"{worker:<22}"
            f"{_num(short.total('batch_size', 'mean', worker=worker)):>7}"
            f"{_num(short.total('step_time_ms', 'mean', worker=worker)):>9}"
            f"{_num(short.total('kv_blocks_used', 'max', worker=worker), 0):>11}"
            f"{_num(short.total('mfu', 'mean', worker=worker), 3):>7}"
            f"{_num(short.total('mbu', 'mean', worker=worker), 3):>7}"
            f"{_num(short.total('worker_tokens', worker=worker)):>9}"
        )
    if not workers:
        lines.append("(no worker stepped in the last minute)")
    return "\n".join(lines)

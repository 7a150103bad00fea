"""What the autoscaler reads about each model's load between two of its intervals."""

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Window:
    arrivals: int = 0
    service_s: list[float] = field(default_factory=list)  # dispatch to finish, per finished request
    ttft_s: list[float] = field(default_factory=list)  # arrival to first token


@dataclass(frozen=True, slots=True)
class LoadWindow:
    """One model's figures since the previous take()."""

    arrivals: int  # requests submitted
    completions: int  # requests that finished after running on a worker
    mean_service_s: float | None  # their mean time from dispatch to finish; None: none finished
    ttft_p90_s: float | None  # the 90th percentile of the first tokens' delays; None: no first token


class LoadMeter:
    """Counts arrivals, finishes and first tokens per model, as the dispatcher and the request table
    see them; the autoscaler takes the counts once an interval. O(1) per event, no Redis."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._windows: defaultdict[str, _Window] = defaultdict(_Window)

    def arrived(self, model: str) -> None:
        self._windows[model].arrivals += 1

    def first_token(self, model: str, ttft_s: float) -> None:
        self._windows[model].ttft_s.append(ttft_s)

    def finished(self, model: str, dispatched_at: float | None) -> None:
        """A request ended; `dispatched_at` (this meter's clock) is None when it never ran."""
        if dispatched_at is not None:
            self._windows[model].service_s.append(max(0.0, self._clock() - dispatched_at))

    def now(self) -> float:
        return self._clock()

    def take(self, model: str) -> LoadWindow:
        """The model's figures since the last take, and a fresh window."""
        window = self._windows.pop(model, _Window())
        service = window.service_s
        return LoadWindow(
            arrivals=window.arrivals,
            completions=len(service),
            mean_service_s=sum(service) / len(service) if service else None,
            ttft_p90_s=_percentile(window.ttft_s, 0.9),
        )


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]

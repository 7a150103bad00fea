"""Synthetic arrival traces: a diurnal day with noise, a sudden burst, a slow ramp (seeded, reproducible)."""

import math
from collections.abc import Callable

import numpy as np

from scheduler_svc.autoscale.config import TRACE_SHAPES
from scheduler_svc.autoscale.trace import Trace

_DAY_S = 86_400.0


def rate_curve(shape: str, duration_s: float, base_rps: float) -> Callable[[np.ndarray], np.ndarray]:
    """The shape's mean arrival rate (requests/s) at each time t in [0, duration_s).

    diurnal: a day's sine from 0.25x to 1.75x the base, lowest at t = 0 (night).
    burst: the base, then 5x the base over the middle sixth of the trace.
    ramp: from the base to 8x the base linearly over the first five sixths, then flat.
    """
    if shape == "diurnal":
        return lambda t: base_rps * (1.0 - 0.75 * np.cos(2 * math.pi * t / _DAY_S))
    if shape == "burst":
        start, end = duration_s * 5 / 12, duration_s * 7 / 12
        return lambda t: np.where((t >= start) & (t < end), 5.0 * base_rps, base_rps)
    if shape == "ramp":
        rise = duration_s * 5 / 6
        return lambda t: base_rps * (1.0 + 7.0 * np.minimum(t / rise, 1.0))
    raise ValueError(f"unknown trace shape {shape!r}: one of {', '.join(TRACE_SHAPES)}")


def generate_trace(
    shape: str,
    duration_s: float,
    base_rps: float,
    seed: int = 0,
    noise: float = 0.15,
    input_median: int = 512,
    output_median: int = 256,
) -> Trace:
    """Poisson arrivals at the shape's rate times a slowly wandering noise (log-AR(1) per minute, of
    standard deviation `noise`), so a forecast is never exact; lognormal prompt and output lengths."""
    if duration_s <= 0 or base_rps <= 0:
        raise ValueError("a trace needs a positive duration and rate")
    if noise < 0:
        raise ValueError("noise must not be negative")
    rng = np.random.default_rng(seed)
    seconds = np.arange(int(math.ceil(duration_s)), dtype=np.float64)
    minutes = len(seconds) // 60 + 1
    # AR(1) in log space, a 10-minute memory: load that wanders, not only Poisson counting noise.
    phi = math.exp(-1 / 10)
    shocks = rng.normal(0.0, noise * math.sqrt(1 - phi * phi), minutes)
    wander = np.empty(minutes)
    wander[0] = rng.normal(0.0, noise)
    for i in range(1, minutes):
        wander[i] = phi * wander[i - 1] + shocks[i]
    rate = rate_curve(shape, duration_s, base_rps)(seconds + 0.5) * np.exp(wander[(seconds // 60).astype(int)])
    counts = rng.poisson(rate)
    times = np.repeat(seconds, counts) + rng.random(int(counts.sum()))
    n = len(times)
    inp = np.clip(np.round(rng.lognormal(math.log(input_median), 0.8, n)), 16, 8192).astype(np.int64)
    out = np.clip(np.round(rng.lognormal(math.log(output_median), 0.6, n)), 8, 4096).astype(np.int64)
    return Trace.of(times, inp, out)

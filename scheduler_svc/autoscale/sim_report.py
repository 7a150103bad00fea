"""What a simulation reports: SLO attainment, worker-hours, scale events and cold starts paid."""

from dataclasses import asdict, dataclass

import numpy as np

from scheduler_svc.autoscale.config import AutoscaleConfig


@dataclass(frozen=True, slots=True)
class SloTargets:
    """A request meets its SLO when both hold."""

    ttft_s: float = 2.0  # arrival to first token
    tpot_s: float = 0.1  # mean time per output token after the first


@dataclass(frozen=True, slots=True)
class SimResult:
    """One policy's run over one trace."""

    policy: str
    forecaster: str
    requests: int
    slo_attainment: float  # share of requests meeting both targets
    ttft_attainment: float  # share meeting the TTFT target
    tpot_attainment: float  # share meeting the TPOT target
    ttft_p50_s: float
    ttft_p99_s: float
    worker_hours: float  # worker-seconds / 3600, starting and draining time included
    mean_workers: float  # worker-seconds over the simulated time
    peak_workers: int  # most workers desired at any interval
    scale_events: int  # intervals at which the pool changed
    cold_starts: int  # workers started (each paid a cold start, or was cancelled during it)
    duration_s: float  # from the first arrival to the last completion
    timeline: list[tuple[float, int, int, int]]  # per interval: (ts, desired, ready, starting)

    def as_dict(self, timeline: bool = False) -> dict:
        """The figures as JSON-ready values; the per-interval timeline only when asked for."""
        out = asdict(self)
        if not timeline:
            del out["timeline"]
        return out


def summarise(
    *,
    config: AutoscaleConfig,
    slo: SloTargets,
    ttft_s: np.ndarray,
    tpot_s: np.ndarray,
    worker_s: float,
    duration_s: float,
    scale_events: int,
    cold_starts: int,
    timeline: list[tuple[float, int, int, int]],
) -> SimResult:
    ttft_ok = ttft_s <= slo.ttft_s + 1e-9
    tpot_ok = tpot_s <= slo.tpot_s + 1e-9
    n = len(ttft_s)
    return SimResult(
        policy=config.policy,
        forecaster=config.forecaster,
        requests=n,
        slo_attainment=float(np.mean(ttft_ok & tpot_ok)) if n else 1.0,
        ttft_attainment=float(np.mean(ttft_ok)) if n else 1.0,
        tpot_attainment=float(np.mean(tpot_ok)) if n else 1.0,
        ttft_p50_s=float(np.quantile(ttft_s, 0.5)) if n else 0.0,
        ttft_p99_s=float(np.quantile(ttft_s, 0.99)) if n else 0.0,
        worker_hours=worker_s / 3600.0,
        mean_workers=worker_s / duration_s if duration_s > 0 else 0.0,
        peak_workers=max((d for _, d, _, _ in timeline), default=0),
        scale_events=scale_events,
        cold_starts=cold_starts,
        duration_s=duration_s,
        timeline=timeline,
    )

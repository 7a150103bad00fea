"""The autoscaler's knobs: the policy, its forecaster, bounds, thresholds and the windows that stop flapping."""

from dataclasses import dataclass

POLICIES = ("static", "reactive", "naive", "lt-u", "lt-ua")
FORECASTERS = ("ewma", "arima")
# The synthetic load traces the simulator generates (trace_shapes.py).
TRACE_SHAPES = ("diurnal", "burst", "ramp")


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """How one model's worker count is decided; the same knobs serve every trace and every model.

    A worker's capacity is `slots_per_worker` concurrent requests. The forecast target is the count that
    runs the forecast load at `target_utilisation` (Little's law); `reactive` aims at the same
    utilisation, as a Kubernetes HPA with that target would.
    """

    policy: str = "static"  # static | reactive | naive | lt-u | lt-ua
    forecaster: str = "ewma"  # ewma | arima
    min_workers: int = 1
    max_workers: int = 1
    interval_s: float = 10.0  # how often decide() is called
    default_cold_start_s: float = 60.0  # the forecast horizon until a worker's cold start is measured
    # The share of the slots the forecast target (and reactive's HPA formula) plans to keep busy:
    # the rest is headroom for noise within one interval.
    target_utilisation: float = 0.75
    # lt-u / lt-ua act only when the smoothed utilisation leaves this band (hysteresis around the target).
    upper_utilisation: float = 0.85
    lower_utilisation: float = 0.55
    # lt-u / lt-ua move at most this share of the current count per interval (and at least one worker).
    step_fraction: float = 0.5
    # reactive: HPA's tolerance; no change while |utilisation / target - 1| stays within it.
    tolerance: float = 0.1
    # Every policy but static: a count only falls to the highest recommendation of this window, or
    # of the cold start if longer (HPA's scale-down stabilisation), so a noisy load never flaps and a
    # dip never sheds a worker that a cold start would have to bring back.
    scale_down_window_s: float = 300.0
    # Half-lives of the smoothing: of the arrival rate (ewma forecaster), of utilisation and demand
    # (what reactive's averaged metric reads), and of the mean service time. None: 6, 3 and 12
    # intervals (60, 30 and 120 s at the default interval), so a faster loop also smooths less.
    rate_half_life_s: float | None = None
    utilisation_half_life_s: float | None = None
    service_half_life_s: float | None = None
    # arima: the rate is binned, fitted on a bounded window and refitted at most every so many bins;
    # between refits each bin only extends the fitted model's state.
    arima_bin_s: float = 60.0
    arima_window_bins: int = 90
    arima_refit_bins: int = 30
    arima_min_bins: int = 30  # below this many bins the ewma forecast stands in
    arima_order: tuple[int, int, int] = (1, 1, 1)
    arima_maxiter: int = 30  # the likelihood search's iterations: a bound on a fit's cost

    def __post_init__(self) -> None:
        # Frozen: the defaults that follow the interval are filled in once, here.
        for name, intervals in (("rate_half_life_s", 6), ("utilisation_half_life_s", 3), ("service_half_life_s", 12)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, intervals * self.interval_s)
        if self.policy not in POLICIES:
            raise ValueError(f"unknown autoscale policy {self.policy!r}: one of {', '.join(POLICIES)}")
        if self.forecaster not in FORECASTERS:
            raise ValueError(f"unknown forecaster {self.forecaster!r}: one of {', '.join(FORECASTERS)}")
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError(
                f"workers bounds must be 0 <= min ({self.min_workers}) <= max ({self.max_workers}), max >= 1"
            )
        if self.interval_s <= 0 or self.default_cold_start_s < 0:
            raise ValueError("interval_s must be positive and default_cold_start_s not negative")
        if not 0 < self.lower_utilisation < self.target_utilisation < self.upper_utilisation:
            raise ValueError("utilisation thresholds must satisfy 0 < lower < target < upper")
        if self.step_fraction <= 0 or self.tolerance < 0 or self.scale_down_window_s < 0:
            raise ValueError("step_fraction must be positive; tolerance and scale_down_window_s not negative")
        if self.arima_bin_s <= 0 or not 2 <= self.arima_min_bins <= self.arima_window_bins or self.arima_refit_bins < 1:
            raise ValueError("arima bins: bin_s > 0, 2 <= min_bins <= window_bins, refit_bins >= 1")

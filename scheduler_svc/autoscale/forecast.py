"""Arrival-rate forecasts over the cold start: an EWMA, and an ARIMA model fitted by statsmodels."""

import logging
import math
import warnings
from collections import deque
from typing import Protocol

import numpy as np

from scheduler_svc.autoscale.config import AutoscaleConfig

log = logging.getLogger(__name__)


class Ewma:
    """An exponentially weighted mean whose weights follow elapsed time, so a half-life means the same
    whatever the interval it is updated at."""

    def __init__(self, half_life_s: float) -> None:
        self._half_life_s = half_life_s
        self.value: float | None = None

    def update(self, x: float, dt_s: float) -> float:
        if self.value is None or self._half_life_s <= 0:
            self.value = x
        else:
            self.value += (1.0 - 0.5 ** (max(dt_s, 0.0) / self._half_life_s)) * (x - self.value)
        return self.value


class RateForecaster(Protocol):
    """Learns an arrival rate (requests/s) and predicts the highest it will reach over a horizon."""

    name: str

    def observe(self, rate: float, dt_s: float) -> None:
        """The rate measured over the last `dt_s` seconds."""
        ...

    def forecast(self, horizon_s: float) -> float:
        """The highest rate expected over the next `horizon_s` seconds."""
        ...


class EwmaForecaster:
    """The smoothed level: a flat forecast, so it never anticipates a trend, but it is never fooled by one."""

    name = "ewma"

    def __init__(self, half_life_s: float) -> None:
        self._level = Ewma(half_life_s)

    def observe(self, rate: float, dt_s: float) -> None:
        self._level.update(rate, dt_s)

    def forecast(self, horizon_s: float) -> float:
        return self._level.value or 0.0


class ArimaForecaster:
    """ARIMA on the rate in bins of `arima_bin_s`, whose forecast extrapolates a trend across the horizon.

    A fit (a likelihood search of at most `arima_maxiter` iterations, about 0.1 s) runs on a bounded
    window and at most every `arima_refit_bins` bins;
    in between each new bin only extends the fitted model's state (a few ms), and the forecast is
    computed once a bin. Until enough bins exist, or when a fit fails, the EWMA forecast stands in.
    """

    name = "arima"

    def __init__(self, config: AutoscaleConfig) -> None:
        # About 1 s to import, so only for those who use it; and imported here, not inside a fit's
        # warning filter, since the import adds its own "always" filters ahead of ours.
        from statsmodels.tsa.arima.model import ARIMA

        self._arima = ARIMA
        self._config = config
        self._fallback = EwmaForecaster(config.rate_half_life_s)
        self._bins: deque[float] = deque(maxlen=config.arima_window_bins)
        self._bin_arrivals = 0.0
        self._bin_s = 0.0
        self._result = None  # the fitted statsmodels results, or None: use the fallback
        self._bins_since_fit = 0
        self._tried = False  # whether a fit was attempted yet
        self._cached: tuple[int, float] | None = None  # (steps, forecast) since the last bin

    @property
    def fitted(self) -> bool:
        return self._result is not None

    def observe(self, rate: float, dt_s: float) -> None:
        self._fallback.observe(rate, dt_s)
        self._bin_arrivals += rate * dt_s
        self._bin_s += dt_s
        if self._bin_s + 1e-9 >= self._config.arima_bin_s:
            self._close_bin(self._bin_arrivals / self._bin_s)
            self._bin_arrivals = self._bin_s = 0.0

    def forecast(self, horizon_s: float) -> float:
        if self._result is None:
            return self._fallback.forecast(horizon_s)
        steps = max(1, math.ceil(horizon_s / self._config.arima_bin_s))
        if self._cached is None or self._cached[0] != steps:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    predicted = np.asarray(self._result.forecast(steps), dtype=float)
            except Exception as exc:  # a degenerate state: the fallback until the next refit
                log.debug("arima forecast failed: %s", exc)
                self._result = None
                return self._fallback.forecast(horizon_s)
            value = float(predicted.max()) if np.all(np.isfinite(predicted)) else math.nan
            if not math.isfinite(value):
                self._result = None
                return self._fallback.forecast(horizon_s)
            self._cached = (steps, max(0.0, value))
        return self._cached[1]

    def _close_bin(self, rate: float) -> None:
        self._bins.append(rate)
        self._cached = None
        self._bins_since_fit += 1
        if len(self._bins) < self._config.arima_min_bins:
            return
        # A failed fit waits for the next refit too: its cost stays bounded whatever the series.
        due = not self._tried or self._bins_since_fit >= self._config.arima_refit_bins
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # convergence and frequency warnings, every fit otherwise
                if due:
                    self._tried, self._bins_since_fit = True, 0
                    self._result = self._fit()
                elif self._result is not None:
                    self._result = self._result.extend([rate])
        except Exception as exc:  # a singular or non-stationary window: the fallback stands in
            log.debug("arima fit failed on %d bins: %s", len(self._bins), exc)
            self._result = None

    def _fit(self):
        order = self._config.arima_order
        series = np.asarray(self._bins, dtype=float)
        if np.ptp(series) == 0.0:  # nothing to learn, and the fit would be singular
            return None
        model = self._arima(series, order=order, trend="n" if order[1] else "c")
        return model.fit(method_kwargs={"maxiter": self._config.arima_maxiter})


def make_forecaster(config: AutoscaleConfig) -> RateForecaster:
    """The forecaster the config names."""
    if config.forecaster == "arima":
        return ArimaForecaster(config)
    return EwmaForecaster(config.rate_half_life_s)

"""The forecasters: EWMA's half-life, ARIMA's trend, its bounded refits and its fallback."""

import warnings

import numpy as np

from scheduler_svc.autoscale.config import AutoscaleConfig
from scheduler_svc.autoscale.forecast import ArimaForecaster, Ewma, EwmaForecaster


def test_an_ewma_moves_halfway_to_a_step_in_one_half_life_whatever_the_interval():
    for dt in (1.0, 10.0, 30.0):
        ewma = Ewma(half_life_s=60.0)
        ewma.update(0.0, dt)
        for _ in range(int(60 / dt)):
            ewma.update(10.0, dt)
        assert abs(ewma.value - 5.0) < 1e-9


def test_the_ewma_forecast_is_its_smoothed_level_and_ignores_the_horizon():
    f = EwmaForecaster(half_life_s=30.0)
    for _ in range(100):
        f.observe(4.0, 10.0)
    assert f.forecast(60.0) == f.forecast(600.0) == 4.0


def _arima(**overrides) -> ArimaForecaster:
    knobs = dict(forecaster="arima", arima_min_bins=30, arima_window_bins=60, arima_refit_bins=20, arima_maxiter=8)
    return ArimaForecaster(AutoscaleConfig(**(knobs | overrides)))


def test_arima_extrapolates_a_ramp_over_the_horizon_where_the_ewma_lags():
    rng = np.random.default_rng(1)
    arima, ewma = _arima(), EwmaForecaster(60.0)
    rates = np.linspace(1.0, 6.0, 45) + rng.normal(0, 0.05, 45)
    for rate in rates:
        for _ in range(6):  # six 10 s intervals a one-minute bin
            arima.observe(rate, 10.0)
            ewma.observe(rate, 10.0)
    assert arima.fitted
    assert arima.forecast(600.0) > rates[-1] > ewma.forecast(600.0)


def test_arima_refits_at_most_every_refit_bins_and_extends_in_between_even_when_a_fit_fails(monkeypatch):
    arima = _arima(arima_min_bins=10, arima_refit_bins=15)
    fits = []
    real_fit = ArimaForecaster._fit
    monkeypatch.setattr(ArimaForecaster, "_fit", lambda self: fits.append(len(self._bins)) or real_fit(self))
    rng = np.random.default_rng(2)
    for rate in 3.0 + np.sin(np.arange(55) / 5) + rng.normal(0, 0.1, 55):
        arima.observe(rate, 60.0)
    assert fits == [10, 25, 40, 55]


def test_arima_stands_in_the_ewma_until_enough_bins_and_on_a_series_it_cannot_fit():
    arima = _arima(arima_min_bins=10)
    for _ in range(9):
        arima.observe(2.0, 60.0)
    assert not arima.fitted and arima.forecast(60.0) == 2.0
    arima.observe(2.0, 60.0)  # ten bins, all equal: nothing to fit
    assert not arima.fitted and arima.forecast(60.0) == 2.0


def test_arima_fits_raise_no_warnings():
    arima = _arima(arima_min_bins=10, arima_refit_bins=5)
    rng = np.random.default_rng(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rate in rng.exponential(1.0, 30):  # noise with no structure: fits that do not converge well
            arima.observe(rate, 60.0)
            arima.forecast(300.0)
    assert [str(w.message) for w in caught] == []

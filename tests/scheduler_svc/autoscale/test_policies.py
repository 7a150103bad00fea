"""Each policy on synthetic series (step, ramp, diurnal sine, burst, noise): where it goes, within
bounds, after its windows, and never flapping at a constant load."""

import pytest

from scheduler_svc.autoscale.load import LoadSample
from scheduler_svc.autoscale.policy import AutoscaleConfig, Autoscaler
from tests.scheduler_svc.autoscale.load_series import SERVICE_S, SLOTS, burst, diurnal, drive, ramp, step

SCALING = ("reactive", "naive", "lt-u", "lt-ua")


def _config(policy: str, forecaster: str = "ewma", **knobs) -> AutoscaleConfig:
    return AutoscaleConfig(policy=policy, forecaster=forecaster, **({"min_workers": 1, "max_workers": 12} | knobs))


def _needed(rate: float) -> int:
    """Workers that run `rate` at the target utilisation (0.75), by Little's law."""
    return -(-int(rate * SERVICE_S * 100) // int(SLOTS * 0.75 * 100))


def _sample(**fields) -> LoadSample:
    base = dict(ts=10.0, arrivals=0, completions=0, mean_service_s=None, queue_depth=0, in_flight=0)
    return LoadSample(**(base | {"workers_ready": 4, "slots_per_worker": 16} | fields))


def test_static_keeps_the_pool_it_has_within_the_bounds():
    scaler = Autoscaler(_config("static", min_workers=2, max_workers=5))
    assert scaler.decide(_sample(queue_depth=500), 3).desired == 3
    assert scaler.decide(_sample(ts=20.0), 9).desired == 5
    assert scaler.decide(_sample(ts=30.0), 0).desired == 2


def test_reactive_is_the_hpa_formula_with_its_tolerance():
    scaler = Autoscaler(_config("reactive", max_workers=20))
    # 96 running on 4 workers of 16 slots at target 0.75: ratio 96 / 48 = 2, so ceil(4 x 2).
    decision = scaler.decide(_sample(in_flight=64, queue_depth=32), 4)
    assert decision.desired == 8 and "wants 8" in decision.reason
    # 50 / 48 is within the 10% tolerance.
    assert Autoscaler(_config("reactive")).decide(_sample(in_flight=50), 4).desired == 4


def test_reactive_counts_starting_workers_as_idle_so_it_does_not_ask_twice():
    scaler = Autoscaler(_config("reactive", max_workers=20))
    first = scaler.decide(_sample(in_flight=64, queue_depth=32), 4)
    again = scaler.decide(_sample(ts=20.0, in_flight=64, queue_depth=32), first.desired)
    assert again.desired == first.desired == 8


@pytest.mark.parametrize("policy", SCALING)
def test_a_step_up_reaches_the_count_the_new_load_needs(policy):
    rates = step(120, 1.0, 6.0, at=30)
    run = drive(rates, _config(policy), cold_start_s=60.0)
    assert run.actual[0] == 1
    assert _needed(6.0) <= run.desired[-1] <= _needed(6.0) + 2


@pytest.mark.parametrize("policy", SCALING)
def test_a_step_down_waits_out_the_scale_down_window_then_sheds(policy):
    rates = step(150, 6.0, 1.0, at=20)
    run = drive(rates, _config(policy), cold_start_s=60.0, initial=_needed(6.0))
    window_steps = int(300 / 10)
    assert min(run.desired[: 20 + window_steps - 1]) == _needed(6.0)  # held for the 300 s window
    assert run.desired[-1] < _needed(6.0)


def test_the_scale_down_window_stretches_to_a_longer_cold_start():
    rates = step(150, 6.0, 1.0, at=20)
    run = drive(rates, _config("naive"), cold_start_s=900.0, initial=_needed(6.0))
    assert min(run.desired[: 20 + 89]) == _needed(6.0)  # 900 s, not 300


@pytest.mark.parametrize("policy", SCALING)
@pytest.mark.parametrize("shape", ["ramp", "diurnal", "burst"])
def test_the_count_stays_within_the_bounds(policy, shape):
    series = {"ramp": ramp(200, 0.0, 40.0), "diurnal": diurnal(200, 8.0, 100), "burst": burst(200, 1.0, 50, 120, 10)}
    run = drive(series[shape], _config(policy, min_workers=2, max_workers=7))
    assert all(2 <= d <= 7 for d in run.desired)
    assert max(run.desired) == 7  # the load asks for more than the bound


@pytest.mark.parametrize("policy,forecaster", [(p, "ewma") for p in SCALING] + [("lt-ua", "arima")])
def test_no_flapping_at_a_constant_noisy_load(policy, forecaster):
    # 4.5 requests/s of Poisson noise for two hours, from the count it needs.
    config = _config(policy, forecaster, arima_maxiter=8)  # a bounded search keeps the test short
    run = drive(step(720, 4.5, 4.5, at=0), config, initial=_needed(4.5), seed=7)
    moves = [i for i in range(1, len(run.desired)) if run.desired[i] != run.desired[i - 1]]
    # At most one excursion in two hours, and none undone within the 300 s scale-down window.
    assert len(moves) <= 2, run.desired
    assert all(b - a >= 30 for a, b in zip(moves, moves[1:])), moves


def test_lt_u_never_goes_beyond_the_forecasts_count_and_lt_ua_does_when_a_burst_outruns_it():
    rates = burst(120, 1.0, 30, 90, factor=6.0)
    lt_u = drive(rates, _config("lt-u"))
    lt_ua = drive(rates, _config("lt-ua"))
    assert all(d.desired <= max(a, d.target) for d, a in zip(lt_u.decisions, lt_u.actual))
    assert any(d.desired > max(a, d.target) for d, a in zip(lt_ua.decisions, lt_ua.actual))
    assert max(lt_ua.desired[30:40]) > max(lt_u.desired[30:40])  # it reacts while the ewma still lags


def test_lt_u_moves_in_steps_toward_the_target_once_utilisation_crosses_the_threshold():
    scaler = Autoscaler(_config("lt-u", max_workers=20))
    sample = _sample(arrivals=200, completions=200, mean_service_s=10.0, in_flight=64, queue_depth=100)
    decision = scaler.decide(sample, 4)
    assert decision.target > 6 and decision.desired == 6  # +50% of 4, toward the forecast's count
    assert "toward" in decision.reason and decision.utilisation > 0.85


@pytest.mark.parametrize("policy", SCALING)
def test_the_count_follows_a_diurnal_sine(policy):
    rates = diurnal(600, 5.0, period=300)
    run = drive(rates, _config(policy))
    peak, trough = run.desired[130:170], run.desired[270:300]  # the second half of the first cycle
    assert max(peak) >= _needed(rates.max()) - 1
    assert min(trough) <= _needed(rates.min()) + 1


def test_arima_forecasts_a_ramp_higher_than_the_ewma_so_naive_plans_ahead():
    rates = ramp(360, 1.0, 8.0)
    ewma = drive(rates, _config("naive", "ewma", arima_min_bins=20))
    arima = drive(rates, _config("naive", "arima", arima_min_bins=20, arima_maxiter=8))
    late = slice(200, 360)
    assert sum(d.forecast_rps for d in arima.decisions[late]) > sum(d.forecast_rps for d in ewma.decisions[late])


@pytest.mark.parametrize("policy", SCALING)
def test_from_zero_workers_the_first_request_asks_for_one(policy):
    scaler = Autoscaler(_config(policy, min_workers=0))
    assert scaler.decide(_sample(workers_ready=0, arrivals=1, queue_depth=1), 0).desired == 1


def test_a_config_out_of_bounds_is_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="unknown autoscale policy"):
        AutoscaleConfig(policy="hpa")
    with pytest.raises(ValueError, match="min"):
        AutoscaleConfig(min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="lower < target < upper"):
        AutoscaleConfig(lower_utilisation=0.9)

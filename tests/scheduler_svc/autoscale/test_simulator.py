"""The simulator's accounting on traces small enough to follow by hand, and its invariants on bigger ones."""

import numpy as np
import pytest

from scheduler_svc.autoscale.policy import AutoscaleConfig
from scheduler_svc.autoscale.sim_report import SloTargets
from scheduler_svc.autoscale.simulator import WorkerModel, simulate
from scheduler_svc.autoscale.trace import Trace
from scheduler_svc.autoscale.trace_shapes import generate_trace


def test_one_static_worker_of_one_slot_queues_in_arrival_order():
    # Prefill 100 tok/s, decode 10 tok/s: 100 in and 10 out take 1 s + 1 s; the first token is at 1.1 s.
    trace = Trace.of([0.0, 0.5, 5.0], [100, 100, 100], [10, 10, 10])
    worker = WorkerModel(slots=1, prefill_tps=100.0, decode_tps=10.0)
    result = simulate(trace, AutoscaleConfig(policy="static"), worker)
    # TTFT: 1.1; 1.5 waiting + 1.1 = 2.6; 1.1. Against 2 s, two of three meet it.
    assert result.slo_attainment == pytest.approx(2 / 3)
    assert result.ttft_p50_s == pytest.approx(1.1)
    assert result.tpot_attainment == 1.0  # 0.1 s a token meets 0.1 s
    assert result.duration_s == pytest.approx(7.0)  # the last finishes at 5 + 2
    assert result.worker_hours == pytest.approx(7.0 / 3600)
    assert (result.scale_events, result.cold_starts) == (0, 0)


def test_a_scale_up_pays_the_cold_start_and_a_drained_worker_stops_costing_at_the_interval_after():
    # Three requests of 10 s (10 tokens at 1 tok/s, first token at 1 s) on one worker of one slot.
    trace = Trace.of([0.0, 0.0, 0.0, 30.0], [0, 0, 0, 0], [10, 10, 10, 1])
    worker = WorkerModel(slots=1, prefill_tps=1000.0, decode_tps=1.0, cold_start_s=3.0)
    # No smoothing, so each interval reads what is running and queued at that instant.
    config = AutoscaleConfig(
        policy="reactive", max_workers=2, interval_s=1.0, scale_down_window_s=5.0, utilisation_half_life_s=0.0
    )
    result = simulate(trace, config, worker, SloTargets(ttft_s=2.0, tpot_s=1.0))
    # t=1: 3 requests on 1 slot, HPA wants ceil(3 / 0.75) = 4, bounded to 2: B starts, ready at 4.
    # A runs r0 0-10 and r2 10-20; B runs r1 4-14. TTFTs 1, 5, 11; r3 at 30 on A: 1.
    assert result.ttft_p50_s == pytest.approx(3.0)  # the median of 1, 1, 5, 11
    assert result.slo_attainment == pytest.approx(0.5)
    # From t=20 nothing runs; the window holds 2 until every proposal of (19, 24] is 1: B drains at
    # 24 with nothing in flight and stops. At 30, r3 alone on one slot asks for ceil(1 / 0.75) = 2:
    # C starts and is still starting when r3 ends at 31. A costs 0-31, B 1-24, C 30-31.
    assert result.cold_starts == 2
    assert result.scale_events == 3
    assert result.worker_hours == pytest.approx((31.0 + 23.0 + 1.0) / 3600)
    assert result.duration_s == pytest.approx(31.0)


def test_a_worker_cancelled_while_it_starts_costs_only_until_then():
    trace = Trace.of([0.0, 0.0, 0.0], [0, 0, 0], [2, 2, 2])
    worker = WorkerModel(slots=1, prefill_tps=1000.0, decode_tps=1.0, cold_start_s=100.0)
    config = AutoscaleConfig(
        policy="reactive", max_workers=3, interval_s=1.0, scale_down_window_s=0.0, utilisation_half_life_s=0.0
    )
    result = simulate(trace, config, worker)
    assert result.cold_starts == 2  # asked for at t=1, never ready: the queue is gone by t=6
    assert result.duration_s == pytest.approx(6.0)
    assert result.worker_hours < (6.0 + 2 * 6.0) / 3600  # cancelled before the end, not after it


@pytest.mark.parametrize("policy", ["reactive", "naive", "lt-u", "lt-ua"])
def test_every_request_completes_once_through_scale_up_and_draining_scale_down(policy):
    trace = generate_trace("burst", 3 * 3600.0, 1.0, seed=3)
    config = AutoscaleConfig(policy=policy, max_workers=10)
    result = simulate(trace, config, WorkerModel(cold_start_s=120.0), initial_workers=1)
    assert result.requests == len(trace)
    assert np.isfinite(result.ttft_p99_s)
    desired = [d for _, d, _, _ in result.timeline]
    assert max(desired) > 2 and desired[-1] < max(desired)  # it scaled up for the burst and back down
    assert all(1 <= d <= 10 for d in desired)
    assert result.worker_hours * 3600 < 10 * result.duration_s


def test_static_at_the_peak_meets_more_of_the_slo_than_static_at_the_trough():
    trace = generate_trace("ramp", 2 * 3600.0, 1.0, seed=4)
    config = AutoscaleConfig(policy="static", max_workers=8)
    low = simulate(trace, config, initial_workers=1)
    high = simulate(trace, config, initial_workers=8)
    assert low.slo_attainment < high.slo_attainment
    assert high.worker_hours == pytest.approx(8 * high.duration_s / 3600)

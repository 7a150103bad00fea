"""The autoscaling policies in the simulator: SLO attainment and worker-hours on three generated traces.

    python -m benchmarks.autoscale_sim                       # every trace, cold starts of 60 s and 10 min
    python -m benchmarks.autoscale_sim --traces burst --cold-starts 600

Traces (seeded): diurnal (24 h, 1 to 7 requests/s with a wandering noise), burst (6 h at 1.5/s with
a sudden 5x hour in the middle), ramp (12 h rising 1.5 to 12/s over 10 h). Every policy runs with the
same knobs (AutoscaleConfig's defaults) on every trace; all start with the workers the first ten
minutes need; static keeps the count the trace's busiest ten minutes need. The goal of issue 26:
lt-ua reaches at least reactive's SLO attainment with 20% fewer worker-hours, or a higher
attainment with no more worker-hours (within 2%).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from scheduler_svc.autoscale.policy import AutoscaleConfig
from scheduler_svc.autoscale.sim_report import SimResult, SloTargets
from scheduler_svc.autoscale.simulator import WorkerModel, simulate
from scheduler_svc.autoscale.trace import Trace
from scheduler_svc.autoscale.trace_shapes import generate_trace

logger = logging.getLogger("autoscale_sim")
TRACES = {"diurnal": (24.0, 4.0), "burst": (6.0, 1.5), "ramp": (12.0, 1.5)}  # hours, base requests/s
RUNS = [("static", "ewma"), ("reactive", "ewma"), ("naive", "ewma"), ("lt-u", "ewma"), ("lt-ua", "ewma")]
RUNS += [("lt-ua", "arima")]
MAX_WORKERS = 40


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", nargs="+", choices=list(TRACES), default=list(TRACES))
    p.add_argument("--cold-starts", nargs="+", type=float, default=[60.0, 600.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/autoscale_sim.json"))
    return p.parse_args()


def _workers_for(trace: Trace, window: slice, worker: WorkerModel, config: AutoscaleConfig) -> int:
    """Little's law on the trace's own rates and lengths, in ten-minute bins, at the target utilisation."""
    service = trace.input_tokens / worker.prefill_tps + trace.output_tokens / worker.decode_tps
    bins = np.arange(0.0, trace.duration_s + 600.0, 600.0)
    rates = np.histogram(trace.timestamps, bins=bins)[0] / 600.0
    need = rates[window].max() * float(service.mean()) / (worker.slots * config.target_utilisation)
    return max(1, min(MAX_WORKERS, math.ceil(need)))


def _goal(lt_ua: SimResult, reactive: SimResult) -> str:
    fewer = lt_ua.slo_attainment >= reactive.slo_attainment and lt_ua.worker_hours <= 0.8 * reactive.worker_hours
    higher = lt_ua.slo_attainment > reactive.slo_attainment and lt_ua.worker_hours <= 1.02 * reactive.worker_hours
    return "met" if fewer or higher else "not met"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    slo = SloTargets()
    rows, table = [], []
    for name in args.traces:
        hours, rps = TRACES[name]
        trace = generate_trace(name, hours * 3600.0, rps, seed=args.seed)
        for cold in args.cold_starts:
            worker = WorkerModel(cold_start_s=cold)
            results: dict[tuple[str, str], SimResult] = {}
            for policy, forecaster in RUNS:
                config = AutoscaleConfig(
                    policy=policy, forecaster=forecaster, max_workers=MAX_WORKERS, default_cold_start_s=cold
                )
                window = slice(None) if policy == "static" else slice(0, 1)
                initial = _workers_for(trace, window, worker, config)
                started = time.perf_counter()
                result = simulate(trace, config, worker, slo, initial_workers=initial)
                wall = time.perf_counter() - started
                results[policy, forecaster] = result
                logger.info("%s cold %.0fs %s/%s: %.2f s", name, cold, policy, forecaster, wall)
                rows.append({"trace": name, "cold_start_s": cold, "wall_s": round(wall, 2), **result.as_dict()})
            reactive = results["reactive", "ewma"]
            for (policy, forecaster), r in results.items():
                goal = _goal(r, reactive) if policy == "lt-ua" else ""
                table.append(
                    f"| {name} | {cold:.0f} s | {policy} ({forecaster}) | {r.slo_attainment:.2%} | "
                    f"{r.worker_hours:.1f} | {r.worker_hours / reactive.worker_hours:.2f}x | {r.scale_events} | "
                    f"{r.cold_starts} | {r.ttft_p99_s:.1f} | {goal} |"
                )
    result = {
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "worker": {k: getattr(WorkerModel(), k) for k in ("slots", "prefill_tps", "decode_tps")},
        "config": {k: getattr(AutoscaleConfig(), k) for k in AutoscaleConfig.__slots__},
        "runs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(
        "| trace | cold start | policy | SLO attainment | worker-hours | of reactive's | scale events | "
        "cold starts | TTFT p99 s | goal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    main()

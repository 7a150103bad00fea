"""`shardline autoscale simulate|trace`: replay an arrival trace against a policy, or generate a trace."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from scheduler_svc.autoscale.config import FORECASTERS, POLICIES, TRACE_SHAPES
from shardline.cli.one_line_errors import one_line_errors
from shardline.cli.serve_extra import require_serve

if TYPE_CHECKING:
    from scheduler_svc.autoscale.sim_report import SimResult


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("autoscale", help="simulate an autoscaling policy on an arrival trace, or generate one")
    actions = p.add_subparsers(metavar="action", required=True)

    sim = actions.add_parser("simulate", help="replay a trace (CSV or JSONL) against modelled workers and a policy")
    sim.add_argument("--trace", type=Path, required=True, help="timestamp, input_tokens, output_tokens per request")
    sim.add_argument("--policy", choices=POLICIES, required=True)
    sim.add_argument("--forecaster", choices=FORECASTERS, default="ewma")
    sim.add_argument("--cold-start-s", type=float, default=60.0, help="a new worker's start to ready")
    sim.add_argument("--min-workers", type=int, default=1)
    sim.add_argument("--max-workers", type=int, default=16)
    sim.add_argument("--initial-workers", type=int, default=None, help="ready at the start (default: min)")
    sim.add_argument("--interval-s", type=float, default=10.0, help="how often the policy decides")
    sim.add_argument("--slots", type=int, default=16, help="requests a worker runs at once (max_num_seqs)")
    sim.add_argument("--decode-tps", type=float, default=30.0, help="one request's tokens/s at a full batch")
    sim.add_argument("--prefill-tps", type=float, default=8000.0, help="one request's prompt tokens/s")
    sim.add_argument("--ttft-slo-s", type=float, default=2.0)
    sim.add_argument("--tpot-slo-s", type=float, default=0.1)
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.set_defaults(func=one_line_errors("autoscale simulate", run_simulate))

    gen = actions.add_parser("trace", help="generate a synthetic arrival trace")
    gen.add_argument("--shape", choices=TRACE_SHAPES, required=True)
    gen.add_argument("--out", type=Path, required=True, help="a .csv or .jsonl file to write")
    gen.add_argument("--hours", type=float, default=24.0)
    gen.add_argument("--rps", type=float, default=4.0, help="the base arrival rate")
    gen.add_argument("--noise", type=float, default=0.15, help="the rate's slow random wander (log std)")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=one_line_errors("autoscale trace", run_trace))


def run_simulate(args: argparse.Namespace) -> int:
    require_serve("autoscale simulate")
    from scheduler_svc.autoscale.policy import AutoscaleConfig
    from scheduler_svc.autoscale.sim_report import SloTargets
    from scheduler_svc.autoscale.simulator import WorkerModel, simulate
    from scheduler_svc.autoscale.trace import read_trace

    trace = read_trace(args.trace)
    config = AutoscaleConfig(
        policy=args.policy,
        forecaster=args.forecaster,
        min_workers=args.min_workers,
        max_workers=args.max_workers,
        interval_s=args.interval_s,
        default_cold_start_s=args.cold_start_s,
    )
    worker = WorkerModel(
        slots=args.slots, prefill_tps=args.prefill_tps, decode_tps=args.decode_tps, cold_start_s=args.cold_start_s
    )
    if args.ttft_slo_s <= 0 or args.tpot_slo_s <= 0:
        raise ValueError("the SLO targets must be positive")
    if args.initial_workers is not None and not 0 <= args.initial_workers <= args.max_workers:
        raise ValueError(f"--initial-workers must be within 0..{args.max_workers}")
    started = time.perf_counter()
    result = simulate(trace, config, worker, SloTargets(args.ttft_slo_s, args.tpot_slo_s), args.initial_workers)
    wall_s = time.perf_counter() - started
    if args.json:
        print(json.dumps({**result.as_dict(), "wall_s": round(wall_s, 3)}, indent=2))
    else:
        print(_table(result, wall_s))
    return 0


def _table(r: SimResult, wall_s: float) -> str:
    rows = [
        ("policy", f"{r.policy} ({r.forecaster})"),
        ("requests", f"{r.requests:,} over {r.duration_s / 3600:.2f} h"),
        ("SLO attainment", f"{r.slo_attainment:.2%} (TTFT {r.ttft_attainment:.2%}, TPOT {r.tpot_attainment:.2%})"),
        ("TTFT p50 / p99", f"{r.ttft_p50_s:.2f} s / {r.ttft_p99_s:.2f} s"),
        ("worker-hours", f"{r.worker_hours:.2f} (mean {r.mean_workers:.2f} workers, peak {r.peak_workers})"),
        ("scale events", str(r.scale_events)),
        ("cold starts paid", str(r.cold_starts)),
        ("simulated in", f"{wall_s:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_trace(args: argparse.Namespace) -> int:
    require_serve("autoscale trace")
    from scheduler_svc.autoscale.trace import write_trace
    from scheduler_svc.autoscale.trace_shapes import generate_trace

    if args.hours <= 0:
        raise ValueError("--hours must be positive")
    trace = generate_trace(args.shape, args.hours * 3600.0, args.rps, seed=args.seed, noise=args.noise)
    write_trace(trace, args.out)
    print(f"wrote {len(trace):,} requests over {trace.duration_s / 3600:.2f} h to {args.out}")
    return 0

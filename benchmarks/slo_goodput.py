"""Goodput under TTFT SLOs: classes and deadlines against FIFO, on the same bursty arrivals, in one run.

    python -m benchmarks.slo_goodput                         # loads 1.0 and 1.3, a round each side
    python -m benchmarks.slo_goodput --loads 1.2 --rounds 2

Two tenants, two SLO classes: `interactive` (TTFT SLO 1 s; short requests) and `batch` (TTFT SLO
10 s; longer ones), each with Poisson arrivals of burstiness 0.5 (vLLM's gamma gaps), half the
requests each. Their offered load, in the VTC's weighted tokens, is each of --loads times the
capacity C measured first on the FIFO stack (a closed loop of 2 x max_num_seqs): at 1.0 the stack
is busy on average and overloaded in every burst; at 1.3 it is overloaded throughout, as a
service is when a burst outlasts what autoscaling can add.

- slo: the scheduler's fair order; interactive requests ask for class 0 with ttft_target_ms 1000,
  batch ones for class 1 with ttft_target_ms 10000; both refuse_late (a request past its target
  can no longer be good, and the capacity it would take goes to one that still can).
- fifo: SHARDLINE_QUEUE_ORDER=fifo, the same arrivals and prompts, no priority, no ttft_target_ms,
  no refuse_late: one class in arrival order.

Both stacks dispatch at most max_num_seqs requests to the worker (SHARDLINE_DISPATCH_OVERCOMMIT=1,
against 1.5 by default): deadlines and refusals act on the scheduler's queue only, and a request
already in an engine's own queue cannot be refused. With 1.5, a run at load 1.3 had batch requests
reach their first token up to 18 s in, past a 10 s target that no longer refused them. A full
worker still takes a request of a better class than the worst it runs, for its engine to preempt,
so an interactive request does not wait in the scheduler's queue for a batch request to finish.

Goodput: requests that completed with a TTFT within their class's SLO, per second of the arrival
window (the same --duration on both sides, so the ratio is that of good requests); a refused
request is not goodput. Each round drains: every request completes or is refused.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

from benchmarks.tenant_stacks import (
    StackTenant,
    capacity,
    median_range,
    run_workload,
    start_stack,
    wait_idle,
    with_seed,
    write_results,
    write_tenants_file,
)
from shardline.bench.metrics import Slos
from shardline.bench.tenant_workload import TenantSpec, TenantWorkload

logger = logging.getLogger("slo_goodput")
SIDES = ("fifo", "slo")
CLASSES = {  # name: (TTFT SLO ms, priority class, input_len, output_len)
    "interactive": (1000.0, 0, 32, 16),
    "batch": (10000.0, 1, 128, 32),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1, help="rounds per side and load, alternating")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per round")
    p.add_argument("--loads", default="1.0,1.3", help="offered loads over the measured capacity, each in turn")
    p.add_argument("--burstiness", type=float, default=0.5)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--dispatch-overcommit", type=float, default=1.0, help="the scheduler's, on both stacks")
    p.add_argument(
        "--refuse-late", default="interactive,batch", help="the classes that send refuse_late on the slo side"
    )
    p.add_argument("--out", type=Path, default=Path("results/slo_goodput.json"))
    return p.parse_args()


def workload(tenants: dict[str, StackTenant], rate: float, args: argparse.Namespace, classes: bool) -> TenantWorkload:
    """Both classes at `rate` requests/s each; `classes`: with their priority and deadlines."""
    refusing = set(filter(None, args.refuse_late.split(",")))
    specs = []
    for name, (slo_ms, priority, input_len, output_len) in CLASSES.items():
        specs.append(
            TenantSpec(
                name,
                tenants[name].key,
                request_rate=rate,
                burstiness=args.burstiness,
                input_len=input_len,
                output_len=output_len,
                priority=priority if classes else None,
                ttft_target_ms=slo_ms if classes else None,
                refuse_late=(name in refusing) if classes else None,
                slos=Slos(ttft_ms=slo_ms),
            )
        )
    return TenantWorkload(specs, duration_s=args.duration, drain=True)


def _row(report: dict, duration_s: float) -> dict:
    tenants = report["tenants"]
    return {
        "good": report["good"],
        "goodput": report["good"] / duration_s,
        "goodput_over_wall": report["goodput"],
        "wall_s": report["wall_s"],
        "per_class": {
            n: {
                k: r[k]
                for k in ("sent", "completed", "good", "refused_503", "throttled_429", "failed", "slo_attainment")
            }
            | {"ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"]}
            for n, r in tenants.items()
        },
    }


def table(result: dict) -> str:
    lines = [
        "| load | side | round | goodput (req/s) | good / sent | interactive: good, refused, TTFT p50/p99 (ms) "
        "| batch: good, refused, TTFT p50/p99 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rnd in result["rounds"]:
        for side in SIDES:
            r = rnd[side]
            sent = sum(c["sent"] for c in r["per_class"].values())
            cells = [
                f"{c['good']}/{c['sent']}, {c['refused_503']}, {_ms(c['ttft_p50_ms'])}/{_ms(c['ttft_p99_ms'])}"
                for c in r["per_class"].values()
            ]
            lines.append(
                f"| {rnd['load']:g} | {side} | {rnd['round']} | {r['goodput']:.3f} | {r['good']}/{sent} | "
                + " | ".join(cells)
                + " |"
            )
    for load, ratio in result["ratio"].items():
        lines.append(f"\nload {load}: slo/fifo goodput {ratio} (median of the rounds' ratios, range)")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    tenants = {name: StackTenant(name) for name in CLASSES}
    env = {"MAX_NUM_SEQS": args.max_num_seqs, "QUEUE_CAPACITY": 8192, "DISPATCH_OVERCOMMIT": args.dispatch_overcommit}
    with tempfile.TemporaryDirectory(prefix="slo-goodput-") as tmp:
        tenants_file = Path(tmp) / "tenants.yaml"
        write_tenants_file(tenants_file, list(tenants.values()))  # one class each: the bodies choose
        stacks = {}
        try:
            for side, order in (("fifo", "fifo"), ("slo", "fair")):
                stacks[side] = start_stack(Path(tmp), side, tenants_file, order, env)
            # Capacity in weighted tokens/s (a probe request of 64 in / 32 out is 128 of them), then the rate
            # per class that offers --load of it in total.
            cap = capacity(stacks["fifo"], tenants["batch"].key, 64, 32, 2 * args.max_num_seqs, 20) * (64 + 2 * 32)
            wait_idle(stacks["fifo"])
            per_request = sum(i + 2 * o for _, _, i, o in CLASSES.values())
            logger.info("capacity %.0f weighted tok/s", cap)
            rounds = []
            for load in loads:
                rate = load * cap / per_request
                for r in range(args.rounds):
                    rnd: dict = {"load": load, "round": r + 1, "rate_per_class": rate}
                    # Alternating which side goes first over the whole run: neither always meets the drift.
                    for side in SIDES if len(rounds) % 2 == 0 else tuple(reversed(SIDES)):
                        w = with_seed(workload(tenants, rate, args, classes=side == "slo"), r)
                        report = run_workload(stacks[side], w, f"load {load:g} {side} {r + 1}/{args.rounds}")
                        rnd[side] = _row(report, args.duration)
                        logger.info("load %g round %d %s: %d good", load, r + 1, side, rnd[side]["good"])
                    rnd["ratio"] = rnd["slo"]["good"] / rnd["fifo"]["good"] if rnd["fifo"]["good"] else None
                    rounds.append(rnd)
        finally:
            for stack in stacks.values():
                stack.stop()
    ratios = {load: [rnd["ratio"] for rnd in rounds if rnd["load"] == load and rnd["ratio"]] for load in loads}
    result = {
        "config": vars(args) | {"out": str(args.out)},
        "capacity_weighted_tok_s": cap,
        "classes": {
            n: dict(zip(("ttft_slo_ms", "priority", "input_len", "output_len"), c)) for n, c in CLASSES.items()
        },
        "rounds": rounds,
        "ratio": {f"{load:g}": median_range(r) if r else None for load, r in ratios.items()},
        "ratio_median": {f"{load:g}": statistics.median(r) if r else None for load, r in ratios.items()},
    }
    write_results(args.out, result, table(result))


if __name__ == "__main__":
    main()

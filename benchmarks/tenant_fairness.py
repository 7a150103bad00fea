"""Fairness under overload: 4 tenants, one sending 10x the others, VTC against FIFO in one run.

    python -m benchmarks.tenant_fairness                     # 2 rounds each side, 60 s each
    python -m benchmarks.tenant_fairness --rounds 1 --duration 30

Two private stacks, identical but for the scheduler's SHARDLINE_QUEUE_ORDER (fifo: arrival order
within a class; fair: tenants by VTC), each with the same tenants file (4 tenants of weight 1,
one class) and a worker of --max-num-seqs. First the FIFO stack's capacity C is measured (a
closed loop of 2 x max_num_seqs requests). Then each tenant sends Poisson arrivals: the three
light ones at --overload x C / 4 each (their fair share, times the overload), the heavy one at
10x that. Every tenant thus offers more than its fair share, and each stays backlogged; the
report checks it from the client's side: a tenant counts as backlogged when one of its requests
was waiting for its first token for at least 90% of the window (fairness.py), and its offered
load over its fair share is printed beside it.

Jain's index is over the VTC-weighted tokens (input + 2 x output) each backlogged tenant was
served within the window [--measure-from, --duration] s, after which the requests still in flight
are cancelled and the stack waits until idle. The sides alternate round by round, on the same
arrivals within a round.
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
from shardline.bench.tenant_workload import TenantSpec, TenantWorkload

logger = logging.getLogger("tenant_fairness")
SIDES = ("fifo", "fair")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds per side, alternating")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per round")
    p.add_argument("--measure-from", type=float, default=15.0, help="the window starts here: queues fill first")
    p.add_argument("--max-num-seqs", type=int, default=8, help="the worker's batch: small, so that queues form")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--overload", type=float, default=1.5, help="each light tenant's rate over its fair share")
    p.add_argument("--heavy-factor", type=float, default=10.0, help="the heavy tenant's rate over a light one's")
    p.add_argument("--out", type=Path, default=Path("results/tenant_fairness.json"))
    return p.parse_args()


def workload(tenants: list[StackTenant], light_rate: float, args: argparse.Namespace) -> TenantWorkload:
    specs = [
        TenantSpec(
            t.name,
            t.key,
            t.weight,
            request_rate=light_rate * (args.heavy_factor if t.name == "heavy" else 1.0),
            input_len=args.input_len,
            output_len=args.output_len,
        )
        for t in tenants
    ]
    return TenantWorkload(specs, duration_s=args.duration, measure_from_s=args.measure_from, drain=False)


def _row(report: dict) -> dict:
    tenants = report["tenants"]
    return {
        "jain_index": report["jain_index"],
        "backlogged": report["backlogged"],
        "weighted_tok_s": {n: r["weighted_throughput"] for n, r in tenants.items()},
        "backlog_fraction": {n: r["backlog_fraction"] for n, r in tenants.items()},
        "offered_over_fair_share": {n: r["offered_over_fair_share"] for n, r in tenants.items()},
        "ttft_p50_ms": {n: r["ttft_ms"]["p50"] for n, r in tenants.items()},
        "sent": {n: r["sent"] for n, r in tenants.items()},
        "failed": {n: r["failed"] for n, r in tenants.items()},
    }


def table(result: dict) -> str:
    """The markdown table of the run: per side, each round's Jain's index and each tenant's service."""
    names = list(result["rounds"][0]["fifo"]["weighted_tok_s"])
    lines = [
        "| side | round | Jain's index (backlogged) | backlogged | "
        + " | ".join(f"{n} tok/s (backlog, offered/fair)" for n in names)
        + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for i, rnd in enumerate(result["rounds"]):
        for side in SIDES:
            r = rnd[side]
            cells = [
                f"{r['weighted_tok_s'][n]:.1f} ({r['backlog_fraction'][n]:.2f}, {r['offered_over_fair_share'][n]:.2f})"
                for n in names
            ]
            jain = "-" if r["jain_index"] is None else f"{r['jain_index']:.3f}"
            lines.append(f"| {side} | {i + 1} | {jain} | {len(r['backlogged'])}/4 | " + " | ".join(cells) + " |")
    for side in SIDES:
        lines.append(f"\n{side}: Jain's index {result[side]['jain_index']}")
    return "\n".join(lines)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    tenants = [StackTenant("heavy"), *(StackTenant(f"light-{i}") for i in (1, 2, 3))]
    env = {"MAX_NUM_SEQS": args.max_num_seqs, "QUEUE_CAPACITY": 8192}
    with tempfile.TemporaryDirectory(prefix="tenant-fairness-") as tmp:
        tenants_file = Path(tmp) / "tenants.yaml"
        write_tenants_file(tenants_file, tenants)
        stacks = {}
        try:
            for side in SIDES:
                stacks[side] = start_stack(Path(tmp), side, tenants_file, side, env)
            cap = capacity(stacks["fifo"], tenants[0].key, args.input_len, args.output_len, 2 * args.max_num_seqs, 20)
            wait_idle(stacks["fifo"])
            light_rate = args.overload * cap / len(tenants)
            logger.info(
                "capacity %.2f req/s: light tenants %.2f req/s, heavy %.2f",
                cap,
                light_rate,
                light_rate * args.heavy_factor,
            )
            base = workload(tenants, light_rate, args)
            rounds = []
            for r in range(args.rounds):
                rnd = {}
                for side in SIDES if r % 2 == 0 else tuple(reversed(SIDES)):
                    report = run_workload(stacks[side], with_seed(base, r), f"{side} {r + 1}/{args.rounds}")
                    rnd[side] = _row(report)
                    logger.info(
                        "round %d %s: Jain %s, backlogged %s", r + 1, side, report["jain_index"], report["backlogged"]
                    )
                rounds.append(rnd)
        finally:
            for stack in stacks.values():
                stack.stop()
    result = {
        "config": vars(args) | {"out": str(args.out)},
        "capacity_req_s": cap,
        "light_rate": light_rate,
        "heavy_rate": light_rate * args.heavy_factor,
        "rounds": rounds,
    }
    for side in SIDES:
        values = [rnd[side]["jain_index"] for rnd in rounds if rnd[side]["jain_index"] is not None]
        result[side] = {
            "jain_index": median_range(values) if values else None,
            "jain_index_median": statistics.median(values) if values else None,
            "all_backlogged_rounds": sum(len(rnd[side]["backlogged"]) == len(tenants) for rnd in rounds),
        }
    write_results(args.out, result, table(result))


if __name__ == "__main__":
    main()

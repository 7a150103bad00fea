"""Model load time and peak memory of each tensor-parallel rank, each TP size in a fresh process.

A fresh process per measurement, so imports, the GGUF header parse and every rank's
spawn are counted as a serving process pays them. The runner is ready when its
constructor returns: rank 0 waits there for every rank to load its shard (the KV
block count is agreed by an all-reduce). Peak RSS is ru_maxrss for rank 0 and
VmHWM from /proc for ranks 1..N-1, read while they are still alive.

    python -m benchmarks.model_load                   # default model, TP 1 and 3
    python -m benchmarks.model_load --tp 1 --profile  # also cProfile the TP 1 load
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_T0 = time.perf_counter()  # before the heavy imports, which are part of what a load costs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "model_load.json"
GOAL_S = 5.0


def _vm_hwm_mib(pid: int) -> float:
    """Peak resident set of a live process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def measure(model: str | None, tp: int, num_blocks: int, profile_to: Path | None) -> dict:
    """Runs in the fresh process: load, take one step, read every rank's peak RSS, shut down."""
    import cProfile
    import multiprocessing as mp
    import resource

    import torch

    from gpu_worker_svc.engine.model_runner import ModelRunner, RunnerConfig
    from gpu_worker_svc.model.attention_metadata import StepBatch

    imported = time.perf_counter()
    profiler = cProfile.Profile() if profile_to else None
    if profiler:
        profiler.enable()
    runner = ModelRunner(RunnerConfig(model=model, tp_size=tp, num_blocks=num_blocks))
    ready = time.perf_counter()
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile_to)
    runner.execute(StepBatch(torch.tensor([1]), torch.tensor([0]), torch.tensor([1]), torch.tensor([[0]])))
    first_logits = time.perf_counter()
    ranks = {0: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    for child in mp.active_children():
        if child.name.startswith("shardline-rank"):
            ranks[int(child.name.removeprefix("shardline-rank"))] = _vm_hwm_mib(child.pid)
    runner.shutdown()
    return {
        "tp": tp,
        "import_s": imported - _T0,
        "construct_s": ready - imported,
        "ready_s": ready - _T0,
        "first_logits_s": first_logits - _T0,
        "peak_rss_mib": [round(ranks[r], 1) for r in sorted(ranks)],
    }


def run_fresh(model: str | None, tp: int, num_blocks: int, profile_to: Path | None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.model_load", "--worker", "--tp", str(tp), "--num-blocks", str(num_blocks)]
    if model:
        cmd += ["--model", model]
    if profile_to:
        cmd += ["--profile-to", str(profile_to)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"TP {tp} load failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0  # interpreter start to exit, shutdown included
    return result


def summarize(runs: list[dict]) -> dict:
    ready = [r["ready_s"] for r in runs]
    return {
        "tp": runs[0]["tp"],
        "ready_s_median": statistics.median(ready),
        "ready_s_min": min(ready),
        "import_s_median": statistics.median(r["import_s"] for r in runs),
        "construct_s_median": statistics.median(r["construct_s"] for r in runs),
        "peak_rss_mib_per_rank": [max(col) for col in zip(*(r["peak_rss_mib"] for r in runs))],
        "runs": runs,
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'TP':>3} {'ready s':>8} {'(min)':>6} {'import s':>9} {'construct s':>12}  peak RSS per rank (MiB)")
    for row in rows:
        rss = ", ".join(f"r{i}={v:.0f}" for i, v in enumerate(row["peak_rss_mib_per_rank"]))
        print(
            f"{row['tp']:>3} {row['ready_s_median']:>8.2f} {row['ready_s_min']:>6.2f} "
            f"{row['import_s_median']:>9.2f} {row['construct_s_median']:>12.2f}  {rss}"
        )


def print_profile(path: Path, top: int = 25) -> None:
    import pstats

    print(f"\ncProfile of the TP 1 runner construction (imports excluded), top {top} by cumulative time:")
    pstats.Stats(str(path), stream=sys.stdout).sort_stats("cumulative").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: the default model)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per TP size")
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=64,
        help="KV blocks per rank; small, so the numbers are the model's, not the cache's",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile one TP 1 load and print the top functions")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print(json.dumps(measure(args.model, args.tp[0], args.num_blocks, args.profile_to)))
        return

    rows = [
        summarize([run_fresh(args.model, tp, args.num_blocks, None) for _ in range(args.repeats)]) for tp in args.tp
    ]
    print_table(rows)
    slow = [r["tp"] for r in rows if r["ready_s_median"] > GOAL_S]
    print(f"goal: ready in <= {GOAL_S:.0f} s: " + (f"missed at TP {slow}" if slow else "met"))
    report = {
        "model": args.model or "default",
        "cpu_count": os.cpu_count(),
        "num_blocks": args.num_blocks,
        "goal_s": GOAL_S,
        "results": rows,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    profile = RESULTS.with_suffix(".prof")
    if args.profile:
        report["profiled_run"] = run_fresh(args.model, 1, args.num_blocks, profile)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    if args.profile:
        print_profile(profile)


if __name__ == "__main__":
    main()

"""KV transfer between two real worker processes, against a bare copy of the same bytes.

Two workers of the default model (no scheduler: they serve without one). Each round computes a
fresh prompt on worker A (its prefill time is reported beside the transfer, as what a transfer
saves), then times `KvTransfer.SendBlocks` from A to B: A's export on its engine thread, slabs
of 1 MiB over gRPC, B's checks and its import on its engine thread. The bare copy is a
`torch.Tensor.copy_` of a tensor of the same size in this process: the floor for moving the bytes.

    python -m benchmarks.kv_transfer [--prompt-len 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from shardline.core.ports import free_port
from shardline.proto import worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
# Per worker: room for one prompt of --prompt-len tokens and the next one (SmolLM2, float32).
BLOCK_BYTES = 737_280


def _start_worker(port: int, kv_blocks: int, log_dir: Path) -> subprocess.Popen:
    args = ["--port", str(port), "--worker-id", f"kv-bench-{port}", "--scheduler", f"127.0.0.1:{free_port()}"]
    args += ["--kv-cache-bytes", str(kv_blocks * BLOCK_BYTES), "--max-num-batched-tokens", "4096", "--no-tracing"]
    log = (log_dir / f"worker-{port}.log").open("wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "gpu_worker_svc.server.main", *args], cwd=REPO, env=env, stdout=log, stderr=log
    )


def _wait_ready(address: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {address} exited with {proc.returncode}")
            try:
                stub.GetInfo(worker_pb2.GetWorkerInfoRequest(), timeout=2)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def _prefill(address: str, rid: str, prompt: list[int]) -> float:
    """Seconds from sending a one-token request to its final delta: the prompt's prefill, mostly."""
    commands: queue.Queue[worker_pb2.WorkerCommand | None] = queue.Queue()
    with grpc.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).Session(iter(commands.get, None))
        start = time.perf_counter()
        commands.put(
            worker_pb2.WorkerCommand(
                add=[
                    worker_pb2.NewRequest(
                        request_id=rid,
                        prompt_token_ids=prompt,
                        params={"max_tokens": 1, "temperature": 0.0, "ignore_eos": True},
                    )
                ]
            )
        )
        for out in call:
            if any(d.request_id == rid and d.finish_reason for d in out.deltas):
                break
        elapsed = time.perf_counter() - start
        call.cancel()
        commands.put(None)
    return elapsed


def _bare_copy_s(num_bytes: int, repeats: int = 5) -> float:
    src = torch.empty(num_bytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # the pages, faulted in once
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/kv_transfer.json"))
    args = ap.parse_args(argv)
    kv_blocks = 2 * (args.prompt_len // 16 + 1) + 4
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kv-bench-") as tmp:
        ports = [free_port(), free_port()]
        procs = [_start_worker(p, kv_blocks, Path(tmp)) for p in ports]
        a, b = (f"127.0.0.1:{p}" for p in ports)
        try:
            for address, proc in zip((a, b), procs):
                _wait_ready(address, proc)
            with grpc.insecure_channel(a) as channel:
                stub = worker_pb2_grpc.KvTransferStub(channel)
                for r in range(args.rounds):
                    prompt = torch.randint(100, 49152, (args.prompt_len,), generator=torch.Generator().manual_seed(r))
                    prefill_s = _prefill(a, f"bench-{r}", prompt.tolist())
                    start = time.perf_counter()
                    result = stub.SendBlocks(
                        worker_pb2.SendBlocksRequest(target_address=b, prompt_token_ids=prompt.tolist())
                    )
                    send_s = time.perf_counter() - start
                    num_bytes = result.imported * BLOCK_BYTES
                    bare_s = _bare_copy_s(num_bytes)
                    rounds.append(
                        {
                            "blocks": result.imported,
                            "mb": num_bytes / 1e6,
                            "send_s": send_s,
                            "rpc_mb_s": num_bytes / 1e6 / send_s,
                            "bare_copy_mb_s": num_bytes / 1e6 / bare_s,
                            "prefill_s": prefill_s,
                        }
                    )
                    print(
                        f"round {r}: {result.imported} blocks, {num_bytes / 1e6:.1f} MB in {1000 * send_s:.0f} ms "
                        f"({rounds[-1]['rpc_mb_s']:.0f} MB/s; bare copy {rounds[-1]['bare_copy_mb_s']:.0f} MB/s); "
                        f"the prompt's prefill on A took {prefill_s:.2f} s"
                    )
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    median = {k: statistics.median(r[k] for r in rounds) for k in ("rpc_mb_s", "bare_copy_mb_s", "send_s", "prefill_s")}
    print(
        f"{args.prompt_len}-token prompt, {rounds[0]['mb']:.1f} MB of KV: SendBlocks {median['rpc_mb_s']:.0f} MB/s "
        f"(median of {args.rounds}), bare copy {median['bare_copy_mb_s']:.0f} MB/s; "
        f"transfer {1000 * median['send_s']:.0f} ms against prefill {median['prefill_s']:.2f} s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How long a worker's drain takes with its requests' KV handed off, against re-prefilling them.

A real stack with two workers of the default model. Each round streams one greedy request with a
fresh prompt of --prompt-len random tokens and, once its first tokens are out (its prompt prefilled),
stops the worker that runs it, alternating two ways:

- `handoff`: SIGTERM. The worker asks the scheduler to move its requests (Scheduler.DrainWorker),
  which has it send each one's computed KV blocks to the worker it moves to (KvTransfer.SendBlocks);
  the request goes on there with prefix hits and prefills only the part past its last full block.
- `reprefill`: SIGKILL. Nothing is sent: the request moves with its tokens from Redis and the next
  worker prefills the prompt and the tokens so far, as every move without a hand-off does (a
  SIGTERM did so before the hand-off, and does with SHARDLINE_STOP_HANDOFF_S=0).

Reported per round: from the signal to the moved request's next token from its next worker (the
drain's cost to that request), the stopped worker's exit, and the tokens the next worker served
from its prefix cache. A SIGTERMed worker decodes on while its blocks are sent, so its own last
tokens arrive after the signal too: the next worker's first token is the first one to arrive after
the request's record names its next worker (polled every 20 ms). The stopped worker is started again
before the next round.

    python -m benchmarks.drain_handoff [--prompt-len 2048] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch

from shardline.client import AsyncShardlineClient, ShardlineClient
from shardline.proto import scheduler_pb2, scheduler_pb2_grpc
from shardline.stack.local_stack import LocalStack, StackConfig

MODES = ("handoff", "reprefill")
# Per worker: room for a moved request's blocks beside one of its own (SmolLM2, float32: 720 KiB a block).
KV_CACHE_BYTES = 512 << 20


async def _one_round(stack: LocalStack, mode: str, prompt: list[int], max_tokens: int, request_id: str) -> dict:
    target = f"127.0.0.1:{stack.config.grpc_port}"
    arrivals: list[tuple[float, int]] = []  # (unix time, tokens so far) per chunk
    started = asyncio.Event()
    async with AsyncShardlineClient(target, timeout=600) as client:

        async def read() -> None:
            count = 0
            async for chunk in client.stream(
                prompt, request_id=request_id, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            ):
                count += len(chunk.token_ids)
                arrivals.append((time.time(), count))
                if count >= 2:
                    started.set()

        reader = asyncio.create_task(read())
        await asyncio.wait_for(started.wait(), 300)
        victim = (await client.get_request(request_id)).worker_id
        before = arrivals[-1][1]
        sig = signal.SIGTERM if mode == "handoff" else signal.SIGKILL
        moved: list[float] = []  # when its record first named another worker

        async def watch() -> None:
            while (await client.get_request(request_id)).worker_id == victim:
                await asyncio.sleep(0.02)
            moved.append(time.time())

        t0 = time.time()
        watcher = asyncio.create_task(watch())
        await asyncio.to_thread(stack.kill, victim, sig)  # returns once the process has exited
        exited_s = time.time() - t0
        await reader
        await asyncio.wait_for(watcher, 10)
        info = await client.get_request(request_id)
    moved_at = moved[0]
    later = [t for t, _ in arrivals if t > moved_at]
    if not later or info.worker_id == victim:
        raise RuntimeError(f"{request_id}: no token after the stop on another worker ({info.worker_id})")
    on_victim = max(count for t, count in arrivals if t <= later[0]) - before
    return {
        "mode": mode,
        "victim": victim,
        "next_worker": info.worker_id,
        "tokens_before_stop": before,
        "next_token_s": later[0] - t0,
        "redispatch_s": moved_at - t0,
        "tokens_after_stop_on_victim": on_victim,
        "worker_exit_s": exited_s,
        "cached_tokens": info.usage.cached_tokens,
        "prompt_tokens": info.usage.prompt_tokens,
    }


def _restart(stack: LocalStack, name: str, timeout_s: float = 300) -> None:
    """Starts the stopped worker again and waits until the scheduler has both workers."""
    stack.restart(next(c for c in stack.children if c.name == name))
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{stack.config.scheduler_port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while len(stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5).workers) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not register again within {timeout_s:.0f}s")
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2048)
    # Enough that the request is still running when it reaches its next worker: a SIGTERMed worker
    # decodes on during the hand-off.
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="rounds of each mode, alternating")
    ap.add_argument("--out", type=Path, default=Path("results/drain_handoff.json"))
    ap.add_argument("--log-dir", type=Path, help="keep the services' logs here (default: a temporary folder)")
    args = ap.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="drain-bench-") as tmp:
        config = StackConfig.on_free_ports(
            workers=2,
            data_dir=Path(tmp) / "data",
            log_dir=args.log_dir or Path(tmp) / "logs",
            tracing=False,
            env={
                "HEARTBEAT_INTERVAL_S": "0.5",
                "KV_CACHE_BYTES": str(KV_CACHE_BYTES),
                "MAX_NUM_BATCHED_TOKENS": str(max(2048, args.prompt_len + 64)),
            },
        )
        stack = LocalStack(config)
        stack.start(timeout_s=300)
        try:
            with ShardlineClient(f"127.0.0.1:{config.grpc_port}", timeout=300) as client:
                client.generate("warm up", max_tokens=2)
            plan = [mode for _ in range(args.rounds) for mode in MODES]
            for i, mode in enumerate(plan):
                # A prompt no worker has seen: any prefix hit after the move is a handed-off block.
                generator = torch.Generator().manual_seed(1000 + i)
                prompt = torch.randint(100, 49152, (args.prompt_len,), generator=generator).tolist()
                result = asyncio.run(_one_round(stack, mode, prompt, args.max_tokens, f"drain-bench-{i}"))
                rounds.append(result)
                print(
                    f"{mode:9s}: re-dispatched {result['redispatch_s']:.2f} s and next token "
                    f"{result['next_token_s']:.2f} s after the signal on "
                    f"{result['next_worker']}, worker exited after {result['worker_exit_s']:.2f} s; "
                    f"{result['cached_tokens']} tokens were prefix hits there "
                    f"(prompt {result['prompt_tokens']} + the output so far)",
                    flush=True,
                )
                if i < len(plan) - 1:
                    _restart(stack, result["victim"])
        finally:
            stack.stop()
    medians = {mode: statistics.median(r["next_token_s"] for r in rounds if r["mode"] == mode) for mode in MODES}
    print(
        f"{args.prompt_len}-token context, time from the stop to the moved request's next token "
        f"(median of {args.rounds}): hand-off {medians['handoff']:.2f} s, re-prefill {medians['reprefill']:.2f} s "
        f"({medians['reprefill'] / medians['handoff']:.1f}x)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rounds": rounds},
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

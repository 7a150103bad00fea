"""The time to first token that remote prefill adds to a long prompt, against prefilling it locally.

A real stack of the default model with one prefill worker and one decode worker
(`shardline up --prefill-workers 1 --decode-workers 1`), SHARDLINE_REMOTE_PREFILL_MIN_TOKENS set to
--prompt-len. Rounds alternate two ways of serving one greedy request with a fresh prompt of random
tokens, which neither worker has seen:

- `remote`: --prompt-len tokens, at the threshold: the prefill worker computes the prompt and sends
  its full blocks to the decode worker (KvTransfer.PrefillBlocks), which then computes the partial
  last block and samples the first token;
- `local`: one token fewer, under the threshold: the decode worker prefills it itself, as an
  aggregated worker does. One token changes nothing measurable in a prefill of thousands.

Reported per round: the TTFT the client sees (from the call to the first token), and the prompt
tokens the decode worker served from its prefix cache (the blocks sent, or none). The two workers
share this machine's cores, so the prefill worker's compute is no faster than the decode worker's:
what remote prefill adds is the transfer and the extra hops, which is what this measures. Its gain,
decode steps that long prefills no longer stall, needs the workers on their own devices.

    python -m benchmarks.disagg_prefill [--prompt-len 2048] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shardline.client import AsyncShardlineClient, ShardlineClient
from shardline.stack.local_stack import LocalStack, StackConfig

MODES = ("remote", "local")


async def _one_round(stack: LocalStack, mode: str, prompt: list[int], max_tokens: int, request_id: str) -> dict:
    async with AsyncShardlineClient(f"127.0.0.1:{stack.config.grpc_port}", timeout=600) as client:
        t0 = time.perf_counter()
        first: float | None = None
        tokens = 0
        async for chunk in client.stream(
            prompt, request_id=request_id, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - t0
            tokens += len(chunk.token_ids)
        info = await client.get_request(request_id)
    if first is None or tokens != max_tokens:
        raise RuntimeError(f"{request_id}: {tokens} of {max_tokens} tokens")
    return {
        "mode": mode,
        "ttft_s": first,
        "total_s": time.perf_counter() - t0,
        "prompt_tokens": info.usage.prompt_tokens,
        "cached_tokens": info.usage.cached_tokens,
        "worker": info.worker_id,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="rounds of each mode, alternating")
    ap.add_argument("--out", type=Path, default=Path("results/disagg_prefill.json"))
    ap.add_argument("--log-dir", type=Path, help="keep the services' logs here (default: a temporary folder)")
    args = ap.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="disagg-bench-") as tmp:
        config = StackConfig.on_free_ports(
            workers=1,
            prefill_workers=1,
            data_dir=Path(tmp) / "data",
            log_dir=args.log_dir or Path(tmp) / "logs",
            tracing=False,
            env={
                "REMOTE_PREFILL_MIN_TOKENS": str(args.prompt_len),
                "KV_CACHE_BYTES": str(512 << 20),
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
                generator = torch.Generator().manual_seed(2000 + i)
                length = args.prompt_len if mode == "remote" else args.prompt_len - 1
                prompt = torch.randint(100, 49152, (length,), generator=generator).tolist()
                result = asyncio.run(_one_round(stack, mode, prompt, args.max_tokens, f"disagg-bench-{i}"))
                rounds.append(result)
                print(
                    f"{mode:6s}: TTFT {result['ttft_s']:.2f} s, {result['prompt_tokens']} prompt tokens, "
                    f"{result['cached_tokens']} from the decode worker's prefix cache",
                    flush=True,
                )
        finally:
            stack.stop()
    medians = {mode: statistics.median(r["ttft_s"] for r in rounds if r["mode"] == mode) for mode in MODES}
    print(
        f"{args.prompt_len}-token prompt, TTFT (median of {args.rounds}): remote prefill {medians['remote']:.2f} s, "
        f"local {medians['local']:.2f} s: remote adds {medians['remote'] - medians['local']:+.2f} s"
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

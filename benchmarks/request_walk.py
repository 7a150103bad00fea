"""Where a burst's time to first token goes, hop by hop, through the whole stack.

Sends waves of concurrent streams (token prompts, ignore_eos) to a stack, then
reads each request's record back (GetRequest): the gateway's arrival stamp, the
scheduler's dispatch and first-token stamps. With the client's own send and
first-chunk times that splits TTFT into:

    client -> gateway arrival       the client call, and the gateway reaching the request
    arrival -> dispatch             validation, Submit, the Redis write and the queue
    dispatch -> first token         the worker: admission, the prefill step, the step's message
    first token -> client           relay to the gateway, detokenize, the stream write

    python -m benchmarks.request_walk                     # a private stack on free ports
    python -m benchmarks.request_walk --url host:50051    # a running stack (clocks must agree)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from shardline.client import AsyncShardlineClient

HOPS = [
    ("client -> arrival", "sent", "arrival"),
    ("arrival -> dispatch", "arrival", "dispatch"),
    ("dispatch -> first token", "dispatch", "first_token"),
    ("first token -> client", "first_token", "ttft"),
    ("TTFT", "sent", "ttft"),
]


async def _one(client: AsyncShardlineClient, prompt: list[int], output_len: int) -> dict:
    record: dict = {"sent": time.time()}
    async for chunk in client.stream(prompt, max_tokens=output_len, ignore_eos=True, temperature=0.0):
        record.setdefault("request_id", chunk.request_id)
        if chunk.token_ids and "ttft" not in record:
            record["ttft"] = time.time()
    return record


async def walk(url: str, waves: int, concurrency: int, input_len: int, output_len: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    prompt = lambda: [rng.randrange(100, 49000) for _ in range(input_len)]  # noqa: E731
    async with AsyncShardlineClient(url, retries=0) as client:
        await _one(client, prompt(), 2)  # warm-up: channels, first-step costs
        results = []
        for _ in range(waves):
            wave = await asyncio.gather(*(_one(client, prompt(), output_len) for _ in range(concurrency)))
            for record in wave:
                info = await client.get_request(record["request_id"])
                record.update(arrival=info.arrival_time, dispatch=info.dispatch_time, first_token=info.first_token_time)
            results.append(list(wave))
    return results


def summarize(wave: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for name, start, end in HOPS:
        values = sorted(1000 * (r[end] - r[start]) for r in wave)
        out[name] = {"min": values[0], "median": statistics.median(values), "max": values[-1]}
    first_sent = min(r["sent"] for r in wave)
    out["last arrival (from first send)"] = {"max": 1000 * (max(r["arrival"] for r in wave) - first_sent)}
    out["last dispatch (from first send)"] = {"max": 1000 * (max(r["dispatch"] for r in wave) - first_sent)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="gateway gRPC address; default: start a private stack")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/request_walk.json"))
    args = ap.parse_args(argv)
    stack = None
    url = args.url
    if url is None:
        from shardline.stack.local_stack import LocalStack, StackConfig

        stack = LocalStack(StackConfig.on_free_ports()).start()
        url = f"127.0.0.1:{stack.config.grpc_port}"
    try:
        waves = asyncio.run(walk(url, args.waves, args.concurrency, args.input_len, args.output_len, args.seed))
    finally:
        if stack is not None:
            stack.stop()
    summaries = [summarize(wave) for wave in waves]
    for i, summary in enumerate(summaries):
        print(f"\nwave {i + 1}: {args.concurrency} streams sent at once, {args.input_len} tokens in")
        print(f"{'hop (ms)':34s}{'min':>10s}{'median':>10s}{'max':>10s}")
        for name, v in summary.items():
            print(f"{name:34s}" + "".join(f"{v[k]:10.1f}" if k in v else f"{'':10s}" for k in ("min", "median", "max")))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "waves": summaries, "requests": waves}, indent=2)
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

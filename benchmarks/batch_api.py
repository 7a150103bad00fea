"""The Batch API on a private stack: its throughput against online requests, and whether a batch
slows interactive traffic.

    python -m benchmarks.batch_api throughput                # 1,000 lines, 128 in / 64 out, 1 round
    python -m benchmarks.batch_api isolation                 # TTFT at concurrency 4, with and without a batch
    python -m benchmarks.batch_api throughput --lines 200 --rounds 2

throughput: a batch of random 128-token prompts (64 out, greedy, ignore_eos) from create to
`completed`, in output tokens/s, against the same number of requests streamed over gRPC as
`shardline bench` sends them, at the concurrency the batch runs at (its worker's chunks at once
times each chunk's most in flight). The sides alternate, each round with fresh prompts.

isolation: interactive requests at concurrency 4 (TTFT and TPOT, p50 and p99), alone and then
while a 2,000-line batch runs (cancelled once the interactive load is done), alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import openai

from shardline.bench.load import LoadSpec, run_load
from shardline.bench.metrics import summarize
from shardline.bench.stack_backend import StackBackend
from shardline.stack.local_stack import LocalStack, StackConfig

logger = logging.getLogger("batch_api")
# The batch worker's defaults (batch_svc/settings.py): chunks at once, times each one's most in flight.
BATCH_CONCURRENCY = 2 * 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["throughput", "isolation"])
    p.add_argument("--model", default=None)
    p.add_argument("--lines", type=int, default=None, help="batch lines (1,000 for throughput, 2,000 for isolation)")
    p.add_argument("--requests", type=int, default=48, help="isolation: interactive requests per side")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def _lines(n: int, input_len: int, output_len: int, vocab: int, seed: int) -> bytes:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(100, vocab) for _ in range(input_len)]
        body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
        rows.append(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    return ("\n".join(rows) + "\n").encode()


def _create(client: openai.OpenAI, data: bytes) -> str:
    upload = client.files.create(file=("bench.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h").id


def _run_batch(client: openai.OpenAI, data: bytes) -> dict:
    t0 = time.perf_counter()
    batch_id = _create(client, data)
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    out = client.files.content(batch.output_file_id).text.splitlines() if batch.output_file_id else []
    tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in out)
    return {"status": batch.status, "lines": len(out), "wall_s": wall, "output_throughput": tokens / wall}


async def _online(url: str, spec: LoadSpec) -> dict:
    backend = StackBackend(url)
    try:
        timings, wall = await run_load(spec, backend.send, "online")
    finally:
        await backend.close()
    summary = summarize(timings, wall)
    summary.pop("detail")
    return summary


def throughput(stack: LocalStack, client: openai.OpenAI, args: argparse.Namespace, vocab: int) -> dict:
    lines = args.lines or 1000
    rounds = []
    for r in range(args.rounds):
        batch = _run_batch(client, _lines(lines, args.input_len, args.output_len, vocab, seed=2 * r))
        spec = LoadSpec(lines, args.input_len, args.output_len, max_concurrency=BATCH_CONCURRENCY, seed=2 * r + 1)
        spec.vocab_size = vocab
        online = asyncio.run(_online(f"127.0.0.1:{stack.config.grpc_port}", spec))
        ratio = batch["output_throughput"] / online["output_throughput"]
        logger.info(
            "round %d: batch %.1f tok/s, online %.1f tok/s, ratio %.3f",
            r,
            batch["output_throughput"],
            online["output_throughput"],
            ratio,
        )
        rounds.append({"batch": batch, "online": online, "ratio": ratio})
    return {"rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds)}


def isolation(stack: LocalStack, client: openai.OpenAI, args: argparse.Namespace, vocab: int) -> dict:
    lines = args.lines or 2000
    url = f"127.0.0.1:{stack.config.grpc_port}"
    rounds = []
    for r in range(args.rounds):
        spec = LoadSpec(args.requests, args.input_len, args.output_len, max_concurrency=4, seed=10 * r)
        spec.vocab_size = vocab
        alone = asyncio.run(_online(url, spec))
        batch_id = _create(client, _lines(lines, args.input_len, args.output_len, vocab, seed=10 * r + 1))
        while client.batches.retrieve(batch_id).request_counts.completed < 8:  # the batch is flowing
            time.sleep(0.5)
        spec.seed = 10 * r + 2
        beside = asyncio.run(_online(url, spec))
        done = client.batches.retrieve(batch_id).request_counts.completed
        client.batches.cancel(batch_id)
        while client.batches.retrieve(batch_id).status != "cancelled":
            time.sleep(0.5)
        row = {
            "alone": {k: alone[k] for k in ("ttft_ms", "tpot_ms", "output_throughput")},
            "with_batch": {k: beside[k] for k in ("ttft_ms", "tpot_ms", "output_throughput")},
            "batch_lines_done_meanwhile": done,
            "p99_ttft_ratio": beside["ttft_ms"]["p99"] / alone["ttft_ms"]["p99"],
            "p50_ttft_ratio": beside["ttft_ms"]["median"] / alone["ttft_ms"]["median"],
        }
        logger.info("round %d: %s", r, json.dumps({k: row[k] for k in ("p50_ttft_ratio", "p99_ttft_ratio")}))
        rounds.append(row)
    return {"rounds": rounds, "median_p99_ttft_ratio": statistics.median(r["p99_ttft_ratio"] for r in rounds)}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("httpx", "httpx2"):  # one line per poll otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="batch-bench-") as tmp:
        config = StackConfig.on_free_ports(
            model=args.model, data_dir=Path(tmp), log_dir=Path(tmp) / "logs", batch_workers=1
        )
        with LocalStack(config) as stack:
            stack.start(timeout_s=300)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{config.http_port}/v1", api_key="x", max_retries=5)
            vocab = asyncio.run(_vocab(f"127.0.0.1:{config.grpc_port}"))
            run = throughput if args.mode == "throughput" else isolation
            result = {"mode": args.mode, **run(stack, client, args, vocab)}
    out = args.out or Path(f"results/batch_api_{args.mode}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    for row in result["rounds"]:
        print(json.dumps({k: v for k, v in row.items() if k not in ("online",)}, indent=2)[:2000])


async def _vocab(url: str) -> int:
    backend = StackBackend(url)
    try:
        return await backend.vocab_size()
    finally:
        await backend.close()


if __name__ == "__main__":
    main()

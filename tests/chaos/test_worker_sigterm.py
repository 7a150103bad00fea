"""A worker SIGTERMed mid-stream (a rolling update, `docker stop`, a scale-down) under greedy streams
of a real stack with two workers: the scheduler moves its requests with their KV blocks sent ahead
(Scheduler.DrainWorker, KvTransfer.SendBlocks), the worker exits within docker's stop timeout, and
every stream ends identical to a run with no fault, the moved ones having prefilled only what the
blocks did not cover.

The faulted run comes first, on caches that hold none of these prompts, so a moved request's prefix
hits on the worker it moves to can only be the blocks handed to it."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from shardline.client import ShardlineClient
from shardline.stack.local_stack import LocalStack, StackConfig
from tests.chaos.streams import run_streams, summary
from tests.e2e.conftest import log_dir, running_stack

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

STREAMS = 4
# Long enough that the requests still run when they move: the worker decodes on during the hand-off.
MAX_TOKENS = 64
BLOCK_SIZE = 16  # the worker's default
# Each prompt starts with its own number, so no two share a KV block: about 110 tokens each.
STORY = (
    "the lighthouse keeper climbed the spiral stairs at dusk, as he had done every evening for thirty "
    "years, carrying a tin of oil, a clean rag and a small notebook in which he wrote down the ships he "
    "saw, the colour of the sea and the direction of the wind. That night the fog came in early and thick, "
    "and when he reached the lamp room he heard, far below, a bell that did not belong to any ship he knew."
)


def _prompts() -> list[str]:
    return [f"Chapter {i + 1}. {STORY} Then" for i in range(STREAMS)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> LocalStack:
    config = StackConfig.on_free_ports(
        workers=2,
        data_dir=tmp_path_factory.mktemp("sigterm-data"),
        log_dir=log_dir(tmp_path_factory, "sigterm"),
        env={"HEARTBEAT_INTERVAL_S": "0.5", "KV_CACHE_BYTES": str(128 << 20)},
    )
    with running_stack(config) as s:
        yield s


def test_a_sigtermed_worker_hands_its_requests_kv_to_where_they_move(stack: LocalStack) -> None:
    target = f"127.0.0.1:{stack.config.grpc_port}"
    ids = [f"sigterm-{i}" for i in range(STREAMS)]

    async def faulted() -> tuple[list, dict[str, str], str, float, int | None]:
        started = asyncio.Event()
        streams = asyncio.create_task(
            run_streams(target, ids, _prompts(), started=started, started_after_tokens=4, max_tokens=MAX_TOKENS)
        )
        await asyncio.wait_for(started.wait(), 120)
        with ShardlineClient(target) as client:
            placed = {rid: client.get_request(rid).worker_id for rid in ids}
        victim = max(set(placed.values()), key=list(placed.values()).count)
        t0 = time.monotonic()
        await asyncio.to_thread(stack.kill, victim, signal.SIGTERM)  # returns once it has exited
        exited_s = time.monotonic() - t0
        code = next(c for c in stack.children if c.name == victim).proc.returncode
        return await streams, placed, victim, exited_s, code

    results, placed, victim, exited_s, code = asyncio.run(faulted())
    reference = asyncio.run(
        run_streams(target, [f"reference-{i}" for i in range(STREAMS)], _prompts(), max_tokens=MAX_TOKENS)
    )
    same = summary(results, {i: r.tokens for i, r in enumerate(reference)})
    print(f"\nSIGTERM {victim}, exited after {exited_s:.2f}s: {same}")

    assert code == 0
    assert exited_s < 10, exited_s  # within docker's default stop timeout
    for result, expected in zip(results, reference):
        assert expected.finish_reason == "length" and len(expected.tokens) == MAX_TOKENS, expected
        assert result.gaps == 0 and not result.errors, result
        assert result.finish_reason == "length", result
        assert result.tokens == expected.tokens, (result, expected)
    with ShardlineClient(target) as client:
        # A request may still finish on the stopping worker while the others' blocks are sent.
        infos = [client.get_request(rid) for rid, worker_id in placed.items() if worker_id == victim]
    moved = [info for info in infos if info.worker_id != victim]
    assert moved, (placed, infos)
    for info in moved:
        assert info.worker_id and info.attempt == 1, info  # moved, not failed
        # Its prompt's full blocks at least were hits on the worker it moved to: the blocks sent.
        prompt_blocks = info.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
        assert info.usage.cached_tokens >= prompt_blocks > 0, info.usage

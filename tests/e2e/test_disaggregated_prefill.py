"""Disaggregated prefill on a real stack (`shardline up --prefill-workers 1 --decode-workers 1`): long
prompts computed by the prefill worker, their blocks sent to the decode worker, and greedy output
bit-identical to an aggregated stack's; short and cached prompts stay on the decode worker; a prefill
worker killed mid-prefill costs its request nothing but time.

The reference is an aggregated stack (one worker of role both), run first on the same prompts."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from shardline.client import ShardlineClient
from shardline.stack.local_stack import LocalStack, StackConfig
from tests.chaos.streams import StreamResult, run_streams
from tests.e2e.conftest import log_dir, running_stack

pytestmark = [pytest.mark.slow, pytest.mark.extended]

MAX_TOKENS = 16
BLOCK_SIZE = 16  # the workers' default
MIN_TOKENS = 128  # SHARDLINE_REMOTE_PREFILL_MIN_TOKENS here: the prompts below are 2-5x that
STORY = (
    "the lighthouse keeper climbed the spiral stairs at dusk, as he had done every evening for thirty "
    "years, carrying a tin of oil, a clean rag and a small notebook in which he wrote down the ships he "
    "saw, the colour of the sea and the direction of the wind. That night the fog came in early and thick, "
    "and when he reached the lamp room he heard, far below, a bell that did not belong to any ship he knew."
)
# Each starts with its own words, so no two share a KV block.
LONG = [f"Chapter {i + 1}. {STORY} {STORY} Then" for i in range(2)]
SHORT = "Write one line about the sea."
# Long enough that the prefill worker is still computing it when the test, polling its log, kills it.
KILLED = f"Book two. {STORY} {STORY} {STORY} {STORY} {STORY} Then"
PROMPTS = [*LONG, SHORT, KILLED]
ENV = {"HEARTBEAT_INTERVAL_S": "0.5", "KV_CACHE_BYTES": str(128 << 20)}


def _target(stack: LocalStack) -> str:
    return f"127.0.0.1:{stack.config.grpc_port}"


def _stream(stack: LocalStack, ids: list[str], texts: list[str]) -> list[StreamResult]:
    return asyncio.run(run_streams(_target(stack), ids, texts, max_tokens=MAX_TOKENS))


def _log(stack: LocalStack, service: str) -> str:
    assert stack.config.log_dir is not None
    path: Path = stack.config.log_dir / f"{service}.log"
    return path.read_text() if path.exists() else ""


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, list[int]]:
    """Each prompt's greedy tokens on an aggregated stack."""
    config = StackConfig.on_free_ports(
        workers=1,
        data_dir=tmp_path_factory.mktemp("aggregated-data"),
        log_dir=log_dir(tmp_path_factory, "aggregated"),
        env=ENV,
    )
    with running_stack(config) as stack:
        results = _stream(stack, [f"reference-{i}" for i in range(len(PROMPTS))], PROMPTS)
    for result in results:
        assert not result.errors and len(result.tokens) == MAX_TOKENS, result
    return {text: result.tokens for text, result in zip(PROMPTS, results)}


@pytest.fixture(scope="module")
def stack(reference, tmp_path_factory) -> LocalStack:
    config = StackConfig.on_free_ports(
        workers=1,
        prefill_workers=1,
        data_dir=tmp_path_factory.mktemp("disaggregated-data"),
        log_dir=log_dir(tmp_path_factory, "disaggregated"),
        env={**ENV, "REMOTE_PREFILL_MIN_TOKENS": str(MIN_TOKENS)},
    )
    with running_stack(config) as s:
        yield s


def test_long_prompts_prefilled_remotely_give_the_aggregated_tokens(stack, reference) -> None:
    ids = [f"long-{i}" for i in range(len(LONG))]
    results = _stream(stack, ids, LONG)
    for text, result in zip(LONG, results):
        assert not result.errors and result.finish_reason == "length", result
        assert result.tokens == reference[text], (result.request_id, result.tokens, reference[text])
    prefill_log = _log(stack, "prefill-0")
    with ShardlineClient(_target(stack)) as client:
        for rid in ids:
            info = client.get_request(rid)
            assert rid in prefill_log, f"{rid} was not prefilled by prefill-0"
            assert (info.worker_id, info.attempt) == ("worker-0", 1)
            # The decode worker never saw this prompt: its full blocks were hits only because they were sent.
            full_blocks = info.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
            assert info.usage.prompt_tokens >= MIN_TOKENS and info.usage.cached_tokens == full_blocks, info.usage


def test_short_and_cached_prompts_stay_on_the_decode_worker(stack, reference) -> None:
    results = _stream(stack, ["short", "long-again"], [SHORT, LONG[0]])
    assert [r.tokens for r in results] == [reference[SHORT], reference[LONG[0]]]
    prefill_log = _log(stack, "prefill-0")
    assert "request short " not in prefill_log and "request long-again " not in prefill_log
    with ShardlineClient(_target(stack)) as client:
        again = client.get_request("long-again")
    assert again.usage.cached_tokens == again.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE


def test_a_prefill_worker_killed_mid_prefill_costs_the_request_nothing(stack, reference) -> None:
    async def faulted() -> list[StreamResult]:
        streams = asyncio.create_task(run_streams(_target(stack), ["killed"], [KILLED], max_tokens=MAX_TOKENS))
        deadline = time.monotonic() + 120
        while "of request killed for" not in _log(stack, "prefill-0"):
            assert time.monotonic() < deadline, "the prefill worker never started the remote prefill"
            assert not streams.done(), streams
            await asyncio.sleep(0.05)
        await asyncio.to_thread(stack.kill, "prefill-0", signal.SIGKILL)
        return await streams

    [result] = asyncio.run(faulted())
    assert not result.errors and result.finish_reason == "length", result
    assert result.tokens == reference[KILLED]
    assert "request killed: remote prefill on prefill-0 failed" in _log(stack, "scheduler")
    with ShardlineClient(_target(stack)) as client:
        info = client.get_request("killed")
    assert (info.worker_id, info.attempt) == ("worker-0", 1)  # not a failed attempt: it never left worker-0
    assert info.usage.cached_tokens == 0  # no block of the killed prefill arrived: worker-0 computed it all

"""A Gemma 2 model (sliding-window layers, soft-capping) served by two workers, one SIGKILLed mid-stream:
every stream ends identical to a run with no fault, the killed worker's requests resumed on the other,
which prefills each prompt and the tokens so far (past the window) before it decodes on."""

from __future__ import annotations

import asyncio

import pytest

from shardline.client import ShardlineClient
from shardline.stack.local_stack import LocalStack, StackConfig
from tests.chaos.streams import prompts, run_streams, summary
from tests.e2e.conftest import log_dir, running_stack
from tests.e2e.test_model_families_served import random_model_with_default_vocab

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.extended]

STREAMS = 8
# Long enough that the streams are still running when the kill lands: the tiny model decodes in about a
# millisecond a step, and 256 tokens plus a prompt still fit its 512 positions.
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> LocalStack:
    folder = tmp_path_factory.mktemp("models") / "tiny-gemma2"
    random_model_with_default_vocab("gemma2", folder)
    config = StackConfig.on_free_ports(
        model=str(folder),
        workers=2,
        data_dir=tmp_path_factory.mktemp("gemma-chaos-data"),
        log_dir=log_dir(tmp_path_factory, "gemma-chaos"),
        env={"HEARTBEAT_INTERVAL_S": "0.5", "KV_CACHE_BYTES": str(32 << 20)},
    )
    with running_stack(config) as s:
        yield s


def test_a_gemma_stream_goes_on_identical_after_its_worker_is_killed(stack) -> None:
    target = f"127.0.0.1:{stack.config.grpc_port}"
    texts = prompts(STREAMS)
    reference = asyncio.run(
        run_streams(target, [f"reference-{i}" for i in range(STREAMS)], texts, max_tokens=MAX_TOKENS)
    )
    assert all(r.finish_reason == "length" and not r.errors for r in reference), reference

    async def with_a_kill() -> list:
        started = asyncio.Event()
        streams = asyncio.create_task(
            run_streams(
                target,
                [f"killed-{i}" for i in range(STREAMS)],
                texts,
                started=started,
                started_after_tokens=4,
                max_tokens=MAX_TOKENS,
            )
        )
        await asyncio.wait_for(started.wait(), 120)
        stack.kill("worker-0")
        return await streams

    results = asyncio.run(with_a_kill())
    tokens = {i: r.tokens for i, r in enumerate(reference)}
    print(f"\nworker killed: {summary(results, tokens)}")
    for i, result in enumerate(results):
        assert result.gaps == 0 and not result.errors, result
        assert (result.finish_reason, result.tokens) == ("length", tokens[i]), result
    with ShardlineClient(target) as client:
        attempts = [client.get_request(r.request_id).attempt for r in results]
    assert 2 in attempts, attempts  # worker-0's requests ran again on worker-1

"""The gRPC API through the SDK, cancellation, and the request state kept in Redis."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from shardline.client import AsyncShardlineClient, ShardlineClient
from shardline.core.store.request_record import RequestStatus
from shardline.core.store.request_store import RequestStore
from shardline.proto import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.slow


def test_generate_and_stream_agree(grpc_target):
    with ShardlineClient(grpc_target) as client:
        whole = client.generate("The sky is", max_tokens=12, temperature=0.0, ignore_eos=True)
        chunks = list(client.stream("The sky is", max_tokens=12, temperature=0.0, ignore_eos=True))
    assert whole.finish_reason == "length" and len(whole.token_ids) == 12
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    offsets = [c.offset for c in chunks if c.token_ids]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert chunks[-1].usage.completion_tokens == 12


def test_drafted_tokens_reach_the_client_several_a_step(grpc_target):
    """The test stack's worker runs n-gram speculation (conftest): text that repeats its prompt keeps
    drafts, and a step's several tokens travel as one delta, through to the client and Redis."""
    prompt = "1, 2, 3, 4, 5, " * 4  # the model counts on: 40 tokens in 9 steps, 31 of them drafts
    with ShardlineClient(grpc_target) as client:
        whole = client.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
        chunks = list(client.stream(prompt, max_tokens=40, temperature=0.0, ignore_eos=True))
        info = client.get_request(whole.request_id)
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids == info.output_token_ids
    assert len(whole.token_ids) == 40
    # One chunk a step: decoding one token a step would take 40 (the gateway merges a few at most,
    # where the detokenizer holds back a partial character or a stop string's prefix).
    assert len([c for c in chunks if c.token_ids]) <= 20
    offsets = [(c.offset, len(c.token_ids)) for c in chunks if c.token_ids]
    assert all(o + n == next_o for (o, n), (next_o, _) in zip(offsets, offsets[1:]))


def test_async_client_and_resume(grpc_target):
    async def run() -> tuple[list[int], list[int], list[int]]:
        async with AsyncShardlineClient(grpc_target) as client:
            full = await client.generate("Count: one, two,", max_tokens=10, temperature=0.0, ignore_eos=True)
            resumed = [t async for c in client.resume(full.request_id, offset=4) for t in c.token_ids]
            info = await client.get_request(full.request_id)
            return full.token_ids, resumed, info.output_token_ids

    full, resumed, stored = asyncio.run(run())
    assert resumed == full[4:]
    assert stored == full


def test_a_resumed_stream_and_the_record_keep_the_logprobs(grpc_target):
    # Replayed from Redis, as after a lost connection: a client asking for logprobs gets them all.
    with ShardlineClient(grpc_target) as client:
        whole = client.generate(
            "The sky is", max_tokens=8, temperature=0.0, ignore_eos=True, top_logprobs=2, prompt_logprobs=1
        )
        chunks = list(client.resume(whole.request_id, offset=0))
        later = list(client.resume(whole.request_id, offset=5))
        info = client.get_request(whole.request_id)
    assert len(whole.logprobs) == 8 and whole.prompt_logprobs and whole.usage.prompt_tokens > 1
    assert [lp for c in chunks for lp in c.logprobs or ()] == whole.logprobs
    assert next(c.prompt_logprobs for c in chunks if c.prompt_logprobs) == whole.prompt_logprobs
    assert [lp for c in later for lp in c.logprobs or ()] == whole.logprobs[5:]
    assert not any(c.prompt_logprobs for c in later)  # sent with the first token only
    assert info.logprobs == whole.logprobs and info.prompt_logprobs == whole.prompt_logprobs
    assert len(info.prompt_logprobs) == whole.usage.prompt_tokens - 1


def test_an_async_stream_left_early_can_be_resumed_at_once(grpc_target):
    # Breaking out of the stream must end its rpc; before, the request ran on to the end, and a
    # Resume was refused ("already streaming") all that time.
    async def run() -> tuple[list[int], list[int]]:
        async with AsyncShardlineClient(grpc_target) as client:
            stream = client.stream("Write a long story:", max_tokens=60, temperature=0.0, ignore_eos=True)
            head: list[int] = []
            async for chunk in stream:
                head += chunk.token_ids
                request_id = chunk.request_id
                if len(head) >= 2:
                    break
            await stream.aclose()
            rest = [t async for c in client.resume(request_id, offset=len(head)) for t in c.token_ids]
            whole = await client.generate("Write a long story:", max_tokens=60, temperature=0.0, ignore_eos=True)
            return head + rest, whole.token_ids

    resumed, whole = asyncio.run(run())
    assert resumed == whole


def test_bad_grpc_request_is_invalid_argument(grpc_target):
    with ShardlineClient(grpc_target, retries=0) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("x", max_tokens=1, top_p=3.0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()


def _kv_blocks_used(stack) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{stack.config.scheduler_port}") as ch:
        workers = scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(scheduler_pb2.ListWorkersRequest()).workers
    return sum(w.kv_blocks_used for w in workers)


def test_cancel_mid_stream_frees_blocks(stack, grpc_target):
    with ShardlineClient(grpc_target) as client:
        stream = client.stream(
            "Write a very long essay about the sea.", max_tokens=400, temperature=0.0, ignore_eos=True
        )
        first = next(stream)
        deadline = time.monotonic() + 10
        while _kv_blocks_used(stack) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _kv_blocks_used(stack) > 0
        client.cancel(first.request_id)
        rest = list(stream)
        assert rest[-1].finish_reason == "abort"
        deadline = time.monotonic() + 10
        while _kv_blocks_used(stack) > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _kv_blocks_used(stack) == 0
        info = client.get_request(first.request_id)
    assert info.status == "cancelled"
    assert len(info.output_token_ids) < 400


def test_request_record_and_tokens_in_redis(stack, grpc_target):
    with ShardlineClient(grpc_target) as client:
        done = client.generate("Hello", max_tokens=6, temperature=0.0, ignore_eos=True)

    async def read():
        async with RequestStore(stack.redis_url) as store:
            return (
                await store.get(done.request_id),
                await store.get_tokens(done.request_id),
                await store.get_prompt(done.request_id),
            )

    record, tokens, prompt = asyncio.run(read())
    assert record.status == RequestStatus.FINISHED and record.worker_id == "worker-0" and record.attempt == 1
    assert tokens == done.token_ids and prompt and len(prompt) == done.usage.prompt_tokens
    assert record.arrival_ts <= record.dispatch_ts <= record.first_token_ts <= record.finish_ts
    assert record.params["max_tokens"] == 6


def test_request_walk_timings_are_ordered_and_add_up(grpc_target):
    """benchmarks.request_walk: each request's stamps fall in order, so the hops split its TTFT."""
    from benchmarks.request_walk import HOPS, summarize, walk

    waves = asyncio.run(walk(grpc_target, waves=1, concurrency=4, input_len=24, output_len=2, seed=3))
    assert len(waves) == 1 and len(waves[0]) == 4
    for r in waves[0]:
        assert r["sent"] <= r["arrival"] <= r["dispatch"] <= r["first_token"] <= r["ttft"]
    summary = summarize(waves[0])
    assert [name for name, _, _ in HOPS] == list(summary)[: len(HOPS)]
    assert summary["TTFT"]["max"] >= summary["dispatch -> first token"]["max"] > 0


def test_the_record_keeps_the_prefix_cache_hits(grpc_target):
    prompt = "A prompt long enough to fill a few KV blocks of sixteen tokens each, said twice over: " * 2
    with ShardlineClient(grpc_target) as client:
        client.generate(prompt, max_tokens=2, temperature=0.0)
        again = client.generate(prompt, max_tokens=2, temperature=0.0)
        info = client.get_request(again.request_id)
    assert again.usage.cached_tokens > 0
    assert info.usage.cached_tokens == again.usage.cached_tokens  # GetRequest said 0 before


def test_structured_output_through_the_sdk_and_its_record(stack, grpc_target):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    with ShardlineClient(grpc_target) as client:
        picked = client.generate(
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8,
            temperature=0.0,
            choice=["red", "green", "blue"],
        )
        as_json = client.generate(
            messages=[{"role": "user", "content": "Name a colour, in JSON."}], max_tokens=40, seed=3, json_schema=schema
        )
        streamed = "".join(
            c.text
            for c in client.stream(
                messages=[{"role": "user", "content": "Name a colour."}],
                max_tokens=8,
                temperature=0.0,
                choice=["red", "green", "blue"],
            )
        )
    assert picked.finish_reason == "stop" and picked.text in ("red", "green", "blue") and streamed == picked.text
    assert as_json.finish_reason == "stop" and json.loads(as_json.text)["colour"] in ("red", "green", "blue")

    async def read():
        async with RequestStore(stack.redis_url) as store:
            return await store.get(as_json.request_id)

    # The constraint is in the record, so a re-dispatch after a worker failure keeps it.
    assert json.loads(asyncio.run(read()).params["structured_output"]["json_schema"]) == schema

"""The hub's detokenizing when the tokenizer service fails: in-process streams do not notice, the
Detokenize rpc path pauses and retries, and a definition that does not load leaves the rpc in charge."""

from __future__ import annotations

import asyncio
import subprocess

import grpc

from gateway.output import local_detokenizer
from shardline.core.errors import Unavailable
from shardline.core.ports import free_port
from shardline.proto import generation_pb2, sampling_pb2
from tests.gateway.conftest import TEXT, start_tokenizer
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import Script


def _start_own_tokenizer() -> tuple[int, subprocess.Popen]:
    port = free_port()
    return port, start_tokenizer(port)


def test_a_tokenizer_restart_pauses_the_streams_and_loses_nothing(text_ids) -> None:
    """Detokenizing through the service (SHARDLINE_LOCAL_DETOKENIZE=0, or before the gateway has the
    tokenizer's definition): killed mid-stream and started again on its port (as `shardline up` or
    compose does), the tokenizer costs the streams a pause: Detokenize is retried, nothing is
    cancelled or lost."""
    port, process = _start_own_tokenizer()

    async def body(stack: Stack) -> None:
        nonlocal process
        call = stack.generation.GenerateStream(generation_pb2.GenerateRequest(prompt="hi"))
        chunks = [await call.read()]
        while len(stack.scheduler.records[chunks[0].request_id].output) < 3:
            await asyncio.sleep(0.01)
        process.kill()
        process.wait()
        stack.scheduler.release()  # the rest is relayed while the tokenizer is down
        await asyncio.sleep(0.5)
        process = await asyncio.to_thread(start_tokenizer, port)
        while (chunk := await call.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
        assert "".join(c.text for c in chunks) == TEXT
        assert [t for c in chunks for t in c.token_ids] == text_ids
        assert chunks[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
        assert stack.scheduler.cancelled == []

    try:
        run_on_stack(f"127.0.0.1:{port}", Script(text_ids, hold_after=3), body, local_detokenize=False)
    finally:
        process.kill()
        process.wait()


def test_in_process_detokenizing_streams_on_through_a_dead_tokenizer(text_ids) -> None:
    """With the tokenizer's definition loaded, the streams no longer need the tokenizer service."""
    port, process = _start_own_tokenizer()

    async def body(stack: Stack) -> None:
        call = stack.generation.GenerateStream(generation_pb2.GenerateRequest(prompt="hi"))
        chunks = [await call.read()]
        while len(stack.scheduler.records[chunks[0].request_id].output) < 3:
            await asyncio.sleep(0.01)
        process.kill()
        process.wait()
        stack.scheduler.release()
        while (chunk := await call.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
        assert "".join(c.text for c in chunks) == TEXT
        assert [t for c in chunks for t in c.token_ids] == text_ids
        assert chunks[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
        assert stack.gateway.hub.processor.detokenizer.local_calls >= 2

    try:
        run_on_stack(f"127.0.0.1:{port}", Script(text_ids, hold_after=3), body)
    finally:
        process.kill()
        process.wait()


def test_a_definition_that_does_not_load_leaves_the_streams_to_the_detokenize_rpc(
    tokenizer_address, text_ids, monkeypatch
) -> None:
    """A tokenizer service without GetDefinition (an older one) or a definition that fails to build:
    each step goes to Detokenize, the text is the same, and the fetch is tried again later."""
    monkeypatch.setattr(local_detokenizer, "RETRY_S", 0.0)
    fetches: list[int] = []

    async def body(stack: Stack) -> None:
        stub = stack.gateway.backends.tokenizer

        async def unimplemented(request, **kwargs):
            fetches.append(1)
            raise Unavailable("the tokenizer has no GetDefinition")

        stub.GetDefinition = unimplemented
        call = stack.generation.GenerateStream(generation_pb2.GenerateRequest(prompt="hi"))
        chunks = [chunk async for chunk in call]
        assert "".join(c.text for c in chunks) == TEXT
        assert stack.gateway.hub.processor.detokenizer.local_calls == 0
        assert len(fetches) >= 2  # tried again, past RETRY_S

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_a_tokenizer_that_stays_down_fails_streams_as_unavailable_and_the_requests_run_on(
    text_ids, monkeypatch
) -> None:
    """Past the outage window the client gets UNAVAILABLE with the offset to resume at, not INTERNAL,
    and the request is not cancelled: it finishes and is recorded, for a Resume once the tokenizer is back."""
    monkeypatch.setattr(local_detokenizer, "TOKENIZER_OUTAGE_S", 1.0)
    port, process = _start_own_tokenizer()

    async def body(stack: Stack) -> None:
        call = stack.generation.GenerateStream(generation_pb2.GenerateRequest(prompt="hi"))
        first = await call.read()
        rid = first.request_id
        while len(stack.scheduler.records[rid].output) < 3:
            await asyncio.sleep(0.01)
        process.kill()
        process.wait()
        stack.scheduler.release()
        received = len(first.token_ids)
        try:
            while (chunk := await call.read()) is not grpc.aio.EOF:
                received += len(chunk.token_ids)
            raise AssertionError("the stream ended without an error")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert f"the tokenizer is unavailable: the request runs on; resume it at offset {received}" in exc.details()
        await asyncio.sleep(0.3)
        assert stack.scheduler.cancelled == []
        assert stack.scheduler.records[rid].output == text_ids

    try:
        run_on_stack(f"127.0.0.1:{port}", Script(text_ids, hold_after=3), body, local_detokenize=False)
    finally:
        process.kill()
        process.wait()

"""The gRPC Generation API: Generate, GenerateStream, Cancel, Resume, GetRequest, ListModels."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shardline.bench.stack_backend import StackBackend
from shardline.client import AsyncShardlineClient, ModelInfo
from shardline.core.text.tokenizer import Tokenizer
from shardline.proto import common_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2
from tests.gateway.conftest import TEXT
from tests.gateway.harness import Stack, run_on_stack, start_gateway_for
from tests.gateway.scripted_scheduler import MODEL, Script


async def read_rest(call) -> list[generation_pb2.GenerateStreamResponse]:
    """The remaining messages of a call already read with read() (grpc forbids mixing in async for)."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def request(**params) -> generation_pb2.GenerateRequest:
    params = sampling_pb2.SamplingParameters(**params)
    return generation_pb2.GenerateRequest(prompt="Tell me about foxes.", params=params)


def test_generate_returns_the_whole_result(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        reply = await stack.generation.Generate(request(max_tokens=100))
        assert reply.request_id.startswith("cmpl-")
        assert (reply.text, list(reply.token_ids)) == (TEXT, text_ids)
        assert reply.finish_reason == sampling_pb2.FINISH_REASON_STOP
        assert reply.usage.completion_tokens == len(text_ids)
        chat = await stack.generation.Generate(
            generation_pb2.GenerateRequest(
                messages={"messages": [{"role": "user", "content": "hi"}]}, request_id="my-chat-1"
            )
        )
        assert chat.request_id == "my-chat-1" and chat.text == TEXT
        tokens = await stack.generation.Generate(
            generation_pb2.GenerateRequest(
                prompt_token_ids={"ids": [1, 19556]}, params=sampling_pb2.SamplingParameters(max_tokens=2)
            )
        )
        assert tokens.finish_reason == sampling_pb2.FINISH_REASON_LENGTH and tokens.usage.prompt_tokens == 2
        assert list(stack.scheduler.submitted[2].prompt_token_ids) == [1, 19556]

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_generate_stream_chunks_are_contiguous(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        chunks = [c async for c in stack.generation.GenerateStream(request(max_tokens=100))]
        assert "".join(c.text for c in chunks) == TEXT
        offsets = [c.offset for c in chunks]
        assert offsets == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
        assert [t for c in chunks for t in c.token_ids] == text_ids
        assert [c.finish_reason for c in chunks[:-1]] == [sampling_pb2.FINISH_REASON_UNSPECIFIED] * (len(chunks) - 1)
        assert chunks[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + len(text_ids)
        assert len({c.request_id for c in chunks}) == 1

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=2), body)


def test_stop_strings_and_cancel_over_grpc(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        chunks = [c async for c in stack.generation.GenerateStream(request(stop=["qqq", "ver th"]))]
        assert "".join(c.text for c in chunks) == " The quick brown fox jumps o"
        assert chunks[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
        await stack.scheduler.wait_cancelled(chunks[0].request_id)

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_cancel_and_disconnect_cancel_upstream(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        call = stack.generation.GenerateStream(request())
        first = await call.read()
        cancelled = await stack.generation.Cancel(common_pb2.CancelRequest(request_id=first.request_id))
        assert cancelled.status == sampling_pb2.REQUEST_STATUS_CANCELLED
        rest = await read_rest(call)
        assert rest[-1].finish_reason == sampling_pb2.FINISH_REASON_ABORT
        # A client that goes away mid-stream cancels its request, once the grace for a Resume is over.
        call = stack.generation.GenerateStream(request())
        first = await call.read()
        call.cancel()
        await asyncio.sleep(0.1)
        assert first.request_id not in stack.scheduler.cancelled
        await stack.scheduler.wait_cancelled(first.request_id)

    run_on_stack(tokenizer_address, Script(text_ids, hold_after=3), body, resume_grace_s=0.5)


def test_a_client_that_lost_its_connection_resumes_within_the_grace(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        call = stack.generation.GenerateStream(request())
        first = await call.read()
        call.cancel()  # the connection is lost
        await asyncio.sleep(0.2)
        resume = stack.generation.Resume(generation_pb2.ResumeRequest(request_id=first.request_id, offset=1))
        replayed = await resume.read()
        # A second stream of it from this gateway is refused while the first holds it: the request is
        # well formed, its state is what forbids it.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stack.generation.Resume(generation_pb2.ResumeRequest(request_id=first.request_id)).read()
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert caught.value.details().startswith("request_id: ") and "already streaming" in caught.value.details()
        await asyncio.sleep(0.5)  # past the grace: the resumed stream holds the request, so no cancel
        assert first.request_id not in stack.scheduler.cancelled
        stack.scheduler.release()
        chunks = [replayed, *await read_rest(resume)]
        assert [t for c in chunks for t in c.token_ids] == text_ids[1:]
        assert first.text + "".join(c.text for c in chunks) == TEXT
        assert chunks[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP

    run_on_stack(tokenizer_address, Script(text_ids, hold_after=3), body, resume_grace_s=0.4)


def test_get_request_and_list_models(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        reply = await stack.generation.Generate(request(max_tokens=5))
        info = await stack.generation.GetRequest(common_pb2.GetRequestRequest(request_id=reply.request_id))
        assert list(info.output_token_ids) == text_ids[:5] and info.status == sampling_pb2.REQUEST_STATUS_FINISHED
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stack.generation.GetRequest(common_pb2.GetRequestRequest(request_id="nope"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        models = await stack.generation.ListModels(generation_pb2.ListModelsRequest())
        assert [(m.name, m.max_context_length, m.num_workers, m.vocab_size) for m in models.models] == [
            (MODEL, 8192, 1, 49152)
        ]
        # The SDK's typed view, and the vocabulary `shardline bench` draws its prompts from.
        async with AsyncShardlineClient(f"127.0.0.1:{stack.gateway.grpc.port}") as client:
            assert await client.models() == [ModelInfo(MODEL, 8192, 1, 49152)]
        backend = StackBackend(f"127.0.0.1:{stack.gateway.grpc.port}")
        try:
            assert await backend.vocab_size() == 49152
        finally:
            await backend.close()

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_resume_a_finished_request_from_an_offset(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    async def body(stack: Stack) -> None:
        reply = await stack.generation.Generate(request())
        for offset in (0, 4, len(text_ids)):
            chunks = [
                c
                async for c in stack.generation.Resume(
                    generation_pb2.ResumeRequest(request_id=reply.request_id, offset=offset)
                )
            ]
            assert "".join(c.text for c in chunks) == TEXT[len(tokenizer.decode(text_ids[:offset])) :]
            assert [t for c in chunks for t in c.token_ids] == text_ids[offset:]
            assert chunks[0].offset == offset and chunks[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
        for bad in (
            generation_pb2.ResumeRequest(request_id=reply.request_id, offset=99),
            generation_pb2.ResumeRequest(request_id=""),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stack.generation.Resume(bad).read()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stack.generation.Resume(generation_pb2.ResumeRequest(request_id="gone")).read()
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_resume_a_running_request_on_another_gateway(tokenizer_address, text_ids) -> None:
    """The first gateway is lost mid-request; a second one attaches, replays, then follows it live."""

    async def body(stack: Stack) -> None:
        stack.scheduler.honour_cancels = False  # the first gateway's disconnect cancel never lands
        call = stack.generation.GenerateStream(request())
        first = await call.read()
        request_id = first.request_id
        while len(stack.scheduler.records[request_id].output) < 5:
            await asyncio.sleep(0.01)
        call.cancel()
        await stack.scheduler.wait_cancelled(request_id)
        other, _ = await start_gateway_for(stack.scheduler_server.port, tokenizer_address, gateway_id="gateway-b")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{other.grpc.port}") as channel:
                resume = generation_pb2_grpc.GenerationStub(channel).Resume(
                    generation_pb2.ResumeRequest(request_id=request_id, offset=2)
                )
                replayed = await resume.read()
                assert list(replayed.token_ids) == text_ids[2:5] and replayed.offset == 2
                assert stack.scheduler.records[request_id].gateway_id == "gateway-b"
                stack.scheduler.release()
                rest = await read_rest(resume)
        finally:
            await other.stop(0)
        chunks = [replayed, *rest]
        assert [t for c in chunks for t in c.token_ids] == text_ids[2:]
        assert "".join(c.text for c in chunks) == TEXT[len(" The quick") :]
        assert chunks[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP

    run_on_stack(tokenizer_address, Script(text_ids, hold_after=5), body, resume_grace_s=0)


def test_resume_at_the_end_of_a_finished_request_owes_nothing(
    tokenizer_address, text_ids, tokenizer: Tokenizer
) -> None:
    """The client had the last chunk, which flushed all held-back text: a Resume at the end sends none,
    even where the stop token's text ('<|im_end|>') looks like the start of a stop string, or a
    character is unfinished."""
    eos = tokenizer.eos_token_ids[0]
    emoji_cut = next(n for n in range(len(text_ids)) if tokenizer.decode(text_ids[:n]).endswith("\ufffd"))

    async def body(stack: Stack) -> None:
        for params in ({"skip_special_tokens": False, "stop": [">>"]}, {}):
            streamed = [c async for c in stack.generation.GenerateStream(request(max_tokens=50, **params))]
            end = streamed[-1].offset + len(streamed[-1].token_ids)
            again = [
                c
                async for c in stack.generation.Resume(
                    generation_pb2.ResumeRequest(request_id=streamed[0].request_id, offset=end)
                )
            ]
            assert "".join(c.text for c in again) == "" and not [t for c in again for t in c.token_ids]
            assert again[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP

    run_on_stack(tokenizer_address, Script(text_ids[:emoji_cut] + [eos]), body)

"""The SDK receives replies up to the gateway's 64 MB message limit, not grpc's 4 MB default."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from shardline.client import AsyncShardlineClient, ShardlineClient
from shardline.core.grpc_server import GRPC_OPTIONS
from shardline.proto import generation_pb2, generation_pb2_grpc, sampling_pb2

# A long completion with top_logprobs: 6 MB on the wire, over grpc's default 4 MB receive limit.
_LOGPROBS = 40_000
_TOP = 20


class _Gateway(generation_pb2_grpc.GenerationServicer):
    def Generate(self, request, context):
        top = [sampling_pb2.TopLogprob(token_id=40_000 + i, logprob=-1.5 - i) for i in range(_TOP)]
        logprobs = [sampling_pb2.TokenLogprob(token_id=30_000, logprob=-0.25, top=top)] * _LOGPROBS
        return generation_pb2.GenerateResponse(
            request_id=request.request_id,
            text="x" * _LOGPROBS,
            token_ids=[30_000] * _LOGPROBS,
            logprobs=logprobs,
            finish_reason=sampling_pb2.FINISH_REASON_LENGTH,
            usage=sampling_pb2.Usage(prompt_tokens=1, completion_tokens=_LOGPROBS),
        )


@pytest.fixture
def gateway_address():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
    generation_pb2_grpc.add_GenerationServicer_to_server(_Gateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _reply_bytes() -> int:
    return len(_Gateway().Generate(generation_pb2.GenerateRequest(request_id="r"), None).SerializeToString())


def test_the_reply_is_over_grpcs_default_limit(gateway_address):
    assert _reply_bytes() > 4 << 20
    with grpc.insecure_channel(gateway_address) as channel:  # grpc's defaults: the reply is refused
        with pytest.raises(grpc.RpcError) as exc:
            generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(request_id="r"))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_sync_client_receives_a_reply_over_4_mb(gateway_address):
    with ShardlineClient(gateway_address) as client:
        completion = client.generate("hi", max_tokens=_LOGPROBS, top_logprobs=_TOP)
    assert len(completion.token_ids) == _LOGPROBS
    assert len(completion.logprobs) == _LOGPROBS and len(completion.logprobs[-1].top) == _TOP


def test_async_client_receives_a_reply_over_4_mb(gateway_address):
    async def main():
        async with AsyncShardlineClient(gateway_address) as client:
            return await client.generate("hi", max_tokens=_LOGPROBS, top_logprobs=_TOP)

    completion = asyncio.run(main())
    assert len(completion.token_ids) == _LOGPROBS
    assert completion.logprobs[0].top[0] == (40_000, -1.5)

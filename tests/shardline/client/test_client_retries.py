"""The SDK's retries never start a generation twice: a retry that finds its request id taken follows it."""

from __future__ import annotations

import grpc
import pytest

from shardline.client import ShardlineClient
from shardline.proto import generation_pb2, sampling_pb2


class _Error(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Gateway:
    """Generate accepts the request, then the connection breaks; the retry finds its id in use."""

    def __init__(self) -> None:
        self.generate_ids: list[str] = []
        self.resumed: list[tuple[str, int]] = []

    def Generate(self, req, **_):
        self.generate_ids.append(req.request_id)
        if len(self.generate_ids) == 1:
            raise _Error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        raise _Error(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {req.request_id!r} is already in use")

    GenerateStream = Generate

    def Resume(self, req, **_):
        self.resumed.append((req.request_id, req.offset))
        yield generation_pb2.GenerateStreamResponse(request_id=req.request_id, text="Hel", token_ids=[1], offset=0)
        yield generation_pb2.GenerateStreamResponse(
            request_id=req.request_id,
            text="lo",
            token_ids=[2],
            offset=1,
            finish_reason=sampling_pb2.FINISH_REASON_LENGTH,
            usage=sampling_pb2.Usage(completion_tokens=2),
        )


@pytest.mark.parametrize("streamed", [False, True])
def test_a_retry_that_finds_its_request_started_follows_it(streamed: bool) -> None:
    with ShardlineClient("127.0.0.1:1", backoff_s=0) as client:
        gateway = client._stub = _Gateway()
        if streamed:
            chunks = list(client.stream("hi", max_tokens=2))
            text, finish = "".join(c.text for c in chunks), chunks[-1].finish_reason
        else:
            done = client.generate("hi", max_tokens=2)
            text, finish = done.text, done.finish_reason
    # One request id for both attempts, chosen by the client; the second attempt resumed the first.
    assert len(set(gateway.generate_ids)) == 1 and gateway.generate_ids[0].startswith("cmpl-")
    assert gateway.resumed == [(gateway.generate_ids[0], 0)]
    assert (text, finish) == ("Hello", "length")


def test_an_id_taken_on_the_first_attempt_is_the_callers_error() -> None:
    class Taken(_Gateway):
        def Generate(self, req, **_):
            raise _Error(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {req.request_id!r} is already in use")

    with ShardlineClient("127.0.0.1:1", backoff_s=0) as client:
        client._stub = Taken()
        with pytest.raises(grpc.RpcError):
            client.generate("hi", request_id="mine")
        assert client._stub.resumed == []


def test_an_async_client_built_outside_any_event_loop_works_in_one() -> None:
    import asyncio

    from shardline.client import AsyncShardlineClient

    client = AsyncShardlineClient("127.0.0.1:1", retries=0)  # at import time, say: no loop running

    async def use() -> grpc.StatusCode:
        try:
            await client.list_models()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await client.close()
        return grpc.StatusCode.OK

    # Its channel is made in the loop that uses it (it was bound to another loop before).
    assert asyncio.run(use()) == grpc.StatusCode.UNAVAILABLE

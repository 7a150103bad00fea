"""gateway/output/local_detokenizer.py against a real tokenizer service: the rpc's answers, in-process."""

from __future__ import annotations

import asyncio

import pytest

from gateway.output.local_detokenizer import LocalDetokenizer
from gateway.upstream.backends import Backends
from shardline.core.errors import InvalidArgument
from shardline.proto import tokenizer_pb2


def request(text_ids: list[int]) -> tokenizer_pb2.DetokenizeRequest:
    half = len(text_ids) // 2
    return tokenizer_pb2.DetokenizeRequest(
        items=[
            tokenizer_pb2.DetokenizeItem(new_token_ids=text_ids[:half], skip_special_tokens=True),
            tokenizer_pb2.DetokenizeItem(
                prefix_token_ids=text_ids[half - 3 : half], new_token_ids=text_ids[half:], final=True
            ),
            tokenizer_pb2.DetokenizeItem(new_token_ids=text_ids[:2], final=True, raw_bytes=True),
        ]
    )


def run(tokenizer_address: str, body) -> None:
    async def main() -> None:
        backends = Backends(tokenizer_address, "127.0.0.1:1")  # no scheduler: only the tokenizer is asked
        try:
            await body(backends)
        finally:
            await backends.close()

    asyncio.run(main())


def test_in_process_answers_are_the_detokenize_rpcs(tokenizer_address, text_ids) -> None:
    async def body(backends: Backends) -> None:
        local = LocalDetokenizer(backends)
        info, reply = await local.detokenize(request(text_ids))
        assert local.local_calls == 1
        expected = await backends.tokenizer.Detokenize(request(text_ids))
        assert list(reply.results) == list(expected.results)
        assert info == await backends.tokenizer.GetInfo(tokenizer_pb2.GetTokenizerInfoRequest())

    run(tokenizer_address, body)


def test_an_id_outside_the_vocabulary_is_refused_naming_its_item(tokenizer_address, text_ids) -> None:
    async def body(backends: Backends) -> None:
        bad = request(text_ids)
        bad.items[1].new_token_ids.append(10**6)
        with pytest.raises(InvalidArgument, match=r"items\[1\]\.new_token_ids"):
            await LocalDetokenizer(backends).detokenize(bad)

    run(tokenizer_address, body)


def test_turned_off_every_step_goes_to_the_rpc(tokenizer_address, text_ids) -> None:
    async def body(backends: Backends) -> None:
        rpc = LocalDetokenizer(backends, enabled=False)
        _, reply = await rpc.detokenize(request(text_ids))
        assert rpc.local_calls == 0
        _, local = await LocalDetokenizer(backends).detokenize(request(text_ids))
        assert list(reply.results) == list(local.results)

    run(tokenizer_address, body)

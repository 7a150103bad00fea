"""Tokenizer.GetDefinition: the served tokenizer, serialized, rebuilt elsewhere to detokenize as the service does."""

from __future__ import annotations

import pytest

from shardline.core.text.detokenizer import DetokenizeItem, detokenize_batch, next_prefix
from shardline.core.text.tokenizer import Tokenizer
from shardline.proto import tokenizer_pb2
from tests.tokenizer_svc.test_service import Stub, service, with_stub
from tokenizer_svc.service import TokenizerService

__all__ = ["service"]  # the fixture


@pytest.mark.parametrize("kind", ["byte-level BPE", "sentencepiece with byte fallback"])
def test_get_definition_rebuilds_a_tokenizer_that_detokenizes_as_the_service(
    kind, service, tokenizer, spm_tokenizer, corpus
) -> None:
    """What a gateway builds from GetDefinition streams the same text as Detokenize, item for item:
    the vocabulary, the added and special tokens, the byte tokens and the decoder all travel."""
    original = tokenizer if kind == "byte-level BPE" else spm_tokenizer
    served = service if original is tokenizer else TokenizerService(spm_tokenizer, "spm-test", 2048)
    ids = original.encode_batch([*corpus, "a 😀 und Grüße <|im_end|>"], add_special_tokens=False)

    async def body(stub: Stub) -> None:
        definition = await stub.GetDefinition(tokenizer_pb2.GetTokenizerDefinitionRequest())
        info = await stub.GetInfo(tokenizer_pb2.GetTokenizerInfoRequest())
        rebuilt = Tokenizer.from_definition(definition.tokenizer_json, definition.model)
        assert definition.model == info.model and rebuilt.vocab_size == info.vocab_size
        for name in ("special_token_ids", "byte_token_ids", "continuation_byte_ids"):
            assert getattr(rebuilt, name) == getattr(original, name), name
        # Each sequence streamed one token at a time, with its prefix window, as the hub sends it.
        for seq in ids:
            prefix, pending, local_text, service_text = [], [], "", ""
            for i, token in enumerate(seq):
                item = DetokenizeItem(prefix, [*pending, token], True, i == len(seq) - 1)
                [(text, consumed)] = detokenize_batch(rebuilt, [item])
                wire = tokenizer_pb2.DetokenizeItem(
                    prefix_token_ids=prefix,
                    new_token_ids=item.new_token_ids,
                    skip_special_tokens=True,
                    final=item.final,
                )
                reply = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(items=[wire]))
                assert (text, consumed) == (reply.results[0].text, reply.results[0].num_consumed)
                local_text += text
                service_text += reply.results[0].text
                prefix = next_prefix(rebuilt, prefix, item.new_token_ids[:consumed], skip_special_tokens=True)
                pending = item.new_token_ids[consumed:]
            assert local_text == service_text == original.decode(seq)
            assert rebuilt.token_bytes(seq) == original.token_bytes(seq)

    with_stub(served, body)

"""Refusal by size, before tokenizing: a prompt whose bytes alone show it cannot fit is refused here,
and never crosses to the tokenizer (whose memory a few megabyte-long prompts used to inflate by GBs).

No token stands for more bytes than the vocabulary's longest, which the tokenizer tells through
Detokenize's raw bytes of every token, asked once. The bound is then the prompt's UTF-8 bytes over
that length, over NORMALIZER_SLACK more: a vocabulary's normalizer may compose up to three
characters into one (NFC, on Hangul) before tokens are cut. The tokenizer service checks the
normalized text exactly too; this check only spares it the obvious cases.
"""

from __future__ import annotations

import asyncio
import math

from gateway.runner.params import ContextLengthExceeded
from gateway.upstream.backends import RPC_TIMEOUT_S, Backends, upstream
from shardline.proto import tokenizer_pb2

NORMALIZER_SLACK = 3
# Tokens a probe item carries: the Detokenize of a whole vocabulary in items of one token each.
_PROBE_ITEMS = 16_384


class PromptBound:
    """The longest token's bytes, asked once of the tokenizer, and the check it allows."""

    def __init__(self, backends: Backends) -> None:
        self._backends = backends
        self._probe: asyncio.Task[int] | None = None

    async def check(self, texts: list[str], max_tokens: int, field: str) -> None:
        """ContextLengthExceeded naming `field` when `texts`, one prompt's pieces, surely pass `max_tokens`."""
        if sum(len(text) for text in texts) <= max_tokens:  # too short to be worth measuring
            return
        size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
        longest = await self.longest_token_bytes()
        least = math.ceil(size / (longest * NORMALIZER_SLACK))
        if least > max_tokens:
            raise ContextLengthExceeded(
                field,
                f"the prompt has at least {least} tokens ({size} bytes, and no token "
                f"is longer than {longest}); at most {max_tokens} fit",
            )

    async def longest_token_bytes(self) -> int:
        """The most bytes one token of the served vocabulary stands for."""
        if self._probe is None or (self._probe.done() and (self._probe.cancelled() or self._probe.exception())):
            self._probe = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._probe)  # a caller that leaves does not cancel it for the others

    async def _ask(self) -> int:
        vocab = (await self._backends.tokenizer_info()).vocab_size
        longest = 1
        for start in range(0, vocab, _PROBE_ITEMS):
            items = [
                tokenizer_pb2.DetokenizeItem(new_token_ids=[i], final=True, raw_bytes=True)
                for i in range(start, min(vocab, start + _PROBE_ITEMS))
            ]
            with upstream("tokenizer"):
                reply = await self._backends.tokenizer.Detokenize(
                    tokenizer_pb2.DetokenizeRequest(items=items), timeout=RPC_TIMEOUT_S
                )
            longest = max(longest, *(len(result.raw_bytes) for result in reply.results))
        return longest

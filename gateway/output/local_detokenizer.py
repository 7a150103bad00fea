"""The gateway's own copy of the served tokenizer, for its streams' per-step detokenization.

A Detokenize call costs far more in gRPC than in detokenizing: at concurrency 1, one call per
token took the tokenizer service 9% of a core and the gateway's call another 2%, ~1.4 ms of CPU a
token on the cores the worker decodes on, for ~10 us of work. So the gateway fetches the tokenizer's
definition once (Tokenizer.GetDefinition) and runs the code the service runs
(shardline/core/text/detokenizer.py) in-process, as vLLM's and TGI's front ends do. Once it has it, a
tokenizer restart no longer pauses the streams either.

Until then (the tokenizer not up yet; a failure, retried every RETRY_S), and with
SHARDLINE_LOCAL_DETOKENIZE=0, each step goes to the service's Detokenize, retried while the
tokenizer is unreachable (detokenize_retried).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from gateway.upstream.backends import RPC_TIMEOUT_S, Backends, upstream
from shardline.core.errors import ShardlineError, Unavailable
from shardline.core.text.detokenizer import checked_item, detokenize_batch
from shardline.core.text.tokenizer import Tokenizer, TokenizerError
from shardline.proto import tokenizer_pb2

logger = logging.getLogger(__name__)

RETRY_S = 5.0  # how long after a failed fetch of the definition the next is tried
_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0
# How long a Detokenize is retried while the tokenizer is unreachable before its streams fail.
TOKENIZER_OUTAGE_S = 30.0


class LocalDetokenizer:
    """Detokenize for the output processor: in-process once the definition is here, else the tokenizer's rpc."""

    def __init__(self, backends: Backends, enabled: bool = True) -> None:
        self._backends = backends
        self._enabled = enabled
        self._tokenizer: Tokenizer | None = None
        self._next_try = 0.0
        self.local_calls = 0  # steps detokenized in-process

    async def detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest
    ) -> tuple[tokenizer_pb2.TokenizerInfo, tokenizer_pb2.DetokenizeResponse]:
        """As the Detokenize rpc answers `request`, with the tokenizer's info; ShardlineError as it fails."""
        tokenizer = await self._local()
        if tokenizer is None:
            return await detokenize_retried(self._backends, request)
        info = await self._backends.tokenizer_info()  # cached: fetched with the definition
        vocab = tokenizer.vocab_size
        items = [
            checked_item(i, it.prefix_token_ids, it.new_token_ids, it.skip_special_tokens, it.final, vocab)
            for i, it in enumerate(request.items)
        ]
        texts = detokenize_batch(tokenizer, items)  # ~10 us an item: cheaper inline than in a thread
        self.local_calls += 1
        return info, tokenizer_pb2.DetokenizeResponse(
            results=[
                tokenizer_pb2.DetokenizeResult(
                    text=text,
                    num_consumed=n,
                    raw_bytes=tokenizer.token_bytes(item.new_token_ids) if item.raw_bytes else b"",
                )
                for (text, n), item in zip(texts, request.items)
            ]
        )

    async def _local(self) -> Tokenizer | None:
        if self._tokenizer is not None or not self._enabled or time.monotonic() < self._next_try:
            return self._tokenizer
        try:
            info = await self._backends.tokenizer_info()
            with upstream("tokenizer"):
                definition = await self._backends.tokenizer.GetDefinition(
                    tokenizer_pb2.GetTokenizerDefinitionRequest(), timeout=RPC_TIMEOUT_S
                )
            tokenizer = await asyncio.to_thread(Tokenizer.from_definition, definition.tokenizer_json, definition.model)
            if (definition.model, tokenizer.vocab_size) != (info.model, info.vocab_size):
                raise TokenizerError(
                    f"its definition is of {definition.model} ({tokenizer.vocab_size} tokens), "
                    f"its info of {info.model} ({info.vocab_size})"
                )
        except (ShardlineError, TokenizerError, grpc.aio.AioRpcError) as exc:
            self._next_try = time.monotonic() + RETRY_S
            logger.warning("detokenizing through the tokenizer service: its tokenizer did not load here (%s)", exc)
            return None
        logger.info("detokenizing in-process with %s's tokenizer (%d tokens)", info.model, tokenizer.vocab_size)
        self._tokenizer = tokenizer
        return tokenizer


async def detokenize_retried(
    backends: Backends, request: tokenizer_pb2.DetokenizeRequest
) -> tuple[tokenizer_pb2.TokenizerInfo, tokenizer_pb2.DetokenizeResponse]:
    """Detokenize, retried while the tokenizer is unreachable: `shardline up` or compose restarts a
    dead one in seconds, and failing every live stream for that would be worse than a pause (the
    stateless call is safe to repeat). Raises Unavailable once TOKENIZER_OUTAGE_S has passed."""
    deadline = time.monotonic() + TOKENIZER_OUTAGE_S
    backoff = _FIRST_BACKOFF_S
    while True:
        try:
            tokenizer = await backends.tokenizer_info()
            with upstream("tokenizer"):
                # wait_for_ready: a call made while the channel reconnects waits for it, not fails.
                reply = await backends.tokenizer.Detokenize(
                    request, timeout=max(0.1, deadline - time.monotonic()), wait_for_ready=True
                )
            return tokenizer, reply
        except Unavailable as exc:
            if time.monotonic() + backoff >= deadline:
                raise
            logger.warning("detokenize failed (%s); retrying in %.2f s", exc, backoff)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, _MAX_BACKOFF_S)

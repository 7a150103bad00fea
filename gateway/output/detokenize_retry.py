"""Detokenize, retried while the tokenizer is unreachable."""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.upstream.backends import Backends, upstream
from shardline.core.errors import Unavailable
from shardline.proto import tokenizer_pb2

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0
# How long a Detokenize is retried while the tokenizer is unreachable before its streams fail.
TOKENIZER_OUTAGE_S = 30.0


async def detokenize_retried(
    backends: Backends, request: tokenizer_pb2.DetokenizeRequest
) -> tuple[tokenizer_pb2.TokenizerInfo, tokenizer_pb2.DetokenizeReply]:
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

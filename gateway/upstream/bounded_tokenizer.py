"""The tokenizer stub as requests use it on their way in: at most so many calls in flight at once.

A burst of requests then waits here, in a bounded line (the admission bound caps it), rather
than as thousands of calls in the tokenizer's memory and in grpc's backlog of unread calls,
which grpc sheds as bare CANCELLED. Detokenize, one batched call per engine step, and GetInfo and
GetDefinition, each asked once, pass straight through: the streams already running must not wait
behind new arrivals.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from shardline.proto import tokenizer_pb2, tokenizer_pb2_grpc


class BoundedTokenizer:
    """A TokenizerStub whose Tokenize, ApplyChatTemplate and CheckStructuredOutput share `limit` slots."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub, limit: int) -> None:
        self._stub = stub
        self._slots = asyncio.Semaphore(limit)
        self.limit = limit
        self.in_flight = 0  # calls holding a slot now
        self.peak = 0  # the most that ever did at once
        self.Detokenize = stub.Detokenize
        self.GetInfo = stub.GetInfo
        self.GetDefinition = stub.GetDefinition

    @asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        async with self._slots:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                yield
            finally:
                self.in_flight -= 1

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest, timeout: float) -> tokenizer_pb2.TokenizeResponse:
        async with self._slot():
            return await self._stub.Tokenize(request, timeout=timeout)

    async def ApplyChatTemplate(
        self, request: tokenizer_pb2.ApplyChatTemplateRequest, timeout: float
    ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        async with self._slot():
            return await self._stub.ApplyChatTemplate(request, timeout=timeout)

    async def CheckStructuredOutput(
        self, request: tokenizer_pb2.CheckStructuredOutputRequest, timeout: float
    ) -> tokenizer_pb2.CheckStructuredOutputResponse:
        async with self._slot():
            return await self._stub.CheckStructuredOutput(request, timeout=timeout)

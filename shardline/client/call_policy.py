"""What every call of one client carries: its API key, its default timeout, and how it retries.

A call is retried on UNAVAILABLE (a gateway restarting, a connection lost), with exponential
backoff; a Generate whose retry finds its request id taken follows the request that started
instead (types.was_taken). The sync client and its Batch API calls share one policy; the asyncio
client awaits the same steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from shardline.client.types import was_taken

T = TypeVar("T")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


@dataclass(slots=True)
class CallPolicy:
    """A client's metadata, default timeout and retries."""

    metadata: list[tuple[str, str]]  # the API key, as gRPC's authorization metadata
    timeout: float | None  # seconds a call may take when it gives none; None: no limit
    retries: int  # attempts after the first, on UNAVAILABLE
    backoff_s: float  # the wait before the first retry, doubled before each next one

    @classmethod
    def of(cls, api_key: str | None, timeout: float | None, retries: int, backoff_s: float) -> CallPolicy:
        return cls([("authorization", f"Bearer {api_key}")] if api_key else [], timeout, retries, backoff_s)

    def call(
        self, fn: Callable[..., T], request: Any, timeout: float | None, taken: Callable[[], T] | None = None
    ) -> T:
        """`fn(request)`, retried on UNAVAILABLE; `taken` answers instead when a retry finds the
        request it would start already started (see was_taken)."""
        for attempt in range(self.retries + 1):
            try:
                return self.once(fn, request, timeout)
            except grpc.RpcError as exc:
                if attempt and taken is not None and was_taken(exc):
                    return taken()
                if exc.code() not in RETRYABLE or attempt == self.retries:
                    raise
                self.back_off(attempt)
        raise AssertionError("unreachable")

    def once(self, fn: Callable[..., T], request: Any, timeout: float | None) -> T:
        """`fn(request)` with the client's metadata and timeout, not retried."""
        return fn(request, timeout=timeout or self.timeout, metadata=self.metadata)

    def delay_s(self, attempt: int) -> float:
        """How long to wait before retry number `attempt` + 1."""
        return self.backoff_s * 2**attempt

    def back_off(self, attempt: int) -> None:
        """Waits before retry number `attempt` + 1."""
        time.sleep(self.delay_s(attempt))

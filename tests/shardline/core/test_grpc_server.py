"""Every service's error mapping: typed errors keep their status, anything else is INTERNAL, never UNKNOWN."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shardline.core.errors import InvalidArgument, NotFound
from shardline.core.grpc_server import _wrap_stream, _wrap_unary


class _Aborted(grpc.aio.AbortError):
    pass


class _Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted()


def _unary(exc: BaseException):
    async def handler(request, context):
        raise exc

    return _wrap_unary(handler)


def _stream(exc: BaseException):
    async def handler(request, context):
        yield 1
        raise exc

    return _wrap_stream(handler)


@pytest.mark.parametrize(
    "exc, code",
    [
        (InvalidArgument("params.top_p", "must be in (0, 1]"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotFound("no request 'x'"), grpc.StatusCode.NOT_FOUND),
        (ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
        (KeyError("k"), grpc.StatusCode.INTERNAL),
    ],
)
def test_errors_map_to_their_status(exc, code):
    async def run() -> tuple[_Context, _Context]:
        unary, stream = _Context(), _Context()
        with pytest.raises(_Aborted):
            await _unary(exc)(None, unary)
        with pytest.raises(_Aborted):
            async for _ in _stream(exc)(None, stream):
                pass
        return unary, stream

    for context in asyncio.run(run()):
        assert context.code == code
    if code == grpc.StatusCode.INTERNAL:
        assert type(exc).__name__ in context.details


def test_a_handlers_own_abort_passes_through():
    async def handler(request, context):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no")

    context = _Context()
    with pytest.raises(_Aborted):
        asyncio.run(_wrap_unary(handler)(None, context))
    assert context.code == grpc.StatusCode.PERMISSION_DENIED


def test_a_port_in_use_is_refused_not_shared():
    # With SO_REUSEPORT a second server bound the same port and took part of the first one's clients.
    from shardline.core.grpc_server import start_grpc_server

    async def run() -> None:
        first = await start_grpc_server([], 0, "127.0.0.1")
        try:
            with pytest.raises(OSError, match="cannot bind"):
                await start_grpc_server([], first.port, "127.0.0.1")
        finally:
            await first.stop(0)

    asyncio.run(run())


def test_a_stop_signal_caught_before_the_wait_is_not_lost():
    # The worker's own handlers catch a signal between its model load and this wait: the event they set
    # stops the server at once (the worker went on serving, its SIGTERM lost, in 4 of 13 tries).
    from shardline.core.grpc_server import start_grpc_server

    async def run() -> list[str]:
        server = await start_grpc_server([], 0, "127.0.0.1")
        caught = asyncio.Event()
        caught.set()
        stopped: list[str] = []

        async def on_stop() -> None:
            stopped.append("on_stop")

        await asyncio.wait_for(server.wait_for_signal(on_stop=on_stop, grace_s=0, stop=caught), timeout=10)
        return stopped

    assert asyncio.run(run()) == ["on_stop"]

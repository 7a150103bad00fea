"""W3C trace-context propagation over gRPC metadata and HTTP headers.

Client interceptors put the caller's current span context into each rpc's
metadata as ``traceparent``; the server interceptor reads it back and runs the
handler inside a SERVER span that is its child. Long-lived streams carry one
context for the whole stream, so per-request context inside a stream travels
in the messages: put ``inject_metadata()`` in a message field on one side and
pass it to ``extract_context()`` on the other.
"""

import asyncio
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

# Always W3C, whatever OTEL_PROPAGATORS says, so every Shardline service agrees.
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_KEYS = frozenset(("traceparent", "tracestate"))

# gRPC metadata pairs, or a mapping such as HTTP headers.
TraceCarrier = Iterable[tuple[str, str | bytes]] | Mapping[str, str]
SpanOpener = Callable[[], trace.Span]  # starts an rpc's span (not current yet)


def inject_metadata(context: Context | None = None) -> list[tuple[str, str]]:
    """The ``traceparent``/``tracestate`` pairs for ``context`` (default: the current one).

    Empty when there is no valid span in the context.
    """
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return list(carrier.items())


def extract_context(metadata: TraceCarrier | None) -> Context:
    """The context carried by gRPC metadata, HTTP headers or a plain dict.

    Keys match case-insensitively. Without a valid ``traceparent`` the result
    is an empty context, so a span started in it is a new root rather than a
    child of whatever happened to be current.
    """
    carrier: dict[str, str] = {}
    if metadata:
        pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
        for key, value in pairs:
            key = key.lower()
            if key in _TRACE_KEYS and isinstance(value, str):
                carrier[key] = value
    return _PROPAGATOR.extract(carrier)


def start_http_server_span(
    tracer: trace.Tracer,
    name: str,
    headers: Mapping[str, str],
    attributes: Attributes = None,
    record_exception: bool = True,
) -> AbstractContextManager[trace.Span]:
    """Context manager for a SERVER span that honours an incoming HTTP ``traceparent``.

    Use it around an HTTP handler, e.g. ``with start_http_server_span(tracer,
    "POST /v1/completions", request.headers): ...``. ``record_exception=False`` leaves the
    exception's traceback event to the caller (it still marks the span failed).
    """
    return tracer.start_as_current_span(
        name,
        context=extract_context(headers),
        kind=trace.SpanKind.SERVER,
        attributes=attributes,
        record_exception=record_exception,
    )


def _with_trace(metadata: Iterable[tuple[str, str | bytes]] | None) -> list[tuple[str, str | bytes]] | None:
    """Metadata with the current context's trace headers replacing any it had."""
    extra = inject_metadata()
    if not extra:
        return None
    return [(key, value) for key, value in (metadata or ()) if key not in _TRACE_KEYS] + extra


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: list[tuple[str, str | bytes]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _SyncCallDetails(_CallDetails, grpc.ClientCallDetails):
    """grpc wants a ClientCallDetails; a NamedTuple cannot mix in other bases directly."""


def _sync_details(details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
    metadata = _with_trace(details.metadata)
    if metadata is None:
        return details
    return _SyncCallDetails(
        details.method,
        details.timeout,
        metadata,
        details.credentials,
        getattr(details, "wait_for_ready", None),
        getattr(details, "compression", None),
    )


class TracingClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Sync-channel interceptor: sends the caller's trace context with every rpc.

    Use as ``grpc.intercept_channel(channel, TracingClientInterceptor())``.
    It starts no span of its own; the server's span is the rpc's record.
    """

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(_sync_details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(_sync_details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(_sync_details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(_sync_details(client_call_details), request_iterator)


def _aio_details(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    metadata = _with_trace(details.metadata)
    if metadata is None:
        return details
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, grpc.aio.Metadata(*metadata), details.credentials, details.wait_for_ready
    )


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_aio_details(client_call_details), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_aio_details(client_call_details), request_iterator)


def aio_client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """grpc.aio interceptors that send the caller's trace context with every rpc.

    Use as ``grpc.aio.insecure_channel(target, interceptors=aio_client_interceptors())``.
    grpc.aio files each interceptor under one rpc kind only, hence four objects.
    """
    return [_AioUnaryUnary(), _AioUnaryStream(), _AioStreamUnary(), _AioStreamStream()]


_HANDLER_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """grpc.aio server interceptor: one SERVER span per rpc, child of the caller's context.

    The span is named ``package.Service/Method`` and carries the ``rpc.*``
    attributes and ``rpc.grpc.status_code``; for streaming responses it lasts
    until the stream ends. A sync handler's ``set_code()`` is invisible here
    (grpc.aio gives it a context without ``code()``), so its span records only
    exceptions.
    """

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        attr_name, factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
        method = handler_call_details.method
        service, _, rpc = method.lstrip("/").partition("/")
        metadata = handler_call_details.invocation_metadata

        def open_span() -> trace.Span:
            return self._tracer.start_span(
                f"{service}/{rpc}",
                context=extract_context(metadata),
                kind=trace.SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc},
            )

        return factory(
            _traced(getattr(handler, attr_name), open_span),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


# Ends of an rpc that gRPC reports as CANCELLED rather than UNKNOWN.
_CANCELLED = (asyncio.CancelledError, GeneratorExit)


@contextmanager
def _rpc_span(span: trace.Span, context: grpc.ServicerContext, current: bool = True) -> Iterator[None]:
    """Ends the rpc's span with the rpc's status code; with `current`, the span is current meanwhile.

    Handlers often fail an rpc with ``context.set_code()`` and a normal
    return, so the code is read from the context, not only from exceptions.
    """
    try:
        # The status comes from the rpc's code and details below, which say more than the exception.
        with trace.use_span(span, record_exception=False, set_status_on_exception=False) if current else nullcontext():
            yield
    except BaseException as exc:
        span.record_exception(exc)
        fallback = grpc.StatusCode.CANCELLED if isinstance(exc, _CANCELLED) else grpc.StatusCode.UNKNOWN
        _record_status(span, _code(context) or fallback, context, f"{type(exc).__name__}: {exc}")
        raise
    else:
        _record_status(span, _code(context) or grpc.StatusCode.OK, context)
    finally:
        span.end()


def _code(context: grpc.ServicerContext) -> grpc.StatusCode | None:
    # The context grpc.aio gives sync handlers has no code(); tracing must not fail their rpc.
    code = getattr(context, "code", None)
    return code() if code else None


def _record_status(
    span: trace.Span, code: grpc.StatusCode, context: grpc.ServicerContext, fallback_message: str = ""
) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        details = getattr(context, "details", lambda: None)()
        if isinstance(details, bytes):
            details = details.decode(errors="replace")
        span.set_status(trace.StatusCode.ERROR, details or fallback_message or code.name)


def _traced(behavior: Callable, open_span: SpanOpener) -> Callable:
    """``behavior`` run inside its rpc span, kept of the same kind (grpc dispatches on it)."""
    if inspect.isasyncgenfunction(behavior):

        async def traced_async_gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
            # The span is current only while the handler runs, never across a yield: grpc abandons a
            # stream at a yield when its client leaves mid-write, and the event loop then closes the
            # generator from another context, where a context attached here could not be detached.
            span = open_span()
            responses = behavior(request, context)
            with _rpc_span(span, context, current=False):
                try:
                    while True:
                        with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                            try:
                                response = await anext(responses)
                            except StopAsyncIteration:
                                break
                        yield response
                finally:
                    await responses.aclose()

        return traced_async_gen
    if inspect.iscoroutinefunction(behavior):

        async def traced_coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with _rpc_span(open_span(), context):
                return await behavior(request, context)

        return traced_coroutine
    if inspect.isgeneratorfunction(behavior):

        def traced_gen(request: Any, context: grpc.ServicerContext) -> Any:
            with _rpc_span(open_span(), context):
                yield from behavior(request, context)

        return traced_gen

    def traced_sync(request: Any, context: grpc.ServicerContext) -> Any:
        with _rpc_span(open_span(), context):
            return behavior(request, context)

    return traced_sync

"""API keys: `Authorization: Bearer <key>` on HTTP, `authorization` metadata on gRPC; from
SHARDLINE_API_KEYS, and from the tenants file (gateway/tenancy/tenants.py) when there is one."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable

import grpc
from aiohttp import web

from gateway.tenancy.tenants import OWNER_CHARS, TenantDirectory, key_digest
from shardline.core.errors import Unauthenticated

# Paths that answer without a key: load balancers and Prometheus do not carry one.
OPEN_PATHS = frozenset(("/health", "/metrics"))


class ApiKeys:
    """The accepted keys: SHARDLINE_API_KEYS' and the tenants file's; none turns authentication off."""

    def __init__(self, keys: Iterable[str], tenants: TenantDirectory | None = None) -> None:
        self._keys = [key.encode() for key in keys]
        self._tenants = tenants

    @property
    def enabled(self) -> bool:
        return bool(self._keys) or self._tenants is not None

    def check(self, authorization: str | None) -> None:
        """Raise Unauthenticated unless `authorization` is "Bearer <an accepted key>"."""
        if not self.enabled:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
        key = key.strip()
        # The file holds digests: a lookup by the key's digest tells nothing of a near miss.
        if self._tenants is not None and self._tenants.knows(key_digest(key)):
            return
        # Compare against every key in constant time, so timing tells nothing about a near miss.
        if not any([hmac.compare_digest(key.encode(), known) for known in self._keys]):
            raise Unauthenticated("invalid API key")

    def owner(self, authorization: str | None) -> str:
        """Who a request belongs to: a digest of the caller's key (never the key itself, which then
        never reaches Redis), or "" when keys are off and every caller may act on every request.
        Call after check()."""
        if not self.enabled:
            return ""
        key = (authorization or "").partition(" ")[2].strip()
        # The same digest as the tenants file's, cut short: the owner also finds the key's tenant.
        return key_digest(key)[:OWNER_CHARS]

    def grpc_owner(self, context: grpc.aio.ServicerContext) -> str:
        """owner() of a gRPC call's `authorization` metadata."""
        return self.owner(dict(context.invocation_metadata() or ()).get("authorization"))


def http_auth_middleware(keys: ApiKeys) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def authenticate(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.path not in OPEN_PATHS:
            keys.check(request.headers.get("Authorization"))
        return await handler(request)

    return authenticate


class GrpcAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to `service` (not health or reflection) without a valid `authorization` metadata."""

    def __init__(self, keys: ApiKeys, service: str) -> None:
        self._keys = keys
        self._prefix = f"/{service}/"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self._keys.enabled or not handler_call_details.method.startswith(self._prefix):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        try:
            self._keys.check(metadata.get("authorization"))
        except Unauthenticated as exc:
            return _refusal(handler, str(exc))
        return handler


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as grpc expects of a streaming handler

    # The request is never parsed: a caller without a key learns nothing from a parse error.
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, _unread, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, _unread, handler.response_serializer)


def _unread(raw: bytes) -> None:
    return None

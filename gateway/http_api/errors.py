"""What a failed HTTP request becomes: an OpenAI-style JSON error with the matching status, and one
log line when it is the client's mistake that aiohttp answered itself."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.http_api.request_body import BodyTimeout, BodyUnreadable
from gateway.tenancy.tenant_limiter import RateLimited
from shardline.core.errors import ShardlineError

logger = logging.getLogger(__name__)

# Seconds a client should wait before retrying a full queue (429) or a missing dependency (503).
RETRY_AFTER_S = 1

# HTTP status -> OpenAI error `type` and default `code`.
_ERROR_KINDS = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("timeout_error", "request_timeout"),
    409: ("invalid_request_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("service_unavailable_error", "service_unavailable"),
    504: ("timeout_error", "timeout"),
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None
) -> dict[str, Any]:
    """`{"error": {...}}` as the OpenAI API sends it; `code` and `kind` (its type) override the status's own."""
    default_kind, default_code = _ERROR_KINDS.get(status, ("server_error", "internal_error"))
    kind = kind or default_kind
    code = code or default_code
    if status == 404 and param == "model":
        code = "model_not_found"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    kind: str | None = None,
) -> web.Response:
    headers = dict(headers or {})
    if status in (429, 503):
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))  # a tenant's limit gives its own
    return web.json_response(error_body(status, message, param, code, kind), status=status, headers=headers)


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every failure as an OpenAI-style JSON error with the matching status."""
    try:
        return await handler(request)
    except ShardlineError as exc:
        response = error_response(
            exc.http_status,
            str(exc),
            getattr(exc, "field", None),
            getattr(exc, "openai_code", None),
            exc.headers if isinstance(exc, RateLimited) else None,
            exc.openai_type if isinstance(exc, RateLimited) else None,
        )
        if isinstance(exc, (BodyTimeout, BodyUnreadable)):
            # The rest of the body may still come, or cannot be read: this connection can serve no other.
            response.force_close()
        return response
    except web.HTTPException as exc:  # unknown route, wrong method, body over client_max_size (413)
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # a 405's methods
        return error_response(exc.status, exc.text or exc.reason, headers=allow)
    except ConnectionResetError:
        raise  # the client left mid-stream; nothing can be sent
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal server error")


class ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger, where a request that is not valid HTTP (a broken request line or
    header, a Content-Encoding with no decoder) is one line at WARNING: aiohttp answers it 400, and
    logs it at ERROR with a traceback, as if the server had failed. Every other record is aiohttp's."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"))

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError) and exc_info.code == 400:
            reason = " ".join(str(exc_info.message).split())  # the parser's own is several lines
            where = str(msg) % args if args else str(msg)
            self.warning("%s: 400, %s: %s", where, type(exc_info).__name__, reason)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)

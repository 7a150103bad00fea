"""Errors every service maps to the same gRPC and HTTP codes.

A handler raises one of these; the server interceptor turns it into a status
code, and the gateway's HTTP layer into the matching HTTP status.
"""

from __future__ import annotations

import grpc


class ShardlineError(Exception):
    """Base class: `code` is the gRPC status, `http_status` the HTTP one."""

    code = grpc.StatusCode.INTERNAL
    http_status = 500


class InvalidArgument(ShardlineError):
    """A request field is missing or out of range; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class FailedPrecondition(ShardlineError):
    """A valid request that the state it acts on does not allow now (a request already streaming
    from this gateway); the message names the field."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class RequestIdTaken(InvalidArgument):
    """The id is taken by another request. INVALID_ARGUMENT / 400 naming the field, as any bad id is; a
    separate class so that a resend of an idempotent request can attach to the one it names instead."""


class Unauthenticated(ShardlineError):
    code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class NotFound(ShardlineError):
    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class ResourceExhausted(ShardlineError):
    """The bounded queue is full: back off and retry."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class DeadlineExceeded(ShardlineError):
    """The request ran out of its time budget (the gateway's request timeout, or the client's own)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class Unavailable(ShardlineError):
    """A dependency (worker, scheduler, tokenizer) cannot be reached right now."""

    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


# Starts the error of a delta that ends a request's stream but not the request: its output up to the
# delta's offset is recorded, and the request runs on (or waits to), so the client gets UNAVAILABLE
# and resumes at that offset instead of an answer cut short.
STREAM_INTERRUPTED = "stream interrupted"

# Starts the error of a request refused because its TTFT target could no longer be met while it
# waited (it asked to be refused rather than served late): gateways answer 503, the reason given.
SLO_UNMET = "ttft target unmet"

# Starts the error of a request failed, or refused at Submit, because no live worker has served its
# model for the scheduler's no_worker_timeout_s: gateways answer 503 with Retry-After, the reason given.
NO_WORKER = "no live worker serves the model"

"""The one rule for request, gateway and worker ids, checked wherever an id enters the system."""

from __future__ import annotations

import re

from shardline.core.errors import InvalidArgument

MAX_ID_LENGTH = 256
# An id a client names its request with (gRPC's request_id, HTTP's X-Request-Id): shorter, so that
# the ids derived from it (a choice's `-<n>` of a request with n > 1) stay within MAX_ID_LENGTH.
MAX_NAMED_ID_LENGTH = 128
# Printable ASCII without spaces or colons: safe inside logs and URLs, and inside Redis keys, whose
# parts are joined by colons (an id `X:tokens` would otherwise name request X's token list).
_ID_PATTERN = re.compile(r"[!-9;-~]+")


def require_id(value: str, field: str, max_length: int = MAX_ID_LENGTH) -> str:
    """`value` if it is 1 to `max_length` printable ASCII characters other than space and `:`; else
    INVALID_ARGUMENT."""
    if not (0 < len(value) <= max_length and _ID_PATTERN.fullmatch(value)):
        # Only the start of a long value: the whole would be echoed into gRPC's error trailer, whose
        # size clients cap (16 KB), and the caller would get RESOURCE_EXHAUSTED instead of this.
        shown = repr(value) if len(value) <= max_length else f"{value[:32]!r}... ({len(value)} characters)"
        raise InvalidArgument(
            field, f"must be 1 to {max_length} printable ASCII characters, with no space and no ':', got {shown}"
        )
    return value


def require_named_id(value: str, field: str) -> str:
    """A client's own request id: require_id, at most MAX_NAMED_ID_LENGTH characters."""
    return require_id(value, field, MAX_NAMED_ID_LENGTH)

"""The one rule for request, gateway and worker ids, checked wherever an id enters the system."""

from __future__ import annotations

import re

from shardline.errors import InvalidArgument

MAX_ID_LENGTH = 256
# Printable ASCII without spaces: safe inside Redis keys, logs and URLs.
_ID_PATTERN = re.compile(r"[!-~]+")


def require_id(value: str, field: str, max_length: int = MAX_ID_LENGTH) -> str:
    """`value` if it is 1 to `max_length` printable ASCII characters without spaces; else INVALID_ARGUMENT."""
    if not (0 < len(value) <= max_length and _ID_PATTERN.fullmatch(value)):
        raise InvalidArgument(field, f"must be 1 to {max_length} printable ASCII characters without spaces, "
                                     f"got {value!r}")
    return value

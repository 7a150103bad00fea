"""A request's JSON body, read within its limits: size (413), arrival (408), framing, JSON, lone surrogates."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from shardline.core.errors import InvalidArgument, ShardlineError

# Seconds a request body may take to arrive in full: a client trickling its bytes would otherwise
# hold a connection and a handler for as long as it liked (aiohttp sets no limit of its own).
BODY_TIMEOUT_S = 30.0


class BodyTimeout(ShardlineError):
    """The request body did not arrive within BODY_TIMEOUT_S: 408, and the connection is closed."""

    http_status = 408


class BodyUnreadable(InvalidArgument):
    """The body does not decode under its Content-Encoding, or its chunked framing is broken: 400, and
    the connection is closed, since where the next request would start in it is unknown."""


# A JSON escape of a UTF-16 surrogate (valid in pairs, which json.loads joins into one character).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# A surrogate written out in UTF-8 (ED A0..BF), which is no valid UTF-8 and yet json.loads decodes
# (it reads bytes with "surrogatepass"), as it decodes one in a UTF-16 or UTF-32 body.
_ENCODED_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


async def json_body(request: web.Request) -> Any:
    try:  # over client_max_size this raises HTTPRequestEntityTooLarge: a 413
        raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    except web.HTTPException:
        raise  # a body over client_max_size: aiohttp's own 413
    except (web.RequestPayloadError, HttpProcessingError) as exc:
        # A Content-Encoding the body does not decode under (a gzip header on plain text), or a
        # broken chunked transfer: the client's mistake, not a server fault. The body is over as far
        # as this request goes: aiohttp would otherwise drain it after the answer, meet the same
        # error, and log it as its own unhandled exception.
        request.content.feed_eof()
        raise BodyUnreadable("body", f"could not be read ({exc.__class__.__name__}: {exc})") from exc
    try:
        body = json.loads(raw)
        if _may_hold_surrogates(raw):
            _refuse_lone_surrogates(body, "")
        return body
    except ValueError as exc:
        raise InvalidArgument("body", f"is not valid JSON ({exc})") from exc
    except RecursionError as exc:  # nesting deeper than the parser's stack: refused, not a 500
        raise InvalidArgument("body", "is nested too deeply") from exc


def _may_hold_surrogates(raw: bytes) -> bool:
    """Whether the parsed body may hold a lone surrogate: escaped, written out, or in a body that
    is not UTF-8 at all (json.loads reads UTF-16 and UTF-32 too; such a body starts with a 0 byte
    in its first four)."""
    return bool(_SURROGATE_ESCAPE.search(raw) or _ENCODED_SURROGATE.search(raw) or b"\x00" in raw[:4])


def _refuse_lone_surrogates(value: Any, path: str) -> None:
    """JSON can spell a lone surrogate ("\\ud800"), which is no Unicode text: refuse it, naming the field."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise InvalidArgument(path or "body", "contains a lone UTF-16 surrogate, which is not text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_lone_surrogates(key, path or "body")
            _refuse_lone_surrogates(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_lone_surrogates(item, f"{path}[{i}]")

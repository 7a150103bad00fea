"""What every service's `main` shares: a bad setting or a failed start is one line, not a traceback.

A person starting a service by hand, or reading compose's or `shardline up`'s output,
needs the setting or resource that is wrong (a port taken, an unreachable Redis, a
value out of range), not a stack trace through asyncio.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError
from redis.exceptions import RedisError

from shardline.core.errors import Unavailable

# Failures to start that the message alone explains: a bad value, a taken port or a missing file,
# Redis unreachable or refusing the password, a dependency unavailable (the request store's own
# word for an unreachable Redis).
STARTUP_ERRORS: tuple[type[Exception], ...] = (ValueError, OSError, RedisError, Unavailable)

_started = False


def started() -> None:
    """A service calls this once it serves: a failure after it is no failed start, and keeps its traceback."""
    global _started
    _started = True


def run_service(name: str, run: Callable[[], object], startup_errors: tuple[type[Exception], ...] = ()) -> int:
    """The exit status of `run()`, which parses the settings and serves: its own status (0 when it
    returns none), 2 for bad settings, 1 for a failed start (either logged as one line), or 1 for
    one of these errors after `started()` (logged with its traceback)."""
    log = logging.getLogger(f"shardline.{name}")
    try:
        status = run()
    except ValidationError as exc:
        log.error("%s: bad settings: %s", name, settings_problems(exc))
        return 2
    except STARTUP_ERRORS + startup_errors as exc:
        if _started:
            log.exception("%s failed", name)
        else:
            log.error("%s cannot start: %s", name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return 1
    return status if isinstance(status, int) else 0


def settings_problems(exc: ValidationError) -> str:
    """One line naming each bad setting, as its SHARDLINE_* variable, with what was wrong."""
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        problems.append(
            f"SHARDLINE_{field.upper()} (--{field.replace('_', '-')}) {message[:1].lower()}{message[1:]}, "
            f"got {error.get('input')!r}"
        )
    return "; ".join(problems)


def redacted(url: str) -> str:
    """`url` with any password replaced by ***, for logs and banners."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = f":{parts.port}" if parts.port else ""
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))

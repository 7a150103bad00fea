"""Async tests without an async pytest plugin."""

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any


def run_async(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Runs an async test in a fresh event loop (keeps the suite free of async plugins)."""

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return wrapper

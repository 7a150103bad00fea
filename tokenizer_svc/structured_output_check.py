"""CheckStructuredOutput's verdicts: each distinct constraint is compiled once, off the event loop.

A client may send the same schema with every request, or ask for n choices of one request (each
is checked): the verdicts of the last CACHE_SIZE constraints are kept (by digest: a constraint can
be megabytes), and concurrent checks of one constraint share a single compile. Compiles run in a
few threads of their own, so that a large schema (seconds) never takes the threads that Tokenize
and Detokenize run in, nor holds up every other constraint.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from shardline.proto import sampling_pb2
from shardline.structured_output import StructuredOutputSpec

CACHE_SIZE = 256
CHECK_THREADS = 4

log = logging.getLogger(__name__)


class StructuredOutputChecker:
    def __init__(self) -> None:
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future[str]] = {}
        self._executor = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="structured-output-check")

    async def error(self, constraint: sampling_pb2.StructuredOutput) -> str:
        """Why the constraint does not compile, for the field the client gave it in; "" when it does."""
        key = hashlib.sha256(constraint.SerializeToString(deterministic=True)).digest()
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self._verdicts.move_to_end(key)
            return verdict
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(self._check(key, constraint))
        # Shielded: a caller that goes away does not cancel the check the others wait on.
        return await asyncio.shield(pending)

    async def _check(self, key: bytes, constraint: sampling_pb2.StructuredOutput) -> str:
        try:
            verdict, lasting = await asyncio.get_running_loop().run_in_executor(self._executor, _error, constraint)
        finally:
            del self._pending[key]
        if lasting:
            self._verdicts[key] = verdict
            if len(self._verdicts) > CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return verdict


def _error(constraint: sampling_pb2.StructuredOutput) -> tuple[str, bool]:
    """(the verdict, whether it lasts): a failure of the engine itself (memory...) is not kept."""
    try:
        StructuredOutputSpec.from_proto(constraint).grammar()
    except ValueError as exc:
        return str(exc).removeprefix("structured_output: "), True
    except Exception as exc:  # the grammar engine's own failure: the client hears of it, the service goes on
        log.exception("checking a structured output constraint failed")
        return f"the grammar engine failed on it ({exc})", False
    return "", True

"""One batch line sent to the gateway as the online request it is, until it has an answer to keep.

The line is named `<batch id>-<line>` (X-Request-Id), which makes it idempotent at the gateway: sent
again after a lost answer (a gateway restart, this worker killed and its chunk redelivered), it
attaches to the request already submitted instead of running it again. 429s and 503s, and a gateway
that cannot be reached, are waited out; any other answer is the line's result, kept as it came.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from opentelemetry import propagate

from batch_svc.aimd import AimdLimit
from shardline.core.batch.input_lines import BatchLine

logger = logging.getLogger(__name__)

# Answers that mean "not now": the line is sent again after a pause.
_RETRY_STATUSES = frozenset({408, 409, 429, 502, 503})
_FIRST_PAUSE_S, _MOST_PAUSE_S = 0.25, 5.0


@dataclass(slots=True)
class LineResult:
    """What a line came to: the gateway's answer, or an error when there was none to keep."""

    status: int | None  # HTTP status; None when no answer came
    body: dict | None
    request_id: str
    error: str = ""


class Stopped(Exception):
    """The batch was cancelled or ran out of its window while the line waited."""


class LineClient:
    """Sends lines to the gateway over one HTTP session."""

    def __init__(self, gateway_url: str, api_key: str, priority: int, session: aiohttp.ClientSession) -> None:
        self._url = gateway_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._priority = priority
        self._session = session

    async def send(
        self, line: BatchLine, endpoint: str, request_id: str, limit: AimdLimit, stopping: Callable[[], bool]
    ) -> LineResult:
        body = dict(line.body)
        # Batch requests queue behind interactive ones; a line may ask for lower still, never higher.
        body["priority"] = max(self._priority, body.get("priority") or 0)
        headers = {**self._headers, "X-Request-Id": request_id, "Content-Type": "application/json"}
        propagate.inject(headers)  # the gateway's request span is a child of this line's
        payload = json.dumps(body).encode()
        pause = _FIRST_PAUSE_S
        while True:
            if stopping():
                raise Stopped
            async with limit:
                try:
                    async with self._session.post(self._url + endpoint, data=payload, headers=headers) as response:
                        answer = await response.read()
                        status = response.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    logger.warning("%s: gateway unreachable (%s); sending it again", request_id, exc)
                    status, answer = None, b""
            if status is not None and status not in _RETRY_STATUSES:
                limit.succeeded()
                return LineResult(status, _json(answer), request_id)
            if status in (429, 503):
                limit.pushed_back()
            await asyncio.sleep(pause)
            pause = min(pause * 2, _MOST_PAUSE_S)


def _json(answer: bytes) -> dict | None:
    try:
        body = json.loads(answer)
    except ValueError:
        return {"error": {"message": answer.decode(errors="replace")[:1000], "type": "server_error"}}
    return body if isinstance(body, dict) else {"value": body}

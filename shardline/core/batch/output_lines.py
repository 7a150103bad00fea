"""A batch's output and error lines, in OpenAI's format."""

from __future__ import annotations

import json


def output_line(batch_id: str, index: int, custom_id: str, status: int, request_id: str, body: dict | None) -> str:
    """A line the endpoint answered: its status and body, exactly as the online request got them."""
    return _line(batch_id, index, custom_id, {"status_code": status, "request_id": request_id, "body": body}, None)


def error_line(batch_id: str, index: int, custom_id: str, code: str, message: str) -> str:
    """A line with no answer from the endpoint."""
    return _line(batch_id, index, custom_id, None, {"code": code, "message": message})


def _line(batch_id: str, index: int, custom_id: str, response: dict | None, error: dict | None) -> str:
    line_id = f"batch_req_{batch_id.removeprefix('batch_')}_{index}"
    return json.dumps({"id": line_id, "custom_id": custom_id, "response": response, "error": error})

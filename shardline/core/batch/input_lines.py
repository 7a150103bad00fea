"""A batch's input file, checked line by line before anything runs, as OpenAI does at create time.

A line is `{"custom_id", "method": "POST", "url", "body"}`. One bad line fails the whole batch, with
an error naming the line (1-based, as editors count) and the field; the body is checked by the same
parser the online endpoint uses, given as `check_body`, so a body the endpoint would refuse is refused
here with the endpoint's own message.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from shardline.core.errors import InvalidArgument

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
# OpenAI's limits on a batch's input file.
MAX_LINES = 50_000
MAX_FILE_BYTES = 200 * 1000 * 1000
MAX_CUSTOM_ID_LENGTH = 512
# A batch that fails its checks reports at most this many of its bad lines.
MAX_REPORTED_ERRORS = 100
_LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(slots=True)
class LineError:
    """One bad line, as OpenAI's batch `errors.data[]` entry."""

    line: int  # 1-based
    param: str  # the field at fault
    message: str
    code: str = "invalid_request"

    def to_openai(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(slots=True)
class BatchLine:
    """A checked input line."""

    index: int  # 0-based
    custom_id: str
    body: dict


@dataclass(slots=True)
class LineChunk:
    """A run of consecutive lines, the unit a batch worker takes: bytes [start, end) of the file."""

    first_line: int
    lines: int
    start: int
    end: int


@dataclass(slots=True)
class CheckedInput:
    lines: int
    chunks: list[LineChunk]
    errors: list[LineError]


def check_input(
    source: BinaryIO, endpoint: str, check_body: Callable[[dict], object], chunk_lines: int
) -> CheckedInput:
    """Every line of `source` checked; the chunks of `chunk_lines` lines it splits into."""
    errors: list[LineError] = []
    seen: set[str] = set()
    chunks: list[LineChunk] = []
    offset = index = 0
    for raw in source:
        start, offset = offset, offset + len(raw)
        if not raw.strip():
            continue  # a blank line (the newline at the end of the file) is no request
        if index >= MAX_LINES:
            errors.append(LineError(index + 1, "input_file_id", f"a batch has at most {MAX_LINES} requests"))
            break
        try:
            line = parse_line(raw, index, endpoint, check_body)
            if line.custom_id in seen:
                raise InvalidArgument("custom_id", f"{line.custom_id!r} is used by an earlier line")
            seen.add(line.custom_id)
        except InvalidArgument as exc:
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(LineError(index + 1, exc.field, str(exc)))
        if index % chunk_lines == 0:
            chunks.append(LineChunk(index, 0, start, start))
        chunks[-1].lines += 1
        chunks[-1].end = offset
        index += 1
    if index == 0 and not errors:
        errors.append(LineError(0, "input_file_id", "the file has no requests"))
    return CheckedInput(index, chunks, errors)


def parse_line(raw: bytes, index: int, endpoint: str, check_body: Callable[[dict], object] | None = None) -> BatchLine:
    """One line as a BatchLine; InvalidArgument naming the field when it is not one."""
    try:
        line = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument("line", f"is not valid JSON: {exc}") from None
    if not isinstance(line, dict):
        raise InvalidArgument("line", "must be a JSON object")
    if unknown := sorted(set(line) - _LINE_KEYS):
        raise InvalidArgument(unknown[0], f"unknown field; a line has {sorted(_LINE_KEYS)}")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_LENGTH:
        raise InvalidArgument("custom_id", f"must be a string of 1 to {MAX_CUSTOM_ID_LENGTH} characters")
    if line.get("method") != "POST":
        raise InvalidArgument("method", f"must be 'POST', got {line.get('method')!r}")
    if line.get("url") != endpoint:
        raise InvalidArgument("url", f"must be the batch's endpoint {endpoint!r}, got {line.get('url')!r}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    if body.get("stream"):
        raise InvalidArgument("body.stream", "a batch's requests cannot stream")
    if check_body is not None:
        try:
            check_body(body)
        except InvalidArgument as exc:
            raise InvalidArgument(f"body.{exc.field}", str(exc).removeprefix(f"{exc.field}: ")) from None
    return BatchLine(index, custom_id, body)


def read_chunk(source: BinaryIO, chunk: LineChunk, endpoint: str) -> list[BatchLine]:
    """The lines of a chunk, already checked at create time."""
    source.seek(chunk.start)
    data = source.read(chunk.end - chunk.start)
    rows = [raw for raw in data.split(b"\n") if raw.strip()]
    return [parse_line(raw, chunk.first_line + i, endpoint) for i, raw in enumerate(rows)]

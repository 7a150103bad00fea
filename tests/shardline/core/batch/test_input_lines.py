"""A batch's input is checked line by line at create time, naming the line and the field."""

from __future__ import annotations

import io
import json

import pytest

from shardline.core.batch.input_lines import MAX_REPORTED_ERRORS, check_input, parse_line, read_chunk
from shardline.core.errors import InvalidArgument

CHAT = "/v1/chat/completions"


def _line(custom_id: str, **overrides: object) -> bytes:
    line = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {"messages": []}, **overrides}
    return json.dumps(line).encode()


def _no_check(body: dict) -> None:
    pass


def test_good_lines_split_into_chunks_of_byte_ranges():
    raw = b"\n".join(_line(f"id-{i}") for i in range(7)) + b"\n\n"
    checked = check_input(io.BytesIO(raw), CHAT, _no_check, chunk_lines=3)
    assert checked.errors == [] and checked.lines == 7
    assert [(c.first_line, c.lines) for c in checked.chunks] == [(0, 3), (3, 3), (6, 1)]
    source = io.BytesIO(raw)
    read = [line for chunk in checked.chunks for line in read_chunk(source, chunk, CHAT)]
    assert [(line.index, line.custom_id) for line in read] == [(i, f"id-{i}") for i in range(7)]


def test_each_bad_line_is_named_with_its_field():
    def refuse_hot(body: dict) -> None:
        if body.get("temperature") == "hot":
            raise InvalidArgument("temperature", "must be a number")

    raw = b"\n".join(
        [
            _line("a"),
            b"[1, 2]",
            _line("b", method="GET"),
            _line("c", url="/v1/completions"),
            _line("d", body={"temperature": "hot"}),
            _line("a"),
            _line("e", extra=1),
            _line("", body={}),
            _line("f", body={"stream": True}),
        ]
    )
    checked = check_input(io.BytesIO(raw), CHAT, refuse_hot, chunk_lines=100)
    assert [(e.line, e.param) for e in checked.errors] == [
        (2, "line"),
        (3, "method"),
        (4, "url"),
        (5, "body.temperature"),
        (6, "custom_id"),
        (7, "extra"),
        (8, "custom_id"),
        (9, "body.stream"),
    ]
    assert checked.errors[3].message == "body.temperature: must be a number"


def test_an_empty_file_and_too_many_errors():
    assert [e.param for e in check_input(io.BytesIO(b"\n"), CHAT, _no_check, 10).errors] == ["input_file_id"]
    raw = b"\n".join(b"nope" for _ in range(MAX_REPORTED_ERRORS + 20))
    checked = check_input(io.BytesIO(raw), CHAT, _no_check, 10)
    assert len(checked.errors) == MAX_REPORTED_ERRORS and checked.lines == MAX_REPORTED_ERRORS + 20


def test_invalid_utf8_is_a_bad_line_not_a_crash():
    with pytest.raises(InvalidArgument, match="line: is not valid JSON"):
        parse_line(b'{"custom_id": "\xff"}', 0, CHAT)

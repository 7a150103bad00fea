"""Bad input over OpenAI HTTP: every bad parameter or body is a 400 (or 408, 413) naming its field, before any work."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import openai
import pytest

from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import MODEL, Script

COMPLETION = {"model": MODEL, "prompt": "Hello"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}

# (endpoint, fields merged into a valid body, the field the 400 must name)
BAD_BODIES = [
    # JSON can spell a lone UTF-16 surrogate, which no UTF-8 text holds: a 400, not a 500 from deep inside.
    ("completions", {"prompt": "\ud800"}, "prompt"),
    ("completions", {"prompt": ["ok", "a\udfffb"]}, "prompt[1]"),
    ("completions", {"stop": ["x", "\ud800"]}, "stop[1]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi \udc00"}]}, "messages[0].content"),
    ("completions", {"temperature": 2.5}, "temperature"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"top_k": 10**6}, "top_k"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": -5}, "max_tokens"),
    ("completions", {"max_tokens": 9000}, "max_tokens"),
    ("completions", {"max_tokens": 8190, "prompt": "one two three four five"}, "max_tokens"),
    ("completions", {"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ("completions", {"seed": "lucky"}, "seed"),
    ("completions", {"seed": 1 << 70}, "seed"),
    ("completions", {"stop": 5}, "stop"),
    ("completions", {"stop": [""]}, "stop"),
    ("completions", {"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("completions", {"stop_token_ids": [49152]}, "stop_token_ids"),
    ("completions", {"stop_token_ids": ["x"]}, "stop_token_ids"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"ignore_eos": "yes"}, "ignore_eos"),
    ("completions", {"priority": "high"}, "priority"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": 65}, "n"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"best_of": 3, "n": 2}, "best_of"),
    ("chat/completions", {"echo": True}, "echo"),
    ("completions", {"echo": "yes"}, "echo"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": "up"}}, "logit_bias"),
    ("completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"-5": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"49152": 1}}, "logit_bias"),
    ("completions", {"logit_bias": [5, 1]}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 10**400}}, "logit_bias"),  # no float holds it
    ("completions", {"logit_bias": {"1" * 5000: 1}}, "logit_bias"),  # past int()'s digit limit
    ("completions", {"temperature": 10**400}, "temperature"),
    ("chat/completions", {"logit_bias": {"5": -100.5}}, "logit_bias"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": ["a"] * 33, "n": 2}, "prompt"),
    ("completions", {"prompt": ["a", 5]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ["a", ""]}, "prompt[1]"),
    ("completions", {"prompt": [1, 49152]}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"n": 65}, "n"),
    ("chat/completions", {"tools": [{"type": "function"}]}, "tools[0]"),
    (
        "chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
        "tool_choice",
    ),
    ("chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat/completions", {"response_format": "json"}, "response_format"),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    (
        "chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
        "response_format.json_schema.schema",
    ),
    # Shapes are checked in the gateway; whether a constraint compiles, by the tokenizer service.
    (
        "chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
        "response_format.json_schema.schema",
    ),
    ("completions", {"guided_regex": "(ab"}, "guided_regex"),
    ("completions", {"guided_regex": 5}, "guided_regex"),
    ("completions", {"guided_choice": []}, "guided_choice"),
    ("completions", {"guided_json": "{oops"}, "guided_json"),
    ("completions", {"guided_grammar": "root ::= nope"}, "guided_grammar"),
    ("completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("chat/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("chat/completions", {"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs.grammar"),
    ("chat/completions", {"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ("chat/completions", {"structured_outputs": {"json": 0}}, "structured_outputs.json"),
    (
        "chat/completions",
        {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
        "structured_outputs.whitespace_pattern",
    ),
    ("chat/completions", {"structured_outputs": {"json": False, "regex": "a"}}, "structured_outputs"),
    (
        "chat/completions",
        {"structured_outputs": {"json": {}, "disable_any_whitespace": "yes"}},
        "structured_outputs.disable_any_whitespace",
    ),
    (
        "chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": "x"}},
        "response_format.json_schema",
    ),
    ("completions", {"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("completions", {"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    (
        "completions",
        {"guided_regex": "a", "guided_decoding_backend": "xgrammar:no-such-option"},
        "guided_decoding_backend",
    ),
    ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"max_completion_tokens": 8190, "max_tokens": 5}, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    # Unhashable: once a 500 (a dict lookup of a list).
    ("chat/completions", {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),
    # Over the default max_tokens (16 for completions): once a 500, from the worker.
    ("completions", {"min_tokens": 20}, "min_tokens"),
    ("completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
]


def test_every_bad_parameter_is_a_400_naming_its_field(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            for endpoint, fields, param in BAD_BODIES:
                base = CHAT if endpoint.startswith("chat") else COMPLETION
                async with http.post(f"{stack.base_url}/v1/{endpoint}", json={**base, **fields}) as response:
                    error = (await response.json())["error"]
                    assert (response.status, error["param"]) == (400, param), (fields, error)
                    assert error["type"] == "invalid_request_error" and error["message"].startswith(param)
            for raw in (b"{not json", b"[" * 100_000 + b"]" * 100_000):  # the second overflows the parser's stack
                async with http.post(f"{stack.base_url}/v1/completions", data=raw) as response:
                    assert response.status == 400 and (await response.json())["error"]["param"] == "body"
            # A body that does not decode under its Content-Encoding: once a 500.
            async with http.post(
                f"{stack.base_url}/v1/completions",
                data=b'{"prompt": "x"}',
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            ) as response:
                error = (await response.json())["error"]
                assert response.status == 400 and error["param"] == "body", error
        assert stack.scheduler.submitted == []
        with pytest.raises(openai.BadRequestError) as caught:
            await openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x").completions.create(
                model=MODEL, prompt="hi", temperature=3
            )
        assert caught.value.body["param"] == "temperature"

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_prompt_and_body_limits(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            long_prompt = {**COMPLETION, "prompt": "one two three four five six seven"}
            async with http.post(f"{stack.base_url}/v1/completions", json=long_prompt) as response:
                error = (await response.json())["error"]
                assert response.status == 400 and (error["param"], error["code"]) == (
                    "prompt",
                    "context_length_exceeded",
                )
            too_long = {**COMPLETION, "max_tokens": 8192, "prompt": "one two"}
            async with http.post(f"{stack.base_url}/v1/completions", json=too_long) as response:
                error = (await response.json())["error"]
                assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
            huge = {**COMPLETION, "prompt": "x" * 5000}
            async with http.post(f"{stack.base_url}/v1/completions", json=huge) as response:
                error = (await response.json())["error"]
                assert response.status == 413 and error["code"] == "request_too_large"

    run_on_stack(tokenizer_address, Script(text_ids), body, max_prompt_tokens=5, max_body_bytes=4096)


def test_a_surrogate_pair_is_a_character(tokenizer_address, text_ids) -> None:
    """JSON spells a character outside the BMP as two surrogates (lone ones are in BAD_BODIES)."""

    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.base_url}/v1/completions", json={**COMPLETION, "prompt": "\U0001f343"}) as r:
                assert r.status == 200

    run_on_stack(tokenizer_address, Script(text_ids[:3]), body)


def test_a_body_that_does_not_arrive_in_time_is_a_408(tokenizer_address, text_ids, monkeypatch) -> None:
    # A client that sends its headers and then trickles (or never sends) its body held a handler forever.
    monkeypatch.setattr("gateway.http_api.request_body.BODY_TIMEOUT_S", 0.3)

    async def body(stack: Stack) -> None:
        host, port = stack.base_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"Connection: close" in head  # the rest of that body may still come: no request can follow
        length = int(next(line for line in head.split(b"\r\n") if line.startswith(b"Content-Length:")).split()[1])
        assert json.loads(await reader.readexactly(length))["error"]["code"] == "request_timeout"
        writer.close()

    run_on_stack(tokenizer_address, Script(text_ids), body)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n",  # a header name with a space
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: two\r\n\r\n{}",
        # br without a brotli decoder installed: aiohttp refuses it as it parses the headers
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n{}",
    ],
    ids=["bad header", "bad length", "no decoder"],
)
def test_a_request_that_is_not_valid_http_is_a_400_logged_in_one_warning_line(
    tokenizer_address, text_ids, caplog, request_bytes
) -> None:
    # aiohttp answers these itself, and logged each at ERROR with a traceback, as a server fault.
    async def body(stack: Stack) -> None:
        host, port = stack.base_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request_bytes)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.split(b" ")[1] == b"400", head
        writer.close()

    with caplog.at_level(logging.WARNING, logger="aiohttp.server"):
        run_on_stack(tokenizer_address, Script(text_ids), body)
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert [r.levelno for r in records] == [logging.WARNING]
    assert records[0].exc_info is None and "\n" not in records[0].getMessage()
    assert "400" in records[0].getMessage()

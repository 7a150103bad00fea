"""Tool calling through the gateway, with the official openai client and the gRPC SDK: the real tokenizer service,
and a scripted scheduler that plays the tokens of a model's answer."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from shardline.client import AsyncShardlineClient, Completion, ToolCall
from shardline.core.text.chat_template import ChatTemplate
from shardline.core.text.tokenizer import Tokenizer
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.http_api.test_openai_http import client
from tests.gateway.scripted_scheduler import MODEL, Script
from tracing import attributes as attr

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
}
MESSAGES = [{"role": "user", "content": "Weather and time in Oslo?"}]


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode_batch([text], add_special_tokens=False)[0]


async def both_ways(stack: Stack, **kwargs) -> tuple[openai.types.chat.ChatCompletion, str | None, dict[int, dict]]:
    """The whole response, and the streamed one added up: (finish reason, calls by index)."""
    openai_client = client(stack)
    whole = await openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
    calls: dict[int, dict] = {}
    content, finish = "", None
    async for chunk in await openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, **kwargs
    ):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index not in calls and delta.type == "function"
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert content == (whole.choices[0].message.content or "")
    return whole, finish, calls


def same_calls(whole: openai.types.chat.ChatCompletion, streamed: dict[int, dict]) -> list[tuple[str, dict]]:
    calls = whole.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (streamed[i]["name"], streamed[i]["arguments"]) for i in range(len(streamed))
    ]
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_required_calls(tokenizer_address, tokenizer: Tokenizer) -> None:
    answer = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'

    async def body(stack: Stack) -> None:
        whole, finish, streamed = await both_ways(stack, tools=[WEATHER, TIME], tool_choice="required")
        assert whole.choices[0].finish_reason == finish == "tool_calls"
        assert whole.choices[0].message.content is None
        assert same_calls(whole, streamed) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
        constraint = stack.scheduler.submitted[0].params.structured_output
        assert {
            span.attributes.get(attr.TOOL_CHOICE)
            for span in stack.spans.get_finished_spans()
            if span.name == "gateway.request"
        } == {"required"}
        schema = json.loads(constraint.json_schema)
        assert schema["type"] == "array" and constraint.disable_any_whitespace
        assert [c["properties"]["name"]["enum"][0] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]

    run_on_stack(tokenizer_address, Script(ids(tokenizer, answer), tokens_per_step=3), body)


def test_named_call(tokenizer_address, tokenizer: Tokenizer) -> None:
    async def body(stack: Stack) -> None:
        whole, finish, streamed = await both_ways(
            stack, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
        )
        assert whole.choices[0].finish_reason == finish == "stop"
        assert same_calls(whole, streamed) == [("get_weather", {"city": "Oslo"})]
        constraint = stack.scheduler.submitted[0].params.structured_output
        assert json.loads(constraint.json_schema) == WEATHER["function"]["parameters"]

    run_on_stack(tokenizer_address, Script(ids(tokenizer, '{"city": "Oslo"}')), body)


@pytest.mark.parametrize(
    "parser, answer, content",
    [
        (
            "hermes",
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            "Checking.\n",
        ),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None),
    ],
)
def test_auto_reads_the_templates_calls(tokenizer_address, tokenizer: Tokenizer, parser, answer, content) -> None:
    async def body(stack: Stack) -> None:
        whole, finish, streamed = await both_ways(stack, tools=[WEATHER, TIME])
        assert whole.choices[0].finish_reason == finish == "tool_calls"
        assert whole.choices[0].message.content == content
        assert same_calls(whole, streamed) == [("get_weather", {"city": "Oslo"})]
        params = stack.scheduler.submitted[0].params
        assert not params.HasField("structured_output")
        # Hermes tags may be special tokens: their text must reach the parser (as vLLM's hermes parser keeps it).
        assert params.skip_special_tokens == (parser != "hermes")

    run_on_stack(tokenizer_address, Script(ids(tokenizer, answer), tokens_per_step=2), body, tool_call_parser=parser)


def test_auto_is_refused_for_a_template_without_tool_calls(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        with pytest.raises(openai.BadRequestError) as caught:
            await client(stack).chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])
        assert caught.value.body["param"] == "tool_choice"
        with pytest.raises(openai.BadRequestError) as caught:  # two constraints at once
            await client(stack).chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                tools=[WEATHER],
                tool_choice="required",
                response_format={"type": "json_object"},
            )
        assert caught.value.body["param"] == "response_format"
        # "none": the model answers in text, which nothing parses.
        reply = await client(stack).chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="none"
        )
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
        assert stack.scheduler.submitted  # only "none" got through

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_a_conversation_with_calls_and_results(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    sent = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 18 C"},
    ]

    async def body(stack: Stack) -> None:
        await client(stack).chat.completions.create(
            model=MODEL, messages=sent, tools=[WEATHER], tool_choice="none", max_tokens=2
        )
        # The default model's template writes contents only; its prompt is the turns' text.
        template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
        meant = MESSAGES + [{"role": "assistant", "content": ""}, {"role": "tool", "content": "Sunny, 18 C"}]
        expected = tokenizer.encode_batch([template.render(meant)], add_special_tokens=False)[0]
        assert list(stack.scheduler.submitted[0].prompt_token_ids) == expected
        with pytest.raises(openai.BadRequestError) as caught:
            bad = [*sent[:1], {**sent[1], "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]
            await client(stack).chat.completions.create(model=MODEL, messages=bad, max_tokens=2)
        assert caught.value.body["param"] == "messages[1].tool_calls[0].function.arguments"

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_tool_calls_over_grpc_with_the_sdk(tokenizer_address, tokenizer: Tokenizer) -> None:
    """The SDK's tools=: calls whole and streamed, replayed calls in messages, and bad tools named."""
    answer = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    history = MESSAGES + [
        {"role": "assistant", "tool_calls": [ToolCall("call_1", "get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]

    async def body(stack: Stack) -> None:
        async with AsyncShardlineClient(f"127.0.0.1:{stack.gateway.grpc.port}") as sdk:
            whole = await sdk.generate(messages=history, tools=[WEATHER, TIME], tool_choice="required")
            assert whole.finish_reason == "tool_calls" and whole.text == ""
            assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
                ("get_weather", {"city": "Oslo"}),
                ("get_time", {}),
            ]
            assert all(c.id.startswith("call_") for c in whole.tool_calls)
            chunks = [c async for c in sdk.stream(messages=history, tools=[WEATHER, TIME], tool_choice="required")]
            streamed = Completion.from_chunks(chunks)
            assert streamed.finish_reason == "tool_calls"
            assert [(c.name, c.arguments) for c in streamed.tool_calls] == [
                (c.name, c.arguments) for c in whole.tool_calls
            ]
            assert sum(len(c.tool_calls or ()) for c in chunks) > 2  # arguments arrived in pieces
            submitted = stack.scheduler.submitted[0]
            assert json.loads(submitted.params.structured_output.json_schema)["type"] == "array"
            named = await sdk.generate(messages=MESSAGES, tools=[WEATHER], tool_choice="get_weather")
            assert named.finish_reason == "stop" and named.tool_calls[0].name == "get_weather"
            as_openai = await sdk.generate(
                messages=MESSAGES,
                tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
            assert as_openai.tool_calls[0].name == "get_weather"
            # A Resume reads the calls again when it brings the tools (the SDK's retry of a taken id does).
            replay = Completion.from_chunks(
                [c async for c in sdk.resume(whole.request_id, 0, tools=[WEATHER, TIME], tool_choice="required")]
            )
            assert replay.finish_reason == "tool_calls"
            assert [(c.name, c.arguments) for c in replay.tool_calls] == [
                (c.name, c.arguments) for c in whole.tool_calls
            ]
            raw = Completion.from_chunks([c async for c in sdk.resume(whole.request_id, 0)])
            assert raw.tool_calls is None and json.loads(raw.text)[0]["name"] == "get_weather"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                _ = [c async for c in sdk.resume(whole.request_id, 2, tools=[WEATHER, TIME], tool_choice="required")]
            assert caught.value.details().startswith("offset:")
            for kwargs, field in (
                ({"tools": [WEATHER]}, "tools.choice"),  # "auto": this template writes none
                ({"tools": [WEATHER], "tool_choice": "get_time"}, "tools.function"),
                ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools.tools_json[0]"),
                ({"tools": [WEATHER], "tool_choice": "required", "regex": "x"}, "params.structured_output"),
                (
                    {
                        "tools": [{**WEATHER, "function": {**WEATHER["function"], "description": "\ud800"}}],
                        "tool_choice": "none",
                    },
                    "tools.tools_json",
                ),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await sdk.generate(messages=MESSAGES, **kwargs)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert caught.value.details().startswith(f"{field}:"), caught.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await sdk.generate("a plain prompt", tools=[WEATHER], tool_choice="required")
            assert caught.value.details().startswith("tools:")

    run_on_stack(tokenizer_address, Script(ids(tokenizer, answer), tokens_per_step=2), body)

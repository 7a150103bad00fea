"""The Tokenizer gRPC service, served for real on a free port with the default model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shardline.core.model_path import model_name
from shardline.core.text.chat_template import ChatTemplate
from shardline.core.text.detokenizer import PREFIX_WINDOW, next_prefix
from shardline.core.text.tokenizer import Tokenizer, TokenizerError
from shardline.proto import sampling_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.main import main, parse_settings
from tokenizer_svc.server import (
    SERVICE_NAME,
    build_service,
    max_context_length,
    read_chat_template,
    start_tokenizer_server,
)
from tokenizer_svc.service import TokenizerService

Stub = tokenizer_pb2_grpc.TokenizerStub


@pytest.fixture(scope="session")
def service(tokenizer: Tokenizer, model_path: Path) -> TokenizerService:
    return TokenizerService(tokenizer, model_name(model_path), max_context_length(tokenizer))


@asynccontextmanager
async def serving(service: TokenizerService) -> AsyncIterator[grpc.aio.Channel]:
    server = await start_tokenizer_server(service, 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop(0)


def with_stub(service: TokenizerService, body: Callable[[Stub], Coroutine[Any, Any, None]]) -> None:
    async def run() -> None:
        async with serving(service) as channel:
            await body(Stub(channel))

    asyncio.run(run())


async def expect_invalid(call: Coroutine[Any, Any, Any], field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field}:"), caught.value.details()


def test_tokenize_matches_the_core_in_one_batch(service, tokenizer, corpus) -> None:
    async def body(stub: Stub) -> None:
        default = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(texts=corpus))
        plain = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(texts=corpus, add_special_tokens=False))
        assert [list(t.ids) for t in default.token_ids] == tokenizer.encode_batch(corpus)
        assert [list(t.ids) for t in plain.token_ids] == tokenizer.encode_batch(corpus, add_special_tokens=False)
        assert list(default.token_ids[0].ids)[:2] == [19556, 28]  # "Hello", ","

    with_stub(service, body)


def test_detokenize_batched_final_gives_the_full_decode(service, tokenizer, corpus) -> None:
    ids = tokenizer.encode_batch(corpus, add_special_tokens=False)

    async def body(stub: Stub) -> None:
        items = [tokenizer_pb2.DetokenizeItem(new_token_ids=seq, final=True, skip_special_tokens=True) for seq in ids]
        response = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(items=items))
        assert [r.text for r in response.results] == [tokenizer.decode(seq) for seq in ids]
        assert [r.num_consumed for r in response.results] == [len(seq) for seq in ids]
        assert all(r.raw_bytes == b"" for r in response.results)  # only when asked for

    with_stub(service, body)


def test_detokenize_gives_raw_bytes_when_asked(service, tokenizer) -> None:
    # " \xf0\x9f\x98" is one token and "\x80" the next: alone, neither is text.
    ids = tokenizer.encode_batch(["a 😀"], add_special_tokens=False)[0]

    async def body(stub: Stub) -> None:
        items = [tokenizer_pb2.DetokenizeItem(new_token_ids=[t], final=True, raw_bytes=True) for t in ids]
        items.append(tokenizer_pb2.DetokenizeItem(new_token_ids=ids, final=True, raw_bytes=True))
        response = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(items=items))
        assert "\ufffd" in "".join(r.text for r in response.results[:-1])
        assert [r.raw_bytes for r in response.results[:-1]] == [tokenizer.token_bytes([t]) for t in ids]
        assert response.results[-1].raw_bytes == "a 😀".encode() and response.results[-1].text == "a 😀"

    with_stub(service, body)


def test_detokenize_incremental_streams_add_up(service, tokenizer, corpus) -> None:
    """Many requests stepped together, one token each per call, as the gateway does per engine step."""
    texts = [t for t in corpus if t]
    ids = tokenizer.encode_batch(texts, add_special_tokens=False)

    async def body(stub: Stub) -> None:
        prefixes: list[list[int]] = [[] for _ in ids]
        pending: list[list[int]] = [[] for _ in ids]
        out = [""] * len(ids)
        for step in range(max(map(len, ids))):
            live = [i for i, seq in enumerate(ids) if step < len(seq)]
            items = []
            for i in live:
                pending[i] = pending[i] + [ids[i][step]]
                final = step == len(ids[i]) - 1
                items.append(
                    tokenizer_pb2.DetokenizeItem(
                        prefix_token_ids=prefixes[i], new_token_ids=pending[i], final=final, skip_special_tokens=True
                    )
                )
            response = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(items=items))
            for i, result in zip(live, response.results):
                out[i] += result.text
                consumed = pending[i][: result.num_consumed]
                prefixes[i] = next_prefix(tokenizer, prefixes[i], consumed, True)
                pending[i] = pending[i][result.num_consumed :]
                assert "\ufffd" not in result.text
        assert out == [tokenizer.decode(seq) for seq in ids]

    with_stub(service, body)


def test_apply_chat_template_renders_and_tokenizes(service, tokenizer) -> None:
    messages = [("system", "Be brief."), ("user", "Hi there"), ("assistant", "Hello!"), ("user", "2+2?")]

    async def body(stub: Stub) -> None:
        request = tokenizer_pb2.ApplyChatTemplateRequest(
            messages=[sampling_pb2.ChatMessage(role=r, content=c) for r, c in messages], add_generation_prompt=True
        )
        response = await stub.ApplyChatTemplate(request)
        template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
        expected = template.render([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True)
        assert response.prompt == expected
        assert response.prompt.endswith("<|im_start|>assistant\n")
        assert list(response.prompt_token_ids) == tokenizer.encode_batch([expected], add_special_tokens=False)[0]

    with_stub(service, body)


def test_chat_template_errors_name_the_message(service) -> None:
    async def body(stub: Stub) -> None:
        await expect_invalid(stub.ApplyChatTemplate(tokenizer_pb2.ApplyChatTemplateRequest()), "messages")
        bad_role = [sampling_pb2.ChatMessage(role="user", content="hi"), sampling_pb2.ChatMessage(role="", content="x")]
        await expect_invalid(
            stub.ApplyChatTemplate(tokenizer_pb2.ApplyChatTemplateRequest(messages=bad_role)), "messages[1].role"
        )

    with_stub(service, body)


def test_model_without_chat_template_refuses_chat(spm_tokenizer: Tokenizer) -> None:
    no_template = TokenizerService(spm_tokenizer, "spm", 512)

    async def body(stub: Stub) -> None:
        info = await stub.GetInfo(tokenizer_pb2.GetTokenizerInfoRequest())
        assert not info.has_chat_template
        request = tokenizer_pb2.ApplyChatTemplateRequest(messages=[sampling_pb2.ChatMessage(role="user", content="x")])
        await expect_invalid(stub.ApplyChatTemplate(request), "messages")

    with_stub(no_template, body)


def test_get_info_describes_the_default_model(service) -> None:
    async def body(stub: Stub) -> None:
        info = await stub.GetInfo(tokenizer_pb2.GetTokenizerInfoRequest())
        assert info.model == "SmolLM2-135M-Instruct"
        assert info.vocab_size == 49152
        assert info.HasField("bos_token_id") and info.bos_token_id == 1
        assert list(info.eos_token_ids) == [2]
        assert info.has_chat_template
        assert info.max_context_length == 8192
        assert list(info.special_token_ids) == list(range(17))
        assert info.detokenize_prefix_window == PREFIX_WINDOW

    with_stub(service, body)


def test_out_of_vocabulary_ids_are_invalid_argument(service) -> None:
    async def body(stub: Stub) -> None:
        items = [
            tokenizer_pb2.DetokenizeItem(new_token_ids=[5]),
            tokenizer_pb2.DetokenizeItem(new_token_ids=[19556, 49152]),
        ]
        await expect_invalid(stub.Detokenize(tokenizer_pb2.DetokenizeRequest(items=items)), "items[1].new_token_ids")
        item = tokenizer_pb2.DetokenizeItem(prefix_token_ids=[10**6], new_token_ids=[5])
        request = tokenizer_pb2.DetokenizeRequest(items=[item])
        await expect_invalid(stub.Detokenize(request), "items[0].prefix_token_ids")

    with_stub(service, body)


def test_check_structured_output_says_why_a_constraint_does_not_compile(service) -> None:
    so = sampling_pb2.StructuredOutput

    async def body(stub: Stub) -> None:
        async def check(constraint: sampling_pb2.StructuredOutput) -> str:
            request = tokenizer_pb2.CheckStructuredOutputRequest(structured_output=constraint)
            return (await stub.CheckStructuredOutput(request)).error

        good = [
            so(json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}}'),
            so(json_object=True),
            so(regex=r"\d+"),
            so(choice=sampling_pb2.Choices(choices=["a", 'say "b"'])),
            so(grammar='root ::= "x"+'),
        ]
        assert [await check(c) for c in good] == [""] * len(good)
        assert (await check(so(json_schema='{"type": "objekt"}'))).startswith("the json schema does not compile: ")
        assert "objekt" in await check(so(json_schema='{"type": "objekt"}'))
        assert (await check(so(regex="(ab"))).startswith("the regex does not compile: ")
        assert "not defined" in await check(so(grammar="root ::= missing"))
        assert (await check(so(json_schema="{oops"))).startswith("json_schema is not valid JSON")
        assert await check(so()) == "set one of json_schema, json_object, regex, choice, grammar"
        assert await check(so(json_object=False)) == "json_object must be true when set"

    with_stub(service, body)


def test_health_and_reflection_answer(service) -> None:
    async def run() -> None:
        async with serving(service) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = [s.name async for reply in call for s in reply.list_services_response.service]
            assert SERVICE_NAME in names

    asyncio.run(run())


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_PORT", "6000")
    monkeypatch.setenv("SHARDLINE_MODEL", "/models/a.gguf")
    assert (parse_settings([]).port, parse_settings([]).model) == (6000, "/models/a.gguf")
    settings = parse_settings(["--port", "7000", "--model", "/models/b"])
    assert (settings.port, settings.model) == (7000, "/models/b")


def test_main_fails_cleanly_on_a_missing_model(tmp_path: Path) -> None:
    assert main(["--port", "0", "--model", str(tmp_path / "missing.gguf")]) == 1


HERMES_TEMPLATE = Path(__file__).parents[1] / "shardline" / "core" / "text" / "hermes_tool_template.jinja"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_tools_and_tool_calls_render_as_transformers_renders_them(hf_tokenizer) -> None:
    service = build_service(None, str(HERMES_TEMPLATE))
    messages = [
        sampling_pb2.ChatMessage(role="user", content="Weather in Oslo?"),
        sampling_pb2.ChatMessage(
            role="assistant",
            tool_calls=[sampling_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')],
        ),
        sampling_pb2.ChatMessage(role="tool", content="Sunny", tool_call_id="call_1", name="get_weather"),
    ]
    # What transformers is given by vLLM: the arguments as a mapping.
    hf_messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1", "name": "get_weather"},
    ]
    expected = hf_tokenizer.apply_chat_template(
        hf_messages, tools=TOOLS, chat_template=HERMES_TEMPLATE.read_text(), tokenize=False, add_generation_prompt=True
    )
    assert '"name": "get_weather", "arguments": {"city": "Oslo"}}' in expected and "<tools>" in expected

    async def body(stub: Stub) -> None:
        info = await stub.GetInfo(tokenizer_pb2.GetTokenizerInfoRequest())
        assert info.tool_call_format == "hermes"
        reply = await stub.ApplyChatTemplate(
            tokenizer_pb2.ApplyChatTemplateRequest(
                messages=messages, add_generation_prompt=True, tools_json=json.dumps(TOOLS)
            )
        )
        assert reply.prompt == expected
        without = await stub.ApplyChatTemplate(
            tokenizer_pb2.ApplyChatTemplateRequest(messages=messages[:1], add_generation_prompt=True)
        )
        assert "<tools>" not in without.prompt
        await expect_invalid(
            stub.ApplyChatTemplate(
                tokenizer_pb2.ApplyChatTemplateRequest(messages=messages, tools_json='{"not": "a list"}')
            ),
            "tools",
        )
        bad_call = sampling_pb2.ChatMessage(
            role="assistant", tool_calls=[sampling_pb2.ToolCall(name="f", arguments="[")]
        )
        await expect_invalid(
            stub.ApplyChatTemplate(tokenizer_pb2.ApplyChatTemplateRequest(messages=[messages[0], bad_call])),
            "messages[1].tool_calls[0].function.arguments",
        )
        lone_surrogate = sampling_pb2.ChatMessage(
            role="assistant", tool_calls=[sampling_pb2.ToolCall(name="f", arguments='{"c": "\\ud800"}')]
        )
        await expect_invalid(
            stub.ApplyChatTemplate(
                tokenizer_pb2.ApplyChatTemplateRequest(
                    messages=[messages[0], lone_surrogate], tools_json=json.dumps(TOOLS)
                )
            ),
            "messages[1].tool_calls[0].function.arguments",
        )

    with_stub(service, body)


def test_default_template_writes_no_tool_calls(service) -> None:
    async def body(stub: Stub) -> None:
        assert (await stub.GetInfo(tokenizer_pb2.GetTokenizerInfoRequest())).tool_call_format == ""

    with_stub(service, body)


def test_chat_template_from_a_file_or_its_text(tmp_path: Path) -> None:
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    assert read_chat_template(str(HERMES_TEMPLATE)) == HERMES_TEMPLATE.read_text()
    with pytest.raises(TokenizerError):
        read_chat_template(str(tmp_path / "missing.jinja"))
    assert parse_settings(["--chat-template", "/models/t.jinja"]).chat_template == "/models/t.jinja"


def test_template_variables_reach_the_template() -> None:
    source = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}[no thinking]{% endif %}"
        "{% for d in documents or [] %}<doc>{{ d.text }}</doc>{% endfor %}"
    )
    service = build_service(None, source)
    user = sampling_pb2.ChatMessage(role="user", content="Hi")

    async def body(stub: Stub) -> None:
        reply = await stub.ApplyChatTemplate(
            tokenizer_pb2.ApplyChatTemplateRequest(
                messages=[user],
                template_kwargs_json=json.dumps({"enable_thinking": False, "documents": [{"text": "A"}]}),
            )
        )
        assert reply.prompt == "user: Hi\n[no thinking]<doc>A</doc>"
        for bad, field in (
            ('{"messages": []}', "chat_template_kwargs.messages"),
            ("[1]", "chat_template_kwargs"),
            ('{"namespace": 1}', "chat_template_kwargs.namespace"),
            ('{"documents": [{"text": "\\ud800"}]}', "messages"),
            ('{"documents": 5}', "chat_template_kwargs"),
        ):
            await expect_invalid(
                stub.ApplyChatTemplate(
                    tokenizer_pb2.ApplyChatTemplateRequest(messages=[user], template_kwargs_json=bad)
                ),
                field,
            )
        await expect_invalid(
            stub.ApplyChatTemplate(
                tokenizer_pb2.ApplyChatTemplateRequest(
                    messages=[user], add_generation_prompt=True, continue_final_message=True
                )
            ),
            "continue_final_message",
        )

    with_stub(service, body)

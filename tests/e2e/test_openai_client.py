"""The official `openai` Python client works unchanged against the gateway."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(http_url):
    return openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0)


def test_models(client):
    assert "SmolLM2-135M-Instruct" in [m.id for m in client.models.list()]


def test_chat_and_stream(client):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=16, temperature=0)
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content


def test_completion_with_logprobs(client):
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Paris is the capital of", max_tokens=4, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens and all(x <= 0 for x in lp.token_logprobs)


def test_bad_request_raises_400(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", temperature=9)


def test_response_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    kwargs = dict(
        model="SmolLM2-135M-Instruct",
        max_tokens=60,
        temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
    )
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "stop"
    assert set(json.loads(whole.choices[0].message.content)) == {"city", "country"}
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        if chunk.choices
    )
    assert streamed == whole.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            **{
                **kwargs,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad", "schema": {"type": "objekt"}},
                },
            }
        )
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    # A regex that compiles but matches nothing past "a": the worker fails that request alone, and
    # since the client's constraint is at fault, the answer is a 400.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{**kwargs, "response_format": None}, extra_body={"guided_regex": r"a[^\s\S]"})
    assert caught.value.body["param"] == "structured_output"
    assert caught.value.body["message"].startswith("structured_output: its grammar allows no token after 1 output")
    assert client.chat.completions.create(**kwargs).choices[0].message.content == whole.choices[0].message.content


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""
    return [tuple(calls[i]) for i in range(len(calls))], finish


@pytest.mark.parametrize(
    "tool_choice, finish",
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")],
)
def test_tool_calls_fit_the_tools(client, tool_choice, finish):
    """The real model, constrained: every call names a tool and its arguments fit that tool's schema;
    streamed, the calls add up to the same."""
    kwargs = dict(
        model="SmolLM2-135M-Instruct",
        max_tokens=80,
        temperature=0,
        tools=[WEATHER, CLOCK],
        tool_choice=tool_choice,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == finish and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls and all(c.id.startswith("call_") for c in choice.message.tool_calls)
    for name, arguments in calls:
        schema = {"get_weather": WEATHER, "get_time": CLOCK}[name]["function"]["parameters"]
        assert set(json.loads(arguments)) == set(schema["required"])
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_weather"]
    assert _streamed_calls(client.chat.completions.create(**kwargs, stream=True)) == (calls, finish)
    # The conversation goes on with the call and its result.
    followup = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        max_tokens=8,
        tools=[WEATHER, CLOCK],
        tool_choice="none",
        messages=[
            *kwargs["messages"],
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "Sunny, 21 C"},
        ],
    )
    assert followup.choices[0].message.content

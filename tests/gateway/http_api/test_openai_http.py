"""The OpenAI-compatible HTTP API, with the official openai client and with raw SSE parsing."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from shardline.core.text.chat_template import ChatTemplate
from shardline.core.text.tokenizer import Tokenizer
from tests.gateway.conftest import TEXT
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import MODEL, Script
from tracing import attributes as attr

PROMPT = "Write one sentence about a fox."


def client(stack: Stack, api_key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=api_key, max_retries=0)


async def sse_events(response: aiohttp.ClientResponse) -> list[dict | str]:
    """The `data:` payloads of a server-sent event stream, JSON-decoded except [DONE]."""
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = []
    async for line in response.content:
        line = line.decode().rstrip("\n")
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", line
    return events


def test_completion_with_the_openai_client(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    async def body(stack: Stack) -> None:
        result = await client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=100, seed=7)
        assert result.id.startswith("cmpl-")
        assert result.choices[0].text == TEXT
        assert result.choices[0].finish_reason == "stop"
        prompt_ids = tokenizer.encode_batch([PROMPT])[0]
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), len(text_ids))
        assert result.usage.total_tokens == len(prompt_ids) + len(text_ids)
        submitted = stack.scheduler.submitted[0]
        assert list(submitted.prompt_token_ids) == prompt_ids
        assert submitted.request_id == result.id and submitted.gateway_id == stack.gateway.settings.gateway_id
        params = submitted.params
        assert (params.max_tokens, params.seed, params.temperature, params.top_p) == (100, 7, 1.0, 1.0)
        assert params.skip_special_tokens and list(submitted.eos_token_ids) == [2]

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_completions_default_to_16_tokens_and_report_length(tokenizer_address, text_ids, tokenizer) -> None:
    async def body(stack: Stack) -> None:
        result = await client(stack).completions.create(model=MODEL, prompt=PROMPT)
        assert stack.scheduler.submitted[0].params.max_tokens == 16
        short = await client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        assert short.choices[0].finish_reason == "length"
        assert short.choices[0].text == tokenizer.decode(text_ids[:3])
        assert short.usage.completion_tokens == 3
        assert len(text_ids) > 16
        assert result.choices[0].finish_reason == "length"
        assert result.choices[0].text == tokenizer.decode(text_ids[:16])

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_chat_completion_applies_the_template(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]

    async def body(stack: Stack) -> None:
        result = await client(stack).chat.completions.create(model=MODEL, messages=messages)
        assert result.id.startswith("chatcmpl-")
        assert result.choices[0].message.role == "assistant"
        assert result.choices[0].message.content == TEXT
        template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
        prompt_ids = tokenizer.encode_batch([template.render(messages)], add_special_tokens=False)[0]
        assert list(stack.scheduler.submitted[0].prompt_token_ids) == prompt_ids
        assert result.usage.prompt_tokens == len(prompt_ids)
        # No max_tokens: the rest of the context, as OpenAI and vLLM do (the worker knows its own).
        assert not stack.scheduler.submitted[0].params.HasField("max_tokens")

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_chat_stream_with_the_openai_client_and_usage(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        stream = await client(stack).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == TEXT
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["stop"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(text_ids)
        assert all(c.usage is None for c in chunks[:-1])
        assert len({c.id for c in chunks}) == 1

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=2), body)


def test_raw_sse_completion_stream(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 64, "stream": True}
            async with http.post(f"{stack.base_url}/v1/completions", json=request) as response:
                assert response.status == 200
                events = await sse_events(response)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "text_completion" and c["id"] == response.headers["X-Request-Id"] for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
        assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage
        # Partial characters are held back: no chunk carries a broken one.
        assert all("\ufffd" not in c["choices"][0]["text"] for c in chunks)

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_client_disconnect_cancels_upstream(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            request = {"model": MODEL, "prompt": PROMPT, "stream": True}
            async with http.post(f"{stack.base_url}/v1/completions", json=request) as response:
                request_id = response.headers["X-Request-Id"]
                await response.content.readline()  # the first event arrived: generation is under way
        await stack.scheduler.wait_cancelled(request_id)
        # A non-streamed request whose client gives up is cancelled too.
        timeout = aiohttp.ClientTimeout(total=0.5)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            with pytest.raises(TimeoutError):
                await http.post(f"{stack.base_url}/v1/completions", json={"model": MODEL, "prompt": PROMPT})
        await stack.scheduler.wait_cancelled(stack.scheduler.submitted[1].request_id)

    run_on_stack(tokenizer_address, Script(text_ids, hold_after=2), body)


def test_logprobs_in_completions_and_chat(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    async def body(stack: Stack) -> None:
        result = await client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2)
        logprobs = result.choices[0].logprobs
        assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in text_ids[:4]]
        assert logprobs.token_logprobs == [-0.25] * 4
        assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])
        assert len(logprobs.top_logprobs[0]) == 2
        chat = await client(stack).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, top_logprobs=2
        )
        content = chat.choices[0].logprobs.content
        assert [c.token for c in content] == logprobs.tokens[:2]
        assert [len(c.top_logprobs) for c in content] == [2, 2]
        assert content[0].bytes == list(content[0].token.encode())
        assert stack.scheduler.submitted[1].params.top_logprobs == 2

    run_on_stack(tokenizer_address, Script(text_ids, logprobs=True), body)


def test_chat_logprobs_bytes_rebuild_a_character_split_over_tokens(tokenizer_address, tokenizer: Tokenizer) -> None:
    # The emoji is two tokens, " \xf0\x9f\x98" and "\x80": alone, each one's text is U+FFFD.
    text = "I 😀 it"
    ids = tokenizer.encode_batch([text], add_special_tokens=False)[0]

    async def body(stack: Stack) -> None:
        messages = [{"role": "user", "content": "hi"}]
        chat = await client(stack).chat.completions.create(model=MODEL, messages=messages, logprobs=True)
        stream = await client(stack).chat.completions.create(model=MODEL, messages=messages, logprobs=True, stream=True)
        streamed = [
            entry async for chunk in stream if chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content
        ]
        for content in (chat.choices[0].logprobs.content, streamed):
            assert "\ufffd" in "".join(entry.token for entry in content)
            assert b"".join(bytes(entry.bytes) for entry in content) == text.encode()
            assert [bytes(entry.bytes) for entry in content] == [tokenizer.token_bytes([t]) for t in ids]
        assert chat.choices[0].message.content == text

    run_on_stack(tokenizer_address, Script(ids, logprobs=True), body)


def test_chat_messages_as_clients_send_them(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    # An assistant turn with null content (it only called tools) and content as several text parts.
    sent = [
        {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "again"},
    ]
    meant = [
        {"role": "user", "content": "Say\nhi"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "again"},
    ]

    async def body(stack: Stack) -> None:
        await client(stack).chat.completions.create(model=MODEL, messages=sent, max_tokens=2)
        template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
        expected = tokenizer.encode_batch([template.render(meant)], add_special_tokens=False)[0]
        assert list(stack.scheduler.submitted[0].prompt_token_ids) == expected

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_streamed_logprob_offsets_equal_the_whole_ones(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    # A stop string that begins like the third token's text holds that text back for a chunk.
    stop = tokenizer.decode(text_ids[2:3]) + "\u2603"

    async def body(stack: Stack) -> None:
        request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "logprobs": 1, "stop": [stop]}
        whole = await client(stack).completions.create(**request)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.base_url}/v1/completions", json={**request, "stream": True}) as response:
                events = await sse_events(response)
        streamed = [e["choices"][0]["logprobs"] for e in events if e != "[DONE]" and e["choices"][0]["logprobs"]]
        assert [o for lp in streamed for o in lp["text_offset"]] == whole.choices[0].logprobs.text_offset
        assert [t for lp in streamed for t in lp["tokens"]] == whole.choices[0].logprobs.tokens
        assert whole.choices[0].logprobs.text_offset[3] == len("".join(whole.choices[0].logprobs.tokens[:3]))

    run_on_stack(tokenizer_address, Script(text_ids, logprobs=True), body)


def test_model_by_id(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        model = await client(stack).models.retrieve(MODEL)
        assert (model.id, model.object) == (MODEL, "model")
        with pytest.raises(openai.NotFoundError):
            await client(stack).models.retrieve("gpt-9")

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_n_completions_per_prompt_and_a_batch_of_prompts(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    async def body(stack: Stack) -> None:
        result = await client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=3, seed=7)
        assert [c.index for c in result.choices] == [0, 1, 2]
        assert all(c.text == tokenizer.decode(text_ids[:4]) for c in result.choices)
        submitted = stack.scheduler.submitted
        assert [s.request_id for s in submitted] == [f"{result.id}-{i}" for i in range(3)]
        assert sorted(s.params.seed for s in submitted) == [7, 8, 9]  # each choice samples differently
        prompt_tokens = len(tokenizer.encode_batch([PROMPT])[0])
        # The prompt counts once; every choice's output counts.
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, 12)
        # Traces: each choice is a request rooted in its gateway.choice span, under the HTTP span,
        # which carries the id the client got (a whole-trace export) and lists the choices.
        spans = stack.spans.get_finished_spans()
        [http] = [s for s in spans if s.name == "gateway.request"]
        assert http.attributes[attr.REQUEST_ID] == result.id
        assert list(http.attributes[attr.CHOICES]) == [f"{result.id}-{i}" for i in range(3)]
        roots = [s for s in spans if s.name == "gateway.choice"]
        assert sorted(s.attributes[attr.REQUEST_ID] for s in roots) == [f"{result.id}-{i}" for i in range(3)]
        assert all(
            s.parent.span_id == http.context.span_id and s.attributes[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
            for s in roots
        )

        batch = await client(stack).completions.create(model=MODEL, prompt=["one", "two three"], max_tokens=2, n=2)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        prompts = [list(s.prompt_token_ids) for s in stack.scheduler.submitted[3:]]
        one, two = tokenizer.encode_batch(["one", "two three"])
        assert sorted(prompts) == sorted([one, one, two, two])
        by_id = {s.request_id: list(s.prompt_token_ids) for s in stack.scheduler.submitted[3:]}
        assert [by_id[f"{batch.id}-{i}"] for i in range(4)] == [one, one, two, two]  # n per prompt, in order
        assert batch.usage.prompt_tokens == len(one) + len(two) and batch.usage.completion_tokens == 8

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_a_stream_of_several_choices(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    async def body(stack: Stack) -> None:
        stream = await client(stack).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            n=2,
            max_tokens=5,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        for index in (0, 1):
            mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
            assert mine[0].delta.role == "assistant"  # each choice opens with its role
            assert "".join(c.delta.content or "" for c in mine) == tokenizer.decode(text_ids[:5])
            assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
        assert len({c.id for c in chunks}) == 1
        # One usage chunk, last, for the whole request.
        assert [c.usage is not None for c in chunks].count(True) == 1 and chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == 10

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_a_refused_choice_refuses_the_request(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        stack.scheduler.accept_only = 2
        with pytest.raises(openai.RateLimitError):
            await client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=3)
        # The choices that were accepted are cancelled: the client got no response to read them from.
        for submitted in stack.scheduler.submitted:
            await stack.scheduler.wait_cancelled(submitted.request_id)
        assert len(stack.scheduler.submitted) == 2

    run_on_stack(tokenizer_address, Script(text_ids, hold_after=1), body)


def test_structured_output_fields_reach_the_scheduler(tokenizer_address, text_ids) -> None:
    """OpenAI's response_format, vLLM's structured_outputs and its guided_* names, as one constraint."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    messages = [{"role": "user", "content": PROMPT}]

    async def body(stack: Stack) -> None:
        openai_client = client(stack)
        await openai_client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}},
        )
        await openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, response_format={"type": "json_object"}
        )
        await openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, response_format={"type": "text"}
        )
        await openai_client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"guided_choice": ["yes", "no"]}
        )
        await openai_client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"guided_json": json.dumps(schema)}
        )
        await openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, extra_body={"structured_outputs": {"regex": "[0-9]+"}}
        )
        await openai_client.chat.completions.create(  # vLLM ignores disable_any_whitespace where no JSON is
            model=MODEL,
            messages=messages,
            max_tokens=4,
            extra_body={"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}},
        )
        await openai_client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=4,
            extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
        )
        await openai_client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=4,
            extra_body={"guided_json": schema, "guided_decoding_backend": "xgrammar:disable-any-whitespace"},
        )
        constraints = [
            s.params.structured_output if s.params.HasField("structured_output") else None
            for s in stack.scheduler.submitted
        ]
        assert json.loads(constraints[0].json_schema) == schema
        assert constraints[1].json_object and constraints[2] is None
        assert list(constraints[3].choice.choices) == ["yes", "no"]
        assert json.loads(constraints[4].json_schema) == schema
        assert constraints[5].regex == "[0-9]+"
        assert [c.disable_any_whitespace for c in constraints if c is not None] == [False] * 6 + [True, True]
        assert constraints[6].regex == "[0-9]+" and json.loads(constraints[7].json_schema) == schema
        kinds = [
            span.attributes.get(attr.STRUCTURED_OUTPUT)
            for span in stack.spans.get_finished_spans()
            if span.name == "gateway.request"
        ]
        assert kinds == [
            "json_schema",
            "json_object",
            None,
            "choice",
            "json_schema",
            "regex",
            "regex",
            "json_schema",
            "json_schema",
        ]

    run_on_stack(tokenizer_address, Script(text_ids), body)

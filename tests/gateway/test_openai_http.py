"""The OpenAI-compatible HTTP API, with the official openai client and with raw SSE parsing."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from gateway import stream_hub
from tests.gateway.conftest import TEXT
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import MODEL, Script
from tokenizer_svc.chat_template import ChatTemplate
from tokenizer_svc.tokenizer import Tokenizer
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
            payload = line[len("data: "):]
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
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], stream=True,
            stream_options={"include_usage": True})
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


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_stop_string_across_tokens_truncates_and_cancels(tokenizer_address, text_ids, tokens_per_step) -> None:
    # "ick bro" starts inside the token " quick" and ends inside " brown".
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            request = {"model": MODEL, "prompt": PROMPT, "stream": True, "stop": ["zzz", "ick bro"], "max_tokens": 64}
            async with http.post(f"{stack.base_url}/v1/completions", json=request) as response:
                events = await sse_events(response)
        chunks = events[:-1]
        assert "".join(c["choices"][0]["text"] for c in chunks) == " The qu"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        request_id = response.headers["X-Request-Id"]
        await stack.scheduler.wait_cancelled(request_id)
        whole = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop="lazy")
        assert whole.choices[0].text == " The quick brown fox jumps over the "
        assert whole.choices[0].finish_reason == "stop"
        await stack.scheduler.wait_cancelled(whole.id)

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=tokens_per_step), body)


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
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, top_logprobs=2)
        content = chat.choices[0].logprobs.content
        assert [c.token for c in content] == logprobs.tokens[:2]
        assert [len(c.top_logprobs) for c in content] == [2, 2]
        assert content[0].bytes == list(content[0].token.encode())
        assert stack.scheduler.submitted[1].params.top_logprobs == 2

    run_on_stack(tokenizer_address, Script(text_ids, logprobs=True), body)


def test_chat_messages_as_clients_send_them(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    # An assistant turn with null content (it only called tools) and content as several text parts.
    sent = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    meant = [{"role": "user", "content": "Say\nhi"}, {"role": "assistant", "content": ""},
             {"role": "user", "content": "again"}]

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
        assert all(s.parent.span_id == http.context.span_id and s.attributes[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == 4
                   for s in roots)

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
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], stream=True, n=2, max_tokens=5,
            stream_options={"include_usage": True})
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


def test_a_stop_string_ending_keeps_the_cached_prompt_tokens_in_usage(tokenizer_address, text_ids, tokenizer) -> None:
    # The gateway ends the request itself on a stop string: the usage it reports still says what the
    # worker's prefix cache served (from the first delta), not only the final delta's figures.
    stop = tokenizer.decode(text_ids[3:5]).strip()

    async def body(stack: Stack) -> None:
        result = await client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=50, stop=[stop])
        assert result.choices[0].finish_reason == "stop"
        assert result.usage.prompt_tokens_details.cached_tokens == 4

    run_on_stack(tokenizer_address, Script(text_ids, cached_tokens=4), body)


@pytest.mark.parametrize("tokens_per_step", [1, 3, 4, 5])
def test_stop_strings_wait_for_min_tokens(tokenizer_address, text_ids, tokens_per_step) -> None:
    """As in vLLM, a stop string ends a request only from its min_tokens-th token on, however the
    tokens arrive: the "o" of " brown" (token 3) passes; with min_tokens 6 the "o" of " over" (token
    6) ends it, with 7 that of " dog" (token 9). Deltas of several tokens cross min_tokens mid-way."""
    async def body(stack: Stack) -> None:
        for min_tokens, text in ((6, " The quick brown fox jumps "), (7, " The quick brown fox jumps over the lazy d")):
            for stream in (False, True):
                reply = await client(stack).completions.create(
                    model=MODEL, prompt=PROMPT, stop="o", extra_body={"min_tokens": min_tokens}, max_tokens=32,
                    stream=stream)
                chunks = [chunk async for chunk in reply] if stream else [reply]
                assert "".join(c.choices[0].text for c in chunks) == text, (min_tokens, stream)
                assert chunks[-1].choices[0].finish_reason == "stop"
        plain = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop="o", max_tokens=32)
        assert plain.choices[0].text == " The quick br"

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=tokens_per_step), body)


@pytest.mark.parametrize("tokens_per_step", [1, 3, 4, 40])
def test_a_stop_string_ends_the_tokens_logprobs_and_usage_at_the_token_that_completes_it(
        tokenizer_address, text_ids, tokenizer: Tokenizer, tokens_per_step) -> None:
    """Tokens that came in the same delta after the one completing a stop string are not output: as in
    vLLM, which checks stop strings after every token, the logprobs and the usage end at that token."""
    stop = "ick bro"  # completed by the third token, " brown"
    through = next(k for k in range(1, len(text_ids) + 1) if stop in tokenizer.decode(text_ids[:k]))

    async def body(stack: Stack) -> None:
        whole = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop=stop, max_tokens=32,
                                                       logprobs=1)
        assert whole.choices[0].text == " The qu"
        assert whole.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in text_ids[:through]]
        assert whole.usage.completion_tokens == through
        streamed = await client(stack).completions.create(
            model=MODEL, prompt=PROMPT, stop=[stop, "zzz"], max_tokens=32, logprobs=1, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in streamed]
        assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == through
        assert chunks[-1].usage.completion_tokens == through
        chat = await client(stack).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stop=stop, max_tokens=32, logprobs=True)
        assert [c.token for c in chat.choices[0].logprobs.content] == whole.choices[0].logprobs.tokens
        assert chat.usage.completion_tokens == through

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=tokens_per_step, logprobs=True), body)


@pytest.mark.parametrize("probes", [2, 3])
def test_the_token_completing_a_stop_string_is_found_over_several_rounds(
        tokenizer_address, text_ids, tokenizer: Tokenizer, probes, monkeypatch) -> None:
    # With few probes per Detokenize call, a long delta takes several rounds to narrow down.
    monkeypatch.setattr("gateway.stop_search._CUT_PROBES", probes)
    for stop in ("azy d", " quick", "Zü"):
        through = next(k for k in range(1, len(text_ids) + 1) if stop in tokenizer.decode(text_ids[:k]))

        async def body(stack: Stack) -> None:
            whole = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop=stop, max_tokens=32)
            assert whole.usage.completion_tokens == through, stop
            assert stop not in whole.choices[0].text and whole.choices[0].finish_reason == "stop"

        run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=40), body)


def test_the_search_reads_a_run_of_invalid_bytes_as_characters(tokenizer_address, text_ids, tokenizer) -> None:
    # 150 tokens that are each a lone invalid byte follow " quick": a leading part ending inside the
    # run must still show " The quick" (a non-final decode held it all back, and 151 extra tokens stayed).
    ids = text_ids[:2] + [111] * 150 + text_ids[2:]
    assert tokenizer.decode([111]) == "\ufffd"

    async def body(stack: Stack) -> None:
        whole = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop="quick", max_tokens=200)
        assert (whole.choices[0].text, whole.usage.completion_tokens) == (" The ", 2)

    run_on_stack(tokenizer_address, Script(ids, tokens_per_step=len(ids)), body)


def test_a_failed_search_keeps_every_token_and_a_stop_at_the_end_costs_one_probe(
        tokenizer_address, text_ids, monkeypatch) -> None:
    probes: list[int] = []  # items per Detokenize call of the search
    failure: list[BaseException] = []
    searching = []
    search = stream_hub.find_stop_tokens

    async def find_stop_tokens(tokenizer, searches) -> None:
        searching.append(True)
        try:
            await search(tokenizer, searches)
        finally:
            searching.clear()

    monkeypatch.setattr(stream_hub, "find_stop_tokens", find_stop_tokens)

    async def body(stack: Stack) -> None:
        real = stack.gateway.backends.tokenizer.Detokenize

        async def detokenize(request, **kwargs):
            if searching:
                probes.append(len(request.items))
                if failure:
                    raise failure[0]
            return await real(request, **kwargs)

        monkeypatch.setattr(stack.gateway.backends.tokenizer, "Detokenize", detokenize)
        end = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop="!", max_tokens=64)
        assert end.choices[0].finish_reason == "stop" and end.usage.completion_tokens == len(text_ids)
        assert probes == [2]  # only "did it need the last token?" (that part's shown and final texts)
        failure.append(RuntimeError("a bug in the search"))
        kept = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop="fox", max_tokens=64)
        assert (kept.choices[0].text, kept.choices[0].finish_reason) == (" The quick brown ", "stop")
        assert kept.usage.completion_tokens == len(text_ids)  # the search failed: every token is kept

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=len(text_ids)), body)


def test_of_two_stops_one_token_completes_the_first_listed_wins(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        for stops, text in ((["brown", "row"], " The quick "), (["row", "brown"], " The quick b")):
            reply = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop=stops, max_tokens=32)
            assert (reply.choices[0].text, reply.usage.completion_tokens) == (text, 3), stops

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=1), body)


@pytest.mark.parametrize("tokens_per_step", [1, 2, 3, 40])
def test_which_stop_wins_does_not_depend_on_how_many_tokens_a_delta_holds(
        tokenizer_address, text_ids, tokens_per_step) -> None:
    # " quick" completes both "ick" and " q": token by token, the first listed wins (vLLM), however
    # the tokens reach the gateway.
    async def body(stack: Stack) -> None:
        for stops, text in ((["ick", " q"], " The qu"), ([" q", "ick"], " The")):
            reply = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop=stops, max_tokens=32)
            assert (reply.choices[0].text, reply.usage.completion_tokens) == (text, 2), stops

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=tokens_per_step), body)


@pytest.mark.parametrize("tokens_per_step", [1, 40])
def test_a_stop_ending_in_a_token_with_unfinished_bytes_waits_for_them_as_a_stream_does(
        tokenizer_address, text_ids, tokenizer, tokens_per_step) -> None:
    # " \xf0\x9f\x98" (a space and three of the emoji's bytes) is one token: a stream shows its space
    # only with the emoji's last byte, so "h " completes at the token after it, in any delta size.
    emoji_start = next(i for i, t in enumerate(text_ids) if tokenizer.decode([t]).startswith(" \ufffd"))
    assert "h " not in tokenizer.decode(text_ids[:emoji_start])

    async def body(stack: Stack) -> None:
        reply = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop="h ", max_tokens=32)
        assert reply.choices[0].text == " The quick brown fox jumps over the lazy dog. Züric"
        assert reply.usage.completion_tokens == emoji_start + 2  # through the emoji's last byte

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=tokens_per_step), body)

"""Stop strings over the OpenAI-compatible HTTP API: where the output ends, whatever the deltas' sizes."""

from __future__ import annotations

import aiohttp
import pytest

from gateway.output import output_processor
from shardline.core.text.tokenizer import Tokenizer
from tests.gateway.conftest import TEXT
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.http_api.test_openai_http import PROMPT, client, sse_events
from tests.gateway.scripted_scheduler import MODEL, Script


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
                    model=MODEL,
                    prompt=PROMPT,
                    stop="o",
                    extra_body={"min_tokens": min_tokens},
                    max_tokens=32,
                    stream=stream,
                )
                chunks = [chunk async for chunk in reply] if stream else [reply]
                assert "".join(c.choices[0].text for c in chunks) == text, (min_tokens, stream)
                assert chunks[-1].choices[0].finish_reason == "stop"
        plain = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop="o", max_tokens=32)
        assert plain.choices[0].text == " The quick br"

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=tokens_per_step), body)


@pytest.mark.parametrize("tokens_per_step", [1, 3, 4, 40])
def test_a_stop_string_ends_the_tokens_logprobs_and_usage_at_the_token_that_completes_it(
    tokenizer_address, text_ids, tokenizer: Tokenizer, tokens_per_step
) -> None:
    """Tokens that came in the same delta after the one completing a stop string are not output: as in
    vLLM, which checks stop strings after every token, the logprobs and the usage end at that token."""
    stop = "ick bro"  # completed by the third token, " brown"
    through = next(k for k in range(1, len(text_ids) + 1) if stop in tokenizer.decode(text_ids[:k]))

    async def body(stack: Stack) -> None:
        whole = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop=stop, max_tokens=32, logprobs=1)
        assert whole.choices[0].text == " The qu"
        assert whole.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in text_ids[:through]]
        assert whole.usage.completion_tokens == through
        streamed = await client(stack).completions.create(
            model=MODEL,
            prompt=PROMPT,
            stop=[stop, "zzz"],
            max_tokens=32,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in streamed]
        assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == through
        assert chunks[-1].usage.completion_tokens == through
        chat = await client(stack).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stop=stop, max_tokens=32, logprobs=True
        )
        assert [c.token for c in chat.choices[0].logprobs.content] == whole.choices[0].logprobs.tokens
        assert chat.usage.completion_tokens == through

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=tokens_per_step, logprobs=True), body)


@pytest.mark.parametrize("probes", [2, 3])
def test_the_token_completing_a_stop_string_is_found_over_several_rounds(
    tokenizer_address, text_ids, tokenizer: Tokenizer, probes, monkeypatch
) -> None:
    # With few probes per Detokenize call, a long delta takes several rounds to narrow down.
    monkeypatch.setattr("gateway.output.stop_strings._CUT_PROBES", probes)
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
    tokenizer_address, text_ids, monkeypatch
) -> None:
    probes: list[int] = []  # items per Detokenize call of the search
    failure: list[BaseException] = []
    searching = []
    search = output_processor.find_stop_tokens

    async def find_stop_tokens(tokenizer, searches) -> None:
        searching.append(True)
        try:
            await search(tokenizer, searches)
        finally:
            searching.clear()

    monkeypatch.setattr(output_processor, "find_stop_tokens", find_stop_tokens)

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
    tokenizer_address, text_ids, tokens_per_step
) -> None:
    # " quick" completes both "ick" and " q": token by token, the first listed wins (vLLM), however
    # the tokens reach the gateway.
    async def body(stack: Stack) -> None:
        for stops, text in ((["ick", " q"], " The qu"), ([" q", "ick"], " The")):
            reply = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop=stops, max_tokens=32)
            assert (reply.choices[0].text, reply.usage.completion_tokens) == (text, 2), stops

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=tokens_per_step), body)


@pytest.mark.parametrize("tokens_per_step", [1, 40])
def test_a_stop_ending_in_a_token_with_unfinished_bytes_waits_for_them_as_a_stream_does(
    tokenizer_address, text_ids, tokenizer, tokens_per_step
) -> None:
    # " \xf0\x9f\x98" (a space and three of the emoji's bytes) is one token: a stream shows its space
    # only with the emoji's last byte, so "h " completes at the token after it, in any delta size.
    emoji_start = next(i for i, t in enumerate(text_ids) if tokenizer.decode([t]).startswith(" \ufffd"))
    assert "h " not in tokenizer.decode(text_ids[:emoji_start])

    async def body(stack: Stack) -> None:
        reply = await client(stack).completions.create(model=MODEL, prompt=PROMPT, stop="h ", max_tokens=32)
        assert reply.choices[0].text == " The quick brown fox jumps over the lazy dog. Züric"
        assert reply.usage.completion_tokens == emoji_start + 2  # through the emoji's last byte

    run_on_stack(tokenizer_address, Script(text_ids, tokens_per_step=tokens_per_step), body)


def test_the_stop_token_is_output_but_not_text(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    """As in vLLM: the EOS or stop token id a request stops on counts as a generated token and is in
    its token ids, but its text is not in the output, even with skip_special_tokens off."""
    eos = tokenizer.eos_token_ids[0]

    async def body(stack: Stack) -> None:
        openai_client = client(stack)
        raw = await openai_client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=100, extra_body={"skip_special_tokens": False}
        )
        assert raw.choices[0].text == TEXT and raw.usage.completion_tokens == len(text_ids) + 1
        chunks = [
            c.choices[0].text
            async for c in await openai_client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=100, stream=True, extra_body={"skip_special_tokens": False}
            )
        ]
        assert "".join(chunks) == TEXT

    run_on_stack(tokenizer_address, Script(text_ids + [eos]), body)

    # An ordinary token as a stop token id: its text is left out too.
    last = text_ids[-1]

    async def stopped_on_id(stack: Stack) -> None:
        reply = await client(stack).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=100, extra_body={"stop_token_ids": [last]}
        )
        assert reply.choices[0].text == tokenizer.decode(text_ids[:-1])
        assert reply.usage.completion_tokens == len(text_ids)

    run_on_stack(tokenizer_address, Script(text_ids), stopped_on_id)

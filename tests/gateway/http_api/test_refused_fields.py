"""Fields an endpoint cannot honour are refused naming them, never ignored; harmless ones are taken,
type-checked; and a surrogate written out in a body's UTF-8 is a 400 naming its field, never a 500."""

from __future__ import annotations

import aiohttp
import pytest

from gateway.http_api.openai_request import parse_request
from shardline.core.errors import InvalidArgument
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import MODEL, Script

COMPLETION = {"model": MODEL, "prompt": "Hello"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

# (chat, fields merged into a valid body, the field the 400 names)
REFUSED = [
    (True, {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    (True, {"function_call": "auto"}, "function_call"),
    (True, {"best_of": 2}, "best_of"),
    (True, {"suffix": "end"}, "suffix"),
    (True, {"prompt": "hi"}, "prompt"),
    (True, {"top_logprobs": "abc", "logprobs": True}, "top_logprobs"),
    (True, {"top_logprobs": float("nan"), "logprobs": True}, "top_logprobs"),
    (True, {"max_completion_tokens": "abc"}, "max_completion_tokens"),
    (True, {"max_completion_tokens": float("nan")}, "max_completion_tokens"),
    (False, {"tools": TOOLS}, "tools"),
    (False, {"tool_choice": "auto"}, "tool_choice"),
    (False, {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    (False, {"top_logprobs": "abc"}, "top_logprobs"),
    (False, {"top_logprobs": float("nan")}, "top_logprobs"),
    (False, {"max_completion_tokens": "abc"}, "max_completion_tokens"),
    (False, {"max_completion_tokens": float("nan")}, "max_completion_tokens"),
    (False, {"functions": []}, "functions"),
    (False, {"use_beam_search": True}, "use_beam_search"),  # vLLM's, not done here
    (True, {"max_token": 5}, "max_token"),  # a misspelling is not silently dropped
    (
        True,
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
    ),
    (True, {"user": 7}, "user"),
    (False, {"metadata": "tag"}, "metadata"),
    (False, {"metadata": {"k": 1}}, "metadata.k"),
    (True, {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
]


@pytest.mark.parametrize("chat, fields, param", REFUSED, ids=[p for _, _, p in REFUSED])
def test_a_field_that_cannot_be_honoured_is_refused_naming_it(chat, fields, param) -> None:
    base = CHAT if chat else COMPLETION
    with pytest.raises(InvalidArgument) as caught:
        parse_request({**base, **fields}, chat)
    assert caught.value.field == param


@pytest.mark.parametrize("chat", [True, False])
def test_harmless_fields_and_nulls_are_taken(chat) -> None:
    base = CHAT if chat else COMPLETION
    parsed = parse_request(
        {**base, "user": "u-1", "metadata": {"team": "search"}, "functions": None, "suffix": None, "tools": None}, chat
    )
    assert parsed.chat == chat


# (endpoint, a raw JSON body holding U+D800 written in UTF-8, the field the 400 names)
SURROGATE_BODIES = [
    ("/v1/completions", b'{"prompt":"hi\xed\xa0\x80","max_tokens":2}', "prompt"),
    ("/v1/completions", b'{"prompt":"hi","stop":["a","\xed\xb0\x80"]}', "stop[1]"),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"\xed\xa0\x80"}]}', "messages[0].content"),
    ("/tokenize", b'{"prompt":"hi\xed\xa0\x80"}', "prompt"),
    ("/tokenize", b'{"messages":[{"role":"user","content":"x\xed\xbf\xbf"}]}', "messages[0].content"),
]


def test_a_surrogate_in_a_bodys_utf8_is_a_400_naming_its_field(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            for path, raw, param in SURROGATE_BODIES:
                async with http.post(
                    f"{stack.base_url}{path}", data=raw, headers={"Content-Type": "application/json"}
                ) as response:
                    error = (await response.json())["error"]
                    assert (response.status, error["param"]) == (400, param), (raw, error)
            # The same in a UTF-16 body, which json.loads reads too.
            utf16 = '{"prompt": "hi"}'.encode("utf-16-le").replace(b"h\x00", b"\x00\xd8")
            async with http.post(f"{stack.base_url}/v1/completions", data=utf16) as response:
                assert response.status == 400 and (await response.json())["error"]["param"] == "prompt"
            async with http.post(f"{stack.base_url}/v1/completions", json={**COMPLETION, "user": "u"}) as response:
                assert response.status == 200
        assert len(stack.scheduler.submitted) == 1

    run_on_stack(tokenizer_address, Script(text_ids[:3]), body)

"""vLLM's /tokenize and /detokenize on the gateway, against the real tokenizer service."""

from __future__ import annotations

import aiohttp

from shardline.core.text.tokenizer import Tokenizer
from tests.gateway.conftest import TEXT
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import MODEL, Script

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]


async def _post(stack: Stack, path: str, body: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.base_url}{path}", json=body) as response:
            return response.status, await response.json()


def test_tokenize_and_detokenize_round_trip(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    async def body(stack: Stack) -> None:
        status, tokens = await _post(stack, "/tokenize", {"model": MODEL, "prompt": TEXT})
        assert status == 200, tokens
        assert tokens["tokens"] == tokenizer.encode_batch([TEXT], add_special_tokens=True)[0]
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 8192
        status, text = await _post(stack, "/detokenize", {"model": MODEL, "tokens": text_ids})
        assert (status, text) == (200, {"prompt": TEXT})
        status, plain = await _post(stack, "/tokenize", {"prompt": "hi", "add_special_tokens": False})  # model optional
        assert status == 200 and plain["tokens"] == tokenizer.encode_batch(["hi"], add_special_tokens=False)[0]

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_a_chats_count_is_its_prompt_tokens_in_usage(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        status, tokens = await _post(stack, "/tokenize", {"model": MODEL, "messages": MESSAGES})
        assert status == 200, tokens
        status, chat = await _post(
            stack, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
        )
        assert status == 200 and tokens["count"] == chat["usage"]["prompt_tokens"]
        assert list(stack.scheduler.submitted[0].prompt_token_ids) == tokens["tokens"]
        _, bare = await _post(stack, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
        assert bare["count"] < tokens["count"] and tokens["tokens"][: bare["count"]] == bare["tokens"]

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_bad_tokenize_requests_name_the_field(tokenizer_address, text_ids) -> None:
    cases = [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "return_token_strs"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens"),
        ("/tokenize", ["x"], 400, "body"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
        # Tools are rendered as chat renders them, so checked as chat checks them.
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools[0]"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": MESSAGES, "prompt": "x"}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
    ]

    async def body(stack: Stack) -> None:
        for path, request, status, param in cases:
            got, error = await _post(stack, path, request)
            assert (got, error["error"]["param"]) == (status, param), (path, request, error)

    run_on_stack(tokenizer_address, Script(text_ids), body)

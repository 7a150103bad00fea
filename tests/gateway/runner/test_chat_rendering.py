"""vLLM's chat rendering options (chat_template_kwargs, documents, add_generation_prompt,
continue_final_message), over HTTP and over gRPC: what reaches the scheduler, and the 400s."""

from __future__ import annotations

import grpc
import openai
import pytest

from shardline.client import AsyncShardlineClient
from shardline.core.text.chat_template import ChatTemplate
from shardline.core.text.tokenizer import Tokenizer
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.http_api.test_openai_http import client
from tests.gateway.scripted_scheduler import MODEL, Script


def test_chat_rendering_options_over_http(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    """vLLM's add_generation_prompt, continue_final_message, chat_template_kwargs and documents."""
    template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
    messages = [{"role": "user", "content": "Name a fox."}, {"role": "assistant", "content": "The red"}]

    def ids(**kwargs) -> list[int]:
        return tokenizer.encode_batch([template.render(messages, **kwargs)], add_special_tokens=False)[0]

    async def body(stack: Stack) -> None:
        openai_client = client(stack)
        await openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body={"continue_final_message": True}
        )
        await openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body={"add_generation_prompt": False}
        )
        await openai_client.chat.completions.create(  # the default template reads neither: same prompt
            model=MODEL,
            messages=messages,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}, "documents": [{"text": "x"}]},
        )
        prompts = [list(s.prompt_token_ids) for s in stack.scheduler.submitted]
        assert prompts == [
            ids(add_generation_prompt=False, continue_final_message=True),
            ids(add_generation_prompt=False),
            ids(),
        ]
        assert tokenizer.decode(prompts[0], skip_special_tokens=False).endswith("assistant\nThe red")
        for extra, field in (
            ({"chat_template": "{{ messages }}"}, "chat_template"),
            ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
            ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
            ({"documents": ["x"]}, "documents"),
            ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                await openai_client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=2, extra_body=extra
                )
            assert caught.value.body["param"] == field
        with pytest.raises(openai.BadRequestError) as caught:
            await openai_client.chat.completions.create(
                model=MODEL, messages=messages[:1], max_tokens=2, extra_body={"continue_final_message": True}
            )
        assert caught.value.body["param"] == "continue_final_message"

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_chat_rendering_options_over_grpc(tokenizer_address, text_ids, tokenizer: Tokenizer) -> None:
    template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
    messages = [{"role": "user", "content": "Name a fox."}, {"role": "assistant", "content": "The red"}]

    async def body(stack: Stack) -> None:
        async with AsyncShardlineClient(f"127.0.0.1:{stack.gateway.grpc.port}") as sdk:
            await sdk.generate(messages=messages, continue_final_message=True, max_tokens=2)
            await sdk.generate(
                messages=messages,
                add_generation_prompt=False,
                max_tokens=2,
                chat_template_kwargs={"enable_thinking": False},
            )
            await sdk.generate(messages=messages, max_tokens=2)
            expected = [
                template.render(messages, add_generation_prompt=False, continue_final_message=True),
                template.render(messages, add_generation_prompt=False),
                template.render(messages),
            ]
            assert [list(s.prompt_token_ids) for s in stack.scheduler.submitted] == [
                tokenizer.encode_batch([text], add_special_tokens=False)[0] for text in expected
            ]
            for kwargs, field in (
                ({"continue_final_message": True, "add_generation_prompt": True}, "messages.continue_final_message"),
                ({"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs.messages"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await sdk.generate(messages=messages, max_tokens=2, **kwargs)
                assert caught.value.details().startswith(f"{field}:"), caught.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await sdk.generate(messages=messages[:1], continue_final_message=True, max_tokens=2)
            assert caught.value.details().startswith("messages.continue_final_message:")

    run_on_stack(tokenizer_address, Script(text_ids), body)

"""vLLM's /tokenize and /detokenize: the served model's tokenizer over HTTP, without generating.

Clients count a prompt's tokens (a chat's as the chat endpoint renders it, so `count` equals the
usage's prompt_tokens) and build prompts of an exact length. A `model` that is given must be the
served one (404 otherwise), as on the other endpoints.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.http_api.openai_request import chat_messages
from gateway.runner.generation_spec import prompt_texts
from gateway.runner.params import ContextLengthExceeded, json_field
from gateway.runner.request_runner import ModelNotFound, RequestRunner
from gateway.tools.tool_params import tools_from_openai
from gateway.upstream.backends import RPC_TIMEOUT_S, upstream
from shardline.core.errors import InvalidArgument
from shardline.proto import tokenizer_pb2


class TokenizeApi:
    """The two handlers; `body` is the request's parsed JSON object."""

    def __init__(self, runner: RequestRunner) -> None:
        self._runner = runner

    async def tokenize(self, body: Any) -> web.Response:
        """{"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}."""
        info = await self._model_info(body)
        tokenizer = self._runner.backends.tokenizer
        if json_field(body, "return_token_strs", bool):
            raise InvalidArgument("return_token_strs", "token strings are not supported; /detokenize decodes ids")
        if "messages" in body and "prompt" in body:
            raise InvalidArgument("prompt", "give a prompt or messages, not both")
        with self._runner.admission.admit():
            if "messages" in body:
                if json_field(body, "add_special_tokens", bool):
                    raise InvalidArgument("add_special_tokens", "a chat's special tokens come from its template")
                conversation = chat_messages(body)  # rendered as the chat endpoint renders it, tools included
                chat = conversation.chat
                assert chat is not None
                await self._runner.prompt_bound.check(prompt_texts(conversation), info.max_context_length, "messages")
                tools = tools_from_openai(body)
                chat.tools_json = tools.tools_json if tools is not None else ""
                with upstream("tokenizer"):
                    reply = await tokenizer.ApplyChatTemplate(chat, timeout=RPC_TIMEOUT_S)
                tokens = list(reply.prompt_token_ids)
            else:
                prompt = json_field(body, "prompt", str)
                if prompt is None:
                    raise InvalidArgument("prompt", "give a prompt (a string) or messages")
                special = json_field(body, "add_special_tokens", bool)
                await self._runner.prompt_bound.check([prompt], info.max_context_length, "prompt")
                request = tokenizer_pb2.TokenizeRequest(
                    texts=[prompt], add_special_tokens=True if special is None else special
                )
                try:
                    with upstream("tokenizer"):
                        encoded = await tokenizer.Tokenize(request, timeout=RPC_TIMEOUT_S)
                except InvalidArgument as exc:  # the tokenizer's own refusal by size names its texts[0]
                    raise ContextLengthExceeded("prompt", str(exc).partition(": ")[2]) from exc
                tokens = list(encoded.token_ids[0].ids)
        return web.json_response({"count": len(tokens), "max_model_len": info.max_context_length, "tokens": tokens})

    async def detokenize(self, body: Any) -> web.Response:
        """{"tokens": [ids]} -> {"prompt": their text}, special tokens included (as vLLM decodes)."""
        info = await self._model_info(body)
        tokens = json_field(body, "tokens", list)
        if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidArgument("tokens", "must be a list of token ids")
        if outside := [t for t in tokens if not 0 <= t < info.vocab_size]:
            raise InvalidArgument("tokens", f"token id {outside[0]} is outside the vocabulary")
        with upstream("tokenizer"):
            reply = await self._runner.backends.tokenizer.Detokenize(
                tokenizer_pb2.DetokenizeRequest(
                    items=[tokenizer_pb2.DetokenizeItem(new_token_ids=tokens, final=True, skip_special_tokens=False)]
                ),
                timeout=RPC_TIMEOUT_S,
            )
        return web.json_response({"prompt": reply.results[0].text})

    async def _model_info(self, body: Any) -> tokenizer_pb2.TokenizerInfo:
        if not isinstance(body, dict):
            raise InvalidArgument("body", "must be a JSON object")
        info = await self._runner.backends.tokenizer_info()
        model = json_field(body, "model", str)
        if model and model != info.model:
            raise ModelNotFound(f"model {model!r} is not served here")
        return info

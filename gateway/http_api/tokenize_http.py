"""vLLM's /tokenize and /detokenize: the served model's tokenizer over HTTP, without generating.

Clients count a prompt's tokens (a chat's as the chat endpoint renders it, so `count` equals the
usage's prompt_tokens) and build prompts of an exact length. A `model` that is given must be the
served one (404 otherwise), as on the other endpoints.
"""

from __future__ import annotations

from aiohttp import web

from gateway.http_api.tokenize_request import DetokenizeRequest, TokenizeRequest
from gateway.runner.generation_spec import prompt_texts
from gateway.runner.params import ContextLengthExceeded
from gateway.runner.request_runner import ModelNotFound, RequestRunner
from gateway.upstream.backends import RPC_TIMEOUT_S, upstream
from shardline.core.errors import InvalidArgument
from shardline.proto import tokenizer_pb2


class TokenizeApi:
    """The two handlers, on the parsed requests."""

    def __init__(self, runner: RequestRunner) -> None:
        self._runner = runner

    async def tokenize(self, request: TokenizeRequest) -> web.Response:
        """-> {"count", "max_model_len", "tokens"}."""
        info = await self._model_info(request.model)
        prompt, context = request.prompt, info.max_context_length
        with self._runner.admission.admit():
            await self._runner.prompt_bound.check(prompt_texts(prompt), context, prompt.field)
            if prompt.chat is not None:
                with upstream("tokenizer"):
                    reply = await self._runner.backends.tokenizer.ApplyChatTemplate(prompt.chat, timeout=RPC_TIMEOUT_S)
                tokens = list(reply.prompt_token_ids)
            else:
                tokens = await self._tokenize(prompt.text or "", request.add_special_tokens)
        return web.json_response({"count": len(tokens), "max_model_len": context, "tokens": tokens})

    async def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        request = tokenizer_pb2.TokenizeRequest(texts=[text], add_special_tokens=add_special_tokens)
        try:
            with upstream("tokenizer"):
                encoded = await self._runner.backends.tokenizer.Tokenize(request, timeout=RPC_TIMEOUT_S)
        except InvalidArgument as exc:  # the tokenizer's own refusal by size names its texts[0]
            raise ContextLengthExceeded("prompt", str(exc).partition(": ")[2]) from exc
        return list(encoded.token_ids[0].ids)

    async def detokenize(self, request: DetokenizeRequest) -> web.Response:
        """-> {"prompt": the tokens' text}, special tokens included (as vLLM decodes)."""
        info = await self._model_info(request.model)
        if outside := [t for t in request.tokens if not 0 <= t < info.vocab_size]:
            raise InvalidArgument("tokens", f"token id {outside[0]} is outside the vocabulary")
        item = tokenizer_pb2.DetokenizeItem(new_token_ids=request.tokens, final=True, skip_special_tokens=False)
        with upstream("tokenizer"):
            reply = await self._runner.backends.tokenizer.Detokenize(
                tokenizer_pb2.DetokenizeRequest(items=[item]), timeout=RPC_TIMEOUT_S
            )
        return web.json_response({"prompt": reply.results[0].text})

    async def _model_info(self, model: str) -> tokenizer_pb2.TokenizerInfo:
        info = await self._runner.backends.tokenizer_info()
        if model and model != info.model:
            raise ModelNotFound(f"model {model!r} is not served here")
        return info

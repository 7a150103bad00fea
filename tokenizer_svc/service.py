"""The Tokenizer gRPC servicer: batched encode, chat templates, batched incremental detokenize.

Every rpc is stateless, so any replica can answer any call. The Rust tokenizer work runs in a
worker thread (asyncio.to_thread) so one large batch never stalls the other rpcs on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, TypeVar

import grpc

from shardline.core.errors import InvalidArgument
from shardline.core.text.chat_template import ChatTemplate, ChatTemplateError
from shardline.core.text.detokenizer import PREFIX_WINDOW, checked_item, detokenize_batch
from shardline.core.text.tokenizer import Tokenizer
from shardline.proto import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.chat_messages import template_messages, template_tools, template_variables
from tokenizer_svc.prompt_size import PromptSize
from tokenizer_svc.structured_output_check import StructuredOutputChecker

logger = logging.getLogger(__name__)
T = TypeVar("T")

# ChatTemplateError messages name the offending message as "messages[3].content"; the gateway
# turns that into the `param` of its error, so it is lifted out of the text.
_MESSAGE_FIELD = re.compile(r"messages\[\d+\](?:\.\w+)?")


class TokenizerService(tokenizer_pb2_grpc.TokenizerServicer):
    """Serves one model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, max_context_length: int) -> None:
        self._tokenizer = tokenizer
        self._info = tokenizer_pb2.TokenizerInfo(
            model=model_name,
            vocab_size=tokenizer.vocab_size,
            eos_token_ids=tokenizer.eos_token_ids,
            max_context_length=max_context_length,
            special_token_ids=sorted(tokenizer.special_token_ids),
            detokenize_prefix_window=PREFIX_WINDOW,
        )
        if tokenizer.bos_token_id is not None:
            self._info.bos_token_id = tokenizer.bos_token_id
        self._definition: tokenizer_pb2.TokenizerDefinition | None = None
        self._template: ChatTemplate | None = None
        # Kept so ApplyChatTemplate can say why there is no template (none, or one that does not compile).
        self._template_problem = ""
        try:
            self._template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
        except ChatTemplateError as exc:
            self._template_problem = str(exc)
            logger.warning("%s: chat completions are unavailable (%s)", model_name, exc)
        self._info.has_chat_template = self._template is not None
        if self._template is not None:
            self._info.tool_call_format = self._template.tool_call_format
        self._structured_output = StructuredOutputChecker()
        self._size = PromptSize(tokenizer, max_context_length)

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        texts = list(request.texts)
        for index, text in enumerate(texts):  # each refused by its size before any of them is tokenized
            if (problem := self._size.problem(text)) is not None:
                return _refuse(context, InvalidArgument(f"texts[{index}]", problem), tokenizer_pb2.TokenizeResponse())
        ids = await asyncio.to_thread(self._tokenizer.encode_batch, texts, add_special)
        return tokenizer_pb2.TokenizeResponse(token_ids=[common_pb2.TokenIds(ids=seq) for seq in ids])

    async def ApplyChatTemplate(
        self, request: tokenizer_pb2.ApplyChatTemplateRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        if self._template is None:
            raise InvalidArgument("messages", self._template_problem)
        if request.continue_final_message and request.add_generation_prompt:
            raise InvalidArgument("continue_final_message", "cannot be combined with add_generation_prompt")
        messages = template_messages(list(request.messages))
        variables = {**template_variables(request.template_kwargs_json), "tools": template_tools(request.tools_json)}
        prompt, ids = await asyncio.to_thread(self._render, messages, request, variables)
        if ids is None:
            problem = self._size.problem(prompt) or ""
            return _refuse(context, InvalidArgument("messages", problem), tokenizer_pb2.ApplyChatTemplateResponse())
        return tokenizer_pb2.ApplyChatTemplateResponse(prompt=prompt, prompt_token_ids=ids)

    def _render(
        self, messages: list[dict[str, Any]], request: tokenizer_pb2.ApplyChatTemplateRequest, variables: dict[str, Any]
    ) -> tuple[str, list[int] | None]:
        """The prompt, and its ids: None when its size shows it cannot fit the context."""
        assert self._template is not None
        try:
            prompt = self._template.render(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                variables=variables,
            )
        except ChatTemplateError as exc:
            found = _MESSAGE_FIELD.search(str(exc))
            field = found.group(0) if found else "chat_template_kwargs" if request.template_kwargs_json else "messages"
            message = str(exc)
            if message.startswith(f"{field}"):  # the message names it already: the client's error names it once
                message = message[len(field) :].lstrip(" :") or message
            raise InvalidArgument(field, message) from exc
        try:  # variables and tools may carry an escaped lone surrogate, which the template wrote out
            prompt.encode()
        except UnicodeEncodeError:
            raise InvalidArgument(
                "messages",
                "the rendered prompt is not Unicode text (a lone surrogate "
                "in the messages, tools or template variables)",
            ) from None
        if self._size.problem(prompt) is not None:
            return prompt, None
        # The template writes the special tokens itself (BOS included, where the model has one).
        return prompt, self._tokenizer.encode_batch([prompt], add_special_tokens=False)[0]

    async def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DetokenizeResponse:
        vocab = self._tokenizer.vocab_size
        items = [
            checked_item(i, it.prefix_token_ids, it.new_token_ids, it.skip_special_tokens, it.final, vocab)
            for i, it in enumerate(request.items)
        ]
        results = await asyncio.to_thread(detokenize_batch, self._tokenizer, items)
        token_bytes = self._tokenizer.token_bytes
        return tokenizer_pb2.DetokenizeResponse(
            results=[
                tokenizer_pb2.DetokenizeResult(
                    text=text, num_consumed=n, raw_bytes=token_bytes(item.new_token_ids) if item.raw_bytes else b""
                )
                for (text, n), item in zip(results, request.items)
            ]
        )

    async def GetInfo(
        self, request: tokenizer_pb2.GetTokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfo:
        return self._info

    async def GetDefinition(
        self, request: tokenizer_pb2.GetTokenizerDefinitionRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerDefinition:
        if self._definition is None:  # serialized once: a gateway asks when it starts, or after a failure
            self._definition = tokenizer_pb2.TokenizerDefinition(
                tokenizer_json=await asyncio.to_thread(self._tokenizer.backend.to_str), model=self._info.model
            )
        return self._definition

    async def CheckStructuredOutput(
        self, request: tokenizer_pb2.CheckStructuredOutputRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.CheckStructuredOutputResponse:
        return tokenizer_pb2.CheckStructuredOutputResponse(
            error=await self._structured_output.error(request.structured_output)
        )


def _refuse(context: grpc.aio.ServicerContext, error: InvalidArgument, empty: T) -> T:
    """Answer `error` without raising it. An abort's exception is kept by grpc, and its traceback
    holds the handler's frames, so the request too, in a reference cycle that only the garbage
    collector breaks, much later: refused 3 MB prompts kept 6 MB each alive that way."""
    context.set_code(error.code)
    context.set_details(str(error))
    return empty

"""The OpenAI-compatible HTTP API (aiohttp): completions, chat completions, models, health, metrics, and
vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.http_api.errors import error_body, openai_errors
from gateway.http_api.openai_choices import (
    Choice,
    choice_specs,
    close_choices,
    merged_chunks,
    start_choices,
    total_usage,
)
from gateway.http_api.openai_echo import echoed_prompts
from gateway.http_api.openai_fields import json_field
from gateway.http_api.openai_request import (
    OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS,
    OpenAIRequest,
    SamplingFields,
    parse_request,
)
from gateway.http_api.openai_response import ResponseFormatter
from gateway.http_api.request_body import json_body
from gateway.http_api.tokenize_http import TokenizeApi
from gateway.http_api.tokenize_request import parse_detokenize, parse_tokenize
from gateway.metrics import metrics_handler
from gateway.runner.request_attach import ID_HEADER
from gateway.runner.request_runner import ModelNotFound, RequestRunner, answer_status
from gateway.tenancy.auth import ApiKeys, http_auth_middleware
from gateway.tools.tool_params import ToolRequest, keeps_special_tokens, resolve_parser
from gateway.upstream.backends import HEALTH_TIMEOUT_S
from shardline.core.errors import InvalidArgument, ShardlineError
from shardline.core.ids import require_named_id
from shardline.proto import generation_pb2, sampling_pb2
from tracing import attributes as attr
from tracing.grpc_context import start_http_server_span

_DONE = b"data: [DONE]\n\n"


# Seconds a client should wait before retrying a full queue (429) or a missing dependency (503).
RETRY_AFTER_S = 1
# Seconds a request body may take to arrive in full: a client trickling its bytes would otherwise
# hold a connection and a handler for as long as it liked (aiohttp sets no limit of its own).
BODY_TIMEOUT_S = 30.0


class BodyTimeout(ShardlineError):
    """The request body did not arrive within BODY_TIMEOUT_S: 408, and the connection is closed."""

    http_status = 408


class BodyUnreadable(InvalidArgument):
    """The body does not decode under its Content-Encoding, or its chunked framing is broken: 400, and
    the connection is closed, since where the next request would start in it is unknown."""


class OpenAIHttpApi:
    """Routes and handlers of the OpenAI-compatible API."""

    def __init__(
        self,
        runner: RequestRunner,
        keys: ApiKeys,
        batch_counts: Callable[[], Awaitable[dict[str, int]]] | None = None,
    ) -> None:
        self._runner = runner
        self._keys = keys
        self._batch_counts = batch_counts  # the Batch API's batches by status, for /metrics; None: it is off
        self._tracer = runner.tracer
        self._started = int(time.time())
        self._tokenizer = TokenizeApi(runner)

    def application(self) -> web.Application:
        app = web.Application(
            client_max_size=self._runner.settings.max_body_bytes,
            middlewares=[openai_errors, http_auth_middleware(self._keys)],
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", metrics_handler(self._runner.backends.scheduler, self._batch_counts))
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival_s = time.perf_counter()
        owner = self._keys.owner(request.headers.get("Authorization"))
        span_attributes = {
            "http.request.method": request.method,
            "url.path": request.path,
            attr.TENANT: self._runner.tenant(owner).name,
        }
        # The span opens before anything is checked, so that every answer, a refusal at the admission
        # gate or a 400 included, is a request span with its status: the collector's series count them.
        with (
            start_http_server_span(
                self._tracer, "gateway.request", request.headers, span_attributes, record_exception=False
            ) as span,
            answer_status(span),
        ):
            # A request the client names is idempotent: sent again, it attaches to the first (request_attach.py).
            # Its id goes on the span first, so that even a refusal at the gate is listed by it.
            named = request.headers.get(ID_HEADER)
            kind = "chatcmpl" if chat else "cmpl"
            request_id = require_named_id(named, ID_HEADER) if named is not None else f"{kind}-{secrets.token_hex(16)}"
            span.set_attribute(attr.REQUEST_ID, request_id)
            self._runner.admission.check()
            parsed = parse_request(await json_body(request), chat)
            if parsed.tools is not None:
                span.set_attribute(attr.TOOL_CHOICE, parsed.tools.choice)
                await self._resolve_tools(parsed.tools, parsed.sampling)
            default_max_tokens = (
                self._runner.settings.default_max_tokens if chat else OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS
            )
            specs = choice_specs(parsed, request_id, default_max_tokens, arrival_s, owner, idempotent=named is not None)
            choices = await start_choices(self._runner, specs, parsed.n, span)
            if len(choices) > 1:  # the id the client gets back finds the whole trace; its choices have rows
                span.set_attribute(attr.CHOICES, [choice.live.request_id for choice in choices])
            try:
                formatters = await self._formatters(request_id, parsed, choices)
                if parsed.stream:
                    return await self._stream(request, request_id, choices, formatters, parsed)
                completions = await asyncio.gather(*(choice.live.collect() for choice in choices))
            finally:
                # Also reached when the client disconnects (the handler is cancelled): cancels upstream.
                close_choices(choices)
        for completion in completions:
            if (failure := completion.failure()) is not None:
                raise failure
        usage = total_usage(choices, [completion.usage for completion in completions], parsed.echo_only)
        headers = {"X-Request-Id": request_id, **choices[-1].live.rate_limit_headers}
        return web.json_response(ResponseFormatter.whole_of(formatters, completions, usage), headers=headers)

    async def _resolve_tools(self, tools: ToolRequest, sampling: SamplingFields) -> None:
        """The parser of "auto" output, now that the model is known, and what it needs of the text."""
        template_format = (await self._runner.backends.tokenizer_info()).tool_call_format
        resolve_parser(tools, self._runner.settings.tool_call_parser, template_format)
        if keeps_special_tokens(tools) and sampling.skip_special_tokens is None:
            sampling.skip_special_tokens = False

    async def _formatters(
        self, request_id: str, parsed: OpenAIRequest, choices: list[Choice]
    ) -> list[ResponseFormatter]:
        """One formatter per choice, each with its echoed prompt when the request asked for echo."""
        created = int(time.time())
        lives = [choice.live for choice in choices]
        echoes = await echoed_prompts(self._runner, lives, parsed.echo_only) if parsed.echo else None
        return [
            ResponseFormatter(
                request_id,
                choice.live.model,
                parsed.chat,
                parsed.include_usage,
                choice.index,
                created,
                echoes[i] if echoes else None,
                parsed.prompt_logprobs,
                parsed.tools,
            )
            for i, choice in enumerate(choices)
        ]

    async def _stream(
        self,
        request: web.Request,
        request_id: str,
        choices: list[Choice],
        formatters: list[ResponseFormatter],
        parsed: OpenAIRequest,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": request_id,
                **choices[-1].live.rate_limit_headers,  # the latest admission's
            }
        )
        await response.prepare(request)
        usages: list[sampling_pb2.Usage | None] = [None] * len(choices)
        with self._tracer.start_as_current_span("stream_out", attributes={attr.REQUEST_ID: request_id}):
            async for index, chunk in merged_chunks(choices):
                if (failure := chunk.failure()) is not None:
                    # The same body a whole response's error has: the field at fault, OpenAI's code.
                    events = [
                        error_body(
                            failure.http_status,
                            str(failure),
                            getattr(failure, "field", None),
                            getattr(failure, "openai_code", None),
                        )
                    ]
                else:
                    events = formatters[index].choice_events(chunk)
                if chunk.finish_reason:
                    usages[index] = chunk.usage
                if events:
                    await response.write(b"".join(_sse(event) for event in events))
            if parsed.include_usage:
                usage = total_usage(choices, usages, parsed.echo_only)
                await response.write(_sse(formatters[0].usage_event(usage)))
            await response.write(_DONE)
        await response.write_eof()
        return response

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer.tokenize(parse_tokenize(await json_body(request)))

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer.detokenize(parse_detokenize(await json_body(request)))

    async def models(self, request: web.Request) -> web.Response:
        models = await self._runner.served_models()
        return web.json_response({"object": "list", "data": [self._model_card(m) for m in models]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        for m in await self._runner.served_models():
            if m.name == name:
                return web.json_response(self._model_card(m))
        raise ModelNotFound(f"model {name!r} is not served here")

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        name = json_field(body, "lora_name", str) or ""
        await self._runner.lora_updates.load(name, json_field(body, "lora_path", str) or "")
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")  # vLLM's answer

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        name = json_field(await json_body(request), "lora_name", str) or ""
        await self._runner.lora_updates.unload(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def _model_card(self, m: generation_pb2.ModelInfo) -> dict[str, Any]:
        return {
            "id": m.name,
            "object": "model",
            "created": self._started,
            "owned_by": "shardline",
            "max_model_len": m.max_context_length,
            # As vLLM's cards: a LoRA adapter's base model, None for a base model.
            "parent": m.parent or None,
        }

    async def health(self, request: web.Request) -> web.Response:
        """200 when a request could be served now: the tokenizer and scheduler answer, this gateway's
        output subscription is open, and a live worker serves the model; else 503 (a readiness check)."""
        dependencies = await self._runner.backends.health()
        workers = 0
        if all(dependencies.values()):
            with contextlib.suppress(ShardlineError):
                workers = sum(m.num_workers for m in await self._runner.served_models(HEALTH_TIMEOUT_S) if not m.parent)
        subscribed = self._runner.hub.connected
        healthy = all(dependencies.values()) and subscribed and workers > 0
        body = {
            "status": "ok" if healthy else "unavailable",
            **dependencies,
            "subscribed": subscribed,
            "workers": workers,
        }
        return web.json_response(body, status=200 if healthy else 503)


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

"""The public gRPC API, shardline.v1.Generation."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import grpc
from google.protobuf import duration_pb2
from opentelemetry import trace

from gateway.output.request_stream import StreamChunk, drain, record_stream
from gateway.runner.chat_request import chat_request
from gateway.runner.generation_spec import GenerationSpec, Prompt
from gateway.runner.request_runner import RequestRunner, answer_status
from gateway.runner.submitted_request import SubmittedRequest
from gateway.tenancy.auth import ApiKeys
from gateway.tenancy.slo_params import Slo, checked_target
from gateway.tenancy.tenant_limiter import RateLimited
from gateway.tools.tool_calls import CallPiece, ToolCallOutput
from gateway.tools.tool_params import (
    ToolRequest,
    keeps_special_tokens,
    resolve_parser,
    tool_constraint,
    tools_from_grpc,
)
from gateway.upstream.backends import RPC_TIMEOUT_S, upstream
from shardline.core.errors import InvalidArgument, NotFound, ShardlineError, Unavailable
from shardline.core.ids import require_id, require_named_id
from shardline.proto import common_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2, scheduler_pb2, tokenizer_pb2
from tracing import attributes as attr

_FINISH_REASONS = {
    "stop": sampling_pb2.FINISH_REASON_STOP,
    "length": sampling_pb2.FINISH_REASON_LENGTH,
    "abort": sampling_pb2.FINISH_REASON_ABORT,
    "error": sampling_pb2.FINISH_REASON_ERROR,
    "tool_calls": sampling_pb2.FINISH_REASON_TOOL_CALLS,
}


class GenerationService(generation_pb2_grpc.GenerationServicer):
    """Generate, stream, cancel, resume and inspect requests."""

    def __init__(self, runner: RequestRunner, keys: ApiKeys) -> None:
        self._runner = runner
        self._keys = keys
        self._tracer = runner.tracer
        self._scheduler = runner.backends.scheduler
        self._gateway_id = runner.settings.gateway_id

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GenerateResponse:
        owner = self._keys.grpc_owner(context)
        # Open before anything is checked, so that a refusal or a bad request is a request span too.
        with (
            self._tracer.start_as_current_span(
                "gateway.request", attributes=self._open_attributes(owner), record_exception=False
            ) as span,
            answer_status(span),
        ):
            self._runner.admission.check()
            spec, tools = await self._spec(request, owner)
            span.set_attributes(_tool_attributes(tools))
            live = await self._start(spec, span, context)
            try:
                completion = await live.collect()
            finally:
                live.close()
        if (failure := completion.failure()) is not None:
            raise failure
        text, calls, finish_reason = completion.text, [], completion.finish_reason
        if tools is not None:
            message, finish_reason = ToolCallOutput(tools).message(completion.text, finish_reason)
            text = message["content"] or ""
            calls = [
                sampling_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                for c in message.get("tool_calls", ())
            ]
        return generation_pb2.GenerateResponse(
            request_id=spec.request_id,
            text=text,
            token_ids=completion.token_ids,
            logprobs=completion.logprobs,
            finish_reason=_FINISH_REASONS[finish_reason or "abort"],
            usage=completion.usage,
            prompt_logprobs=completion.prompt_logprobs,
            tool_calls=calls,
        )

    async def GenerateStream(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        owner = self._keys.grpc_owner(context)
        # No span is current across a yield: grpc abandons a stream at a yield when its client leaves
        # mid-write, and the event loop closes the generator later, from another context. It opens before
        # anything is checked, so that a refusal or a bad request is a request span too.
        span = self._tracer.start_span("gateway.request", attributes=self._open_attributes(owner))
        try:
            with trace.use_span(span), answer_status(span):  # current while submitting: Submit carries the trace
                self._runner.admission.check()
                spec, tools = await self._spec(request, owner)
                span.set_attributes(_tool_attributes(tools))
                live = await self._start(spec, span, context)
            output = ToolCallOutput(tools) if tools is not None else None
            stream_out = self._tracer.start_span(
                "stream_out", context=trace.set_span_in_context(span), attributes={attr.REQUEST_ID: spec.request_id}
            )
            try:
                async for chunk in live.chunks():
                    yield _stream_response(spec.request_id, chunk, output)
            finally:
                stream_out.end()
                # Also reached when the client goes away mid-stream: close() cancels the request
                # upstream, after a grace in which the client may Resume it.
                live.close(self._runner.settings.resume_grace_s)
        except Exception as exc:
            if not isinstance(exc, ShardlineError):  # answer_status marked those, without a traceback
                span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, str(exc))
            raise
        finally:
            span.end()

    def _open_attributes(self, owner: str) -> dict[str, str]:
        """What a request span knows when it opens: the tenant the caller's key counts against."""
        return {attr.TENANT: self._runner.tenant(owner).name}

    async def _start(
        self, spec: GenerationSpec, span: trace.Span, context: grpc.aio.ServicerContext
    ) -> SubmittedRequest:
        """Submit `spec`; over a tenant's limit, RESOURCE_EXHAUSTED with `retry-after` in the trailers."""
        try:
            return await self._runner.start(spec, span)
        except RateLimited as exc:
            await context.abort(exc.code, str(exc), trailing_metadata=exc.grpc_metadata())
            raise  # abort() raises; this only tells the type checker

    async def Cancel(
        self, request: common_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.CancelResponse:
        require_id(request.request_id, "request_id")  # here, naming the field, not in the scheduler's answer
        if self._keys.enabled:
            await self._owned(request.request_id, context)
        with upstream("scheduler"):
            return await self._scheduler.Cancel(request, timeout=RPC_TIMEOUT_S)

    async def Resume(
        self, request: generation_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """Replay the output from `offset` out of the request's record, then follow it live if it still runs."""
        require_id(request.request_id, "request_id")
        output = None
        if request.HasField("tools"):
            if request.offset:
                raise InvalidArgument("offset", "must be 0 with tools: calls are read from the start of the output")
            tools = tools_from_grpc(request.tools)
            if tools is not None:
                await self._resolve_parser(tools)
                output = ToolCallOutput(tools)
        hub = self._runner.hub
        info = await self._owned(request.request_id, context)
        running = info.status < sampling_pb2.REQUEST_STATUS_FINISHED
        if request.offset > len(info.output_token_ids):
            raise InvalidArgument("offset", f"the request has generated {len(info.output_token_ids)} tokens so far")
        if running and not await hub.wait_connected(RPC_TIMEOUT_S):
            raise Unavailable("the scheduler is unreachable: no output subscription")
        eos = (await self._runner.backends.tokenizer_info()).eos_token_ids
        # Deltas wait in `buffered` until the record is in, so none is lost or doubled around Attach.
        hub.register(record_stream(info, eos))
        try:
            if running:
                attach = scheduler_pb2.AttachRequest(request_id=info.request_id, gateway_id=self._gateway_id)
                with upstream("scheduler"):
                    info = await self._scheduler.Attach(attach, timeout=RPC_TIMEOUT_S)
            stream = await hub.apply_record(info.request_id, info, request.offset)
            async for chunk in drain(stream):
                yield _stream_response(info.request_id, chunk, output)
        finally:
            # A client that leaves mid-stream cancels the request, as with GenerateStream.
            hub.release(info.request_id, grace_s=self._runner.settings.resume_grace_s)

    async def GetRequest(
        self, request: common_pb2.GetRequestRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.RequestInfo:
        require_id(request.request_id, "request_id")
        info = await self._owned(request.request_id, context)
        info.ClearField("owner")  # the key's digest stays inside the platform
        return info

    async def _owned(self, request_id: str, context: grpc.aio.ServicerContext) -> common_pb2.RequestInfo:
        """The request's record, if the caller's key submitted it. Another key's request is NOT_FOUND,
        as an unknown one is: with keys on, a key reads, resumes and cancels only its own requests."""
        with upstream("scheduler"):
            info = await self._scheduler.GetRequest(
                common_pb2.GetRequestRequest(request_id=request_id), timeout=RPC_TIMEOUT_S
            )
        if info.owner != self._keys.grpc_owner(context):
            raise NotFound(f"request_id: no request {request_id!r}")
        return info

    async def ListModels(
        self, request: generation_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ListModelsResponse:
        return generation_pb2.ListModelsResponse(models=await self._runner.served_models())

    async def LoadLoraAdapter(
        self, request: common_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoraAdaptersResponse:
        adapters = await self._runner.lora_updates.load(request.lora_name, request.lora_path)
        return common_pb2.LoraAdaptersResponse(adapters=adapters)

    async def UnloadLoraAdapter(
        self, request: common_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoraAdaptersResponse:
        return common_pb2.LoraAdaptersResponse(adapters=await self._runner.lora_updates.unload(request.lora_name))

    async def _resolve_parser(self, tools: ToolRequest) -> None:
        info = await self._runner.backends.tokenizer_info()
        resolve_parser(tools, self._runner.settings.tool_call_parser, info.tool_call_format, "tools.choice")

    async def _spec(
        self, request: generation_pb2.GenerateRequest, owner: str
    ) -> tuple[GenerationSpec, ToolRequest | None]:
        """The request as a GenerationSpec, and its tools (their constraint, if any, in its params)."""
        prompt = _prompt(request)
        if request.HasField("request_id"):
            request_id = require_named_id(request.request_id, "request_id")
        else:
            request_id = f"{'chatcmpl' if prompt.chat is not None else 'cmpl'}-{secrets.token_hex(16)}"
        timeout_s = _positive_seconds(request.timeout, "timeout") if request.HasField("timeout") else None
        tools, structured_output_field = await self._tools(request, prompt)
        return GenerationSpec(
            request_id=request_id,
            model=request.model,
            prompt=prompt,
            params=request.params,
            default_max_tokens=self._runner.settings.default_max_tokens,
            priority=request.priority,
            timeout_s=timeout_s,
            field_prefix="params.",
            structured_output_field=structured_output_field,
            owner=owner,
            slo=Slo(
                checked_target(_positive_seconds(request.ttft_target, "ttft_target"), "ttft_target")
                if request.HasField("ttft_target")
                else None,
                request.refuse_late if request.HasField("refuse_late") else None,
            ),
        ), tools

    async def _tools(self, request: generation_pb2.GenerateRequest, prompt: Prompt) -> tuple[ToolRequest | None, str]:
        """The request's tools, with their constraint put on its params and their definitions on its
        chat; and the field its constraint came from, for errors."""
        structured_output_field = "params.structured_output"
        tools = tools_from_grpc(request.tools) if request.HasField("tools") else None
        if tools is None:
            return None, structured_output_field
        if prompt.chat is None:
            raise InvalidArgument("tools", "tool calling needs messages (a chat)")
        prompt.chat.tools_json = tools.tools_json
        params = request.params
        given = params.structured_output if params.HasField("structured_output") else None
        constraint = tool_constraint(tools, given, structured_output_field)
        if constraint is not None:
            params.structured_output.CopyFrom(constraint)
            structured_output_field = "tools"
        await self._resolve_parser(tools)
        if keeps_special_tokens(tools) and not params.HasField("skip_special_tokens"):
            params.skip_special_tokens = False
        return tools, structured_output_field


def _prompt(request: generation_pb2.GenerateRequest) -> Prompt:
    """The request's input: its text, its conversation or its token ids."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return Prompt(text=request.prompt)
    if kind == "messages":
        return Prompt(chat=_chat(request.messages), field="messages")
    if kind == "prompt_token_ids":
        return Prompt(token_ids=list(request.prompt_token_ids.ids), field="prompt_token_ids")
    raise InvalidArgument("input", "set one of prompt, messages or prompt_token_ids")


def _positive_seconds(duration: duration_pb2.Duration, field: str) -> float:
    """A Duration's seconds, checked as protobuf defines it. Not ToTimedelta(), which overflows (a
    server error) on seconds beyond timedelta's range; a budget over the gateway's own is cut to it."""
    nanos, seconds = duration.nanos, duration.seconds
    if not -999_999_999 <= nanos <= 999_999_999 or (seconds and nanos and (seconds < 0) != (nanos < 0)):
        raise InvalidArgument(field, f"is not a valid Duration (seconds={seconds}, nanos={nanos})")
    total = seconds + nanos / 1e9
    if total <= 0:
        raise InvalidArgument(field, "must be positive")
    return total


def _chat(messages: generation_pb2.ChatMessages) -> tokenizer_pb2.ApplyChatTemplateRequest:
    generation_prompt = messages.add_generation_prompt if messages.HasField("add_generation_prompt") else None
    return chat_request(
        list(messages.messages),
        generation_prompt,
        messages.continue_final_message,
        messages.template_kwargs_json,
        prefix="messages.",
    )


def _tool_attributes(tools: ToolRequest | None) -> dict[str, str]:
    return {attr.TOOL_CHOICE: tools.choice} if tools is not None else {}


def _stream_response(
    request_id: str, chunk: StreamChunk, tools: ToolCallOutput | None = None
) -> generation_pb2.GenerateStreamResponse:
    """One chunk on the wire; with tools, its text split into what the model said and its calls."""
    if (failure := chunk.failure()) is not None:
        raise failure
    text, finish_reason = chunk.text, chunk.finish_reason
    pieces: list[CallPiece] = []
    if tools is not None:
        text, pieces = tools.feed(chunk.text, final=finish_reason is not None)
        finish_reason = tools.finish_reason(finish_reason)
    response = generation_pb2.GenerateStreamResponse(
        request_id=request_id,
        text=text,
        token_ids=chunk.token_ids,
        offset=chunk.offset,
        logprobs=chunk.logprobs,
        prompt_logprobs=chunk.prompt_logprobs,
        tool_calls=[
            generation_pb2.ToolCallDelta(index=p.index, id=p.id or "", name=p.name or "", arguments=p.arguments)
            for p in pieces
        ],
    )
    if finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[finish_reason]
        response.usage.CopyFrom(chunk.usage)
    return response

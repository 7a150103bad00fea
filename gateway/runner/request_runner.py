"""One request's way through the gateway, shared by the gRPC and HTTP front ends.

Resolve the model and parameters, tokenize (chat template included), register with the stream hub,
Submit; then hand the consumer its chunks, and at the end cancel upstream if the consumer left early
and record the request's metrics and detokenize span.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import trace

from gateway.output.collected_output import CollectedOutput
from gateway.output.request_stream import RequestStream, StreamChunk
from gateway.output.stop_matcher import StopMatcher
from gateway.output.stream_hub import StreamHub
from gateway.runner.admission import Admission
from gateway.runner.params import ContextLengthExceeded, ModelLimits, resolve_max_tokens, validate_sampling
from gateway.runner.prompt_bound import PromptBound
from gateway.runner.request_attach import attach_existing
from gateway.runner.request_metrics import RequestEnd, record_end
from gateway.settings import GatewaySettings
from gateway.tenancy.slo_params import Slo
from gateway.tenancy.tenant_limiter import Hold, RateLimited, limiter_for
from gateway.tenancy.tenants import Tenant, TenantDirectory, tenant_of
from gateway.tenancy.tenants_redis import RedisTenantDirectory
from gateway.upstream.backends import RPC_TIMEOUT_S, Backends, upstream
from shardline.core.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    RequestIdTaken,
    ResourceExhausted,
    Unavailable,
)
from shardline.proto import generation_pb2, sampling_pb2, scheduler_pb2, tokenizer_pb2
from tracing import attributes as attr

logger = logging.getLogger(__name__)

# How long a request waits for the scheduler subscription to (re)open before answering 503: one
# reconnect at the hub's longest backoff.
SUBSCRIPTION_WAIT_S = 2.0
# The scheduler aborts a request at its deadline; the gateway gives it this long to say so.
DEADLINE_GRACE_S = 5.0
# An abort that arrives this close to the deadline (or later) is the scheduler's deadline cancel;
# the scheduler's clock is another machine's, so allow some skew.
DEADLINE_SKEW_S = 1.0


class ModelNotFound(NotFound):
    """The request names a model this gateway does not serve."""

    field = "model"


@dataclass(slots=True)
class Prompt:
    """What to continue: exactly one of text, chat and token_ids is set."""

    text: str | None = None  # raw prompt text, tokenized with the tokenizer's special tokens
    # A conversation and how to render it (tools, template variables), for the chat template.
    chat: tokenizer_pb2.ApplyChatTemplateRequest | None = None
    token_ids: list[int] | None = None  # an already tokenized prompt
    field: str = "prompt"  # the request field it came from, named in errors


@dataclass(slots=True)
class GenerationSpec:
    """A parsed request, ready to validate, tokenize and submit."""

    request_id: str  # cmpl-..., chatcmpl-... or the client's own
    model: str  # requested model; empty picks the served one
    prompt: Prompt
    params: sampling_pb2.SamplingParameters  # as the client sent them, not yet validated
    default_max_tokens: int | None  # max_tokens when the client gave none; None: the rest of the context
    priority: int = 0  # lower is served first
    timeout_s: float | None = None  # the client's own budget, within the gateway's
    field_prefix: str = ""  # put before parameter names in errors ("params." over gRPC)
    max_tokens_field: str = "max_tokens"  # the name the client gave max_tokens, for errors
    # Where the client gave its constraint, for errors, prefix included ("tools" when its tool_choice set it).
    structured_output_field: str = "structured_output"
    arrival_s: float = field(default_factory=time.perf_counter)  # for TTFT and duration
    arrival_time: Timestamp = field(default_factory=lambda: _now_timestamp(0.0))  # sent to the scheduler
    owner: str = ""  # digest of the caller's API key: only that key may read, resume or cancel it
    # Named by the client over HTTP: a resend attaches to it (request_attach.py), and its client
    # leaving does not cancel it, so that the resend finds it running or finished.
    idempotent: bool = False
    slo: Slo = Slo()  # its TTFT target and refuse_late, as the client gave them (its tenant's fill in)


@dataclass(slots=True)
class PreparedRequest:
    """A request validated and tokenized, not yet submitted."""

    spec: GenerationSpec
    span: trace.Span  # the request's span: its attributes, and the Submit rpc's trace context
    info: tokenizer_pb2.TokenizerInfo  # the served model's tokenizer facts
    params: sampling_pb2.SamplingParameters  # resolved, max_tokens included
    prompt_ids: list[int]
    tenant: Tenant  # the tenant it counts against
    slo: Slo  # its effective SLO: its own, else its tenant's


class SubmittedRequest:
    """A submitted request: its chunks, and the bookkeeping when its consumer is done."""

    def __init__(
        self,
        runner: RequestRunner,
        spec: GenerationSpec,
        model: str,
        stream: RequestStream,
        span: trace.Span,
        deadline_s: float,
        prepared: PreparedRequest,
        hold: Hold | None = None,
    ) -> None:
        self.request_id = spec.request_id
        self.model = model
        self.prompt_tokens = stream.prompt_tokens
        self.prompt = spec.prompt  # as the client sent it
        self.prompt_ids = prepared.prompt_ids  # as the model reads it
        self._tenant, self._ttft_target_s = prepared.tenant.name, prepared.slo.ttft_target_s
        self._runner = runner
        self._spec = spec
        self._stream = stream
        self._span = span
        self._deadline_s = deadline_s
        self._last: StreamChunk | None = None
        self._hold = hold  # its charge to its tenant's limits, ended when the request ends
        self.rate_limit_headers = hold.headers if hold is not None else {}  # OpenAI's x-ratelimit-*

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        """The output as it is produced; the last chunk has finish_reason and usage."""
        while self._last is None or self._last.finish_reason is None:
            try:
                async with asyncio.timeout(max(0.0, self._deadline_s - time.perf_counter()) + DEADLINE_GRACE_S):
                    chunk = await self._stream.queue.get()
                if chunk.finish_reason == "abort" and time.perf_counter() > self._deadline_s - DEADLINE_SKEW_S:
                    chunk.error = self._timed_out()  # the scheduler ends a request at its deadline by cancelling it
            except TimeoutError:
                logger.warning("%s: no end from the scheduler past the deadline; aborting", self.request_id)
                self._runner.hub.release(self.request_id)
                completed = self._stream.next_offset
                chunk = StreamChunk(
                    "", [], completed, finish_reason="abort", error=self._timed_out(), usage=self._stream.usage()
                )
            self._last = chunk
            if chunk.finish_reason is not None and self._hold is not None and self._runner.limiter is not None:
                await self._runner.limiter.settle(self._hold, chunk)  # before the client has it: its slot is free
            yield chunk

    def _timed_out(self) -> str:
        return f"request timed out after {self._deadline_s - self._spec.arrival_s:g} s"

    async def collect(self) -> CollectedOutput:
        """The whole output, once the request finishes."""
        completion = CollectedOutput()
        async for chunk in self.chunks():
            completion.add(chunk)
        return completion

    def close(self, grace_s: float = 0.0) -> None:
        """The consumer is done or gone: cancel upstream if unfinished (after `grace_s`, unless the
        request is resumed meanwhile), record metrics and spans."""
        self._runner.hub.release(self.request_id, cancel=not self._spec.idempotent, grace_s=grace_s)
        finished = self._last is not None and self._last.finish_reason is not None
        if not finished and self._hold is not None and self._runner.limiter is not None:
            self._runner.limiter.detach(self._hold)  # it still holds its slot until it ends
        end = RequestEnd(
            request_id=self.request_id,
            model=self.model,
            tenant=self._tenant,
            ttft_target_s=self._ttft_target_s,
            arrival_s=self._spec.arrival_s,
            timing=self._stream.timing,
            end_s=time.perf_counter(),
            usage=self._last.usage if finished else self._stream.usage(),
            finish_reason=self._last.finish_reason if finished else "abort",
            timed_out=isinstance(self._last.failure() if finished else None, DeadlineExceeded),
            error=self._last.error if finished else "",
        )
        record_end(end, self._span, self._runner.tracer)


class RequestRunner:
    """Validates, tokenizes and submits requests, and answers the model questions both front ends ask."""

    def __init__(self, settings: GatewaySettings, backends: Backends, hub: StreamHub, tracer: trace.Tracer) -> None:
        self.settings = settings
        self.backends = backends
        self.hub = hub
        self.tracer = tracer
        self.admission = Admission(settings.max_admitting, settings.queue_full_hold_s)
        self.prompt_bound = PromptBound(backends)
        self.tenants: TenantDirectory | None = None
        if settings.tenants_file:
            self.tenants = TenantDirectory(settings.tenants_file)
        elif settings.tenants_redis_key:
            self.tenants = RedisTenantDirectory(settings.redis_url, settings.tenants_redis_key)
        self.limiter = limiter_for(settings, self.tenants, backends)

    async def start(self, spec: GenerationSpec, span: trace.Span) -> SubmittedRequest:
        """Submit `spec`; call inside `span` (current), so the Submit rpc carries the request's trace."""
        with self.admission.admit():
            return await self.submit(await self.prepare(spec, span))

    async def prepare(self, spec: GenerationSpec, span: trace.Span) -> PreparedRequest:
        """Validate and tokenize `spec`, submitting nothing: a request of several choices checks them all first."""
        span.set_attribute(attr.REQUEST_ID, spec.request_id)
        info = await self.backends.tokenizer_info()
        if spec.model not in ("", info.model):
            raise ModelNotFound(f"model {spec.model!r} is not served here; this gateway serves {info.model!r}")
        limits = self.limits(info)
        params = validate_sampling(spec.params, limits, spec.field_prefix, spec.max_tokens_field)
        tenant = tenant_of(self.tenants, spec.owner)
        slo = spec.slo.over(tenant.slo)
        if slo.refuse_late and slo.ttft_target_s is None:
            raise InvalidArgument(
                "refuse_late", "needs a TTFT target to be late against: ttft_target_ms, or the tenant's"
            )
        await self.prompt_bound.check(prompt_texts(spec.prompt), limits.max_prompt_tokens, spec.prompt.field)
        with self.tracer.start_as_current_span("tokenize", attributes={attr.REQUEST_ID: spec.request_id}) as tokenize:
            prompt_ids = await self._tokenize(spec.prompt, info)
            tokenize.set_attribute(attr.NUM_TOKENS, len(prompt_ids))
        if not prompt_ids:
            raise InvalidArgument(spec.prompt.field, "the prompt is empty")
        if len(prompt_ids) > limits.max_prompt_tokens:
            raise ContextLengthExceeded(
                spec.prompt.field, f"the prompt has {len(prompt_ids)} tokens; at most {limits.max_prompt_tokens} fit"
            )
        resolve_max_tokens(
            params, len(prompt_ids), limits, spec.default_max_tokens, spec.field_prefix, spec.max_tokens_field
        )
        if params.HasField("structured_output"):
            await self._check_structured_output(params.structured_output, spec.structured_output_field)
            span.set_attribute(attr.STRUCTURED_OUTPUT, params.structured_output.WhichOneof("kind"))
        span.set_attributes(
            {
                attr.GEN_AI_REQUEST_MODEL: info.model,
                attr.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
                attr.GEN_AI_REQUEST_TOP_P: params.top_p,
            }
        )
        if params.HasField("max_tokens"):  # unset: up to the worker's context length
            span.set_attribute(attr.GEN_AI_REQUEST_MAX_TOKENS, params.max_tokens)
        return PreparedRequest(spec, span, info, params, prompt_ids, tenant, slo)

    async def submit(self, prepared: PreparedRequest) -> SubmittedRequest:
        """Submit a prepared request; call inside its span (current), so the Submit rpc carries its trace."""
        spec, info, params, prompt_ids = prepared.spec, prepared.info, prepared.params, prepared.prompt_ids
        self.admission.check_queue()  # found full while this one was tokenized: spare the scheduler the Submit
        if not await self.hub.wait_connected(SUBSCRIPTION_WAIT_S):
            raise Unavailable("the scheduler is unreachable: no output subscription")
        timeout_s = min(spec.timeout_s or self.settings.request_timeout_s, self.settings.request_timeout_s)
        stop = StopMatcher(list(params.stop))
        stream = RequestStream(
            spec.request_id,
            len(prompt_ids),
            params.skip_special_tokens,
            stop,
            min_tokens=params.min_tokens,
            wants_prompt_logprobs=params.HasField("prompt_logprobs"),
            stop_token_ids=frozenset(info.eos_token_ids) | frozenset(params.stop_token_ids),
        )
        self.hub.register(stream)
        tenant, slo, hold = prepared.tenant, prepared.slo, None
        prepared.span.set_attribute(attr.TENANT, tenant.name)
        submit = scheduler_pb2.SubmitRequest(
            request_id=spec.request_id,
            gateway_id=self.settings.gateway_id,
            model=info.model,
            prompt_token_ids=prompt_ids,
            params=params,
            eos_token_ids=info.eos_token_ids,
            priority=tenant.priority_for(spec.priority),
            arrival_time=spec.arrival_time,
            deadline=_now_timestamp(timeout_s),
            owner=spec.owner,
            tenant=tenant.name,
            tenant_weight=tenant.weight,
        )
        if slo.ttft_target_s is not None:
            submit.ttft_target.FromNanoseconds(round(slo.ttft_target_s * 1e9))
            submit.refuse_late = bool(slo.refuse_late)
            prepared.span.set_attribute(attr.TTFT_TARGET_MS, slo.ttft_target_s * 1000)
        try:
            hold = await self._admit(tenant, prepared)
            with upstream("scheduler"):
                await self.backends.scheduler.Submit(submit, timeout=RPC_TIMEOUT_S)
        except RequestIdTaken:
            self.hub.release(spec.request_id, cancel=False)
            if self.limiter is not None:  # a resend follows the request admitted before, which keeps its slot
                self.limiter.release_unsubmitted(hold, free_slot=False)
            if not spec.idempotent:
                raise
            return await attach_existing(self, prepared, spec.arrival_s + timeout_s)
        except BaseException as exc:
            if isinstance(exc, ResourceExhausted) and not isinstance(exc, RateLimited):
                self.admission.queue_full()
            # A Submit interrupted by a client that left may still have landed: cancel it to be sure.
            self.hub.release(spec.request_id, cancel=isinstance(exc, asyncio.CancelledError))
            if self.limiter is not None:
                self.limiter.release_unsubmitted(hold)
            raise
        deadline_s = spec.arrival_s + timeout_s
        return SubmittedRequest(self, spec, info.model, stream, prepared.span, deadline_s, prepared, hold)

    async def _admit(self, tenant: Tenant, prepared: PreparedRequest) -> Hold | None:
        """Charge the request to its tenant's limits, if it has any: others cost no Redis round trip."""
        if self.limiter is None or not tenant.limits.enforced:
            return None
        spec, params, prompt_tokens = prepared.spec, prepared.params, len(prepared.prompt_ids)
        # max_tokens unset: up to the context's end, which is what the request may use
        max_tokens = (
            params.max_tokens if params.HasField("max_tokens") else prepared.info.max_context_length - prompt_tokens
        )
        field = spec.field_prefix + spec.max_tokens_field
        return await self.limiter.admit(tenant, spec.request_id, prompt_tokens, max_tokens, field)

    async def served_models(self, timeout_s: float = RPC_TIMEOUT_S) -> list[generation_pb2.ModelInfo]:
        """This gateway's model, when at least one live worker serves it (the tokenizer fixes the model)."""
        info = await self.backends.tokenizer_info()
        with upstream("scheduler"):
            pool = await self.backends.scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=timeout_s)
        workers = sum(1 for state in pool.workers if state.alive and state.worker.model == info.model)
        if not workers:
            return []
        context = info.max_context_length
        return [
            generation_pb2.ModelInfo(
                name=info.model, max_context_length=context, num_workers=workers, vocab_size=info.vocab_size
            )
        ]

    def limits(self, info: tokenizer_pb2.TokenizerInfo) -> ModelLimits:
        context = info.max_context_length
        return ModelLimits(
            vocab_size=info.vocab_size,
            max_context_length=context,
            max_prompt_tokens=min(self.settings.max_prompt_tokens or context - 1, context - 1),
            max_tokens_limit=min(self.settings.max_tokens_limit or context, context),
        )

    async def _check_structured_output(self, constraint: sampling_pb2.StructuredOutput, field: str) -> None:
        """A constraint that does not compile is the client's error, found before anything is queued."""
        with upstream("tokenizer"):
            reply = await self.backends.tokenizer.CheckStructuredOutput(
                tokenizer_pb2.CheckStructuredOutputRequest(structured_output=constraint), timeout=RPC_TIMEOUT_S
            )
        if reply.error:
            raise InvalidArgument(field, reply.error)

    async def _tokenize(self, prompt: Prompt, info: tokenizer_pb2.TokenizerInfo) -> list[int]:
        if prompt.token_ids is not None:
            outside = [t for t in prompt.token_ids if not 0 <= t < info.vocab_size]
            if outside:
                raise InvalidArgument(prompt.field, f"token id {outside[0]} is outside the vocabulary")
            return prompt.token_ids
        if prompt.chat is not None:
            with upstream("tokenizer"):
                reply = await self.backends.tokenizer.ApplyChatTemplate(prompt.chat, timeout=RPC_TIMEOUT_S)
            return list(reply.prompt_token_ids)
        try:
            with upstream("tokenizer"):
                tokens = await self.backends.tokenizer.Tokenize(
                    tokenizer_pb2.TokenizeRequest(texts=[prompt.text or ""]), timeout=RPC_TIMEOUT_S
                )
        except InvalidArgument as exc:  # the tokenizer's own refusal by size names its texts[0]
            raise ContextLengthExceeded(prompt.field, str(exc).partition(": ")[2]) from exc
        return list(tokens.token_ids[0].ids)


def prompt_texts(prompt: Prompt) -> list[str]:
    """The texts a prompt surely puts in the model's input, for its refusal by size: a chat's turns but
    the assistant's, which some templates shorten (Qwen 3 drops the reasoning of past turns)."""
    if prompt.text is not None:
        return [prompt.text]
    if prompt.chat is not None:
        return [turn.content for turn in prompt.chat.messages if turn.role != "assistant"]
    return []


def _now_timestamp(after_s: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(time.time_ns() + int(after_s * 1e9))
    return stamp

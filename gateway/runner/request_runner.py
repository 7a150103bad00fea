"""One request's way in, shared by the gRPC and HTTP front ends.

Resolve the model and parameters, tokenize (chat template included), register with the stream hub,
Submit (a resend of a named request attaches to the first: request_attach.py); the consumer then
follows it as a SubmittedRequest (submitted_request.py).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace

from gateway.output.request_stream import RequestStream, stream_for
from gateway.output.stream_hub import StreamHub
from gateway.runner.admission import Admission
from gateway.runner.generation_spec import GenerationSpec, PreparedRequest, Prompt, prompt_texts, timestamp_in
from gateway.runner.lora_updates import LoraUpdates
from gateway.runner.params import ContextLengthExceeded, ModelLimits, resolve_max_tokens, validate_sampling
from gateway.runner.prompt_bound import PromptBound
from gateway.runner.request_attach import attach_existing
from gateway.runner.submitted_request import SubmittedRequest
from gateway.settings import GatewaySettings
from gateway.tenancy.tenant_limiter import Hold, RateLimited, limiter_for
from gateway.tenancy.tenants import Tenant, TenantDirectory, tenant_of
from gateway.tenancy.tenants_redis import RedisTenantDirectory
from gateway.upstream.backends import RPC_TIMEOUT_S, Backends, upstream
from shardline.core.errors import (
    InvalidArgument,
    NotFound,
    RequestIdTaken,
    ResourceExhausted,
    ShardlineError,
    Unavailable,
)
from shardline.proto import generation_pb2, sampling_pb2, scheduler_pb2, tokenizer_pb2
from tracing import attributes as attr

# How long a request waits for the scheduler subscription to (re)open before answering 503: one
# reconnect at the hub's longest backoff.
SUBSCRIPTION_WAIT_S = 2.0


@contextmanager
def answer_status(span: trace.Span, record_others: bool = True) -> Iterator[None]:
    """Put the status a request is answered with on its span when the block raises a ShardlineError:
    the tracing collector's series tell refusals (429) from failures by it. Such an answer is marked
    failed without a traceback event, which cost 200 us a refusal against 3 us for the refusal itself;
    any other exception keeps its traceback unless `record_others` is False, for a block inside another
    answer_status of the same span (open the span with record_exception=False)."""
    try:
        yield
    except ShardlineError as exc:
        span.set_attribute(attr.HTTP_STATUS, exc.http_status)
        span.set_status(trace.StatusCode.ERROR, str(exc))
        raise
    except Exception as exc:
        if record_others:
            span.record_exception(exc)
        raise


class ModelNotFound(NotFound):
    """The request names a model this gateway does not serve."""

    field = "model"


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
        self.lora_updates = LoraUpdates(settings, backends)

    def tenant(self, owner: str) -> Tenant:
        """The tenant a request of `owner` counts against: a lookup in memory, cheap enough for a refusal."""
        return tenant_of(self.tenants, owner)

    async def start(self, spec: GenerationSpec, span: trace.Span) -> SubmittedRequest:
        """Submit `spec`; call inside `span` (current), so the Submit rpc carries the request's trace."""
        # Its callers' answer_status of the same span records anything else; this one sees a rate limit
        # before the gRPC front end turns it into an abort.
        with answer_status(span, record_others=False), self.admission.admit():
            return await self.submit(await self.prepare(spec, span))

    async def prepare(self, spec: GenerationSpec, span: trace.Span) -> PreparedRequest:
        """Validate and tokenize `spec`, submitting nothing: a request of several choices checks them all first."""
        span.set_attribute(attr.REQUEST_ID, spec.request_id)
        info = await self.backends.tokenizer_info()
        adapter = ""
        if spec.model not in ("", info.model):
            adapters = [m.name for m in await self.served_models() if m.parent == info.model]
            if spec.model not in adapters:
                also = f" and its LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
                raise ModelNotFound(
                    f"model {spec.model!r} is not served here; this gateway serves {info.model!r}{also}"
                )
            adapter = spec.model
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
                attr.GEN_AI_REQUEST_MODEL: adapter or info.model,
                attr.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
                attr.GEN_AI_REQUEST_TOP_P: params.top_p,
            }
        )
        if params.HasField("max_tokens"):  # unset: up to the worker's context length
            span.set_attribute(attr.GEN_AI_REQUEST_MAX_TOKENS, params.max_tokens)
        if adapter:
            span.set_attribute(attr.LORA_ADAPTER, adapter)
        return PreparedRequest(spec, span, info, params, prompt_ids, tenant, slo, adapter)

    async def submit(self, prepared: PreparedRequest) -> SubmittedRequest:
        """Submit a prepared request; call inside its span (current), so the Submit rpc carries its trace."""
        spec, info, params, prompt_ids = prepared.spec, prepared.info, prepared.params, prepared.prompt_ids
        self.admission.check_queue()  # found full while this one was tokenized: spare the scheduler the Submit
        if not await self.hub.wait_connected(SUBSCRIPTION_WAIT_S):
            raise Unavailable("the scheduler is unreachable: no output subscription")
        timeout_s = min(spec.timeout_s or self.settings.request_timeout_s, self.settings.request_timeout_s)
        stream = stream_for(spec.request_id, len(prompt_ids), params, info.eos_token_ids)
        self.hub.register(stream)
        tenant, slo, hold = prepared.tenant, prepared.slo, None
        prepared.span.set_attribute(attr.TENANT, tenant.name)
        submit = scheduler_pb2.SubmitRequest(
            request_id=spec.request_id,
            gateway_id=self.settings.gateway_id,
            model=prepared.served_model,
            prompt_token_ids=prompt_ids,
            params=params,
            eos_token_ids=info.eos_token_ids,
            priority=tenant.priority_for(spec.priority),
            arrival_time=spec.arrival_time,
            deadline=timestamp_in(timeout_s),
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
            model, stream = await attach_existing(self.backends, self.hub, self.settings.gateway_id, prepared)
            return self._follow(prepared, model, stream, spec.arrival_s + timeout_s)
        except BaseException as exc:
            if isinstance(exc, ResourceExhausted) and not isinstance(exc, RateLimited):
                self.admission.queue_full()
            # A Submit interrupted by a client that left may still have landed: cancel it to be sure.
            self.hub.release(spec.request_id, cancel=isinstance(exc, asyncio.CancelledError))
            if self.limiter is not None:
                self.limiter.release_unsubmitted(hold)
            raise
        return self._follow(prepared, prepared.served_model, stream, spec.arrival_s + timeout_s, hold)

    def _follow(
        self, prepared: PreparedRequest, model: str, stream: RequestStream, deadline_s: float, hold: Hold | None = None
    ) -> SubmittedRequest:
        return SubmittedRequest(prepared, model, stream, deadline_s, self.hub, self.limiter, self.tracer, hold)

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
        """This gateway's model, when at least one live worker serves it (the tokenizer fixes the model),
        then the LoRA adapters its live workers serve on it, each with the model as its parent."""
        info = await self.backends.tokenizer_info()
        with upstream("scheduler"):
            pool = await self.backends.scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=timeout_s)
        live = [state.worker for state in pool.workers if state.alive and state.worker.model == info.model]
        if not live:
            return []
        context, vocab = info.max_context_length, info.vocab_size
        adapters = Counter(name for worker in live for name in dict.fromkeys(worker.adapters))
        return [
            generation_pb2.ModelInfo(
                name=info.model, max_context_length=context, num_workers=len(live), vocab_size=vocab
            ),
            *(
                generation_pb2.ModelInfo(
                    name=name, max_context_length=context, num_workers=n, vocab_size=vocab, parent=info.model
                )
                for name, n in sorted(adapters.items())
            ),
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

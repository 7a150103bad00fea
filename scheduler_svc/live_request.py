"""An unfinished request as the scheduler holds it in memory; Redis has the durable copy."""

import asyncio
import math
from dataclasses import dataclass, field

from google.protobuf import json_format
from opentelemetry import trace

from shardline.core.store.request_record import RequestRecord
from shardline.proto import sampling_pb2, worker_pb2
from tracing import attributes as attr
from tracing.grpc_context import extract_context


@dataclass(slots=True)
class LiveRequest:
    """What dispatch, relay and recovery need about one request between Submit and its finish."""

    request_id: str  # unique id, from the client or the gateway
    gateway_id: str  # whose Subscribe stream receives its deltas; Attach changes it
    model: str  # model that must serve it: a worker's own, or a LoRA adapter's name (WorkerInfo.adapters)
    priority: int  # priority class; lower is dispatched first
    prompt_token_ids: list[int]  # the prompt, sent in full on every dispatch
    params: sampling_pb2.SamplingParameters  # resolved sampling parameters, seed set
    eos_token_ids: list[int]  # tokens that end it
    arrival_ts: float  # when it arrived (unix seconds)
    deadline_ts: float | None = None  # abort it if unfinished by then
    traceparent: str = ""  # W3C traceparent of the Submit call, for the worker's spans
    owner: str = ""  # digest of the API key that submitted it (the gateway checks it)
    tenant: str = ""  # whose fair share it counts against within its class
    tenant_weight: float = 1.0  # that tenant's share, relative to the other tenants'
    ttft_deadline_ts: float | None = None  # when its first token is due (unix seconds); None: no target
    refuse_late: bool = False  # fail it once that passes while it waits, rather than serve it late
    attempt: int = 0  # 1 once dispatched, one more per worker failure (what max_attempts limits)
    worker_id: str | None = None  # worker running it; None while queued
    dispatched_at: float | None = None  # monotonic time of its latest dispatch, for the load meter
    output_token_ids: list[int] = field(default_factory=list)  # earlier attempts' tokens, prefilled on re-dispatch
    num_output_tokens: int = 0  # tokens generated so far over all attempts
    cancelled: bool = False  # an abort is on its way to the worker; its death must not re-queue it
    queue_span: trace.Span | None = None  # the `queue` span, open from enqueue to dispatch
    deadline_timer: asyncio.TimerHandle | None = None  # aborts it at deadline_ts
    ttft_timer: asyncio.TimerHandle | None = None  # with refuse_late: refuses it at ttft_deadline_ts if it waits

    @property
    def due_ts(self) -> float:
        """What earliest-deadline-first orders by: its first token's deadline, else its own, else never."""
        due = self.ttft_deadline_ts if self.ttft_deadline_ts is not None else self.deadline_ts
        return math.inf if due is None else due

    def to_record(self) -> RequestRecord:
        """The record Submit persists."""
        return RequestRecord(
            request_id=self.request_id,
            model=self.model,
            params=json_format.MessageToDict(self.params, preserving_proto_field_name=True),
            gateway_id=self.gateway_id,
            priority=self.priority,
            arrival_ts=self.arrival_ts,
            eos_token_ids=self.eos_token_ids,
            deadline_ts=self.deadline_ts,
            traceparent=self.traceparent or None,
            owner=self.owner,
            tenant=self.tenant,
            tenant_weight=self.tenant_weight,
            ttft_deadline_ts=self.ttft_deadline_ts,
            refuse_late=self.refuse_late,
        )

    @classmethod
    def from_record(cls, record: RequestRecord, prompt: list[int], tokens: list[int]) -> "LiveRequest":
        """Rebuilds a request from Redis, with the tokens it has generated so far."""
        return cls(
            request_id=record.request_id,
            gateway_id=record.gateway_id,
            model=record.model,
            priority=record.priority,
            prompt_token_ids=prompt,
            params=params_from_json(record.params),
            eos_token_ids=record.eos_token_ids,
            arrival_ts=record.arrival_ts,
            deadline_ts=record.deadline_ts,
            traceparent=record.traceparent or "",
            owner=record.owner,
            tenant=record.tenant,
            tenant_weight=record.tenant_weight,
            ttft_deadline_ts=record.ttft_deadline_ts,
            refuse_late=record.refuse_late,
            attempt=record.attempt,
            output_token_ids=tokens,
            num_output_tokens=len(tokens),
        )

    def new_request(self) -> worker_pb2.NewRequest:
        """The request as a worker receives it: prompt plus whatever earlier attempts generated."""
        params = self.params
        if self.output_token_ids and params.HasField("prompt_logprobs"):
            # Its prompt's logprobs came with its first token and are in Redis (the same MULTI/EXEC):
            # computed again, they would cost the new worker's prefill its prefix cache.
            params = sampling_pb2.SamplingParameters()
            params.CopyFrom(self.params)
            params.ClearField("prompt_logprobs")
        return worker_pb2.NewRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            priority=self.priority,
            traceparent=self.traceparent,
            model=self.model,
        )


def params_from_json(params: dict) -> sampling_pb2.SamplingParameters:
    """Sampling parameters as persisted by to_record()."""
    return json_format.ParseDict(params, sampling_pb2.SamplingParameters())


def queue_span(tracer: trace.Tracer, request: LiveRequest, depth: int, running: int) -> trace.Span:
    """The `queue` span a request has open from its enqueue to its dispatch, in its caller's trace; it
    carries the queue's depth and the requests in flight then, which the collector's series read."""
    return tracer.start_span(
        "queue",
        context=extract_context({"traceparent": request.traceparent}),
        attributes={
            attr.REQUEST_ID: request.request_id,
            attr.TENANT: request.tenant,
            attr.QUEUE_DEPTH: depth,
            attr.RUNNING_REQUESTS: running,
            attr.GEN_AI_REQUEST_MODEL: request.model,
        },
    )

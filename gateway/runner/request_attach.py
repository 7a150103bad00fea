"""Idempotent requests: a request the client named, sent again, attaches to the one already submitted.

A client that names its request (`X-Request-Id` over HTTP) and loses the answer (its connection, its
process) sends the same request again. The scheduler refuses the id as taken; the gateway then checks
that the id names this very request (same owner, prompt and parameters) and follows it from its
record: the tokens so far at once, the rest live. So a resend never runs the model twice, and the
answer is the one the first send would have had. A batch worker that crashed mid-chunk relies on it.
"""

from __future__ import annotations

from gateway.output.request_stream import RequestStream, record_stream
from gateway.output.stream_hub import StreamHub
from gateway.runner.generation_spec import PreparedRequest
from gateway.upstream.backends import RPC_TIMEOUT_S, Backends, upstream
from shardline.core.errors import RequestIdTaken
from shardline.proto import common_pb2, sampling_pb2, scheduler_pb2

ID_HEADER = "X-Request-Id"


async def attach_existing(
    backends: Backends, hub: StreamHub, gateway_id: str, prepared: PreparedRequest
) -> tuple[str, RequestStream]:
    """The model and the stream of the already submitted request `prepared` names, followed from its
    start; RequestIdTaken when the id names another request."""
    spec, scheduler = prepared.spec, backends.scheduler
    with upstream("scheduler"):
        read = common_pb2.GetRequestRequest(request_id=spec.request_id)
        info = await scheduler.GetRequest(read, timeout=RPC_TIMEOUT_S)
    if info.owner != spec.owner or not _same_request(info, prepared):
        raise RequestIdTaken(ID_HEADER, f"{spec.request_id!r} names another request; pick an id of its own")
    hub.register(record_stream(info, prepared.info.eos_token_ids))
    try:
        if info.status < sampling_pb2.REQUEST_STATUS_FINISHED:
            attach = scheduler_pb2.AttachRequest(request_id=spec.request_id, gateway_id=gateway_id)
            with upstream("scheduler"):
                info = await scheduler.Attach(attach, timeout=RPC_TIMEOUT_S)
        stream = await hub.apply_record(spec.request_id, info, 0)
    except BaseException:
        hub.release(spec.request_id, cancel=False)  # the request is the first send's: leave it running
        raise
    return info.model, stream


def _same_request(info: common_pb2.RequestInfo, prepared: PreparedRequest) -> bool:
    """Whether the record is of this request: same prompt length and parameters (the seed aside when
    the client set none, since the gateway picks one at random for each send)."""
    if info.usage.prompt_tokens != len(prepared.prompt_ids) or info.model != prepared.info.model:
        return False
    recorded, sent = sampling_pb2.SamplingParameters(), sampling_pb2.SamplingParameters()
    recorded.CopyFrom(info.params)
    sent.CopyFrom(prepared.params)
    if not prepared.spec.params.HasField("seed"):
        recorded.ClearField("seed")
        sent.ClearField("seed")
    return recorded == sent

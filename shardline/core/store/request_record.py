"""A request's persisted record: its lifecycle enums, its fields, and their encoding as the
`shardline:req:<id>` hash (see request_store.py for the keys beside it)."""

import json
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class RequestStatus(IntEnum):
    """Lifecycle state; values match shardline.v1.RequestStatus, terminal from FINISHED on."""

    QUEUED = 1
    RUNNING = 2
    FINISHED = 3
    CANCELLED = 4
    FAILED = 5

    @property
    def is_finished(self) -> bool:
        """True for the terminal states."""
        return self >= RequestStatus.FINISHED


class FinishReason(IntEnum):
    """Why a request stopped; values match shardline.v1.FinishReason."""

    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4


@dataclass(slots=True)
class RequestRecord:
    """One request's persisted state: the `shardline:req:<id>` hash."""

    request_id: str  # unique id, from the client or the gateway
    model: str  # model that serves it
    params: dict[str, Any]  # resolved sampling parameters, JSON-compatible
    gateway_id: str  # gateway whose Subscribe stream receives the output
    priority: int = 0  # priority class; lower is served first
    arrival_ts: float = field(default_factory=time.time)  # when the scheduler accepted it
    status: RequestStatus = RequestStatus.QUEUED  # lifecycle state
    worker_id: str | None = None  # worker serving it now, or last, if dispatched
    attempt: int = 0  # 1 once dispatched, one more per worker failure (a scheduler restart adds none)
    finish_reason: FinishReason | None = None  # set once terminal
    error: str | None = None  # why it failed, if it did
    dispatch_ts: float | None = None  # first dispatch to a worker (kept by a re-dispatch, like first_token_ts)
    first_token_ts: float | None = None  # first output token persisted
    cached_tokens: int = 0  # prompt tokens the serving worker's prefix cache served (its first delta says)
    finish_ts: float | None = None  # reached a terminal status
    prompt_len: int = 0  # prompt tokens; create() sets it from the prompt
    num_output_tokens: int = 0  # tokens generated so far; read from the tokens key
    eos_token_ids: list[int] = field(default_factory=list)  # tokens that end it, re-sent on every dispatch
    deadline_ts: float | None = None  # abort it if unfinished by then; None means no deadline
    traceparent: str | None = None  # W3C traceparent of its trace, so a re-dispatch joins it
    owner: str = ""  # digest of the API key that submitted it; empty without keys
    tenant: str = ""  # the tenant its key belongs to; empty from a gateway that names none
    tenant_weight: float = 1.0  # that tenant's share of service within its priority class
    ttft_deadline_ts: float | None = None  # when its first token is due (its TTFT target); None: no target
    refuse_late: bool = False  # fail it once that deadline passes while it waits, rather than serve it late


def encode_record(record: RequestRecord, prompt_len: int) -> list[str | int | float]:
    fields: dict[str, str | int | float | None] = {
        "model": record.model,
        "params": json.dumps(record.params, separators=(",", ":")),
        "status": record.status.name,
        "gateway_id": record.gateway_id,
        "priority": record.priority,
        "prompt_len": prompt_len,
        "attempt": record.attempt,
        "arrival_ts": record.arrival_ts,
        "worker_id": record.worker_id,
        "dispatch_ts": record.dispatch_ts,
        "eos_token_ids": json.dumps(record.eos_token_ids) if record.eos_token_ids else None,
        "deadline_ts": record.deadline_ts,
        "traceparent": record.traceparent or None,
        "owner": record.owner or None,
        "tenant": record.tenant or None,
        "tenant_weight": record.tenant_weight if record.tenant_weight != 1.0 else None,
        "ttft_deadline_ts": record.ttft_deadline_ts,
        "refuse_late": 1 if record.refuse_late else None,
    }
    return [item for name, value in fields.items() if value is not None for item in (name, value)]


def decode_record(request_id: str, raw: dict[bytes, bytes], num_output_tokens: int) -> RequestRecord:
    h = {key.decode(): value.decode() for key, value in raw.items()}

    def optional_float(name: str) -> float | None:
        return float(h[name]) if name in h else None

    return RequestRecord(
        request_id=request_id,
        model=h["model"],
        params=json.loads(h["params"]),
        gateway_id=h["gateway_id"],
        priority=int(h["priority"]),
        arrival_ts=float(h["arrival_ts"]),
        status=RequestStatus[h["status"]],
        worker_id=h.get("worker_id"),
        attempt=int(h["attempt"]),
        finish_reason=FinishReason[h["finish_reason"]] if "finish_reason" in h else None,
        error=h.get("error"),
        dispatch_ts=optional_float("dispatch_ts"),
        first_token_ts=optional_float("first_token_ts"),
        finish_ts=optional_float("finish_ts"),
        cached_tokens=int(h.get("cached_tokens", 0)),
        prompt_len=int(h["prompt_len"]),
        num_output_tokens=num_output_tokens,
        eos_token_ids=json.loads(h.get("eos_token_ids", "[]")),
        deadline_ts=optional_float("deadline_ts"),
        traceparent=h.get("traceparent"),
        owner=h.get("owner", ""),
        tenant=h.get("tenant", ""),
        tenant_weight=float(h.get("tenant_weight", 1.0)),
        ttft_deadline_ts=optional_float("ttft_deadline_ts"),
        refuse_late=h.get("refuse_late") == "1",
    )

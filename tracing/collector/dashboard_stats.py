"""What the dashboard shows per request, derived from the request's stored spans.

The spans a request leaves (names as the services emit them):

- gateway ``gateway.request``: arrival to the last byte out; carries the
  ``gen_ai.*`` request, usage and finish-reason attributes. An OpenAI request
  with several choices (n > 1) is a request per choice, each rooted in a
  ``gateway.choice`` span that carries those; the ``gateway.request`` holding
  them lists them (``shardline.choices``) and gets no row of its own;
- gateway ``tokenize``; scheduler ``queue`` (submitted to dispatched);
- worker ``prefill`` (admitted to first token) and ``decode`` (first token
  to finish);
- gateway ``detokenize``: from the first per-step detokenize call, made when
  the first tokens reach the gateway, to the last one.

The latency breakdown cuts ``gateway.request`` at the end of each stage, so
the stages add up to the end-to-end latency and each one also holds the hop
into it (the Submit rpc in ``queue``, dispatch and admission in ``prefill``,
the relay of the last tokens and the response's end in ``detokenize``).
"""

from dataclasses import dataclass, field

from tracing import attributes as attr
from tracing.collector.stored_span import AttrValue, StoredSpan

# The span that spans a request's life at the gateway, per request.
ROOT_SPANS = ("gateway.request", "gateway.choice")
# Breakdown stages in order, each ending where its named span ends.
STAGES = ("tokenize", "queue", "prefill", "decode", "detokenize")
RUNNING = "running"
NS_PER_MS = 1_000_000


@dataclass(slots=True)
class RequestSummary:
    """One dashboard row."""

    request_id: str
    # The trace of the request's gateway span (a client's traceparent sets it).
    trace_id: str
    # Unix ns of the request's first span.
    start_ns: int
    # The finish reason (stop, length, abort, error), or "running" before the gateway span ends.
    status: str
    model: str = ""
    input_tokens: int | None = None
    output_tokens: int | None = None
    # Arrival at the gateway to the first tokens back at the gateway.
    ttft_ms: float | None = None
    # Mean time per output token after the first.
    tpot_ms: float | None = None
    # Arrival to the end of the response.
    e2e_ms: float | None = None
    # Stage -> milliseconds; sums to e2e_ms once the request has finished.
    stages_ms: dict[str, float] = field(default_factory=dict)
    # The worker instance that ran it (the last one, after a re-dispatch).
    worker: str = ""
    # Every service instance with a span in the request's traces.
    instances: list[str] = field(default_factory=list)
    error: str = ""
    # The tenant it counted against, "" when the gateway did not name one (refused before its Submit).
    tenant: str = ""
    # Its TTFT target, and met, missed or refused against it (gateway/runner/request_metrics.py); None without one.
    ttft_target_ms: float | None = None
    slo_outcome: str | None = None

    def to_json(self) -> dict[str, object]:
        """The row as the ``/api/requests`` JSON object."""
        return {
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "start_unix_s": self.start_ns / 1e9,
            "status": self.status,
            "model": self.model,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": _round(self.ttft_ms),
            "tpot_ms": _round(self.tpot_ms),
            "e2e_ms": _round(self.e2e_ms),
            "stages_ms": {stage: _round(ms) for stage, ms in self.stages_ms.items()},
            "worker": self.worker,
            "instances": self.instances,
            "error": self.error,
            "tenant": self.tenant,
            "ttft_target_ms": self.ttft_target_ms,
            "slo_outcome": self.slo_outcome,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _int(value: AttrValue) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ms(ns: int) -> float:
    return ns / NS_PER_MS


def summarize(request_id: str, spans: list[StoredSpan]) -> RequestSummary | None:
    """The request's row, from the spans of its traces; None when none carries its id, when it is
    an OpenAI request of several choices (they have the rows), or a choice of one refused before its
    choices all started (the request has the row)."""
    own = [span for span in spans if span.request_id == request_id]
    if not own:
        return None
    named: dict[str, list[StoredSpan]] = {}
    for span in sorted(own, key=lambda s: s.start_ns):
        named.setdefault(span.name, []).append(span)
    root = next((named[name][0] for name in ROOT_SPANS if name in named), None)
    if root is not None and (attr.CHOICES in root.attributes or attr.CHOICE_UNSTARTED in root.attributes):
        return None
    start_ns = root.start_ns if root else min(span.start_ns for span in own)
    summary = RequestSummary(
        request_id=request_id,
        trace_id=root.trace_id if root else own[0].trace_id,
        start_ns=start_ns,
        status=_status(root),
        instances=sorted({span.instance_id for span in spans}),
        error=next((span.error for span in own if span.error), ""),
    )
    described = root or named.get("prefill", own)[0]
    summary.model = str(described.attributes.get(attr.GEN_AI_REQUEST_MODEL) or "")
    summary.input_tokens = _int(described.attributes.get(attr.GEN_AI_USAGE_INPUT_TOKENS))
    summary.output_tokens = _int((root or own[-1]).attributes.get(attr.GEN_AI_USAGE_OUTPUT_TOKENS))
    if root is not None:
        summary.tenant = str(root.attributes.get(attr.TENANT) or "")
        target = root.attributes.get(attr.TTFT_TARGET_MS)
        summary.ttft_target_ms = float(target) if isinstance(target, int | float) else None
        outcome = root.attributes.get(attr.SLO_OUTCOME)
        summary.slo_outcome = str(outcome) if outcome else None
    workers = named.get("prefill") or named.get("decode") or []
    summary.worker = workers[-1].instance_id if workers else ""

    end_ns = root.end_ns if root else max(span.end_ns for span in own)
    summary.stages_ms = _stages(named, start_ns, end_ns)
    if root is not None:
        summary.e2e_ms = _ms(root.end_ns - root.start_ns)
    first_ns, last_ns = _token_times(named)
    if first_ns is not None:
        summary.ttft_ms = _ms(max(0, first_ns - start_ns))
        out = summary.output_tokens
        if out is not None and out > 1 and last_ns is not None:
            summary.tpot_ms = _ms(max(0, last_ns - first_ns)) / (out - 1)
    return summary


def _status(root: StoredSpan | None) -> str:
    if root is None:
        return RUNNING
    reasons = root.attributes.get(attr.GEN_AI_RESPONSE_FINISH_REASONS)
    if isinstance(reasons, list) and reasons:
        return str(reasons[0])
    return "error" if root.error else "unknown"


def _stages(named: dict[str, list[StoredSpan]], start_ns: int, end_ns: int) -> dict[str, float]:
    """Stage durations between consecutive stage ends, clamped so they never run backwards.

    A stage without its span gets 0 and its time goes to the next stage; the
    last stage runs to ``end_ns``.
    """
    ends: list[int | None] = [
        _first_end(named, "tokenize"),
        _first_end(named, "queue"),
        _first_token_ns(named),
        _last_end(named, "decode") or _last_end(named, "prefill"),
        end_ns,
    ]
    stages: dict[str, float] = {}
    previous = start_ns
    for stage, stage_end in zip(STAGES, ends, strict=True):
        boundary = min(max(stage_end if stage_end is not None else previous, previous), end_ns)
        stages[stage] = _ms(boundary - previous)
        previous = boundary
    return stages


def _first_end(named: dict[str, list[StoredSpan]], name: str) -> int | None:
    spans = named.get(name)
    return spans[0].end_ns if spans else None


def _last_end(named: dict[str, list[StoredSpan]], name: str) -> int | None:
    spans = named.get(name)
    return max(span.end_ns for span in spans) if spans else None


def _first_token_ns(named: dict[str, list[StoredSpan]]) -> int | None:
    """When the worker produced the first token: prefill's end, or decode's start."""
    if named.get("prefill"):
        return named["prefill"][0].end_ns
    if named.get("decode"):
        return named["decode"][0].start_ns
    return None


def _token_times(named: dict[str, list[StoredSpan]]) -> tuple[int | None, int | None]:
    """First and last token as the gateway saw them, else as the worker produced them."""
    detokenize = named.get("detokenize")
    if detokenize:
        return detokenize[0].start_ns, max(span.end_ns for span in detokenize)
    return _first_token_ns(named), _last_end(named, "decode")

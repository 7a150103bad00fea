"""What the collector's time series count, and the samples each received span adds to them.

Every series is read from spans the services already send (names as they emit them):

- the gateway's request span (``gateway.request``, or ``gateway.choice`` per choice of an OpenAI
  request with several) at its end: a request, its output tokens, its TTFT and TPOT as the gateway
  measured them, and whether it was refused (429) or failed. The gateway opens that span before it
  checks anything, so every answer it gives, a refusal at its admission gate included, has one; a
  request of several choices refused before they all started is counted once, by its HTTP span;
- the scheduler's ``queue`` and ``dispatch`` spans: the queue depth and the requests in flight at
  each enqueue and dispatch, and a failover when a dispatch is a request's second attempt or later;
- each worker's ``engine_step`` span (tensor-parallel rank 0): batch size, step time, KV blocks in
  use, MFU, MBU and the tokens the step generated (its ``gen_ai.usage.output_tokens``).

Requests count when they end, as the gateway's Prometheus counters do, so a live chart moves as
requests finish; gauges count when they were sampled.
"""

from dataclasses import dataclass

from tracing import attributes as attr
from tracing.collector.stored_span import AttrValue, StoredSpan

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
ROOT_SPANS = ("gateway.request", "gateway.choice")
# The spans the series read; the collector decodes only these for them.
SERIES_SPANS = frozenset((*ROOT_SPANS, "queue", "dispatch", "engine_step"))
TOO_MANY_REQUESTS = 429


@dataclass(frozen=True, slots=True)
class SeriesSpec:
    """One series: what it counts, how its samples combine in a time bucket, and its labels."""

    name: str
    # counter: summed, read as a rate per second; gauge: mean and max; histogram: latency percentiles.
    kind: str
    # The label names, in the order a sample's label values come.
    labels: tuple[str, ...]
    # The unit of what the API returns: "1/s" and "tokens/s" for counters.
    unit: str
    # One line for the API's listing and the docs.
    description: str


SERIES: dict[str, SeriesSpec] = {
    spec.name: spec
    for spec in (
        SeriesSpec("requests", COUNTER, ("model", "tenant"), "1/s", "requests the gateway answered, any outcome"),
        SeriesSpec("output_tokens", COUNTER, ("model", "tenant"), "tokens/s", "output tokens of those requests"),
        SeriesSpec("errors", COUNTER, ("model", "tenant"), "1/s", "requests that failed, 429s apart"),
        SeriesSpec("rejected", COUNTER, ("tenant",), "1/s", "requests refused with 429: a tenant limit, a full queue"),
        SeriesSpec("failovers", COUNTER, ("worker",), "1/s", "requests dispatched again, by the worker they went to"),
        SeriesSpec("ttft_ms", HISTOGRAM, ("model",), "ms", "time to first token, arrival to first token out"),
        SeriesSpec("tpot_ms", HISTOGRAM, ("model",), "ms", "time per output token after the first"),
        SeriesSpec("queue_depth", GAUGE, (), "requests", "the scheduler's queue, at each enqueue and dispatch"),
        SeriesSpec("running", GAUGE, (), "requests", "the scheduler's requests in flight, as queue_depth"),
        SeriesSpec("batch_size", GAUGE, ("worker",), "requests", "requests in a worker's step"),
        SeriesSpec("step_time_ms", GAUGE, ("worker",), "ms", "a worker's step, schedule to outputs"),
        SeriesSpec("kv_blocks_used", GAUGE, ("worker",), "blocks", "KV-cache blocks in use on a worker"),
        SeriesSpec("mfu", GAUGE, ("worker",), "fraction", "model FLOPs utilization of a worker's steps"),
        SeriesSpec("mbu", GAUGE, ("worker",), "fraction", "memory bandwidth utilization of a worker's steps"),
        SeriesSpec("worker_tokens", COUNTER, ("worker",), "tokens/s", "tokens a worker's steps generated"),
    )
}


@dataclass(frozen=True, slots=True)
class Sample:
    """One observation of one series."""

    name: str
    # The values of the series' labels, in SeriesSpec.labels order.
    labels: tuple[str, ...]
    # Unix seconds of the observation.
    time_s: float
    value: float


def _number(value: AttrValue) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def samples_of(span: StoredSpan) -> list[Sample]:
    """The samples one finished span adds; none for spans the series do not read."""
    if span.name in ROOT_SPANS:
        return _request_samples(span)
    if span.name in ("queue", "dispatch"):
        return _scheduler_samples(span)
    if span.name == "engine_step" and span.rank in (None, 0):
        return _step_samples(span)
    return []


def _request_samples(span: StoredSpan) -> list[Sample]:
    a = span.attributes
    # An OpenAI request of several choices: each choice that started is a request of its own. One
    # refused before they all did is one request, counted with its status on the HTTP span.
    if attr.CHOICES in a or attr.CHOICE_UNSTARTED in a:
        return []
    model, tenant = str(a.get(attr.GEN_AI_REQUEST_MODEL) or ""), str(a.get(attr.TENANT) or "")
    at = span.end_ns / 1e9
    samples = [Sample("requests", (model, tenant), at, 1.0)]
    tokens = _number(a.get(attr.GEN_AI_USAGE_OUTPUT_TOKENS))
    if tokens:
        samples.append(Sample("output_tokens", (model, tenant), at, tokens))
    reasons = a.get(attr.GEN_AI_RESPONSE_FINISH_REASONS)
    failed = bool(span.error) or (isinstance(reasons, list) and "error" in reasons)
    if _number(a.get(attr.HTTP_STATUS)) == TOO_MANY_REQUESTS:
        samples.append(Sample("rejected", (tenant,), at, 1.0))
    elif failed:
        samples.append(Sample("errors", (model, tenant), at, 1.0))
    for name, key in (("ttft_ms", attr.TTFT_MS), ("tpot_ms", attr.TPOT_MS)):
        ms = _number(a.get(key))
        if ms is not None:
            samples.append(Sample(name, (model,), at, ms))
    return samples


def _scheduler_samples(span: StoredSpan) -> list[Sample]:
    at = span.start_ns / 1e9
    samples = []
    for name, key in (("queue_depth", attr.QUEUE_DEPTH), ("running", attr.RUNNING_REQUESTS)):
        value = _number(span.attributes.get(key))
        if value is not None:
            samples.append(Sample(name, (), at, value))
    attempt = _number(span.attributes.get(attr.ATTEMPT))
    if span.name == "dispatch" and attempt is not None and attempt > 1:
        samples.append(Sample("failovers", (str(span.attributes.get(attr.WORKER_ID) or ""),), at, 1.0))
    return samples


def _step_samples(span: StoredSpan) -> list[Sample]:
    a, worker, at = span.attributes, (span.instance_id,), span.end_ns / 1e9
    step_s = (span.end_ns - span.start_ns) / 1e9
    samples = [Sample("step_time_ms", worker, at, step_s * 1000)]
    for name, key in (
        ("batch_size", attr.BATCH_SIZE),
        ("kv_blocks_used", attr.KV_BLOCKS_USED),
        ("mfu", attr.MFU),
        ("mbu", attr.MBU),
    ):
        value = _number(a.get(key))
        if value is not None:
            samples.append(Sample(name, worker, at, value))
    generated = _number(a.get(attr.GEN_AI_USAGE_OUTPUT_TOKENS))
    if generated:
        samples.append(Sample("worker_tokens", worker, at, generated))
    return samples

"""Prometheus metrics shared by the Shardline services.

Names follow the OpenTelemetry GenAI conventions as they map to Prometheus
(``gen_ai.server.time_to_first_token`` in seconds becomes
``gen_ai_server_time_to_first_token_seconds``, the ``gen_ai.request.model``
attribute becomes the ``gen_ai_request_model`` label). Each service process
exposes the metrics it updates; the others stay at zero. The gateway's /metrics
(gateway/metrics.py) adds the scheduler's figures at scrape time instead.
"""

from wsgiref.simple_server import WSGIServer

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

MODEL_LABEL = "gen_ai_request_model"

# Bucket boundaries are the GenAI conventions' advice, except time per output
# token, which starts lower: a small model decodes a token in about 2 ms on a GPU,
# and the advised first bucket (10 ms) would hold every sample.
TIME_TO_FIRST_TOKEN = Histogram(
    "gen_ai_server_time_to_first_token_seconds",
    "Time from request arrival to the first generated token.",
    [MODEL_LABEL],
    buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "gen_ai_server_time_per_output_token_seconds",
    "Time per generated token after the first, per request.",
    [MODEL_LABEL],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
)
REQUEST_DURATION = Histogram(
    "gen_ai_server_request_duration_seconds",
    "Time from request arrival to its last token, cancel or failure.",
    [MODEL_LABEL],
    buckets=(0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92),
)
QUEUE_DEPTH = Gauge("shardline_queue_depth", "Requests waiting in the scheduler's global queue.")
RUNNING_REQUESTS = Gauge("shardline_running_requests", "Requests being generated right now.")
KV_CACHE_USAGE = Gauge("shardline_kv_cache_usage_ratio", "Fraction of the worker's KV blocks in use (0 to 1).")
TOKENS_PER_SECOND = Gauge("shardline_generation_tokens_per_second", "Tokens generated per second, last engine step.")
# Each worker's engine steps, as the time view's per-worker charts show them from the step spans.
KV_BLOCKS_USED = Gauge("shardline_kv_blocks_used", "KV-cache blocks held by the worker's requests.")
STEP_DURATION = Histogram(
    "shardline_engine_step_duration_seconds",
    "Wall time of one engine step: a batch's forward pass, sampling and bookkeeping.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12),
)
MODEL_FLOPS_UTILIZATION = Gauge(
    "shardline_model_flops_utilization", "Model FLOPs utilisation (MFU) of the last engine step, 0 to 1."
)
MODEL_BANDWIDTH_UTILIZATION = Gauge(
    "shardline_model_bandwidth_utilization", "Memory-bandwidth utilisation (MBU) of the last engine step, 0 to 1."
)
# The scheduler's dispatches that are a request's second attempt or later: the time view's failovers.
FAILOVERS = Counter("shardline_failovers", "Requests dispatched again after their worker failed.")
# N-gram speculation (vLLM's spec_decode counters): their ratio is the draft acceptance rate.
SPEC_DRAFT_TOKENS = Counter("shardline_spec_decode_num_draft_tokens", "Draft tokens the engine computed.")
SPEC_ACCEPTED_TOKENS = Counter(
    "shardline_spec_decode_num_accepted_tokens", "Draft tokens confirmed by sampling and kept as output."
)
# The scheduler's autoscaler, per model: what a KEDA ScaledObject or an HPA can follow
# (deploy/k8s/keda-scaledobject.yaml), and why it decided as it did.
AUTOSCALER_DESIRED = Gauge("shardline_autoscaler_desired_workers", "Workers the autoscaler wants.", ["model"])
AUTOSCALER_READY = Gauge("shardline_autoscaler_ready_workers", "Workers registered and not draining.", ["model"])
AUTOSCALER_FORECAST = Gauge(
    "shardline_autoscaler_forecast_requests_per_second", "Forecast arrival rate over the cold start.", ["model"]
)
AUTOSCALER_DECISIONS = Counter(
    "shardline_autoscaler_decisions",
    "Decisions per model and direction (up, down, hold); each one's reason is in `shardline status` and its span.",
    ["model", "direction"],
)
SPANS_DROPPED = Counter(
    "shardline_tracing_spans_dropped",
    "Finished spans dropped because the export queue was full.",
)


def start_metrics_server(port: int, addr: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY) -> WSGIServer:
    """Serves ``/metrics`` from a background thread, for services without HTTP.

    Returns the server; call its ``shutdown()`` to stop it. Port 0 picks a free
    port, readable as ``server.server_port``.
    """
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server


async def metrics_handler(_request: web.Request) -> web.Response:
    """aiohttp handler for ``/metrics`` on a service that already serves HTTP."""
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

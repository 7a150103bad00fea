"""Span attribute names used across Shardline.

The ``gen_ai.*`` names follow the OpenTelemetry GenAI semantic conventions;
the ``shardline.*`` names are ours. The Perfetto writer reads several of them
(request id, rank, the counter attributes), so services must use these
constants rather than spelling the strings themselves.
"""

# GenAI semantic conventions.
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"

# OpenTelemetry general conventions the writer reads.
SERVICE_NAME = "service.name"
SERVICE_INSTANCE_ID = "service.instance.id"
THREAD_NAME = "thread.name"

# Shardline. A span carrying REQUEST_ID belongs on that request's track.
REQUEST_ID = "shardline.request_id"
# On the gateway.request span of an OpenAI request with several choices (n > 1, a batch of prompts):
# the request ids of its choices, each a request of its own with a gateway.choice span.
CHOICES = "shardline.choices"
# On a gateway.choice span whose request was refused or failed before all its choices started: the
# client's one answer (its status) is on the HTTP span, so this choice is not a request of its own.
CHOICE_UNSTARTED = "shardline.choice_unstarted"
RANK = "shardline.rank"
STEP = "shardline.step"
NUM_TOKENS = "shardline.num_tokens"
STRUCTURED_OUTPUT = "shardline.structured_output"  # the constraint's kind: json_schema, regex...
TOOL_CHOICE = "shardline.tool_choice"  # a request with tools: none, auto, required or named
# On the scheduler's dispatch span: the worker it went to, and its attempt (above 1: a failover).
WORKER_ID = "shardline.worker_id"
ATTEMPT = "shardline.attempt"
# Disaggregated prefill (scheduler_svc/prefill_decision.py, docs/kv_transfer.md). On the dispatch span:
# whether the prompt is prefilled on a prefill worker, why (or why not), and how many of its tokens the
# router knew the decode worker to hold. On the remote_prefill span: the prefill worker that computed it,
# the blocks it sent, how it ended (remote, fallback_local or cancelled), and a prefill_failed event per
# prefill worker that failed, with its error.
PREFILL_REMOTE = "shardline.prefill.remote"
PREFILL_REASON = "shardline.prefill.reason"
PREFILL_CACHED_TOKENS = "shardline.prefill.cached_tokens"
PREFILL_WORKER_ID = "shardline.prefill.worker_id"
PREFILL_BLOCKS_SENT = "shardline.prefill.blocks_sent"
PREFILL_OUTCOME = "shardline.prefill.outcome"
PREFILL_ERROR = "shardline.prefill.error"
# On a gateway request span: the HTTP status of a request refused or failed before it ran (429 over the
# admission bound, a limit or a full queue; 400 for bad input), the gRPC code's equivalent for a gRPC request.
HTTP_STATUS = "shardline.http_status"
# On a gateway request span at its end: its time to first token and mean time per output token after the
# first, as the gateway measured them for gen_ai.server.time_to_first_token and time_per_output_token.
TTFT_MS = "shardline.ttft_ms"
TPOT_MS = "shardline.tpot_ms"
PREFIX_CACHE_HITS = "shardline.prefix_cache_hits"
DRAFT_TOKENS = "shardline.draft_tokens"  # n-gram speculation: draft tokens the step computed
ACCEPTED_TOKENS = "shardline.accepted_tokens"  # of those, the ones kept as output
TENANT = "shardline.tenant"  # the tenant a request counts against (gateway request span, scheduler queue span)
LORA_ADAPTER = "shardline.lora_adapter"  # the LoRA adapter a request runs with (gateway request span, worker spans)
# A request with a TTFT target (gateway request span): the target, and how it fared: met, missed or
# refused (gateway/runner/request_metrics.py says which is which).
TTFT_TARGET_MS = "shardline.ttft_target_ms"
SLO_OUTCOME = "shardline.slo_outcome"
# Batch jobs: the batch a batch.chunk or batch.line span works for, the chunk's index, the lines it kept.
BATCH_ID = "shardline.batch_id"
BATCH_CHUNK = "shardline.batch_chunk"
BATCH_LINES_KEPT = "shardline.batch_lines_kept"

# Shardline gauges sampled on step and queue spans; each becomes a Perfetto counter track.
QUEUE_DEPTH = "shardline.queue_depth"
# The scheduler's requests dispatched and not finished, on its queue and dispatch spans.
RUNNING_REQUESTS = "shardline.running_requests"
BATCH_SIZE = "shardline.batch_size"
KV_BLOCKS_USED = "shardline.kv_blocks_used"
TOKENS_PER_S = "shardline.tokens_per_s"
MFU = "shardline.mfu"
MBU = "shardline.mbu"

# The scheduler's autoscaler, on its `autoscale` span each interval: the workers it wants, those
# serving, and the arrival rate it forecasts.
DESIRED_WORKERS = "shardline.desired_workers"
READY_WORKERS = "shardline.ready_workers"
FORECAST_RPS = "shardline.forecast_rps"

COUNTER_ATTRIBUTES = (
    QUEUE_DEPTH,
    RUNNING_REQUESTS,
    BATCH_SIZE,
    KV_BLOCKS_USED,
    TOKENS_PER_S,
    MFU,
    MBU,
    DESIRED_WORKERS,
    READY_WORKERS,
    FORECAST_RPS,
)

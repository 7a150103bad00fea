"""The shared Prometheus metrics, scraped over real HTTP."""

import urllib.request

from tests.tracing.run_async import run_async
from tracing import metrics


def test_metrics_server_exposes_genai_histograms_and_gauges() -> None:
    metrics.TIME_TO_FIRST_TOKEN.labels("smollm2-135m").observe(0.03)
    metrics.TIME_PER_OUTPUT_TOKEN.labels("smollm2-135m").observe(0.002)
    metrics.QUEUE_DEPTH.set(7)
    server = metrics.start_metrics_server(0, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as response:
            body = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'gen_ai_server_time_to_first_token_seconds_bucket{gen_ai_request_model="smollm2-135m",le="0.04"}' in body
    # A 2 ms token lands in a bucket finer than the conventions' first (10 ms) one.
    assert 'gen_ai_server_time_per_output_token_seconds_bucket{gen_ai_request_model="smollm2-135m",le="0.0025"}' in body
    assert "shardline_queue_depth 7.0" in body
    for name in (
        "gen_ai_server_request_duration_seconds",
        "shardline_running_requests",
        "shardline_kv_cache_usage_ratio",
        "shardline_generation_tokens_per_second",
        "shardline_tracing_spans_dropped_total",
    ):
        assert f"# TYPE {name.removesuffix('_total')}" in body


@run_async
async def test_aiohttp_handler_serves_the_same_registry() -> None:
    metrics.RUNNING_REQUESTS.set(2)
    response = await metrics.metrics_handler(None)
    assert response.headers["Content-Type"].startswith("text/plain; version=")
    assert b"shardline_running_requests 2.0" in response.body

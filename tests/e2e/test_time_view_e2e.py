"""The dashboard's time view on a live stack under a small mixed load: plain requests, a burst that
the full queue answers with 429s, and a worker killed mid-stream. In headless Chromium the charts hold
the series API's points, the 429s and the failover show in their chart, and a window dragged across
the load lists exactly the API's requests of that window and opens them in Perfetto.

Screenshots (git-ignored): artifacts/tracing/live_time_view.png and live_time_view_perfetto.png.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from shardline.client import ShardlineClient
from shardline.stack.local_stack import LocalStack, StackConfig
from tests.e2e.conftest import log_dir, running_stack
from tests.e2e.http_client import get, post
from tests.tracing.collector.headless_chromium import HeadlessChromium, find_chromium
from tests.tracing.collector.test_time_view_chromium import drag

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_chromium() is None, reason="needs chromium (scripts/setup.sh installs it)"),
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "tracing"
QUEUE_FULL_HOLD_S = GatewaySettings.model_fields["queue_full_hold_s"].default


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory):
    # One sequence per worker step and a queue of one, so that a burst overflows it: the first refusals come
    # from the scheduler's full queue, the rest from the gateway's hold after it; each leaves its span.
    config = StackConfig.on_free_ports(
        workers=2,
        tracing=True,
        data_dir=tmp_path_factory.mktemp("time-view-data"),
        log_dir=log_dir(tmp_path_factory, "time-view"),
        env={
            "HEARTBEAT_INTERVAL_S": "0.5",
            "KV_CACHE_BYTES": str(64 << 20),
            "MAX_NUM_SEQS": "1",
            "QUEUE_CAPACITY": "1",
        },
    )
    with running_stack(config) as stack:
        yield stack


def mixed_load(stack: LocalStack) -> tuple[float, str, int]:
    """Runs the load; returns when it started, the failed-over request's id, and how many got 429."""
    http = f"http://127.0.0.1:{stack.config.http_port}/v1/completions"
    started = time.time()
    for prompt in ("Hello", "The sky is"):
        assert post(http, {"prompt": prompt, "max_tokens": 6})[0] == 200
    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(lambda i: post(http, {"prompt": f"Count {i}", "max_tokens": 24})[0], range(12)))
    assert set(statuses) <= {200, 429} and 429 in statuses, statuses
    time.sleep(QUEUE_FULL_HOLD_S)  # the gateway refuses everything until its hold after the full queue ends
    params = dict(max_tokens=48, seed=3, ignore_eos=True)
    with ShardlineClient(f"127.0.0.1:{stack.config.grpc_port}", timeout=120) as client:
        stream = client.stream("Tell me about the sea.", **params)
        tokens = 0
        for chunk in stream:
            tokens += len(chunk.token_ids)
            if tokens >= 8:
                break
        request_id = chunk.request_id
        stack.kill(client.get_request(request_id).worker_id)
        tokens += sum(len(rest.token_ids) for rest in stream)
        assert tokens == 48 and client.get_request(request_id).attempt == 2
    return started, request_id, statuses.count(429)


def test_live_time_view_shows_the_429s_and_the_failover_and_lists_a_window(small_stack: LocalStack) -> None:
    started, moved, refused = mixed_load(small_stack)
    dashboard = f"http://127.0.0.1:{small_stack.config.dashboard_port}"

    def series(query: str) -> dict:
        status, body = get(f"{dashboard}/api/series?{query}")
        assert status == 200, body
        return json.loads(body)

    deadline = time.monotonic() + 30
    while True:  # spans are exported every half second
        read = series(f"names=rejected,failovers&from={started - 1}&to={time.time()}&step=1")
        totals = {name: sum(v for s in read["series"] if s["name"] == name for v in s["values"]) for name in
                  ("rejected", "failovers")}  # fmt: skip
        if totals == {"rejected": refused, "failovers": 1}:
            break
        assert time.monotonic() < deadline, (totals, refused)
        time.sleep(0.5)

    async def drive() -> None:
        async with HeadlessChromium(find_chromium(), window=(1500, 1150)) as b:
            await b.navigate(f"{dashboard}/")
            await b.wait_for("document.querySelectorAll('#charts [data-chart=failures] path.line').length >= 2")
            drawn = await b.evaluate(
                "[...document.querySelectorAll('#charts path.line')].map((p) => "
                "[p.closest('figure').dataset.chart, p.dataset.key, JSON.parse(p.dataset.values)])"
            )
            shown = await b.evaluate("({...document.getElementById('time-view').dataset})")
            step = int(shown["step"])
            api = series(f"from={shown['from']}&to={shown['to']}&step={step}")
            lines = {(chart, key): values for chart, key, values in drawn}
            for row in (s for s in api["series"] if s["name"] == "requests"):
                key = f"requests:rate:{row['labels']['model']}|{row['labels']['tenant']}"
                assert lines["requests", key] == row["values"], key
            assert sum(v or 0 for v in lines["failures", "rejected:rate"]) * step == refused
            assert sum(v or 0 for v in lines["failures", "failovers:rate"]) * step == 1
            await drag(b, "requests", started - 1, time.time())
            await b.wait_for("document.querySelectorAll('#window-table tbody tr').length > 0")
            await b.screenshot(ARTIFACTS / "live_time_view.png")
            box = await b.evaluate("({...document.getElementById('window-requests').dataset})")
            listed = await b.evaluate(
                "[...document.querySelectorAll('#window-table tbody tr')].map((r) => r.dataset.requestId)"
            )
            status, body = get(f"{dashboard}/api/requests?from={box['from']}&to={box['to']}&limit=200")
            assert status == 200, body
            assert listed == [r["request_id"] for r in json.loads(body)["requests"]]
            assert moved in listed and len(listed) >= 2 + 12 + 1, (box, body)
            await b.navigate(await b.evaluate("document.getElementById('window-requests-perfetto').href"))
            await b.wait_for(f"document.body.innerText.includes('request {moved}')", timeout_s=90)
            await asyncio.sleep(1)
            await b.screenshot(ARTIFACTS / "live_time_view_perfetto.png")

    asyncio.run(drive())

"""The dashboard's time view in headless Chromium, over four minutes of spans with a burst of 429s and a
worker that stops: its charts hold the series API's points, and a window dragged on a chart lists exactly
the window's requests and opens them in the local Perfetto UI.

Screenshots (git-ignored) go to artifacts/tracing/: time_view.png, time_view_selected.png and
time_view_perfetto.png.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from tests.tracing.collector.fake_request import SpanFactory
from tests.tracing.collector.headless_chromium import HeadlessChromium, find_chromium
from tests.tracing.collector.series_load import at, request, worker_steps
from tests.tracing.collector.served_request import to_otlp
from tests.tracing.collector.test_dashboard_app import dashboard
from tracing import attributes as attr
from tracing.collector.otlp_receiver import series_resolutions
from tracing.collector.span_store import SpanStore
from tracing.collector.stored_span import StoredSpan
from tracing.settings import TracingSettings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_chromium() is None, reason="needs chromium (scripts/setup.sh installs it)"),
]
ARTIFACTS = Path(__file__).resolve().parents[3] / "artifacts" / "tracing"
LOAD_S = 240
BURST_S = (120, 130)  # 429s for tenant zeta, five a second
WORKER_1_STOPS_S = 150  # its last step; its request fails over to worker-0 a second later


def load(f: SpanFactory) -> list[StoredSpan]:
    """Spans of LOAD_S seconds, offsets in ms from the load's start."""
    spans = []
    for i in range(LOAD_S // 2):
        spans += request(f, f"r-{i:03}", ("acme", "zeta")[i % 2], 30.0 + (i % 7) * 10, at_ms=i * 2000)
    for i in range((BURST_S[1] - BURST_S[0]) * 5):
        refused = f.span(
            "gateway.request", "gateway", "gateway-0", BURST_S[0] * 1000 + i * 200, BURST_S[0] * 1000 + i * 200 + 1,
            trace_id=f"{0xF000 + i:032x}",
            **{attr.REQUEST_ID: f"r-429-{i:02}", attr.TENANT: "zeta", attr.HTTP_STATUS: 429},
        )  # fmt: skip
        refused.error = "tenant zeta is over its request rate"
        spans.append(refused)
    moved = {attr.REQUEST_ID: "r-001", attr.ATTEMPT: 2, attr.WORKER_ID: "worker-0", attr.QUEUE_DEPTH: 0}
    spans.append(f.span("dispatch", "scheduler", "scheduler", (WORKER_1_STOPS_S + 1) * 1000, 151_001, **moved))
    spans += worker_steps(f, "worker-0", 0, LOAD_S * 1000, step_ms=100)
    spans += worker_steps(f, "worker-1", 0, WORKER_1_STOPS_S * 1000, step_ms=100)
    return spans


async def api(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def drag(browser: HeadlessChromium, chart: str, from_s: float, to_s: float) -> None:
    """A real mouse drag across a chart, from one time to another."""
    xy = await browser.evaluate(
        f"""(() => {{
          const chart = timeView.charts.find((c) => c.figure.dataset.chart === "{chart}");
          const box = chart.svg.getBoundingClientRect();
          const at = (t) => box.left + chart.x(t) * box.width / 460;
          return [at({from_s}), at({to_s}), box.top + box.height / 2];
        }})()"""
    )
    x1, x2, y = xy
    for kind, x in (("mousePressed", x1), ("mouseMoved", (x1 + x2) / 2), ("mouseMoved", x2), ("mouseReleased", x2)):
        await browser.call(
            "Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", buttons=0 if kind == "mouseReleased" else 1,
            clickCount=1,
        )  # fmt: skip


def test_time_view_charts_the_series_and_lists_a_dragged_windows_requests(redis_url: str) -> None:
    start_s = time.time() - LOAD_S - 5

    async def drive() -> None:
        store = SpanStore.from_url(
            redis_url, max_spans=100_000, max_age_s=3600, series=series_resolutions(TracingSettings())
        )
        await store.add(to_otlp(at(load(SpanFactory()), start_s)))
        try:
            async with dashboard(store) as (base, http), HeadlessChromium(find_chromium(), window=(1500, 1150)) as b:
                await b.navigate(f"{base}/")
                await b.wait_for("document.querySelectorAll('#charts path.line').length >= 12")
                await asyncio.sleep(0.5)
                await b.screenshot(ARTIFACTS / "time_view.png")
                drawn = await b.evaluate(
                    "[...document.querySelectorAll('#charts path.line')].map((p) => "
                    "[p.closest('figure').dataset.chart, p.dataset.key, JSON.parse(p.dataset.values)])"
                )
                shown = await b.evaluate("({...document.getElementById('time-view').dataset})")
                query = f"from={shown['from']}&to={shown['to']}&step={shown['step']}"
                read = await api(http, f"{base}/api/series?{query}")
                lines = {(chart, key): values for chart, key, values in drawn}
                # Every drawn line of the requests chart is a series of the API, point for point.
                for row in (s for s in read["series"] if s["name"] == "requests"):
                    key = f"requests:rate:{row['labels']['model']}|{row['labels']['tenant']}"
                    assert lines["requests", key] == row["values"], key
                # The 429s and the failover are in the failures chart, when they happened.
                rejected = lines["failures", "rejected:rate"]
                peak = read["times"][max(range(len(rejected)), key=lambda i: rejected[i] or 0)]
                # A point's time is its bucket's start, aligned down to the step: up to a step early.
                step_s = int(shown["step"])
                assert BURST_S[0] - step_s <= peak - start_s < BURST_S[1] + 1 and max(rejected) == 5.0
                assert sum(v for v in lines["failures", "failovers:rate"] if v) * step_s == 1
                # worker-1's batch line stops where it stopped stepping.
                stopped = lines["batch", "batch_size:mean:worker-1"]
                last = max(i for i, v in enumerate(stopped) if v is not None)
                assert abs(read["times"][last] - (start_s + WORKER_1_STOPS_S)) <= 2

                await drag(b, "requests", start_s + 100, start_s + 131)
                await b.wait_for("document.querySelectorAll('#window-table tbody tr').length > 0")
                await b.screenshot(ARTIFACTS / "time_view_selected.png")
                box = await b.evaluate("({...document.getElementById('window-requests').dataset})")
                listed = await b.evaluate(
                    "[...document.querySelectorAll('#window-table tbody tr')].map((r) => r.dataset.requestId)"
                )
                window = await api(http, f"{base}/api/requests?from={box['from']}&to={box['to']}&limit=200")
                assert listed == [r["request_id"] for r in window["requests"]]
                # Exactly the requests whose spans fall in the dragged window: a served request lasts 100 ms.
                low, high = float(box["from"]) - start_s, float(box["to"]) - start_s
                served = {f"r-{i:03}" for i in range(LOAD_S // 2) if low - 0.1 <= 2 * i <= high}
                refused = {f"r-429-{i:02}" for i in range(50) if low - 0.001 <= BURST_S[0] + i * 0.2 <= high}
                assert set(listed) == served | refused and refused
                assert 99 <= low <= 101 and 130 <= high <= 132
                these = await b.evaluate("document.getElementById('window-requests-perfetto').href")
                assert these.startswith(f"{base}/perfetto/#!/viewer?url=")
                await b.navigate(these)
                first = sorted(served)[0]
                await b.wait_for(f"document.body.innerText.includes('request {first}')", timeout_s=90)
                await asyncio.sleep(1)
                await b.screenshot(ARTIFACTS / "time_view_perfetto.png")
        finally:
            await store.close()

    asyncio.run(drive())
    for name in ("time_view.png", "time_view_selected.png", "time_view_perfetto.png"):
        assert (ARTIFACTS / name).stat().st_size > 10_000

"""The stream hub's batching, reconnection and bookkeeping: traces, metrics, models and health."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import grpc
import openai
import pytest
from opentelemetry import trace

from gateway.output import local_detokenizer
from gateway.output.request_stream import RequestStream
from gateway.output.stop_strings import StopMatcher
from shardline.proto import common_pb2, generation_pb2, sampling_pb2
from tests.gateway.conftest import TEXT
from tests.gateway.harness import Stack, run_on_stack
from tests.gateway.scripted_scheduler import MODEL, Script
from tracing import attributes as attr

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize("local", [True, False], ids=["in-process", "rpc"])
def test_one_detokenize_call_per_token_batch_for_all_requests(tokenizer_address, text_ids, local, monkeypatch) -> None:
    """In-process (the default) or through the tokenizer service's Detokenize, every TokenBatch costs
    exactly one batched detokenize call, whatever the number of requests in it."""
    items_per_call: list[int] = []
    rpc_calls: list[int] = []
    batch = local_detokenizer.detokenize_batch

    def counting_batch(tokenizer, items):
        items_per_call.append(len(items))
        return batch(tokenizer, items)

    monkeypatch.setattr(local_detokenizer, "detokenize_batch", counting_batch)

    async def body(stack: Stack) -> None:
        stub = stack.gateway.backends.tokenizer
        detokenize = stub.Detokenize

        def counting(request, **kwargs):
            rpc_calls.append(len(request.items))
            return detokenize(request, **kwargs)

        stub.Detokenize = counting
        oai = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x")
        requests = [
            asyncio.create_task(oai.completions.create(model=MODEL, prompt=f"Prompt {i}", max_tokens=50))
            for i in range(3)
        ]
        while len(stack.scheduler.submitted) < 3 or any(len(r.output) < 1 for r in stack.scheduler.records.values()):
            await asyncio.sleep(0.01)
        stack.scheduler.release()
        results = await asyncio.gather(*requests)
        assert [r.choices[0].text for r in results] == [TEXT] * 3
        calls = items_per_call if local else rpc_calls
        assert (rpc_calls if local else items_per_call) == []
        assert stack.gateway.hub.processor.detokenizer.local_calls == len(items_per_call)
        assert len(calls) == stack.scheduler.batches_sent
        assert max(calls) == 3
        assert sum(calls) == 3 * len(text_ids)  # one delta per token per request

    run_on_stack(tokenizer_address, Script(text_ids, hold_after=1), body, local_detokenize=local)


def test_lost_subscription_reconnects_and_catches_up(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        call = stack.generation.GenerateStream(generation_pb2.GenerateRequest(prompt="hi"))
        first = await call.read()
        while len(stack.scheduler.records[first.request_id].output) < 5:
            await asyncio.sleep(0.01)
        stack.scheduler.drop_subscribers()  # as a scheduler restart would
        stack.scheduler.release()  # the rest is generated while no one listens, then read from the record
        chunks = [first]
        while (chunk := await call.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
        assert "".join(c.text for c in chunks) == TEXT
        assert [t for c in chunks for t in c.token_ids] == text_ids
        assert chunks[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
        assert stack.gateway.hub.connected

    run_on_stack(tokenizer_address, Script(text_ids, hold_after=5), body)


def test_a_cancel_the_scheduler_missed_is_sent_again_once_it_is_back(tokenizer_address, text_ids) -> None:
    # The client leaves while the scheduler is down: the request would be recovered from Redis and
    # run for nobody, so the cancel goes again when the subscription returns.
    async def body(stack: Stack) -> None:
        call = stack.generation.GenerateStream(generation_pb2.GenerateRequest(prompt="hi"))
        first = await call.read()
        stack.scheduler.refuse_cancels = grpc.StatusCode.UNAVAILABLE
        call.cancel()
        await asyncio.sleep(0.2)  # the refused Cancel
        assert first.request_id not in stack.scheduler.cancelled
        stack.scheduler.refuse_cancels = None
        stack.scheduler.drop_subscribers()  # the scheduler is back: the hub resubscribes and catches up
        await stack.scheduler.wait_cancelled(first.request_id)
        assert stack.scheduler.cancelled.count(first.request_id) == 1

    run_on_stack(tokenizer_address, Script(text_ids, hold_after=2), body, resume_grace_s=0)


def test_request_span_honours_traceparent_and_reaches_submit(tokenizer_address, text_ids) -> None:
    async def body(stack: Stack) -> None:
        headers = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}
        request = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0.5, "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.base_url}/v1/completions", json=request, headers=headers) as response:
                await response.read()
        spans = {span.name: span for span in stack.spans.get_finished_spans()}
        root = spans["gateway.request"]
        assert format(root.context.trace_id, "032x") == TRACE_ID and root.kind == trace.SpanKind.SERVER
        assert root.attributes[attr.GEN_AI_REQUEST_MODEL] == MODEL
        assert root.attributes[attr.GEN_AI_REQUEST_MAX_TOKENS] == 8
        assert root.attributes[attr.GEN_AI_REQUEST_TEMPERATURE] == 0.5
        assert root.attributes[attr.GEN_AI_REQUEST_TOP_P] == 1.0
        assert root.attributes[attr.GEN_AI_USAGE_INPUT_TOKENS] == 1
        assert root.attributes[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == 8
        assert root.attributes[attr.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
        assert root.attributes[attr.REQUEST_ID] == response.headers["X-Request-Id"]
        for name in ("tokenize", "detokenize", "stream_out"):
            assert spans[name].parent.span_id == root.context.span_id, name
        assert spans["detokenize"].attributes["shardline.detokenize_calls"] == 8
        traceparent = stack.scheduler.submit_metadata[0]["traceparent"]
        assert traceparent.split("-")[1] == TRACE_ID

    run_on_stack(tokenizer_address, Script(text_ids), body)


def _sample(metrics: str, name: str) -> float:
    found = re.search(
        rf'^{name}\{{(finish_reason="length",)?gen_ai_request_model="{MODEL}"\}} (\S+)$', metrics, re.MULTILINE
    )
    return float(found.group(2)) if found else 0.0


def test_metrics_models_and_health(tokenizer_address, text_ids) -> None:
    names = [
        "gen_ai_server_time_to_first_token_seconds_count",
        "gen_ai_server_time_per_output_token_seconds_count",
        "gen_ai_server_request_duration_seconds_count",
        "shardline_prompt_tokens_total",
        "shardline_generation_tokens_total",
        "shardline_requests_total",
    ]

    async def body(stack: Stack) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{stack.base_url}/metrics") as response:
                before = [_sample(await response.text(), name) for name in names]
            oai = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x")
            await oai.completions.create(model=MODEL, prompt="hi", max_tokens=10)
            async with http.get(f"{stack.base_url}/metrics") as response:
                metrics = await response.text()
            after = [_sample(metrics, name) for name in names]
            # Per request, not per token; the request ended with finish_reason "length".
            assert [a - b for a, b in zip(after, before)] == [1, 1, 1, 1, 10, 1]
            # The scheduler's queue and pool, asked for at scrape time, and not the zeros of gauges
            # that only the scheduler and workers set.
            for line in (
                "shardline_queue_depth 3.0",
                "shardline_running_requests 0.0",
                "shardline_workers_alive 1.0",
                'shardline_kv_cache_usage_ratio{worker_id="worker-0"} 0.25',
            ):
                assert len(re.findall(rf"^{re.escape(line)}$", metrics, re.MULTILINE)) == 1, line
            assert "shardline_generation_tokens_per_second" not in metrics
            models = await oai.models.list()
            assert [(m.id, m.owned_by) for m in models.data] == [(MODEL, "shardline")]
            async with http.get(f"{stack.base_url}/health") as response:
                assert response.status == 200
                assert await response.json() == {
                    "status": "ok",
                    "tokenizer": True,
                    "scheduler": True,
                    "subscribed": True,
                    "workers": 1,
                }
            async with http.get(f"{stack.base_url}/v1/nothing") as response:
                assert response.status == 404 and "error" in await response.json()

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_resume_does_not_repeat_held_deltas_that_the_record_already_holds(tokenizer_address, text_ids) -> None:
    """Deltas relayed while Attach's write was in flight overlap the record: each token goes out once."""

    async def body(stack: Stack) -> None:
        hub, rid = stack.gateway.hub, "resume-overlap"
        stream = RequestStream(rid, 3, True, StopMatcher([]), buffered=[])
        hub.register(stream)
        # Held (buffered) while the record is read: tokens 3..5, which the record will also hold.
        await hub.processor.process([common_pb2.RequestDelta(request_id=rid, offset=3, token_ids=text_ids[3:6])])
        record = common_pb2.RequestInfo(
            request_id=rid, output_token_ids=text_ids[:5], status=sampling_pb2.REQUEST_STATUS_RUNNING
        )
        await hub.apply_record(rid, record, 2)
        chunks = []
        while not stream.queue.empty():
            chunks.append(stream.queue.get_nowait())
        assert [t for c in chunks for t in c.token_ids] == text_ids[2:6]
        assert stream.next_offset == 6
        hub.release(rid)

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_a_resume_at_any_offset_gives_exactly_the_text_not_yet_had(tokenizer_address, text_ids, tokenizer) -> None:
    """A stream holds text back (a character split across tokens, the start of a stop string); a client
    resuming at the offset it reached has not had that text, and gets it: had + resumed == whole."""
    ids = tokenizer.encode_batch([" Leaf 🍃 and 中文 end, and more"])[0]
    stops = ["and 中X"]  # "and 中" is held back until "文" rules it out

    async def streamed(hub, rid: str, count: int, final: bool) -> str:
        stream = RequestStream(rid, 3, True, StopMatcher(stops))
        hub.register(stream)
        for i in range(count):
            last = final and i == count - 1
            await hub.processor.process(
                [
                    common_pb2.RequestDelta(
                        request_id=rid,
                        offset=i,
                        token_ids=[ids[i]],
                        finish_reason=sampling_pb2.FINISH_REASON_STOP
                        if last
                        else sampling_pb2.FINISH_REASON_UNSPECIFIED,
                    )
                ]
            )
        text = ""
        while not stream.queue.empty():
            text += stream.queue.get_nowait().text
        hub.release(rid, cancel=False)
        return text

    async def body(stack: Stack) -> None:
        hub = stack.gateway.hub
        whole = await streamed(hub, "whole", len(ids), final=True)
        assert whole == tokenizer.decode(ids)
        record = common_pb2.RequestInfo(
            output_token_ids=ids,
            status=sampling_pb2.REQUEST_STATUS_FINISHED,
            finish_reason=sampling_pb2.FINISH_REASON_STOP,
        )
        for offset in range(len(ids) + 1):
            had = await streamed(hub, f"had-{offset}", offset, final=False)
            rid = f"resumed-{offset}"
            stream = RequestStream(rid, 3, True, StopMatcher(stops), buffered=[])
            hub.register(stream)
            record.request_id = rid
            await hub.apply_record(rid, record, offset)
            resumed = ""
            while not stream.queue.empty():
                resumed += stream.queue.get_nowait().text
            assert had + resumed == whole, (offset, had, resumed)

    run_on_stack(tokenizer_address, Script(text_ids), body)


def test_a_client_leaving_a_stream_cancels_it_and_logs_no_error(tokenizer_address, text_ids, caplog) -> None:
    # The handler's generators must close in the task that ran them: finalized later by the event
    # loop, they would leave their span contexts in another context (OpenTelemetry logs a traceback).
    async def body(stack: Stack) -> None:
        for _ in range(2):
            call = stack.generation.GenerateStream(generation_pb2.GenerateRequest(prompt="hi"))
            first = await call.read()
            call.cancel()
            await stack.scheduler.wait_cancelled(first.request_id)
        async with aiohttp.ClientSession() as http:
            for chat in (False, True):
                body = {
                    "model": MODEL,
                    "stream": True,
                    **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}),
                }
                url = f"{stack.base_url}/v1/{'chat/completions' if chat else 'completions'}"
                async with http.post(url, json=body) as response:
                    await response.content.readline()
                    request_id = response.headers["X-Request-Id"]
                await stack.scheduler.wait_cancelled(request_id)
        await asyncio.sleep(0.2)

    with caplog.at_level("ERROR"):
        run_on_stack(tokenizer_address, Script(text_ids, hold_after=2), body, resume_grace_s=0)
    # The gateway's and OpenTelemetry's own errors (an HTTP client of another test collected here may
    # log asyncio noise of its own).
    ours = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "ERROR" and r.name.startswith(("gateway", "opentelemetry", "tracing", "shardline"))
    ]
    assert ours == []


def test_a_first_token_without_the_prompt_logprobs_asked_for_fails_the_request(tokenizer_address, text_ids) -> None:
    """A first token caught up from the Redis record has no prompt logprobs: an error, not a short answer."""

    def top(token_id: int) -> sampling_pb2.TokenLogprob:
        return sampling_pb2.TokenLogprob(token_id=token_id, logprob=-1.0)

    async def body(stack: Stack) -> None:
        hub = stack.gateway.hub
        whole = RequestStream("pl-whole", 3, True, StopMatcher([]), wants_prompt_logprobs=True)
        lost = RequestStream("pl-lost", 3, True, StopMatcher([]), wants_prompt_logprobs=True)
        one = RequestStream("pl-one-token-prompt", 1, True, StopMatcher([]), wants_prompt_logprobs=True)
        for stream in (whole, lost, one):
            hub.register(stream)
        await hub.processor.process(
            [
                common_pb2.RequestDelta(
                    request_id="pl-whole",
                    offset=0,
                    token_ids=text_ids[:1],
                    prompt_logprobs=[top(text_ids[1]), top(text_ids[2])],
                ),
                common_pb2.RequestDelta(request_id="pl-lost", offset=0, token_ids=text_ids[:2]),
                common_pb2.RequestDelta(request_id="pl-one-token-prompt", offset=0, token_ids=text_ids[:1]),
            ]
        )
        chunk = whole.queue.get_nowait()
        assert [lp.token_id for lp in chunk.prompt_logprobs] == text_ids[1:3] and chunk.finish_reason is None
        assert set(chunk.token_texts) == set(text_ids[1:3])
        failed = lost.queue.get_nowait()
        assert failed.finish_reason == "error" and "prompt logprobs were lost" in failed.error
        await stack.scheduler.wait_cancelled("pl-lost")
        assert one.queue.get_nowait().finish_reason is None  # a one-token prompt has none to lose
        hub.release("pl-whole")
        hub.release("pl-one-token-prompt")

    run_on_stack(tokenizer_address, Script(text_ids), body)

"""The OpenAI backend of `shardline bench` reads a real event stream: a tiny aiohttp server plays the server."""

from __future__ import annotations

import asyncio
import json
import socket

from aiohttp import web

from shardline.bench.load import LoadSpec, run_load
from shardline.bench.metrics import RequestTiming, summarize
from shardline.bench.openai_backend import OpenAIBackend, api_root


def _event(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def _text(text: str, finish_reason: str | None = None) -> bytes:
    return _event({"choices": [{"index": 0, "text": text, "finish_reason": finish_reason}], "usage": None})


USAGE = _event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}})
DONE = b"data: [DONE]\n\n"


async def _serve(script: list[bytes], status: int = 200, models: list[dict] | None = None):
    """A server whose /v1/completions streams `script`'s pieces; it keeps every request body it got."""
    seen: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append({"body": await request.json(), "auth": request.headers.get("Authorization")})
        if status != 200:
            return web.json_response({"error": {"message": "max_tokens is too large", "code": 400}}, status=status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in script:
            await response.write(piece)
            await asyncio.sleep(0.005)
        return response

    async def list_models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": models or []})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}", seen


def _run(script: list[bytes], prompts: int = 1, status: int = 200, **backend_args):
    async def go():
        runner, url, seen = await _serve(script, status)
        backend = OpenAIBackend(url, backend_args.pop("model", "m"), **backend_args)
        try:
            timings, wall = await run_load(LoadSpec(num_prompts=prompts, input_len=6, output_len=4), backend.send)
            return timings, wall, seen, backend
        finally:
            await backend.close()
            await runner.cleanup()

    return asyncio.run(go())


def test_chunks_with_text_are_timed_and_the_usage_chunk_counts_the_tokens():
    # Four tokens in three chunks with text (one holds two, as a kept draft does), then a finish
    # chunk without text, a keep-alive comment and the usage chunk.
    script = [_text("He"), _text("llo wo"), b": ping\n\n", _text("rld"), _text("", "length"), USAGE, DONE]
    timings, wall, seen, backend = _run(script, api_key="sk-test")
    [t] = timings
    assert t.ok, t.error
    assert len(t.chunk_times) == 3 and t.chunk_times == sorted(t.chunk_times)
    assert (t.output_len, t.input_len) == (4, 5)  # the server's own counts
    assert t.tpot == (t.chunk_times[-1] - t.chunk_times[0]) / 3
    body = seen[0]["body"]
    assert body["prompt"] == LoadSpec(num_prompts=1, input_len=6).prompts()[0]  # token ids, as sent
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["ignore_eos"], body["model"]) == (4, 0, True, "m")
    assert seen[0]["auth"] == "Bearer sk-test"
    assert backend.check.without_usage == backend.check.short_usage == 0
    assert summarize(timings, wall)["output_throughput"] == 4 / wall


def test_without_a_usage_chunk_each_chunk_with_text_counts_one_token():
    timings, _, seen, backend = _run([_text("a"), _text("b"), _text("c", "length"), DONE], ignore_eos=False)
    assert timings[0].ok and timings[0].output_len == 3
    assert timings[0].input_len == 6  # what was sent, the server having said nothing
    assert backend.check.without_usage == 1
    assert "ignore_eos" not in seen[0]["body"]


def test_usage_counting_fewer_tokens_than_chunks_is_not_believed():
    short = _event({"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 1}})
    timings, _, _, backend = _run([_text("a"), _text("b"), short, DONE])
    assert timings[0].output_len == 2 and backend.check.short_usage == 1


def test_error_events_fail_their_requests_and_the_run_goes_on():
    error = _event({"error": {"message": "the worker died", "type": "server_error", "code": 500}})
    timings, wall, _, _ = _run([_text("a"), error, DONE], prompts=3)
    assert [t.ok for t in timings] == [False] * 3
    assert timings[0].error == "RuntimeError: error event: the worker died"
    out = summarize(timings, wall)
    assert (out["completed"], out["failed"]) == (0, 3)
    # llama-server ends a stream it cannot finish with an `error:` line.
    timings, _, _, _ = _run([_text("a"), b'error: {"code": 500, "message": "slot gone"}\n\n'])
    assert timings[0].error == "RuntimeError: error event: slot gone"


def test_a_refused_request_and_a_stream_cut_short_are_counted_failures():
    timings, _, _, _ = _run([], status=400)
    assert timings[0].error == "RuntimeError: HTTP 400: max_tokens is too large"
    timings, _, _, _ = _run([_text("a"), _text("b")])  # no [DONE]: the server went away mid-stream
    assert timings[0].error == "RuntimeError: the stream ended before [DONE]"
    timings, _, _, _ = _run([_text("", "length"), USAGE, DONE])
    assert timings[0].error == "RuntimeError: the stream ended without a chunk that carried text"


def test_a_connection_refused_is_a_failure_of_every_request_not_a_crash():
    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go():
        backend = OpenAIBackend(f"http://127.0.0.1:{port}/v1/", "m")
        try:
            return await run_load(LoadSpec(num_prompts=4, input_len=4, output_len=2), backend.send)
        finally:
            await backend.close()

    timings, wall = asyncio.run(go())
    assert [t.ok for t in timings] == [False] * 4
    assert all("ClientConnectorError" in t.error for t in timings)
    assert summarize(timings, wall)["failed"] == 4


def test_the_model_is_the_first_listed_and_text_prompts_go_as_text():
    async def go():
        models = [{"id": "first", "meta": {"n_vocab": 32000}}, {"id": "second"}]
        runner, url, seen = await _serve([_text("x"), USAGE, DONE], models=models)
        backend = OpenAIBackend(url, detokenize=lambda ids: " ".join(map(str, ids)))
        try:
            assert await backend.vocab_size() == 32000  # llama-server says it in meta.n_vocab
            timing = RequestTiming(input_len=2)
            await backend.send([101, 102], 1, timing)
            return seen, timing
        finally:
            await backend.close()
            await runner.cleanup()

    seen, timing = asyncio.run(go())
    assert seen[0]["body"]["model"] == "first"
    assert seen[0]["body"]["prompt"] == "101 102"
    assert timing.input_len == 5  # the server's count of the re-tokenized text


def test_a_server_url_may_end_in_v1_or_a_slash():
    assert {api_root(u) for u in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/")} == {"http://h:1"}

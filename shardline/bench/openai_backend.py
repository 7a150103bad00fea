"""The benchmark's load against any OpenAI-compatible server: streamed /v1/completions over HTTP."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass

import aiohttp

from shardline.bench.metrics import RequestTiming

log = logging.getLogger(__name__)

# No overall limit: a c16 burst on a CPU can wait seconds for its first token. A server that
# stops sending for this long has failed the request.
_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)

# An error event carries no HTTP status (the stream's headers said 200): OpenAI's error `type` says
# which refusal it was, so that throttled (429) and refused-late (503) requests are counted apart.
_STATUS_OF_TYPE = {"rate_limit_error": 429, "service_unavailable_error": 503}


def api_root(base_url: str) -> str:
    """`http://host:port`, `http://host:port/` and `http://host:port/v1` all name the same server."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


@dataclass(slots=True)
class StreamCheck:
    """What a target's streams said about themselves, counted over a run, for the cross-check."""

    requests: int = 0
    without_usage: int = 0  # no usage chunk: the output was counted as one token per chunk with text
    short_usage: int = 0  # usage counted fewer completion tokens than chunks with text arrived

    def warnings(self, name: str) -> list[str]:
        out = []
        if self.without_usage:
            out.append(
                f"{name}: {self.without_usage} of {self.requests} streams had no usage chunk (does the server "
                "take stream_options.include_usage?): their output was counted as one token per chunk"
            )
        if self.short_usage:
            out.append(f"{name}: {self.short_usage} streams' usage counted fewer tokens than chunks with text")
        return out


class OpenAIBackend:
    """Streams each request to an OpenAI-compatible server's /v1/completions, as `vllm bench serve` does.

    Prompts go as token-id lists, which vLLM, SGLang, llama.cpp's llama-server, Shardline and
    OpenAI itself accept; `detokenize` turns them into text first, for servers that take only
    text (the server's usage then says how many prompt tokens it counted).
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        ignore_eos: bool = True,
        detokenize: Callable[[list[int]], str] | None = None,
        extra_body: dict | None = None,
    ) -> None:
        self.root = api_root(base_url)
        # Fields every request adds, e.g. a tenant's priority, ttft_target_ms and refuse_late.
        self.extra_body = dict(extra_body or {})
        self.model = model  # None: the first of GET /v1/models, asked on first use
        self.ignore_eos = ignore_eos
        self.detokenize = detokenize
        self.check = StreamCheck()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # limit=0: the load's own semaphore decides how many requests are in flight.
        self.session = aiohttp.ClientSession(headers=headers, timeout=_TIMEOUT, connector=aiohttp.TCPConnector(limit=0))

    async def models(self) -> list[dict]:
        """The server's GET /v1/models entries."""
        try:
            async with self.session.get(f"{self.root}/v1/models") as response:
                if response.status != 200:
                    raise ConnectionError(
                        f"{self.root}/v1/models: HTTP {response.status}: {_message(await response.text())}"
                    )
                return (await response.json(content_type=None)).get("data") or []
        except aiohttp.ClientError as exc:
            raise ConnectionError(f"{self.root}/v1/models: {type(exc).__name__}: {exc}") from exc

    async def vocab_size(self) -> int | None:
        """Asks GET /v1/models once: picks the model to name when none was given, and returns the
        vocabulary size the server reports (llama-server's `meta.n_vocab`), else None."""
        models = await self.models()
        if self.model is None:
            if not models:
                raise ValueError(f"{self.root} serves no model (GET /v1/models is empty): give --model")
            self.model = str(models[0]["id"])
        sizes = [m["meta"].get("n_vocab") for m in models if isinstance(m.get("meta"), dict)]
        return min((s for s in sizes if isinstance(s, int) and s > 0), default=None)

    def body(self, prompt: list[int], output_len: int) -> dict:
        """The request: greedy, a fixed output length where the server takes ignore_eos."""
        body = {
            "model": self.model,
            "prompt": self.detokenize(prompt) if self.detokenize else prompt,
            "max_tokens": output_len,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:  # a vLLM, SGLang and llama.cpp extension; OpenAI itself refuses it
            body["ignore_eos"] = True
        return body | self.extra_body

    async def send(self, prompt: list[int], output_len: int, timing: RequestTiming) -> None:
        """One streamed request; its chunks' arrival times and token counts go into `timing`."""
        body = self.body(prompt, output_len)
        if self.model is None:
            await self.vocab_size()
            body["model"] = self.model
        self.check.requests += 1
        start = time.perf_counter()
        async with self.session.post(f"{self.root}/v1/completions", json=body) as response:
            if response.status != 200:
                timing.status = response.status
                raise RuntimeError(f"HTTP {response.status}: {_message(await response.text())}")
            usage = await read_stream(response.content, start, timing)
        if not timing.chunk_times:
            raise RuntimeError("the stream ended without a chunk that carried text")
        chunks = len(timing.chunk_times)
        if usage is None:
            self.check.without_usage += 1
            timing.output_len = chunks
            return
        completion = usage.get("completion_tokens")
        if not isinstance(completion, int) or completion < chunks:
            self.check.short_usage += 1
            timing.output_len = chunks
        else:
            timing.output_len = completion
        if isinstance(usage.get("prompt_tokens"), int):  # what the server counted (text prompts re-tokenize)
            timing.input_len = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            timing.cached_tokens = details["cached_tokens"]

    async def close(self) -> None:
        for warning in self.check.warnings(self.root):
            log.warning(warning)
        await self.session.close()


async def read_stream(lines: AsyncIterable[bytes], start: float, timing: RequestTiming) -> dict | None:
    """Read a completions event stream to its `[DONE]`: the arrival of every chunk whose text is not
    empty goes into `timing.chunk_times`; returns the usage, if a chunk carried one.

    Only chunks with text count, as the project's metrics define TTFT and ITL: a last chunk
    with only a finish reason, or the usage chunk, carries no token the client sees. An
    `error` event or an `{"error": ...}` payload fails the request, and so does a stream that
    ends without `[DONE]`.
    """
    usage = None
    event = ""
    async for raw in lines:
        at = time.perf_counter()
        line = raw.decode("utf-8", "replace").strip()
        if not line or line.startswith(":"):  # between events, or a comment (a keep-alive ping)
            if not line:
                event = ""
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            event = value
            continue
        if field == "error":  # llama-server's way of failing a stream it had started
            raise RuntimeError(f"error event: {_message(value)}")
        if field != "data":
            continue
        if value == "[DONE]":
            return usage
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RuntimeError(f"a chunk that is not JSON: {value[:80]!r}") from exc
        if event == "error" or "error" in data:
            timing.status = _status_of(data)
            raise RuntimeError(f"error event: {_message(value)}")
        if data.get("usage"):
            usage = data["usage"]
        for choice in data.get("choices") or []:
            if choice.get("text"):
                timing.chunk_times.append(at - start)
                break
    raise RuntimeError("the stream ended before [DONE]")


def _status_of(data: dict) -> int:
    """The HTTP status an error event stands for: a numeric `code` (vLLM's), else its OpenAI `type`; 0
    where it says neither."""
    error = data.get("error", data)
    if not isinstance(error, dict):
        return 0
    if isinstance(error.get("code"), int):
        return error["code"]
    return _STATUS_OF_TYPE.get(str(error.get("type")), 0)


def _message(text: str) -> str:
    """An error body's message (OpenAI's `{"error": {"message": ...}}`, or vLLM's), else its start."""
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text.strip()[:200]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error)[:200]
    return str(error)[:200]

"""Blocking client for Shardline's gRPC `Generation` API."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from shardline.client.batch_client import BatchClient
from shardline.client.call_policy import RETRYABLE, CallPolicy
from shardline.client.channel_options import CHANNEL_OPTIONS
from shardline.client.types import (
    Chunk,
    Completion,
    ModelInfo,
    RequestDetails,
    build_request,
    build_tools,
    resume_request,
    tools_of,
    was_taken,
)
from shardline.proto import common_pb2, generation_pb2, generation_pb2_grpc


class ShardlineClient:
    """Talks to a Shardline gateway over gRPC.

    >>> client = ShardlineClient("localhost:50051")
    >>> print(client.generate("The capital of France is", max_tokens=8).text)

    Calls that fail with UNAVAILABLE (a gateway restarting, say) are retried
    `retries` times with exponential backoff (3 s in all by default); a stream is
    retried only until its first chunk, and `resume()` continues one that broke
    later. A generation is never started twice: each has a request id (chosen here
    unless given), and a retry that finds it taken follows the one that started.

    `batches` holds the Batch API's calls: upload a file of requests, start a batch, follow it,
    download its results (see BatchClient).
    """

    def __init__(
        self,
        target: str = "localhost:50051",
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        retries: int = 4,
        backoff_s: float = 0.2,
    ) -> None:
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._policy = CallPolicy.of(api_key, timeout, retries, backoff_s)
        self.batches = BatchClient(self._policy, self._channel)  # the Batch API: files and batches

    def generate(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Completion:
        """Generate a whole completion. `params` are sampling parameters: max_tokens, temperature, top_p,
        top_k, min_p, seed, stop, stop_token_ids, presence/frequency/repetition_penalty, ignore_eos,
        top_logprobs, logit_bias ({token id: bias in [-100, 100]}), prompt_logprobs (the prompt's
        own tokens' logprobs, each with that many alternatives), plus model, request_id and priority.
        A request_id of your own is 1 to 128 printable ASCII characters with no space and no ':'.

        Structured output takes one of: json_schema (a JSON Schema, as a dict or its JSON text),
        json_object=True (any JSON object), regex, choice (a list of strings) or grammar (EBNF, rule
        "root"); disable_any_whitespace=True makes JSON compact. A complete output ends with
        finish_reason "stop" (see StructuredOutput in protos/shardline/v1/sampling.proto); a bad
        constraint is INVALID_ARGUMENT naming params.structured_output.

        Tool calling (with messages): tools=[OpenAI tool definitions], tool_choice="auto" (the
        default; needs a model whose chat template writes calls), "none", "required" or a function's
        name, and parallel_tool_calls. The calls come back in Completion.tool_calls (and
        Chunk.tool_calls, in pieces), with finish_reason "tool_calls" (or "stop" for a named one).

        Chat rendering (with messages), as vLLM takes it: chat_template_kwargs (variables for the
        template, such as {"enable_thinking": False}), continue_final_message=True (the model goes on
        with the last, assistant, message) and add_generation_prompt."""
        req = build_request(prompt, messages=messages, timeout=timeout, **params)
        return self._policy.call(
            lambda r, **kw: Completion.from_proto(self._stub.Generate(r, **kw)),
            req,
            timeout,
            taken=lambda: Completion.from_chunks(
                list(self._stream(self._stub.Resume, resume_request(req.request_id, 0, tools_of(req)), timeout))
            ),
        )

    def stream(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Iterator[Chunk]:
        """Generate, yielding chunks as tokens arrive; the last chunk carries finish_reason and usage."""
        req = build_request(prompt, messages=messages, timeout=timeout, **params)
        return self._stream(self._stub.GenerateStream, req, timeout, starts=True)

    def resume(
        self,
        request_id: str,
        offset: int = 0,
        *,
        timeout: float | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> Iterator[Chunk]:
        """Continue a request's stream from token `offset` (replayed from the server's record, then live).

        Use the `offset + len(token_ids)` of the last chunk received: the text not yet received,
        whole characters and stop-string look-ahead included, comes first. A stream whose connection
        broke stays resumable for the gateway's `SHARDLINE_RESUME_GRACE_S` (5 s by default), through
        any gateway; after that its request is cancelled.

        A request made with tools replays as raw text, unless the same `tools` (and `tool_choice`,
        `parallel_tool_calls`) come again, from offset 0: then its calls are read as they were.
        """
        req = resume_request(request_id, offset, build_tools(tools, tool_choice, parallel_tool_calls))
        return self._stream(self._stub.Resume, req, timeout)

    def _stream(self, fn: Callable[..., Any], req: Any, timeout: float | None, starts: bool = False) -> Iterator[Chunk]:
        """`fn`'s chunks, retried until the first; `starts`: it starts the generation `req` names."""
        policy = self._policy
        for attempt in range(policy.retries + 1):
            started = False
            try:
                for msg in policy.once(fn, req, timeout):
                    started = True
                    yield Chunk.from_proto(msg)
                return
            except grpc.RpcError as exc:
                if attempt and not started and starts and was_taken(exc):
                    yield from self._stream(
                        self._stub.Resume, resume_request(req.request_id, 0, tools_of(req)), timeout
                    )
                    return
                if started or exc.code() not in RETRYABLE or attempt == policy.retries:
                    raise
                policy.back_off(attempt)

    def cancel(self, request_id: str) -> None:
        """Stop a request; its worker frees the request's KV blocks."""
        self._policy.call(self._stub.Cancel, common_pb2.CancelRequest(request_id=request_id), None)

    def get_request(self, request_id: str) -> RequestDetails:
        """A request's status, worker, attempts, timings, usage and generated token ids."""
        return RequestDetails.from_proto(
            self._policy.call(self._stub.GetRequest, common_pb2.GetRequestRequest(request_id=request_id), None)
        )

    def list_models(self) -> list[str]:
        """Names of the models this gateway serves."""
        return [m.name for m in self.models()]

    def models(self) -> list[ModelInfo]:
        """The models this gateway serves (those with a live worker), with their limits."""
        resp = self._policy.call(self._stub.ListModels, generation_pb2.ListModelsRequest(), None)
        return [ModelInfo.from_proto(m) for m in resp.models]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ShardlineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

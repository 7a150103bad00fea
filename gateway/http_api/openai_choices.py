"""The choices of one OpenAI request: n completions per prompt, for one prompt or a batch of them.

Each choice is a request of its own to the scheduler (`<id>-<index>`; a single choice keeps the
request's id), so choices batch, stream and fail over like any other request, and the n choices of
one prompt share its KV blocks through the workers' prefix cache. With a seed, choice k of a prompt
samples with seed + k, as vLLM does, so the n choices differ and each is reproducible.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar, cast

from opentelemetry import trace

from gateway.http_api.openai_request import OpenAIRequest
from gateway.output.request_stream import StreamChunk, usage_of
from gateway.runner.generation_spec import GenerationSpec, PreparedRequest
from gateway.runner.request_runner import RequestRunner
from gateway.runner.submitted_request import SubmittedRequest
from shardline.proto import sampling_pb2
from tracing import attributes as attr

_UINT64 = 1 << 64
T = TypeVar("T")


@dataclass(slots=True)
class Choice:
    """One choice: its live request, and its own span when the request has several choices."""

    index: int  # choices[].index: prompt index * n + sample
    sample: int  # which of its prompt's n completions it is
    live: SubmittedRequest
    span: trace.Span | None  # a child of the HTTP span; None when that span is the choice's own


def choice_specs(
    parsed: OpenAIRequest,
    request_id: str,
    default_max_tokens: int | None,
    arrival_s: float,
    owner: str = "",
    idempotent: bool = False,
) -> list[GenerationSpec]:
    """One GenerationSpec per choice, in index order; `idempotent` when the client named the request."""
    specs = []
    request_params = parsed.sampling.parameters()
    for p, prompt in enumerate(parsed.prompts):
        for sample in range(parsed.n):
            index = p * parsed.n + sample
            params = sampling_pb2.SamplingParameters()
            params.CopyFrom(request_params)
            if params.HasField("seed"):
                params.seed = (params.seed + sample) % _UINT64
            specs.append(
                GenerationSpec(
                    request_id=request_id if parsed.num_choices == 1 else f"{request_id}-{index}",
                    model=parsed.model,
                    prompt=prompt,
                    params=params,
                    default_max_tokens=default_max_tokens,
                    priority=parsed.priority,
                    max_tokens_field=parsed.sampling.max_tokens_field,
                    arrival_s=arrival_s,
                    structured_output_field=parsed.structured_output_field or "structured_output",
                    owner=owner,
                    idempotent=idempotent,
                    slo=parsed.slo,
                )
            )
    return specs


async def start_choices(runner: RequestRunner, specs: list[GenerationSpec], n: int, span: trace.Span) -> list[Choice]:
    """Submits every choice, once all of them are valid; if one is refused, the others are cancelled."""
    if len(specs) == 1:
        return [Choice(0, 0, await runner.start(specs[0], span), None)]
    # Each choice has its own span, current while it is prepared and submitted, so its trace reaches the workers.
    with runner.admission.admit(len(specs)):
        spans = [runner.tracer.start_span("gateway.choice", attributes={attr.REQUEST_ID: s.request_id}) for s in specs]
        prepared = await asyncio.gather(
            *(_in_span(sp, runner.prepare(spec, sp)) for spec, sp in zip(specs, spans)), return_exceptions=True
        )
        _raise_first(prepared, spans, [])
        ready = cast(list[PreparedRequest], prepared)  # _raise_first raised if one was an exception
        lives = await asyncio.gather(
            *(_in_span(sp, runner.submit(p)) for sp, p in zip(spans, ready)), return_exceptions=True
        )
    started = [
        Choice(i, i % n, live, sp)
        for i, (live, sp) in enumerate(zip(lives, spans))
        if not isinstance(live, BaseException)
    ]
    _raise_first(lives, spans, started)
    return started


async def _in_span(span: trace.Span, work: Awaitable[T]) -> T:
    with trace.use_span(span, end_on_exit=False):
        return await work


def _raise_first(results: list, spans: list[trace.Span], started: list[Choice]) -> None:
    """Nothing of the request goes on when one of its choices failed: end it all and raise that error."""
    failures = [r for r in results if isinstance(r, BaseException)]
    if not failures:
        return
    for span in spans:
        # The client gets one answer, the first failure, counted on the HTTP span; no choice counts alone.
        span.set_attribute(attr.CHOICE_UNSTARTED, True)
    close_choices(started)
    for span, result in zip(spans, results):
        if isinstance(result, BaseException):
            span.record_exception(result)
            span.end()
        elif not started:
            span.end()
    raise failures[0]


def close_choices(choices: list[Choice]) -> None:
    """The consumer is done or gone: cancel unfinished choices upstream, end their spans."""
    for choice in choices:
        choice.live.close()
        if choice.span is not None:
            choice.span.end()


async def merged_chunks(choices: list[Choice]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """(choice index, chunk) as any choice produces them, until every choice has finished."""
    if len(choices) == 1:
        async for chunk in choices[0].live.chunks():
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, StreamChunk | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for chunk in choice.live.chunks():
                queue.put_nowait((choice.index, chunk))
        finally:
            queue.put_nowait((choice.index, None))

    tasks = [asyncio.create_task(pump(choice)) for choice in choices]
    try:
        remaining = len(tasks)
        while remaining:
            index, piece = await queue.get()
            if piece is None:
                remaining -= 1
            else:
                yield index, piece
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(
    choices: list[Choice], usages: list[sampling_pb2.Usage | None], echo_only: bool = False
) -> sampling_pb2.Usage:
    """The request's usage: each prompt counted once (with its first choice's cache hits), every choice's
    output tokens summed; none under `echo_only`, whose responses leave out the token sampled."""
    total = sampling_pb2.Usage()
    for choice, usage in zip(choices, usages):
        usage = usage or usage_of(choice.live.prompt_tokens, 0)
        if choice.sample == 0:
            total.prompt_tokens += usage.prompt_tokens
            total.cached_tokens += usage.cached_tokens
        if not echo_only:
            total.completion_tokens += usage.completion_tokens
    total.total_tokens = total.prompt_tokens + total.completion_tokens
    return total

"""Typed results of the Shardline client SDK."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import grpc

from shardline.proto import common_pb2, generation_pb2, sampling_pb2
from shardline.structured_output import KINDS as STRUCTURED_OUTPUT_KINDS
from shardline.structured_output import StructuredOutputSpec

_FINISH = {
    sampling_pb2.FINISH_REASON_STOP: "stop",
    sampling_pb2.FINISH_REASON_LENGTH: "length",
    sampling_pb2.FINISH_REASON_ABORT: "abort",
    sampling_pb2.FINISH_REASON_ERROR: "error",
    sampling_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
_STATUS = {
    sampling_pb2.REQUEST_STATUS_QUEUED: "queued",
    sampling_pb2.REQUEST_STATUS_RUNNING: "running",
    sampling_pb2.REQUEST_STATUS_FINISHED: "finished",
    sampling_pb2.REQUEST_STATUS_CANCELLED: "cancelled",
    sampling_pb2.REQUEST_STATUS_FAILED: "failed",
}


@dataclass(slots=True)
class Usage:
    """Token counts of a request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a worker's prefix cache

    @classmethod
    def from_proto(cls, u: sampling_pb2.Usage) -> Usage:
        return cls(u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_tokens)


@dataclass(slots=True)
class TokenLogprob:
    """The log-probability of a generated (or, in prompt_logprobs, a prompt) token, with the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first
    rank: int = 0  # how many tokens are at least as likely (vLLM's rank; 1: the most likely); 0: unknown

    @classmethod
    def from_proto(cls, lp: sampling_pb2.TokenLogprob) -> TokenLogprob:
        return cls(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top], lp.rank)


@dataclass(slots=True)
class ToolCall:
    """A function the model called: `arguments` is a JSON object's text (json.loads it)."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of a streamed tool call: the call's first piece has its id and name (None on the
    others), and each piece more of its arguments' text."""

    index: int  # which call of the turn
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Completion:
    """A finished generation."""

    request_id: str
    text: str  # with tools: what the model said besides its calls
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error"; "tool_calls" when the model called tools
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    # With prompt_logprobs=N: entry i is prompt token i + 1's, given the tokens before it.
    prompt_logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None  # with tools=: the calls the model made

    @classmethod
    def from_chunks(cls, chunks: list[Chunk]) -> Completion:
        """The completion a whole stream of chunks makes up."""
        logprobs = [lp for c in chunks for lp in c.logprobs or ()]
        prompt_logprobs = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
        calls: list[ToolCall] = []
        for delta in (d for c in chunks for d in c.tool_calls or ()):
            if delta.id is not None:
                calls.append(ToolCall(delta.id, delta.name or "", ""))
            calls[delta.index].arguments += delta.arguments
        last = chunks[-1]
        return cls(
            last.request_id,
            "".join(c.text for c in chunks),
            [t for c in chunks for t in c.token_ids],
            last.finish_reason,
            last.usage or Usage(),
            logprobs or None,
            prompt_logprobs,
            calls or None,
        )

    @classmethod
    def from_proto(cls, r: generation_pb2.GenerateResponse) -> Completion:
        return cls(
            r.request_id,
            r.text,
            list(r.token_ids),
            _FINISH.get(r.finish_reason),
            Usage.from_proto(r.usage),
            [TokenLogprob.from_proto(lp) for lp in r.logprobs] or None,
            [TokenLogprob.from_proto(lp) for lp in r.prompt_logprobs] or None,
            [ToolCall(c.id, c.name, c.arguments) for c in r.tool_calls] or None,
        )


@dataclass(slots=True)
class Chunk:
    """One piece of a streamed generation: new text and the tokens behind it."""

    request_id: str
    text: str
    token_ids: list[int]
    offset: int  # index of the first token of this chunk in the whole output; resume from offset + len
    finish_reason: str | None  # set on the last chunk
    usage: Usage | None  # set on the last chunk
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first chunk with tokens, when asked for
    tool_calls: list[ToolCallDelta] | None = None  # with tools=: pieces of the calls, in order

    @classmethod
    def from_proto(cls, r: generation_pb2.GenerateStreamResponse) -> Chunk:
        finish = _FINISH.get(r.finish_reason)
        return cls(
            r.request_id,
            r.text,
            list(r.token_ids),
            r.offset,
            finish,
            Usage.from_proto(r.usage) if finish else None,
            [TokenLogprob.from_proto(lp) for lp in r.logprobs] or None,
            [TokenLogprob.from_proto(lp) for lp in r.prompt_logprobs] or None,
            [ToolCallDelta(d.index, d.arguments, d.id or None, d.name or None) for d in r.tool_calls] or None,
        )


@dataclass(slots=True)
class RequestDetails:
    """A request's record: status, worker, attempts, timings (unix seconds), tokens and their logprobs."""

    request_id: str
    model: str
    status: str
    worker_id: str
    attempt: int
    finish_reason: str | None
    error: str
    usage: Usage
    arrival_time: float | None
    dispatch_time: float | None
    first_token_time: float | None
    finish_time: float | None
    output_token_ids: list[int]
    # When the request asked for them (top_logprobs, prompt_logprobs): as in its Completion.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    @classmethod
    def from_proto(cls, r: common_pb2.RequestInfo) -> RequestDetails:
        def ts(name: str) -> float | None:
            return getattr(r, name).ToMicroseconds() / 1e6 if r.HasField(name) else None

        return cls(
            r.request_id,
            r.model,
            _STATUS.get(r.status, "unknown"),
            r.worker_id,
            r.attempt,
            _FINISH.get(r.finish_reason),
            r.error,
            Usage.from_proto(r.usage),
            ts("arrival_time"),
            ts("dispatch_time"),
            ts("first_token_time"),
            ts("finish_time"),
            list(r.output_token_ids),
            [TokenLogprob.from_proto(lp) for lp in r.output_logprobs] or None,
            [TokenLogprob.from_proto(lp) for lp in r.prompt_logprobs] or None,
        )


@dataclass(slots=True)
class ModelInfo:
    """A served model: its name (for `model=`), context length, live workers and vocabulary size; for a
    LoRA adapter, `parent` is the model it adapts ("" for a base model)."""

    name: str
    max_context_length: int
    num_workers: int
    vocab_size: int
    parent: str = ""

    @classmethod
    def from_proto(cls, m: generation_pb2.ModelInfo) -> ModelInfo:
        return cls(m.name, m.max_context_length, m.num_workers, m.vocab_size, m.parent)


def build_request(
    prompt: str | list[int] | None = None,
    *,
    messages: list[dict[str, Any]] | None = None,
    model: str = "",
    request_id: str | None = None,
    priority: int = 0,
    timeout: float | None = None,
    ttft_target: float | None = None,
    refuse_late: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
    add_generation_prompt: bool | None = None,
    **params: Any,
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from a prompt (text or token ids) or chat messages plus sampling parameters.

    Messages are OpenAI's: {"role", "content"} (role "system", "developer", "user", "assistant" or
    "tool"), an assistant's earlier "tool_calls" (OpenAI's shape, or ToolCall objects) and a tool's
    answer with its "tool_call_id". `tools` are OpenAI tool
    definitions; `tool_choice` is "auto" (the default), "none", "required", a function's name, or
    OpenAI's {"type": "function", "function": {"name": ...}}. `chat_template_kwargs` (variables for
    the template), `continue_final_message` and `add_generation_prompt` are vLLM's chat options.

    `ttft_target` (seconds): the first token should come within it (the tenant's target when unset);
    the gateway's tenant queue serves the earliest deadline first. `refuse_late`: once the target
    can no longer be met while the request waits, fail it (UNAVAILABLE, its message starting "ttft
    target unmet") instead of serving it late; unset, the tenant's choice."""
    req = generation_pb2.GenerateRequest(model=model, priority=priority)
    _set_input(req, prompt, messages, chat_template_kwargs, continue_final_message, add_generation_prompt)
    if (spec := build_tools(tools, tool_choice, parallel_tool_calls)) is not None:
        req.tools.CopyFrom(spec)
    # Chosen here when not given: a retry after a connection lost mid-call must not start the
    # generation twice, and with its id it finds the one that did start (see was_taken).
    req.request_id = request_id or f"{'chatcmpl' if messages is not None else 'cmpl'}-{secrets.token_hex(16)}"
    _set_deadlines(req, timeout, ttft_target, refuse_late)
    _set_sampling(req.params, params)
    return req


def _set_input(
    req: generation_pb2.GenerateRequest,
    prompt: str | list[int] | None,
    messages: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None,
    continue_final_message: bool,
    add_generation_prompt: bool | None,
) -> None:
    """The request's input: chat messages with their template options, or a prompt's text or ids."""
    if messages is not None:
        req.messages.messages.extend(_chat_message(m) for m in messages)
        if chat_template_kwargs:
            req.messages.template_kwargs_json = json.dumps(chat_template_kwargs)
        req.messages.continue_final_message = continue_final_message
        if add_generation_prompt is not None:
            req.messages.add_generation_prompt = add_generation_prompt
    elif chat_template_kwargs or continue_final_message or add_generation_prompt is not None:
        raise ValueError("chat_template_kwargs, continue_final_message and add_generation_prompt need messages")
    elif isinstance(prompt, str):
        req.prompt = prompt
    elif prompt is not None:
        req.prompt_token_ids.ids.extend(prompt)
    else:
        raise ValueError("give a prompt (text or token ids) or messages")


def _set_deadlines(
    req: generation_pb2.GenerateRequest, timeout: float | None, ttft_target: float | None, refuse_late: bool | None
) -> None:
    """The request's time budget and its first token's target, in the wire's units."""
    if timeout is not None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        req.timeout.FromMilliseconds(max(1, round(timeout * 1000)))
    if ttft_target is not None:
        if not ttft_target > 0:
            raise ValueError(f"ttft_target must be positive, got {ttft_target}")
        req.ttft_target.FromMicroseconds(max(1, round(ttft_target * 1e6)))
    if refuse_late is not None:
        req.refuse_late = refuse_late


def _set_sampling(sampling: sampling_pb2.SamplingParameters, params: dict[str, Any]) -> None:
    """The sampling keywords onto their message; None leaves a field to the server's default."""
    for name, value in params.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            getattr(sampling, name).extend([value] if isinstance(value, (str, int)) else value)
        elif name == "seed":
            sampling.seed = value % (1 << 64)  # signed seeds (OpenAI's) map onto the wire's uint64
        elif name == "logit_bias":  # {token id: bias}; OpenAI-style string ids are taken too
            sampling.logit_bias.update({int(token): float(bias) for token, bias in value.items()})
        elif name == "top_logprobs":
            sampling.logprobs = True
            sampling.top_logprobs = value
        elif name == "json_object" and not value:
            continue  # json_object=False asks for nothing, as in vLLM
        elif name in STRUCTURED_OUTPUT_KINDS:
            if sampling.structured_output.WhichOneof("kind") is not None:
                raise ValueError(f"{name}: give one structured output constraint, not several")
            if name == "choice" and isinstance(value, str):  # a string is a sequence too: "y", "e", "s"
                raise ValueError("choice must be a list of strings")
            # Merged: a disable_any_whitespace given before it stays.
            sampling.structured_output.MergeFrom(StructuredOutputSpec(name, _spec_value(name, value)).to_proto())
        elif name == "disable_any_whitespace":  # with json_schema or json_object: compact JSON
            if value:  # False is the default: setting it would create an empty constraint
                sampling.structured_output.disable_any_whitespace = True
        else:
            setattr(sampling, name, value)  # AttributeError names an unknown parameter


def build_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> generation_pb2.Tools | None:
    """The Tools message: OpenAI tool definitions, and tool_choice as "auto", "none", "required", a
    function's name, or OpenAI's {"type": "function", "function": {"name": ...}}."""
    if tools is None:
        if tool_choice is not None or parallel_tool_calls is not None:
            raise ValueError("tool_choice and parallel_tool_calls need tools")
        return None
    spec = generation_pb2.Tools(tools_json=json.dumps(tools))
    if isinstance(tool_choice, dict):
        spec.function = tool_choice["function"]["name"]
    elif tool_choice in (None, "auto", "none", "required"):
        spec.choice = tool_choice or "auto"
    else:
        spec.function = tool_choice
    if parallel_tool_calls is not None:
        spec.parallel_tool_calls = parallel_tool_calls
    return spec


def _chat_message(m: dict[str, Any]) -> sampling_pb2.ChatMessage:
    # OpenAI's newer "developer" turn is the system turn, as the HTTP API takes it.
    role = "system" if m["role"] == "developer" else m["role"]
    message = sampling_pb2.ChatMessage(
        role=role, content=m.get("content") or "", tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or ""
    )
    for call in m.get("tool_calls") or ():
        if isinstance(call, ToolCall):
            message.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
        else:  # OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}
            arguments = call["function"].get("arguments", "{}")
            message.tool_calls.add(
                id=call.get("id", ""),
                name=call["function"]["name"],
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
            )
    return message


def _spec_value(kind: str, value: Any) -> str | tuple[str, ...]:
    """A structured output keyword's value as StructuredOutputSpec holds it: a JSON Schema (a dict,
    or its JSON text) as text, choices as a tuple; json_object=True holds nothing. The others, a
    regex and an EBNF grammar (rule "root"), are text already."""
    if kind == "json_schema":
        return value if isinstance(value, str) else json.dumps(value)
    if kind == "choice":
        return tuple(value)
    return "" if kind == "json_object" else value


def resume_request(
    request_id: str, offset: int, tools: generation_pb2.Tools | None = None
) -> generation_pb2.ResumeRequest:
    """A ResumeRequest; with the request's tools, the replay is read into tool calls again (offset 0)."""
    req = generation_pb2.ResumeRequest(request_id=request_id, offset=offset)
    if tools is not None:
        req.tools.CopyFrom(tools)
    return req


def tools_of(req: generation_pb2.GenerateRequest) -> generation_pb2.Tools | None:
    return req.tools if req.HasField("tools") else None


def was_taken(exc: grpc.RpcError) -> bool:
    """A retried Generate refused because its request id is in use: the earlier attempt reached the
    gateway before its connection broke, and the request runs on (resume it, do not start another)."""
    return exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in (exc.details() or "")

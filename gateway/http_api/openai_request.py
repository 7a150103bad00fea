"""OpenAI /v1/completions and /v1/chat/completions bodies, parsed once into typed requests.

Every field is read and type-checked here, in one pass, and an error is an InvalidArgument naming
the field (`param` in the OpenAI error body); the rest of the gateway reads the typed request,
never the body. Ranges that depend on the served model are checked once it is known
(gateway/runner/params.py: validate_sampling).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.http_api.chat_messages import chat_messages, chat_tools
from gateway.http_api.openai_fields import as_float, integer_field, json_field, refuse_unknown_fields
from gateway.http_api.structured_fields import structured_output_from_openai
from gateway.runner.generation_spec import Prompt
from gateway.runner.params import MAX_TOP_LOGPROBS
from gateway.tenancy.slo_params import Slo, checked_target
from gateway.tools.tool_params import ToolRequest, tool_constraint
from shardline.core.errors import InvalidArgument
from shardline.proto import sampling_pb2

# Most completions one OpenAI request may ask for (prompts x n): each is a request in the queue.
MAX_CHOICES = 64
# OpenAI's legacy /v1/completions generates 16 tokens when max_tokens is absent.
OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_UINT32 = 1 << 32
_INT32 = 1 << 31
_UINT64 = 1 << 64
# The sampling fields that only go on the wire when given: SamplingParameters tells them from unset.
_WHEN_GIVEN = (
    "max_tokens",
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "skip_special_tokens",
    "prompt_logprobs",
)


@dataclass(slots=True)
class SamplingFields:
    """A body's sampling fields, type-checked; None where the client gave none."""

    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"  # max_completion_tokens when a chat request used OpenAI's newer name
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    top_k: int = 0  # 0: no top-k (vLLM spells it -1)
    min_tokens: int = 0
    seed: int | None = None  # OpenAI's signed 64 bits, as the wire carries them: unsigned
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)  # by token id
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    logprobs: bool = False  # the sampled tokens' logprobs
    top_logprobs: int = 0  # alternatives per token
    prompt_logprobs: int | None = None  # alternatives per prompt token, when the prompt's logprobs are asked for
    structured_output: sampling_pb2.StructuredOutput | None = None  # the constraint on the output, if any

    def parameters(self) -> sampling_pb2.SamplingParameters:
        """The SamplingParameters these fields ask for, not yet resolved (validate_sampling does)."""
        params = sampling_pb2.SamplingParameters(
            top_k=self.top_k,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            logit_bias=self.logit_bias,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
        )
        for name in _WHEN_GIVEN:
            value = getattr(self, name)
            if value is not None:
                setattr(params, name, value)
        if self.structured_output is not None:
            params.structured_output.CopyFrom(self.structured_output)
        return params


@dataclass(slots=True)
class OpenAIRequest:
    """A completions or chat completions request, parsed and type-checked (ranges are checked later)."""

    chat: bool  # /v1/chat/completions rather than /v1/completions
    model: str  # requested model
    prompts: list[Prompt]  # prompt texts, token ids or chat messages: several for a batch of completions
    sampling: SamplingFields
    priority: int = 0  # lower is served first (a vLLM extension)
    n: int = 1  # completions to generate per prompt
    stream: bool = False  # answer with server-sent events
    include_usage: bool = False  # stream_options.include_usage: end the stream with a usage chunk
    echo: bool = False  # completions: the prompt comes back before its completion (with its logprobs)
    echo_only: bool = False  # echo with max_tokens 0: each choice is its prompt alone (how text is scored)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was sent: answer it in vLLM's shape
    structured_output_field: str = ""  # where sampling.structured_output came from (response_format...)
    tools: ToolRequest | None = None  # chat: the functions the model may call, and how
    slo: Slo = Slo()  # ttft_target_ms and refuse_late, as sent

    @property
    def num_choices(self) -> int:
        """Choices in the response: n per prompt, prompt by prompt (OpenAI's order)."""
        return len(self.prompts) * self.n


def parse_request(body: Any, chat: bool) -> OpenAIRequest:
    """The request in an OpenAI JSON body; InvalidArgument names the first bad field."""
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    refuse_unknown_fields(body, chat)
    model = json_field(body, "model", str) or ""
    prompts = [chat_messages(body)] if chat else _prompts(body)
    if chat and json_field(body, "echo", bool):
        raise InvalidArgument("echo", "echo is only supported by /v1/completions")
    stream = bool(json_field(body, "stream", bool))
    if stream and body.get("prompt_logprobs") is not None:
        raise InvalidArgument(
            "prompt_logprobs",
            "is not available when stream is true (as in vLLM); /v1/completions' echo with logprobs streams them",
        )
    if not chat and json_field(body, "suffix", str):
        raise InvalidArgument("suffix", "suffix is not supported")
    sampling = sampling_fields(body, chat)
    priority = integer_field(body, "priority", -_INT32, _INT32) or 0
    n = integer_field(body, "n", 1, MAX_CHOICES + 1) or 1
    if not chat and integer_field(body, "best_of", 1, _UINT32) not in (None, n):
        # best_of > n means ranking candidates by likelihood and returning the best n: not done here.
        raise InvalidArgument("best_of", "only best_of equal to n is supported")
    sampling.structured_output, structured_output_field = structured_output_from_openai(body)
    tools = None
    if chat:
        tools, structured_output_field = _tools(body, prompts[0], sampling, structured_output_field)
    if len(prompts) * n > MAX_CHOICES:
        raise InvalidArgument(
            "n" if len(prompts) == 1 else "prompt",
            f"a request may ask for at most {MAX_CHOICES} completions (prompts x n), got {len(prompts)} x {n}",
        )
    options = json_field(body, "stream_options", dict)
    if options is not None and not stream:
        raise InvalidArgument("stream_options", "is only allowed when stream is true")
    include_usage = bool(json_field(options or {}, "include_usage", bool, "stream_options.include_usage"))
    echo, echo_only = (False, False) if chat else _echo(body, sampling)
    return OpenAIRequest(
        chat,
        model,
        prompts,
        sampling,
        priority,
        n,
        stream,
        include_usage,
        echo,
        echo_only,
        body.get("prompt_logprobs") is not None,
        structured_output_field,
        tools,
        _slo(body),
    )


def sampling_fields(body: dict[str, Any], chat: bool) -> SamplingFields:
    """The sampling fields of a completions or chat body, type-checked; their ranges are checked later."""
    fields = SamplingFields()
    max_tokens = integer_field(body, "max_completion_tokens", 0, _UINT32) if chat else None
    if max_tokens is not None:
        fields.max_tokens_field = "max_completion_tokens"  # OpenAI's newer name; it wins over max_tokens
    else:
        max_tokens = integer_field(body, "max_tokens", 0, _UINT32)
    fields.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        setattr(fields, name, json_field(body, name, float))
    top_k = integer_field(body, "top_k", -1, _UINT32)
    fields.top_k = 0 if top_k in (None, -1) else top_k
    fields.min_tokens = integer_field(body, "min_tokens", 0, _UINT32) or 0
    seed = integer_field(body, "seed", -(1 << 63), _UINT64)
    fields.seed = None if seed is None else seed % _UINT64
    fields.stop = _stop_strings(body.get("stop"))
    fields.stop_token_ids = json_field(body, "stop_token_ids", list) or []
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _UINT32 for t in fields.stop_token_ids):
        raise InvalidArgument("stop_token_ids", "must be a list of token ids")
    fields.logit_bias = _logit_bias(json_field(body, "logit_bias", dict) or {})
    fields.ignore_eos = bool(json_field(body, "ignore_eos", bool))
    fields.skip_special_tokens = json_field(body, "skip_special_tokens", bool)
    if chat:
        fields.logprobs = bool(json_field(body, "logprobs", bool))
        fields.top_logprobs = integer_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS + 1) or 0
    else:
        # Completions: logprobs is the number of alternatives per token (0 still returns the sampled one's).
        count = integer_field(body, "logprobs", 0, MAX_TOP_LOGPROBS + 1)
        fields.logprobs = count is not None
        fields.top_logprobs = count or 0
    fields.prompt_logprobs = integer_field(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS + 1)  # vLLM's extension
    return fields


def _tools(
    body: dict[str, Any], conversation: Prompt, sampling: SamplingFields, structured_output_field: str
) -> tuple[ToolRequest | None, str]:
    """A chat's tools, their definitions put in its conversation and their constraint, if any, on
    its output; and the field its constraint came from."""
    tools = chat_tools(body)
    if tools is None:
        return None, structured_output_field
    assert conversation.chat is not None
    conversation.chat.tools_json = tools.tools_json
    constraint = tool_constraint(tools, sampling.structured_output, structured_output_field)
    if constraint is None:
        return tools, structured_output_field
    sampling.structured_output = constraint
    return tools, "tools"


def _echo(body: dict[str, Any], sampling: SamplingFields) -> tuple[bool, bool]:
    """/v1/completions' echo, and whether the echoed prompt is all the answer (max_tokens 0), with what
    each asks of the sampler."""
    echo = bool(json_field(body, "echo", bool))
    if echo and sampling.logprobs and sampling.prompt_logprobs is None:
        # An echoed prompt's tokens get logprobs like the completion's (how harnesses score text).
        sampling.prompt_logprobs = sampling.top_logprobs
    echo_only = echo and sampling.max_tokens == 0
    if echo_only:
        # OpenAI's way to score a text: its logprobs, no completion. As in vLLM, the engine still samples
        # one token (a prefill yields one), and the response leaves it out.
        if sampling.min_tokens:
            raise InvalidArgument("min_tokens", "must not exceed max_tokens")
        sampling.max_tokens = 1
    return echo, echo_only


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidArgument("stop", "must be a string or a list of strings")
    return stops


def _logit_bias(biases: dict[str, Any]) -> dict[int, float]:
    checked = {}
    for key, bias in biases.items():
        # JSON object keys are strings: OpenAI's are token ids written in decimal.
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < _UINT32):
            raise InvalidArgument("logit_bias", f"keys must be token ids, got {key[:20]!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidArgument("logit_bias", f"the bias of token {key} must be a number")
        checked[int(key)] = as_float(bias, "logit_bias")
    return checked


def _slo(body: dict[str, Any]) -> Slo:
    """The SLO fields: vLLM-style extensions, ttft_target_ms and refuse_late."""
    target_ms = json_field(body, "ttft_target_ms", float)
    target_s = None if target_ms is None else checked_target(target_ms / 1000.0, "ttft_target_ms")
    return Slo(target_s, json_field(body, "refuse_late", bool))


def _prompts(body: dict[str, Any]) -> list[Prompt]:
    """A prompt (text or token ids), or a batch of them: a list of texts or of token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and _is_token_ids(prompt)):
        return [_prompt(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        return [_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise InvalidArgument("prompt", "must be a string, a list of token ids, or a non-empty list of either")


def _prompt(prompt: str | list[int], field: str) -> Prompt:
    return Prompt(text=prompt, field=field) if isinstance(prompt, str) else Prompt(token_ids=prompt, field=field)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

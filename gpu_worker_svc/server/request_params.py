"""The worker's edge: a NewRequest as the engine's arguments, checked once for all the engine needs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_worker_svc.engine.sampling_params import SamplingParams
from shardline.proto import sampling_pb2, worker_pb2
from shardline.structured_output import StructuredOutputSpec

if TYPE_CHECKING:
    from gpu_worker_svc.engine.llm_engine import LLMEngine


@dataclass(slots=True)
class EngineLimits:
    """What one request must fit in an engine."""

    max_model_len: int  # the longest sequence, prompt and output, the engine holds
    vocab_size: int  # token ids must be below this

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineLimits:
        return cls(engine.max_model_len, engine.model_config.vocab_size)


@dataclass(slots=True)
class EngineRequest:
    """What `LLMEngine.add_request` needs for one NewRequest."""

    params: SamplingParams  # validated sampling parameters
    eos_token_id: int | None  # None: the model's own EOS


def engine_request(new: worker_pb2.NewRequest, limits: EngineLimits) -> EngineRequest:
    """Map the proto onto the engine and check it; ValueError (naming the field) when it cannot run.

    Unset optional fields take the engine's defaults, except max_tokens, which the proto defines
    as "up to the context length" (`limits.max_model_len`, the longest sequence this worker holds).
    """
    p = new.params
    room = limits.max_model_len - len(new.prompt_token_ids)
    params = SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else room,
        min_tokens=p.min_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_k=p.top_k,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=p.seed if p.HasField("seed") else None,
        # The first EOS id is the request's EOS; the others stop it like stop tokens, unless EOS is ignored.
        stop_token_ids=[*p.stop_token_ids, *(() if p.ignore_eos else new.eos_token_ids[1:])],
        ignore_eos=p.ignore_eos,
        logprobs=_logprobs(p),
        logit_bias=dict(p.logit_bias),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        structured_output=(
            StructuredOutputSpec.from_proto(p.structured_output) if p.HasField("structured_output") else None
        ),
    )
    check_request(new.prompt_token_ids, params, limits, new.output_token_ids)
    return EngineRequest(params, new.eos_token_ids[0] if new.eos_token_ids else None)


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    limits: EngineLimits,
    output_token_ids: Sequence[int] = (),
) -> None:
    """Everything the engine needs of one request, which its internals then trust: ValueError, its
    message starting with the field at fault. `output_token_ids` resumes a request after them.

    Past the context the rotary table ends and a token id past the vocabulary indexes past the
    embedding: either would fail a step for the whole batch, so they are refused here.
    """
    prompt, output = len(prompt_token_ids), len(output_token_ids)
    if not prompt:
        raise ValueError("prompt_token_ids must not be empty")
    room = limits.max_model_len - prompt
    if room <= output:
        resumed = f" and {output} output_token_ids" if output else ""
        raise ValueError(
            f"prompt_token_ids: {prompt} tokens{resumed} leave no room in the context length of {limits.max_model_len}"
        )
    params.validate()
    if params.max_tokens > room:
        raise ValueError(
            f"max_tokens: prompt of {prompt} tokens + max_tokens={params.max_tokens} "
            f"exceeds the context length of {limits.max_model_len}"
        )
    if output >= params.max_tokens:
        raise ValueError(
            f"max_tokens={params.max_tokens} leaves nothing to generate after {output} resumed output tokens"
        )
    vocab = limits.vocab_size
    for name, ids in (
        ("prompt_token_ids", prompt_token_ids),
        ("output_token_ids", output_token_ids),
        ("logit_bias", list(params.logit_bias)),
    ):
        if ids and (max(ids) >= vocab or min(ids) < 0):
            raise ValueError(f"{name} must be in [0, {vocab})")


def _logprobs(p: sampling_pb2.SamplingParameters) -> int | None:
    if not p.logprobs:
        if p.top_logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return None
    return p.top_logprobs

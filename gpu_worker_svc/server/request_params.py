"""A NewRequest's sampling parameters, as the engine's SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker_svc.engine.sampling_params import SamplingParams
from shardline.proto import sampling_pb2, worker_pb2
from shardline.structured_output import StructuredOutputSpec


@dataclass(slots=True)
class EngineRequest:
    """What `LLMEngine.add_request` needs for one NewRequest."""

    params: SamplingParams  # validated sampling parameters
    eos_token_id: int | None  # None: the model's own EOS


def engine_request(new: worker_pb2.NewRequest, max_model_len: int) -> EngineRequest:
    """Map the proto onto the engine; ValueError (naming the field) when a value is out of range.

    Unset optional fields take the engine's defaults, except max_tokens, which
    the proto defines as "up to the context length" (`max_model_len`, the
    longest sequence this worker can hold).
    """
    p = new.params
    room = max_model_len - len(new.prompt_token_ids)
    if room < 1:
        raise ValueError(
            f"prompt_token_ids: {len(new.prompt_token_ids)} tokens leave no room "
            f"in the context length of {max_model_len}"
        )
    # Past the context the rotary table ends, so refuse here rather than fail mid-step.
    if p.HasField("max_tokens") and p.max_tokens > room:
        raise ValueError(
            f"max_tokens: prompt of {len(new.prompt_token_ids)} tokens + max_tokens={p.max_tokens} "
            f"exceeds the context length of {max_model_len}"
        )
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
    params.validate()
    return EngineRequest(params, new.eos_token_ids[0] if new.eos_token_ids else None)


def _logprobs(p: sampling_pb2.SamplingParameters) -> int | None:
    if not p.logprobs:
        if p.top_logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return None
    return p.top_logprobs

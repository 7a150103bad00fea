"""Per-request sampling parameters, with vLLM/OpenAI semantics."""

import math
from dataclasses import dataclass, field

from shardline.structured_output import StructuredOutputSpec

# At or below this temperature a request is decoded greedily: dividing logits
# by a near-zero temperature would overflow instead of sharpening.
GREEDY_TEMPERATURE = 1e-5
# The most top logprobs a request may ask for; like vLLM's default cap, it
# keeps the per-step top-k over the vocabulary small.
MAX_LOGPROBS = 20
# OpenAI's documented range for presence and frequency penalties.
MAX_ABS_PENALTY = 2.0
# OpenAI's documented range for a logit bias.
MAX_ABS_LOGIT_BIAS = 100.0


@dataclass(slots=True)
class SamplingParams:
    """How the tokens of one request are chosen and when it stops."""

    max_tokens: int = 16  # most output tokens, pre-filled (resumed) ones included
    min_tokens: int = 0  # output tokens generated before EOS/stop ids may end it
    temperature: float = 1.0  # <= GREEDY_TEMPERATURE means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    min_p: float = 0.0  # drop tokens below min_p * the top token's probability
    repetition_penalty: float = 1.0  # HF/vLLM semantics, over prompt + output tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over output token counts
    seed: int | None = None  # None: the engine picks one at add time and stores it
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that stop
    ignore_eos: bool = False  # keep generating past EOS
    logprobs: int | None = None  # None: none; 0: the sampled token's only; N: plus top N
    # Logprobs of the prompt's own tokens (vLLM's prompt_logprobs), as for `logprobs`. They cost a
    # prefill without the prefix cache: a cached block has no logits left to read.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # The language the output must belong to (JSON Schema, regex, ...; engine/grammar.py). Once the
    # output is complete only EOS is allowed, and the request stops even under ignore_eos or min_tokens.
    structured_output: StructuredOutputSpec | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        """Raise ValueError, its message starting with the bad field's name."""
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _check_finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        _check_finite("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_finite("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_finite(name, value)
            if abs(value) > MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id)
            if token_id < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {token_id}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id)
            _check_finite("logit_bias", bias)
            if token_id < 0 or abs(bias) > MAX_ABS_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias must map token ids >= 0 to biases in "
                    f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], got {token_id}: {bias}"
                )
        if self.structured_output is not None:
            self.structured_output.check()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")


def _check_int(name: str, value: object) -> None:
    # bool is an int subclass, but `top_k=True` is always a client mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")

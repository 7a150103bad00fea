"""What the engine reports each step: new tokens per request, plus per-step stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw logits
    rank: int  # how many tokens have a logprob at least as high (vLLM's rank; 1: the most likely)
    top: list[tuple[int, float]]  # the top N (token id, logprob), most likely first


@dataclass(slots=True)
class RequestOutput:
    request_id: str  # the request these tokens belong to
    new_token_ids: list[int]  # tokens sampled this step (empty for an abort)
    offset: int  # output index of the first new token
    logprobs: list[TokenLogprobs] | None  # one per new token, when the request asked for them
    finish_reason: str | None  # "stop", "length", "abort", "error", or None while running
    num_prompt_tokens: int  # prompt length, for usage
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # On a fresh request's first token, when it asked for prompt logprobs: entry i is prompt token
    # i + 1's (the first prompt token has none).
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # with finish_reason "error": why, for the client


@dataclass(slots=True)
class StepStats:
    step: int  # engine step counter
    batch_size: int  # sequences computed this step
    num_tokens: int  # tokens computed (prefill + decode)
    num_prefill_tokens: int  # tokens of prompt chunks
    num_decode_tokens: int  # decode tokens: one per decoding sequence, and its draft tokens
    prefix_cache_hit_tokens: int  # tokens admitted from the prefix cache this step
    kv_blocks_used: int  # blocks held by requests
    kv_blocks_total: int  # capacity of the cache
    num_waiting: int  # requests queued in the engine after the step
    num_running: int  # requests running after the step
    num_preempted: int  # requests preempted this step
    step_time_s: float  # wall time of schedule + forward + sample + update
    attention_pairs: int = 0  # causal (query, key) pairs attention scored, for FLOP estimates
    kv_tokens_read: int = 0  # KV positions attention read across the batch, for byte estimates
    num_draft_tokens: int = 0  # n-gram speculation: draft tokens computed (num_decode_tokens counts them)
    num_accepted_tokens: int = 0  # drafts that proved to be the tokens decoding gives, kept as output


@dataclass(slots=True)
class StepResult:
    """What one engine step produced: the requests with news, its figures, and whom it admitted."""

    outputs: list[RequestOutput] = field(default_factory=list)  # one per request with news
    stats: StepStats | None = None  # None when nothing ran
    admitted_ids: list[str] = field(default_factory=list)  # requests admitted from waiting this step


@dataclass(slots=True)
class GenerationResult:
    """A finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # entry i is prompt token i + 1's, when asked for
    error: str | None = None  # with finish_reason "error": why

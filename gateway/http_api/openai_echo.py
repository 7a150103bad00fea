"""Prompt logprobs in OpenAI's and vLLM's shapes, and /v1/completions' `echo`.

Evaluation harnesses (lm-evaluation-harness's `local-completions`, for one) score a text by sending
it as the prompt with `echo: true, logprobs: 1` and reading the prompt tokens' logprobs back. The
workers compute them in the prefill (`SamplingParameters.prompt_logprobs`). This module finds the
text an echo puts in front of a completion, and gives vLLM's own `prompt_logprobs` shape; the
ResponseFormatter puts the prompt's tokens in the legacy `logprobs` object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.runner.request_runner import RequestRunner
from gateway.runner.submitted_request import SubmittedRequest
from gateway.upstream.backends import RPC_TIMEOUT_S, upstream
from shardline.proto import sampling_pb2, tokenizer_pb2


@dataclass(slots=True)
class EchoedPrompt:
    """What an echo puts before a choice's completion."""

    text: str  # the prompt as sent, or its token ids decoded
    first_token_text: str  # the text of its first token, which has no logprob (nothing comes before it)
    only: bool = False  # max_tokens 0: the echo is the whole choice, and the token sampled is left out


async def echoed_prompts(
    runner: RequestRunner, lives: list[SubmittedRequest], only: bool = False
) -> list[EchoedPrompt]:
    """Each request's echo, with one Detokenize call for all of them."""
    items = []
    for live in lives:
        items.append(tokenizer_pb2.DetokenizeItem(new_token_ids=live.prompt_ids[:1], final=True))
        if live.prompt.text is None:  # token ids: their decode, special tokens kept, as vLLM echoes them
            items.append(tokenizer_pb2.DetokenizeItem(new_token_ids=live.prompt_ids, final=True))
    with upstream("tokenizer"):
        reply = await runner.backends.tokenizer.Detokenize(
            tokenizer_pb2.DetokenizeRequest(items=items), timeout=RPC_TIMEOUT_S
        )
    texts = iter(result.text for result in reply.results)
    echoes = []
    for live in lives:
        first = next(texts)
        echoes.append(EchoedPrompt(live.prompt.text if live.prompt.text is not None else next(texts), first, only))
    return echoes


def vllm_prompt_logprobs(
    prompt_logprobs: list[sampling_pb2.TokenLogprob], texts: dict[int, str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per position the prompt token
    and the most likely alternatives, keyed by token id, each with its rank (the alternatives' are
    their places, 1 first)."""
    return [
        None,
        *(
            {
                str(t): {"logprob": v, "rank": rank, "decoded_token": texts[t]}
                for t, v, rank in [
                    *((alt.token_id, alt.logprob, i + 1) for i, alt in enumerate(lp.top)),
                    (lp.token_id, lp.logprob, lp.rank),
                ]
            }
            for lp in prompt_logprobs
        ),
    ]

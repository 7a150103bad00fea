"""Which token of a multi-token delta completed a stop string (vLLM checks them token by token).

The gateway matches stop strings on text, and a delta may carry several tokens (a gateway that fell
behind, a catch-up). The tokens after the one that completed the stop are not the request's output:
not in its token_ids, logprobs or usage. This finds that token with batched Detokenize calls of the
delta's leading parts, only when a stop string matched in a delta of several tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.upstream.backends import RPC_TIMEOUT_S, upstream
from gateway.upstream.bounded_tokenizer import BoundedTokenizer
from shardline.proto import tokenizer_pb2

# Leading parts of a delta detokenized per round.
_CUT_PROBES = 32


@dataclass(slots=True)
class StopSearch:
    """One delta whose stop string matched: the range of token counts that may have completed it."""

    item: tokenizer_pb2.DetokenizeItem  # how its text was detokenized: its context, pending and new tokens
    num_new: int  # its new tokens (the last ones of item.new_token_ids)
    text: str  # its text
    end: int  # where the stop string that is complete first ends in `text`
    lo: int  # the fewest of its new tokens whose text may reach `end`
    hi: int  # a number of its new tokens whose text does reach it (all of them, at first)
    hi_text: str  # the text of those `hi` tokens


async def find_stop_tokens(tokenizer: BoundedTokenizer, searches: list[StopSearch]) -> None:
    """Narrows each one's range [lo, hi] of token counts to the fewest whose text holds the stop.

    A first round asks only whether the stop needed the delta's last token (so a delta that ends
    with it costs one probe). Then each round detokenizes up to _CUT_PROBES leading parts of each
    delta in one call: one round for a delta of up to that many tokens.

    A part holds the stop when the text a stream would have shown after its last token begins
    with the delta's text up to the stop's end. That is its incremental (non-final) decode, which
    holds back a token that ends in an unfinished character with all its text (a space before an
    emoji's first bytes, say). Only where that decode gave up on the part (a run of undecodable
    bytes longer than it looks back over) does the part's final decode stand in for it.
    """
    first = True
    while open_ := [s for s in searches if s.lo < s.hi]:
        plan = [(s, [s.hi - 1] if first else list(range(s.lo, s.hi, -(-(s.hi - s.lo) // _CUT_PROBES)))) for s in open_]
        items = [
            tokenizer_pb2.DetokenizeItem(
                prefix_token_ids=s.item.prefix_token_ids,
                new_token_ids=s.item.new_token_ids[: len(s.item.new_token_ids) - s.num_new + k],
                skip_special_tokens=s.item.skip_special_tokens,
                final=final,
            )
            for s, counts in plan
            for k in counts
            for final in (False, True)
        ]
        with upstream("tokenizer"):
            reply = await tokenizer.Detokenize(tokenizer_pb2.DetokenizeRequest(items=items), timeout=RPC_TIMEOUT_S)
        results = iter(reply.results)
        for s, counts in plan:
            reached = []
            for k in counts:
                shown, final = next(results), next(results)
                text = shown.text if shown.num_consumed else final.text
                if text.startswith(s.text[: s.end]):
                    reached.append((k, text))
            if reached:
                s.hi, s.hi_text = min(reached)
            s.lo = max([k + 1 for k in counts if k < s.hi], default=s.lo)
        first = False

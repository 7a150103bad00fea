"""Stop strings: matched on a request's text as it arrives, from its min_tokens-th token on, and the
token that completed one found when a delta of several tokens holds it.

Stop strings end a request once its output has min_tokens tokens (as vLLM checks them), so a delta
whose tokens straddle that point is matched in two parts: the text before, which may not end it,
and the rest. The gateway matches on text, and a delta may carry several tokens (a gateway that
fell behind, a catch-up); the tokens after the one that completed the stop are not the request's
output: not in its token_ids, logprobs or usage. StopSearch finds that token with batched
Detokenize calls of the delta's leading parts, only when a stop string matched in such a delta.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.upstream.backends import RPC_TIMEOUT_S, upstream
from gateway.upstream.bounded_tokenizer import BoundedTokenizer
from shardline.proto import tokenizer_pb2

# Leading parts of a delta detokenized per round.
_CUT_PROBES = 32


class StopMatcher:
    """Finds the first stop string in a request's text, across the pieces it arrives in.

    Text that could be the start of a stop string is held back until the next piece decides it,
    so a client never receives the first half of a stop string that the second half then ends.
    """

    __slots__ = ("_stops", "_held", "match_end")

    def __init__(self, stops: list[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._held = ""
        # After a feed that matched: where the stop string ends in that feed's text. The token
        # whose text reaches it is the request's last (the tokens after it are not its output).
        self.match_end = 0

    @property
    def holds_text(self) -> bool:
        """Whether it ever holds text back: it has stop strings."""
        return bool(self._stops)

    @property
    def held(self) -> str:
        """The text held back now: the next piece is matched with it in front."""
        return self._held

    def first_listed(self, text: str) -> int | None:
        """Where the first stop string in the list that occurs in `text` begins (its first occurrence)."""
        for stop in self._stops:
            if (index := text.find(stop)) >= 0:
                return index
        return None

    def feed(self, text: str, final: bool = False, armed: bool = True, one_token: bool = False) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string matched); the match and all after it are cut.

        `final` releases the held-back text: no further piece can complete a stop string.
        `armed` False (the request has not yet generated its min_tokens, as vLLM counts them) lets
        complete stop strings through, but still holds back a partial one that the next piece,
        armed, may complete.
        Of several stop strings in one piece, the one complete first wins, as when the text is
        checked token by token; of several a single token completes (`one_token`), the first in the
        list wins, as in vLLM.
        """
        held, buffer = len(self._held), self._held + text
        self._held = ""
        matches = (
            [(index + len(stop), index) for stop in self._stops if (index := buffer.find(stop)) >= 0] if armed else []
        )
        if matches:
            end, start = matches[0] if one_token else min(matches)
            self.match_end = end - held
            return buffer[:start], True
        if final:
            return buffer, False
        keep = self._longest_partial_match(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def match(
        self, text: str, final: bool, num_new: int, unarmed: int, unarmed_text: str | None
    ) -> tuple[str, int | None]:
        """Feeds a delta's text, armed from the request's min_tokens-th token on: the first `unarmed`
        of its `num_new` tokens come before it, and `unarmed_text` is their text when the delta
        straddles that point. Returns the text to send and, when a stop string matched, where it ends
        in `text`."""
        if unarmed == 0 or not num_new:
            return self._ended(*self.feed(text, final=final, one_token=num_new == 1), 0)
        if unarmed_text is None:  # every new token comes before min_tokens
            return self._ended(*self.feed(text, final=final, armed=False), 0)
        if not text.startswith(unarmed_text):  # a decoder that respells its tail: check the whole text
            return self._ended(*self.feed(text, final=final), 0)
        before, _ = self.feed(unarmed_text, armed=False)
        after, end = self._ended(*self.feed(text[len(unarmed_text) :], final=final), len(unarmed_text))
        return before + after, end

    def _ended(self, text: str, stopped: bool, fed_from: int) -> tuple[str, int | None]:
        """(text, where the matched stop string ends in the delta's text, or None): the match's end is
        in the piece fed, which began `fed_from` characters into the delta's text."""
        return text, fed_from + self.match_end if stopped else None

    def _longest_partial_match(self, buffer: str) -> int:
        # The longest end of the buffer that is a proper prefix of a stop string.
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest


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

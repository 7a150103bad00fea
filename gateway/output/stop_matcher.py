"""Stop strings, matched on streamed text that arrives in arbitrary pieces."""

from __future__ import annotations


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

    def _longest_partial_match(self, buffer: str) -> int:
        # The longest end of the buffer that is a proper prefix of a stop string.
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest

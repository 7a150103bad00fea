"""The fewest tokens a text can have, known from its size alone: a text that cannot fit the context
is refused before it is tokenized.

The Rust encoder keeps several words per token while it works (ids, offsets, masks, the pieces'
text), and the allocator keeps the pages after: 30 prompts of 3.4 MB took this service from 129 MB
to 2.3 GB of RSS, for prompts that were refused afterwards anyway. No token covers more of the
text than the longest token does (in bytes for a byte-level vocabulary, whose tokens stand for
bytes; in characters otherwise), so the text's length divided by that is a lower bound on its
tokens. A normalizer may shorten the text first (NFC composes, Strip drops blanks), so with one the
text is measured as normalized, piece by piece, so that no copy of a huge text is made whole.
"""

from __future__ import annotations

import json
import math

from shardline.core.text.tokenizer import Tokenizer

# Characters normalized at a time when the vocabulary has a normalizer, and what a cut between two
# pieces may cost (a character composed across the cut comes out as two).
_NORMALIZE_PIECE_CHARS = 1 << 16
_CUT_SLACK_CHARS = 4


class PromptSize:
    """The lower bound on a text's tokens, and the refusal of a text whose bound passes `max_tokens`."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        backend = tokenizer.backend
        self._normalizer = backend.normalizer
        self.byte_level = "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("pre_tokenizer"))
        if self.byte_level:
            self.longest_token = max(len(tokenizer.token_bytes([i])) for i in range(tokenizer.vocab_size))
        else:
            added = {i: token.content for i, token in backend.get_added_tokens_decoder().items()}
            self.longest_token = max(
                len(added.get(i) or backend.id_to_token(i) or "") for i in range(tokenizer.vocab_size)
            )
        self.longest_token = max(1, self.longest_token)

    def min_tokens(self, text: str) -> int:
        """No tokenization of `text` has fewer tokens than this."""
        if self._normalizer is None:
            return math.ceil(self._length(text) / self.longest_token)
        length = 0
        for start in range(0, len(text), _NORMALIZE_PIECE_CHARS):
            piece = self._normalizer.normalize_str(text[start : start + _NORMALIZE_PIECE_CHARS])
            length += max(0, self._length(piece) - _CUT_SLACK_CHARS)
        return math.ceil(length / self.longest_token)

    def problem(self, text: str) -> str | None:
        """Why `text` cannot fit `max_tokens` tokens, when its size alone shows it; None when it may."""
        if len(text) <= self.max_tokens:  # too short to be worth measuring: its tokens are cheap to count
            return None
        least = self.min_tokens(text)
        if least <= self.max_tokens:
            return None
        unit = "bytes" if self.byte_level else "characters"
        return (
            f"has at least {least} tokens ({self._length(text)} {unit}, and no token is longer than "
            f"{self.longest_token}), more than the model's context of {self.max_tokens}"
        )

    def _length(self, text: str) -> int:
        return len(text.encode("utf-8", "surrogatepass")) if self.byte_level else len(text)

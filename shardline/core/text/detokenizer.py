"""Stateless incremental detokenization.

The gateway owns a stream's state; this module only turns tokens into text. For each request it is
handed a short prefix of tokens already turned into text (context only) and the tokens not yet
turned into text. The delta is decode(prefix + new[:k]) minus decode(prefix), for the largest k
whose text does not end in an incomplete UTF-8 character (U+FFFD); the caller re-sends the
new[k:] it gets back unconsumed. A request's last call passes final=True, which flushes everything.

Decoding the prefix together with the new tokens, instead of the new tokens alone, keeps the text
right where a token's spelling depends on its neighbours: a sentencepiece "▁word" loses its space
at the start of a decode, and a character's bytes can be spread over several tokens.

The caller builds each next prefix with `next_prefix` (the last PREFIX_WINDOW tokens consumed,
specials left out when they are skipped). Then the deltas of a stream add up to
decode(first prefix + all tokens) minus decode(first prefix): with an empty first prefix, to
`tokenizer.decode(all tokens)`.

A byte-fallback decoder (sentencepiece) reads a run of <0xNN> tokens as a whole: valid UTF-8
becomes its characters, anything else one U+FFFD per byte, the run's finished characters included.
So a run that ends the new tokens waits until a non-byte token ends it (or final): text emitted
from a run that a stray byte later spoils would differ from the full decode. Runs longer than
_MAX_BYTE_RUN (a stretch of characters the vocabulary lacks) are emitted as they come instead.

Limits: a U+FFFD the model really means is held back until final, and a run of more than
_MAX_HELD_BACK tokens that decode to invalid UTF-8 waits for the next clean token; the total text
is right in both cases.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from shardline.core.errors import InvalidArgument
from shardline.core.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Tokens of context kept before the new ones; enough for every decoder we load (vLLM keeps 5).
PREFIX_WINDOW = 6
# Shorter cuts tried when all new tokens end in an incomplete character. Such a character has at
# most 3 of its bytes, so at most 3 tokens; one more covers malformed bytes just before it.
_MAX_HELD_BACK = 4
# Longest unfinished run of byte-fallback tokens held back whole (16 four-byte characters).
_MAX_BYTE_RUN = 64
_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class DetokenizeItem:
    """One request's share of a batched detokenize call."""

    prefix_token_ids: list[int]  # the last few tokens already turned into text; context, never emitted
    new_token_ids: list[int]  # tokens to turn into text: the ones held back last time, then the new ones
    skip_special_tokens: bool = True  # leave special tokens (<|im_end|>, ...) out of the text
    final: bool = False  # the request is over: emit everything, even an incomplete character


def checked_item(
    index: int,
    prefix_token_ids: Sequence[int],
    new_token_ids: Sequence[int],
    skip_special_tokens: bool,
    final: bool,
    vocab_size: int,
) -> DetokenizeItem:
    """Item `index` of a batch, from its wire form; InvalidArgument naming its field for an id outside
    the vocabulary: the Rust decoder silently drops unknown ids, which would hide a caller's bug as
    missing text."""
    for field, ids in (("prefix_token_ids", prefix_token_ids), ("new_token_ids", new_token_ids)):
        if ids and max(ids) >= vocab_size:
            raise InvalidArgument(
                f"items[{index}].{field}", f"token id {max(ids)} is outside the vocabulary (size {vocab_size})"
            )
    return DetokenizeItem(list(prefix_token_ids), list(new_token_ids), skip_special_tokens, final)


def detokenize_incremental(
    tokenizer: Tokenizer,
    prefix_token_ids: list[int],
    new_token_ids: list[int],
    skip_special_tokens: bool,
    final: bool,
) -> tuple[str, int]:
    """(text delta, number of new tokens consumed) for one request; see the module docstring."""
    item = DetokenizeItem(prefix_token_ids, new_token_ids, skip_special_tokens, final)
    return detokenize_batch(tokenizer, [item])[0]


def detokenize_batch(tokenizer: Tokenizer, items: Sequence[DetokenizeItem]) -> list[tuple[str, int]]:
    """(text delta, number consumed) per item, with one `decode_batch` call per phase.

    Phase 1 decodes every prefix and every prefix + all new tokens. Only an item whose text then
    ends in an incomplete character, with more than one new token, needs phase 2: its shorter cuts.
    """
    items = [_without_open_byte_run(tokenizer, it) for it in items]
    prefixes = [_visible(tokenizer, _context(tokenizer, it.prefix_token_ids), it.skip_special_tokens) for it in items]
    news = [_visible_each(tokenizer, it.new_token_ids, it.skip_special_tokens) for it in items]
    live = [i for i, it in enumerate(items) if it.new_token_ids]
    sequences: list[list[int]] = []
    for i in live:
        sequences += [prefixes[i], prefixes[i] + _flatten(news[i])]
    texts = tokenizer.decode_batch(sequences, skip_special_tokens=False) if sequences else []

    results: list[tuple[str, int]] = [("", 0)] * len(items)
    prefix_texts: dict[int, str] = {}
    retry: list[int] = []
    for n, i in enumerate(live):
        prefix_text, full_text = texts[2 * n], texts[2 * n + 1]
        prefix_texts[i] = prefix_text
        if items[i].final or not full_text.endswith(_REPLACEMENT):
            results[i] = (_delta(prefix_text, full_text), len(items[i].new_token_ids))
        elif len(items[i].new_token_ids) > 1:
            retry.append(i)
    if retry:
        _shorter_cuts(tokenizer, retry, prefixes, news, prefix_texts, results)
    return results


def _shorter_cuts(
    tokenizer: Tokenizer,
    retry: list[int],
    prefixes: list[list[int]],
    news: list[list[list[int]]],
    prefix_texts: dict[int, str],
    results: list[tuple[str, int]],
) -> None:
    # Phase 2: try consuming fewer tokens, longest first; k = 0 (emit nothing) needs no decode.
    cuts: list[tuple[int, int]] = []
    for i in retry:
        count = len(news[i])
        cuts += [(i, k) for k in range(count - 1, max(0, count - 1 - _MAX_HELD_BACK), -1)]
    texts = tokenizer.decode_batch([prefixes[i] + _flatten(news[i][:k]) for i, k in cuts], skip_special_tokens=False)
    done: set[int] = set()
    for (i, k), text in zip(cuts, texts):
        if i not in done and not text.endswith(_REPLACEMENT):
            results[i] = (_delta(prefix_texts[i], text), k)
            done.add(i)


def _without_open_byte_run(tokenizer: Tokenizer, item: DetokenizeItem) -> DetokenizeItem:
    """The item without the run of byte-fallback tokens that ends it, unless final: the next token
    may still join that run and change how all of it decodes. The caller re-sends the run."""
    new, run = item.new_token_ids, 0
    if item.final or not tokenizer.byte_token_ids:
        return item
    while run < len(new) and new[len(new) - 1 - run] in tokenizer.byte_token_ids:
        run += 1
    if run == 0 or run > _MAX_BYTE_RUN:
        return item
    return DetokenizeItem(item.prefix_token_ids, new[: len(new) - run], item.skip_special_tokens, item.final)


def _delta(prefix_text: str, full_text: str) -> str:
    if full_text.startswith(prefix_text):
        return full_text[len(prefix_text) :]
    # A decoder whose output for the prefix changes once more tokens follow (some HF-folder
    # tokenizers do): emit from where the two texts part, so no text is emitted twice.
    logger.debug("decoded prefix %r is not a prefix of %r", prefix_text, full_text)
    return full_text[len(os.path.commonprefix([prefix_text, full_text])) :]


def _context(tokenizer: Tokenizer, prefix: list[int]) -> list[int]:
    # A byte-fallback decoder turns a whole run of <0xNN> tokens into U+FFFD when the run starts
    # mid-character, so the context must not start on a continuation byte.
    start = 0
    while start < len(prefix) and prefix[start] in tokenizer.continuation_byte_ids:
        start += 1
    return prefix[start:]


def _visible(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> list[int]:
    # Special tokens are dropped here rather than by the decoder, so that one decode_batch call can
    # serve items that skip them and items that keep them; the decoders treat the two alike.
    if not skip_special_tokens:
        return ids
    return [t for t in ids if t not in tokenizer.special_token_ids]


def _visible_each(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> list[list[int]]:
    # Per new token (empty when skipped), so that a cut at k counts tokens the caller sent.
    special = tokenizer.special_token_ids if skip_special_tokens else frozenset()
    return [[] if t in special else [t] for t in ids]


def _flatten(parts: list[list[int]]) -> list[int]:
    return [t for part in parts for t in part]


def next_prefix(
    tokenizer: Tokenizer, prefix: list[int], consumed: Sequence[int], skip_special_tokens: bool
) -> list[int]:
    """The prefix to send with the next call, after `consumed` tokens were turned into text.

    When special tokens are skipped they are left out of the window, so that a run of them never
    empties the context (a sentencepiece decoder would then drop the next word's leading space).
    """
    window = prefix + _visible(tokenizer, list(consumed), skip_special_tokens)
    return window[-PREFIX_WINDOW:]


class IncrementalDetokenizer:
    """Stateful streaming detokenizer for in-process use (offline generate, CLI).

    The deltas it returns concatenate to `tokenizer.decode(all tokens added)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._prefix: list[int] = []
        self._pending: list[int] = []

    def add(self, token_ids: Sequence[int]) -> str:
        """The new text that `token_ids` complete; an incomplete character waits for more tokens."""
        return self._step(list(token_ids), final=False)

    def finish(self) -> str:
        """Whatever text is still held back, incomplete characters included."""
        return self._step([], final=True)

    def _step(self, token_ids: list[int], final: bool) -> str:
        pending = self._pending + token_ids
        text, consumed = detokenize_incremental(self.tokenizer, self._prefix, pending, self.skip_special_tokens, final)
        self._prefix = next_prefix(self.tokenizer, self._prefix, pending[:consumed], self.skip_special_tokens)
        self._pending = pending[consumed:]
        return text

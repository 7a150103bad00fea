"""Structured output in the engine: a grammar matcher per constrained request, one mask per step.

The matcher follows the request's tokens (it accepts each one as the sequence appends it), so its
mask is a pure function of the output so far: a request resumed from a prefix
of its output replays that prefix into a fresh matcher and samples on exactly as before, and
preemption (which keeps the output) needs nothing at all.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import Any

import torch
import torch.nn.functional as F

from shardline.core.model_path import resolve_model_path
from shardline.structured_output import StructuredOutputSpec, compile_error, load_xgrammar

log = logging.getLogger(__name__)

_BITS = 32  # xgrammar's bitmask packs 32 tokens per int32 word, token i at bit i % 32


class GrammarMatcher:
    """Where one request's output stands in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and no change) when the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The output is complete and its EOS accepted: the request must stop."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int, ahead: Seq[int] = ()) -> None:
        """Write the tokens allowed next into row `row` of an int32 bitmask (none after the end);
        with `ahead`, those allowed after these tokens (which valid_prefix() vouched for)."""
        for token_id in ahead:
            if not self._matcher.accept_token(token_id):
                raise ValueError(f"draft token {token_id} is not allowed by the grammar")
        if self._matcher.is_terminated():  # xgrammar raises here; the request is ending anyway
            bitmask[row] = 0
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        if ahead:
            self._matcher.rollback(len(ahead))

    def valid_prefix(self, token_ids: Seq[int]) -> int:
        """How many leading tokens of `token_ids` the grammar allows from here (it stays where it is)."""
        n = 0
        for token_id in token_ids:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return n


class GrammarBackend:
    """Compiles constraints against one model's vocabulary.

    The last CACHE_SIZE specs' compiled grammars (or compile errors, as their message) are kept,
    least recently used evicted first: a served schema is mostly the same few schemas again, and a
    grammar can take megabytes.
    """

    CACHE_SIZE = 64

    def __init__(self, vocab: list[bytes], logits_width: int, stop_token_ids: list[int]) -> None:
        xgr = load_xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=logits_width, stop_token_ids=stop_token_ids)
        # xgrammar's own cache has no bound by default; this class keeps a bounded one instead.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[StructuredOutputSpec, Any] = OrderedDict()  # grammar, or error message
        self._lock = threading.Lock()  # compile() runs in the worker's grammar threads, matcher() in the engine's

    @classmethod
    def for_model(cls, model: str | None, logits_width: int, stop_token_ids: list[int]) -> GrammarBackend:
        """The backend of the model a runner serves: its tokenizer gives each token's bytes."""
        from shardline.core.text.tokenizer import (  # the same vocabulary files the service reads
            Tokenizer,
            TokenizerError,
        )

        start = time.perf_counter()
        try:
            tokenizer = Tokenizer.from_model_path(resolve_model_path(model))
        except (TokenizerError, OSError) as exc:
            raise ValueError(f"structured_output: this model's tokenizer cannot be read ({exc})") from None
        # Special tokens spell no text: as empty entries, the grammar never lets one into the output
        # (a "<|im_end|>" inside a JSON string would vanish when the text is detokenized).
        specials = tokenizer.special_token_ids
        vocab = [b"" if i in specials else tokenizer.token_bytes([i]) for i in range(tokenizer.vocab_size)]
        backend = cls(vocab, logits_width, stop_token_ids)
        log.info("structured output ready: %d tokens indexed in %.2f s", len(vocab), time.perf_counter() - start)
        return backend

    def is_compiled(self, spec: StructuredOutputSpec) -> bool:
        """matcher(spec) would not compile: the spec's grammar, or its error, is in the cache."""
        with self._lock:
            return spec in self._compiled

    def compile(self, spec: StructuredOutputSpec) -> Any:
        """The spec's compiled grammar, from the cache or compiled now (seconds, for a large schema),
        or the message of the ValueError (naming structured_output) that says why it does not compile."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        try:
            compiled = self._compiler.compile_grammar(spec.grammar())
        except ValueError as exc:
            compiled = str(exc)
        except Exception as exc:  # the compiler's own refusal (xgrammar raises RuntimeError)
            compiled = str(compile_error(spec.kind, exc))
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self.CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(
        self, spec: StructuredOutputSpec, output_token_ids: Seq[int] = (), compiled: Any = None
    ) -> GrammarMatcher:
        """A matcher at the start of `spec`, advanced over `output_token_ids` (a resumed request's
        output); ValueError naming the field when the spec does not compile or the output strays.
        `compiled`: compile(spec)'s result, taken earlier (the cache may have let it go since)."""
        grammar = self.compile(spec) if compiled is None else compiled
        if isinstance(grammar, str):
            raise ValueError(grammar)
        matcher = GrammarMatcher(self._xgr.GrammarMatcher(grammar))
        for i, token_id in enumerate(output_token_ids):
            if matcher.is_terminated or not matcher.accept(token_id):
                raise ValueError(f"output_token_ids: token {token_id} at index {i} is not allowed by structured_output")
        if matcher.is_terminated:
            raise ValueError("output_token_ids: the structured output is already complete (it ends in EOS)")
        return matcher


def mask_logits(
    logits: torch.Tensor, matchers: Seq[GrammarMatcher | None], drafts: list[list[int]] | None = None
) -> torch.Tensor:
    """`logits` with every token that the rows' grammars forbid set to -inf; other rows unchanged.
    `matchers[r]`: row r's grammar, None for an unconstrained row. `drafts[r]`: draft tokens row r
    follows (n-gram speculation): its mask is the one after them.

    The bitmask is unpacked a byte at a time, through a table of the 256 bytes' 8 additive masks
    (0 or -inf): one embedding lookup and one add for the step. At 16 rows of 49k tokens that is
    0.4 ms here, where shifting out the bits, or xgrammar's own CPU kernel, took 3-4 ms.
    """
    rows = [(i, matcher) for i, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    bitmask = torch.full((len(rows), (vocab + _BITS - 1) // _BITS), -1, dtype=torch.int32)
    for k, (i, matcher) in enumerate(rows):
        matcher.fill(bitmask, k, drafts[i] if drafts is not None else ())
    # Little-endian words: byte j of a row holds tokens 8j .. 8j + 7, token 8j + b at bit b.
    codes = bitmask.view(torch.uint8).to(logits.device).long()  # widened on the device: 8x fewer bytes copied
    add = F.embedding(codes, _byte_masks(logits.device, logits.dtype)).view(len(rows), -1)[:, :vocab]
    if len(rows) == logits.shape[0]:
        return logits + add
    indices = torch.tensor([i for i, _ in rows], device=logits.device)
    return logits.index_add(0, indices, add)  # x + 0 is x; x - inf is -inf


@functools.cache
def _byte_masks(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: row c is 0 where bit b of byte c is set (allowed), -inf where it is clear."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)

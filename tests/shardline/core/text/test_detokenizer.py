"""Incremental detokenization: deltas never split a character, and add up to the full decode."""

from __future__ import annotations

import random

import pytest

from shardline.core.text.detokenizer import (
    PREFIX_WINDOW,
    DetokenizeItem,
    IncrementalDetokenizer,
    detokenize_batch,
    detokenize_incremental,
    next_prefix,
)
from shardline.core.text.tokenizer import Tokenizer

# Characters whose bytes the default model spreads over several tokens, back to back.
SPLIT_HEAVY = "😀😃🙏🏽👨‍👩‍👧‍👦🇫🇷 中文测试你好世界 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ẞ Ærøskøbing 🏳️‍🌈"


@pytest.fixture(params=["default", "sentencepiece"])
def any_tokenizer(request) -> Tokenizer:
    return request.getfixturevalue("tokenizer" if request.param == "default" else "spm_tokenizer")


def stream(
    tok: Tokenizer, ids: list[int], chunks: list[int], skip: bool, naive_prefix: bool = False
) -> tuple[list[str], int]:
    """Play the gateway: send chunks, re-send what is not consumed, keep a short prefix.

    Returns the deltas and how many calls held tokens back.
    """
    prefix: list[int] = []
    pending: list[int] = []
    deltas: list[str] = []
    held = pos = 0
    for size in chunks:
        pending += ids[pos : pos + size]
        pos += size
        text, consumed = detokenize_incremental(tok, prefix, pending, skip, final=pos >= len(ids))
        deltas.append(text)
        held += consumed < len(pending)
        if naive_prefix:  # what the brief describes: the last tokens emitted, specials included
            prefix = (prefix + pending[:consumed])[-PREFIX_WINDOW:]
        else:
            prefix = next_prefix(tok, prefix, pending[:consumed], skip)
        pending = pending[consumed:]
    assert not pending
    return deltas, held


def random_chunks(rng: random.Random, total: int) -> list[int]:
    chunks = []
    while total > 0:
        chunks.append(min(total, rng.randint(1, 5)))
        total -= chunks[-1]
    return chunks or [0]


@pytest.mark.parametrize("skip", [True, False])
def test_one_token_at_a_time(any_tokenizer, corpus, skip):
    held_total = 0
    for text in [*corpus, SPLIT_HEAVY]:
        [ids] = any_tokenizer.encode_batch([text])
        deltas, held = stream(any_tokenizer, ids, [1] * len(ids) or [0], skip)
        held_total += held
        assert not any("\ufffd" in d for d in deltas), deltas
        assert "".join(deltas) == any_tokenizer.decode(ids, skip_special_tokens=skip)
    assert held_total > 10  # the corpus does split characters across tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_chunks(any_tokenizer, corpus, seed):
    rng = random.Random(seed)
    for text in [*corpus, SPLIT_HEAVY]:
        [ids] = any_tokenizer.encode_batch([text])
        skip = rng.random() < 0.5
        deltas, _ = stream(any_tokenizer, ids, random_chunks(rng, len(ids)), skip)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == any_tokenizer.decode(ids, skip_special_tokens=skip)


def test_byte_level_needs_no_prefix_care(tokenizer, corpus):
    # With the plain "last 6 tokens emitted" window, specials included, byte-level BPE stays exact.
    for text in [*corpus, SPLIT_HEAVY]:
        [ids] = tokenizer.encode_batch([text])
        for skip in (True, False):
            deltas, _ = stream(tokenizer, ids, [1] * len(ids) or [0], skip, naive_prefix=True)
            assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_prefix_starting_mid_character(spm_tokenizer):
    # "😀" is four <0xNN> tokens here. A window starting on a continuation byte would make the
    # byte-fallback decoder turn the whole run, the new character included, into U+FFFD.
    [ids] = spm_tokenizer.encode_batch(["😀😀"], add_special_tokens=False)
    emoji = ids[-8:]  # after the "▁" the sentencepiece pre-tokenizer puts first
    assert emoji[1] in spm_tokenizer.continuation_byte_ids
    assert spm_tokenizer.decode(emoji[1:]) == "\ufffd" * 7  # what an untrimmed window would decode
    assert detokenize_incremental(spm_tokenizer, emoji[1:4], emoji[4:], True, True) == ("😀", 4)


@pytest.mark.parametrize("skip", [True, False])
def test_a_stray_byte_spoiling_a_byte_run_is_never_emitted_twice(spm_tokenizer, skip):
    """The byte-fallback decoder reads a run of <0xNN> tokens whole: a stray byte after "🙂" turns
    the emoji's bytes into U+FFFDs too. An unfinished run waits for the token that ends it, so the
    deltas add up to the full decode (they used to emit "🙂" and then the whole run again)."""
    tok = spm_tokenizer
    [emoji] = tok.encode_batch(["🙂"], add_special_tokens=False)
    [are] = tok.encode_batch([" are"], add_special_tokens=False)
    stray = tok.backend.token_to_id("<0xF0>")
    for ids in (emoji + [stray] + are, emoji + emoji[:-1], emoji + are):  # mid-stream; cut by max_tokens; clean
        deltas, _ = stream(tok, ids, [1] * len(ids), skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids


def test_incomplete_character_is_held_until_final(tokenizer):
    [ids] = tokenizer.encode_batch(["a😀"], add_special_tokens=False)
    assert len(ids) >= 3  # "a" and the emoji's bytes in two or more tokens
    assert detokenize_incremental(tokenizer, [], ids[:-1], True, final=False) == ("a", 1)
    assert detokenize_incremental(tokenizer, [], ids[1:-1], True, final=False) == ("", 0)
    assert detokenize_incremental(tokenizer, ids[:1], ids[1:], True, final=False) == ("😀", len(ids) - 1)
    # final flushes the incomplete bytes as the full decode shows them.
    text, consumed = detokenize_incremental(tokenizer, ids[:1], ids[1:-1], True, final=True)
    assert (text, consumed) == (tokenizer.decode(ids[:-1])[1:], len(ids) - 2) and text.endswith("\ufffd")
    assert detokenize_incremental(tokenizer, ids, [], True, final=True) == ("", 0)


def test_special_tokens_skipped_or_kept(tokenizer):
    [ids] = tokenizer.encode_batch(["Hi<|im_end|>"], add_special_tokens=False)
    assert detokenize_incremental(tokenizer, ids[:1], ids[1:], True, False) == ("", 1)
    assert detokenize_incremental(tokenizer, ids[:1], ids[1:], False, False) == ("<|im_end|>", 1)


def test_batch_equals_single_calls_with_two_decode_calls_at_most(any_tokenizer, corpus, monkeypatch):
    rng = random.Random(7)
    texts = [*corpus, SPLIT_HEAVY] * 2
    all_ids = any_tokenizer.encode_batch(texts)
    # Per request: prefix, pending, position, skip flag, and the text streamed so far.
    state = [{"prefix": [], "pending": [], "pos": 0, "skip": rng.random() < 0.5, "out": ""} for _ in texts]
    decode_calls = []
    real_decode_batch = Tokenizer.decode_batch

    def counting_decode_batch(self, sequences, skip_special_tokens=True):
        decode_calls.append(len(sequences))
        return real_decode_batch(self, sequences, skip_special_tokens)

    while any(s["pos"] < len(ids) or s["pending"] for s, ids in zip(state, all_ids)):
        active = [i for i, s in enumerate(state) if s["pos"] < len(all_ids[i]) or s["pending"]]
        items = []
        for i in active:
            s, size = state[i], rng.randint(1, 4)
            s["pending"] = s["pending"] + all_ids[i][s["pos"] : s["pos"] + size]
            s["pos"] += size
            items.append(DetokenizeItem(s["prefix"], s["pending"], s["skip"], s["pos"] >= len(all_ids[i])))
        expected = [
            detokenize_incremental(
                any_tokenizer, it.prefix_token_ids, it.new_token_ids, it.skip_special_tokens, it.final
            )
            for it in items
        ]
        decode_calls.clear()
        with monkeypatch.context() as patch:
            patch.setattr(Tokenizer, "decode_batch", counting_decode_batch)
            results = detokenize_batch(any_tokenizer, items)
        assert results == expected
        assert len(decode_calls) <= 2
        assert decode_calls or not any(consumed for _, consumed in results)  # none: every item held back a byte run
        for i, it, (text, consumed) in zip(active, items, results):
            s = state[i]
            s["out"] += text
            s["prefix"] = next_prefix(any_tokenizer, s["prefix"], it.new_token_ids[:consumed], s["skip"])
            s["pending"] = it.new_token_ids[consumed:]
    for s, ids in zip(state, all_ids):
        assert s["out"] == any_tokenizer.decode(ids, skip_special_tokens=s["skip"])


def test_empty_batch_and_empty_items(tokenizer):
    assert detokenize_batch(tokenizer, []) == []
    assert detokenize_batch(tokenizer, [DetokenizeItem([1, 2], [], True, False)]) == [("", 0)]


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_class(any_tokenizer, skip):
    [ids] = any_tokenizer.encode_batch([SPLIT_HEAVY + " <|im_end|> done"])
    detok = IncrementalDetokenizer(any_tokenizer, skip_special_tokens=skip)
    rng = random.Random(3)
    deltas, pos = [], 0
    while pos < len(ids):
        size = rng.randint(1, 3)
        deltas.append(detok.add(ids[pos : pos + size]))
        pos += size
    deltas.append(detok.finish())
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == any_tokenizer.decode(ids, skip_special_tokens=skip)


def test_next_prefix_window(tokenizer):
    # 2 is <|im_end|>, special; 100 and up are ordinary tokens.
    assert next_prefix(tokenizer, [100, 101], [102, 2, 103], skip_special_tokens=True) == [100, 101, 102, 103]
    assert next_prefix(tokenizer, [100, 101, 102, 103], [2, 104, 105, 106], skip_special_tokens=False) == [
        102,
        103,
        2,
        104,
        105,
        106,
    ]

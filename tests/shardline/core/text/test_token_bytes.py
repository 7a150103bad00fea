"""Each token's bytes before UTF-8 decoding (logprobs' `bytes`), for both kinds of vocabulary."""

from __future__ import annotations

from shardline.core.text.tokenizer import Tokenizer

EMOJI = "😀"  # four bytes, which both vocabularies below split over tokens


def test_byte_level_tokens_add_up_to_the_texts_bytes(tokenizer: Tokenizer, corpus: list[str]) -> None:
    for text in corpus:
        ids = tokenizer.encode_batch([text], add_special_tokens=False)[0]
        assert b"".join(tokenizer.token_bytes([t]) for t in ids) == text.encode(), text
        assert tokenizer.token_bytes(ids) == text.encode()


def test_a_token_that_ends_mid_character_has_its_own_bytes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_batch([f"a {EMOJI}"], add_special_tokens=False)[0]
    pieces = [tokenizer.token_bytes([t]) for t in ids]
    texts = [tokenizer.decode([t]) for t in ids]
    # The emoji's tokens have no text of their own; their bytes make the character again.
    broken = b"".join(piece for piece, text in zip(pieces, texts) if "\ufffd" in text)
    assert broken.strip() == EMOJI.encode()
    assert b"".join(pieces) == f"a {EMOJI}".encode()


def test_special_tokens_are_their_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_batch(["<|im_start|>user<|im_end|>"], add_special_tokens=False)[0]
    assert [tokenizer.token_bytes([t]) for t in ids] == [b"<|im_start|>", b"user", b"<|im_end|>"]


def test_sentencepiece_byte_fallback_tokens_are_single_bytes(spm_tokenizer: Tokenizer, corpus: list[str]) -> None:
    for text in [*corpus, f"x {EMOJI} y"]:
        ids = spm_tokenizer.encode_batch([text], add_special_tokens=False)[0]
        spelled = b"".join(spm_tokenizer.token_bytes([t]) for t in ids)
        # The vocabulary writes a word's leading space as "▁", and sentencepiece adds one at the
        # start of the text, which the decoder strips: so does this comparison.
        decoded = spm_tokenizer.decode(ids, skip_special_tokens=False)
        assert spelled.decode().removeprefix(" ") == decoded, text
    emoji_ids = spm_tokenizer.encode_batch([EMOJI], add_special_tokens=False)[0]
    assert [spm_tokenizer.token_bytes([t]) for t in emoji_ids][-4:] == [bytes([b]) for b in EMOJI.encode()]


def test_added_tokens_are_read_as_the_decoder_reads_them() -> None:
    # The ByteLevel decoder maps an added token's characters through the byte table too.
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as BackendTokenizer

    from shardline.core.text.token_bytes import TokenBytes

    backend = BackendTokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken("Ġhi", special=False), AddedToken("é", special=False), AddedToken("<|x|>")])
    token_bytes = TokenBytes(backend)
    assert [token_bytes([i]) for i in (1, 2, 3)] == [b" hi", b"\xe9", b"<|x|>"]
    assert [backend.decode([i]) for i in (1, 2, 3)] == [" hi", "\ufffd", "<|x|>"]

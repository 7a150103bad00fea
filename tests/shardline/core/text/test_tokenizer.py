"""Tokenizer: ids and text identical to transformers' for GGUF and HF-folder models; clear errors."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from shardline.core.text.tokenizer import Tokenizer, TokenizerError


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_default_model_ids_match_transformers(tokenizer, hf_tokenizer, add_special_tokens, corpus):
    ours = tokenizer.encode_batch(corpus, add_special_tokens=add_special_tokens)
    for text, ids in zip(corpus, ours):
        assert ids == hf_tokenizer(text, add_special_tokens=add_special_tokens).input_ids, text


def test_default_model_random_text_matches_transformers(tokenizer, hf_tokenizer):
    # Seeded random mixes of the character classes the pre-tokenizer regex treats differently.
    pool = [*"aZé ß\n\t\r  09٣.,'!?-_<|>", "'s", "'LL", "中", "語", "😀", "👨\u200d👩", "\u0301", "<|im_end|>"]
    rng = random.Random(1234)
    texts = ["".join(rng.choices(pool, k=rng.randint(1, 40))) for _ in range(300)]
    assert tokenizer.encode_batch(texts) == [hf_tokenizer(t).input_ids for t in texts]


def test_default_model_keeps_chat_markup_whole(tokenizer):
    [ids] = tokenizer.encode_batch(["<|im_start|>user\nHi<|im_end|>"])
    assert ids[0] == tokenizer.backend.token_to_id("<|im_start|>") == 1
    assert ids[-1] == tokenizer.backend.token_to_id("<|im_end|>") == 2
    assert tokenizer.encode_batch([""]) == [[]]  # SmolLM2 adds no BOS (tokenizer.ggml.add_bos_token = false)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_default_model_decode_matches_transformers(tokenizer, hf_tokenizer, skip_special_tokens, corpus):
    batches = tokenizer.encode_batch(corpus)
    texts = tokenizer.decode_batch(batches, skip_special_tokens=skip_special_tokens)
    for ids, text in zip(batches, texts):
        assert text == hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == text
    # Without special tokens in the way, decoding gives back the exact text (byte-level BPE is lossless).
    plain = [t for t in corpus if "<|" not in t]
    assert tokenizer.decode_batch(tokenizer.encode_batch(plain)) == plain


def test_default_model_facts(tokenizer, hf_tokenizer):
    assert tokenizer.model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == [hf_tokenizer.eos_token_id] == [2]  # <|im_end|> ends a chat turn
    assert tokenizer.special_token_ids == frozenset(range(17))  # the 17 control tokens of the GGUF
    assert tokenizer.chat_template == hf_tokenizer.chat_template
    assert tokenizer.continuation_byte_ids == frozenset()  # byte-level: no <0xNN> tokens
    assert tokenizer.context_length == 8192  # llama.context_length, read with the vocabulary


def test_hf_folder_matches_transformers(tmp_path, tokenizer, hf_tokenizer, corpus):
    hf_tokenizer.save_pretrained(tmp_path)
    folder_tok = Tokenizer.from_model_path(tmp_path)
    assert folder_tok.model_name == tmp_path.name
    for add_special_tokens in (True, False):
        expected = [hf_tokenizer(t, add_special_tokens=add_special_tokens).input_ids for t in corpus]
        assert folder_tok.encode_batch(corpus, add_special_tokens=add_special_tokens) == expected
    assert folder_tok.chat_template == tokenizer.chat_template
    assert (folder_tok.bos_token_id, folder_tok.eos_token_ids) == (1, [2])
    assert folder_tok.special_token_ids == tokenizer.special_token_ids


def test_hf_folder_reads_flags_and_generation_config(tmp_path, hf_tokenizer):
    hf_tokenizer.save_pretrained(tmp_path)
    config = (tmp_path / "tokenizer_config.json").read_text()
    (tmp_path / "tokenizer_config.json").write_text(config.replace('"backend"', '"add_bos_token": true, "backend"'))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    folder_tok = Tokenizer.from_model_path(tmp_path)
    assert folder_tok.encode_batch(["Hi"]) == [[1, *folder_tok.encode_batch(["Hi"], add_special_tokens=False)[0]]]
    assert folder_tok.eos_token_ids == [2, 0]
    assert folder_tok.context_length is None  # no config.json in the folder
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    assert Tokenizer.from_model_path(tmp_path).context_length == 2048


def test_sentencepiece_gguf_matches_transformers(spm_gguf, spm_tokenizer, corpus):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)
    for add_special_tokens in (True, False):
        ours = spm_tokenizer.encode_batch(corpus, add_special_tokens=add_special_tokens)
        assert ours == [hf(t, add_special_tokens=add_special_tokens).input_ids for t in corpus]
    for ids in spm_tokenizer.encode_batch(corpus):
        for skip in (True, False):
            assert spm_tokenizer.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert spm_tokenizer.bos_token_id == 1 and spm_tokenizer.eos_token_ids == [2]
    # Characters outside the 400-piece vocabulary go through byte-fallback tokens.
    assert len(spm_tokenizer.continuation_byte_ids) == 64


def test_sentencepiece_gguf_matches_sentencepiece(spm_gguf, spm_tokenizer, corpus):
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_file=str(spm_gguf.parent / "m.model"))
    # Plain text that does not start with a blank; sentencepiece itself does not parse "<s>" in text.
    plain = [t for t in corpus if t and not t[0].isspace() and "<" not in t]
    assert spm_tokenizer.encode_batch(plain, add_special_tokens=False) == [sp.encode(t) for t in plain]
    assert spm_tokenizer.decode_batch([sp.encode(t) for t in plain]) == plain


def test_load_time(model_path):
    Tokenizer.from_model_path(model_path)  # warm the page cache and imports
    start = time.perf_counter()
    Tokenizer.from_model_path(model_path)
    assert time.perf_counter() - start < 2.0  # about 0.3 s here; generous for a shared CI machine


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(TokenizerError, match=f"{missing}: no such model file or folder"):
        Tokenizer.from_model_path(missing)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all", b"GGUF\x03\x00\x00\x00\x01"])
def test_non_gguf_file_names_it(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match=f"{path}: .*(not a GGUF file|truncated)"):
        Tokenizer.from_model_path(path)


def test_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_model_path(tmp_path)


def test_corrupt_tokenizer_files(tmp_path, tokenizer):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json: unreadable tokenizer file"):
        Tokenizer.from_model_path(tmp_path)
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=f"{tmp_path}: unreadable tokenizer config"):
        Tokenizer.from_model_path(tmp_path)


def _write_gguf(path: Path, architecture: str = "llama", **metadata) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in metadata.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unknown_tokenizer_type_names_file_and_type(tmp_path):
    path = _write_gguf(tmp_path / "t5.gguf", **{"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(TokenizerError, match=rf"{path}: unsupported tokenizer model 't5'"):
        Tokenizer.from_model_path(path)


def test_unsupported_sentencepiece_variant(tmp_path):
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}
    path = _write_gguf(tmp_path / "gemma.gguf", "gemma", **metadata)
    with pytest.raises(TokenizerError, match=rf"{path}: the sentencepiece variant of architecture 'gemma'"):
        Tokenizer.from_model_path(path)


def test_gguf_without_vocabulary(tmp_path):
    path = _write_gguf(tmp_path / "empty.gguf", **{"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(TokenizerError, match=rf"{path}: no tokenizer.ggml.tokens"):
        Tokenizer.from_model_path(path)

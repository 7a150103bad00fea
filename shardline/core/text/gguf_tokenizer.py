"""Build a Rust `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

This follows transformers' GGUF integration (integrations/gguf/gguf_tokenizer_mapping.py and the
GPT2Tokenizer / LlamaTokenizer classes it hands the vocabulary to), so that the ids match the ones
`AutoTokenizer.from_pretrained(..., gguf_file=...)` gives. The keys are llama.cpp's
(`tokenizer.ggml.*`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

# llama.cpp's token types (llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split regex its merges were learned with. Any other value (gpt2,
# smollm, ...) gets GPT-2's own ByteLevel regex, as in transformers.
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map, which byte-level vocabularies are spelled in.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


_BYTE_SPELLING = _bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_SPELLING.values())


@dataclass(slots=True)
class GGUFBackend:
    """A backend tokenizer built from GGUF metadata, with the special tokens the metadata names."""

    backend: BackendTokenizer  # the Rust tokenizer, added tokens and post-processor included
    bos_token: str | None  # text of tokenizer.ggml.bos_token_id
    eos_token: str | None  # text of tokenizer.ggml.eos_token_id
    end_of_turn_ids: list[int]  # tokenizer.ggml.eot_token_id / eom_token_id, when the file gives them


def build_gguf_backend(metadata: dict[str, Any]) -> GGUFBackend:
    """The tokenizer a GGUF's `tokenizer.ggml.*` metadata describes; ValueError if it is unsupported."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"no tokenizer.ggml.tokens in the GGUF metadata (tokenizer model {kind!r})")
    if kind == "gpt2":
        backend = _byte_level(metadata, tokens)
        add_bos_default = False
    elif kind == "llama":
        architecture = metadata.get("general.architecture")
        if architecture in _SENTENCEPIECE_VARIANTS:
            # transformers builds these differently (respelled blanks, a normalizer instead of Metaspace).
            raise ValueError(f"the sentencepiece variant of architecture {architecture!r} is not supported")
        backend = _sentencepiece_bpe(metadata, tokens)
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
        add_bos_default = True
    else:
        raise ValueError(f"unsupported tokenizer model {kind!r} (supported: 'gpt2', 'llama')")

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    _add_special_tokens(backend, metadata, tokens, kind, [token(k) for k in _SPECIAL_ID_KEYS])
    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    backend.post_processor = post_processor(backend, bos if add_bos else None, eos if add_eos else None)
    end_of_turn = [metadata[key] for key in _END_OF_TURN_ID_KEYS if key in metadata]
    return GGUFBackend(backend, bos, eos, end_of_turn)


_SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
# llama.cpp names a chat model's end-of-turn (and end-of-message, for tool calls) tokens here.
_END_OF_TURN_ID_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_SENTENCEPIECE_VARIANTS = frozenset({"gemma", "gemma2", "gemma3", "phi3"})


def _byte_level(metadata: dict[str, Any], tokens: list[str]) -> BackendTokenizer:
    # Byte-level vocabularies spell every token in the byte alphabet; a token written otherwise (a
    # raw special with a space, say) is looked up by its respelled bytes. One check over the whole
    # vocabulary first, since that is the usual case and per-token checks cost ~80 ms.
    if _spelled("".join(tokens)):
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        vocab = {
            t if _spelled(t) else "".join(_BYTE_SPELLING[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
        }
    backend = BackendTokenizer(
        BPE(vocab, _merges(metadata, vocab), continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = _PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str]) -> BackendTokenizer:
    # Sentencepiece BPE as transformers' LlamaTokenizer: "▁" for spaces, bytes as <0xNN> tokens.
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = BackendTokenizer(BPE(vocab, _merges(metadata, vocab), fuse_unk=True, byte_fallback=True))
    # transformers always prepends "▁" here; llama.cpp honours the flag, and so do we.
    add_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges(metadata: dict[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        return [tuple(m.split(" ", 1)) for m in merges]
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError("the GGUF metadata has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
    return _merges_from_scores(vocab, dict(zip(metadata["tokenizer.ggml.tokens"], scores)))


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    # Sentencepiece files store no merges: every split of a token into two known pieces is a merge,
    # ranked by the token's score (transformers' generate_merges, with the same tie-breaking).
    ranked: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        ranked.extend(local)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_special_tokens(
    backend: BackendTokenizer, metadata: dict[str, Any], tokens: list[str], kind: str, named: list[str | None]
) -> None:
    # Control tokens and the named bos/eos/unk/pad become special added tokens, so text like
    # "<|im_end|>" maps to one id and decode can skip them; user-defined ones are added but not special.
    # A control token outside the byte alphabet in a byte-level vocabulary is a llama.cpp mislabel that
    # transformers skips.
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or []
    byte_level = kind == "gpt2"
    control = [t for t, type_ in zip(tokens, types) if type_ == _CONTROL and (not byte_level or _spelled(t))]
    special = list(dict.fromkeys([*control, *(t for t in named if t is not None)]))
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, type_ in zip(tokens, types) if type_ == _USER_DEFINED and (not byte_level or _spelled(t))]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _spelled(token: str) -> bool:
    return set(token) <= _BYTE_ALPHABET


def post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """The post-processor adding BOS and/or EOS around each sequence, as transformers builds it."""
    head = f"{bos}:0 " if bos is not None else ""
    tail = f" {eos}:0" if eos is not None else ""
    pair_head = f" {bos}:1" if bos is not None else ""
    pair_tail = f" {eos}:1" if eos is not None else ""
    special = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(
        single=f"{head}$A:0{tail}", pair=f"{head}$A:0{tail}{pair_head} $B:1{pair_tail}", special_tokens=special
    )

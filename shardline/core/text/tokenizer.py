"""The serving tokenizer: one Rust `tokenizers.Tokenizer` plus the facts a server needs.

It loads from a Hugging Face folder (tokenizer.json) or from a single GGUF file. A GGUF carries no
tokenizer.json, so the backend is rebuilt from the metadata the same way transformers' GGUF
integration does (transformers/integrations/gguf/gguf_tokenizer_mapping.py); the tests hold the ids
identical to it. transformers itself is never imported here: it takes seconds to load.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from shardline.core.gguf_file import GGUFError, GGUFFile
from shardline.core.text.gguf_tokenizer import build_gguf_backend, post_processor
from shardline.core.text.token_bytes import TokenBytes

logger = logging.getLogger(__name__)

# Special tokens that chat templates use to close a turn. A model stops on them like on EOS when its
# template writes them, as HF generation_config.json files list them (Qwen2: <|im_end|>, <|endoftext|>).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class TokenizerError(ValueError):
    """Tokenizer files are missing, unreadable or of an unsupported kind."""


class Tokenizer:
    """Encode, decode and describe the vocabulary of one model."""

    __slots__ = (
        "backend",
        "model_name",
        "bos_token",
        "eos_token",
        "bos_token_id",
        "eos_token_ids",
        "chat_template",
        "special_token_ids",
        "continuation_byte_ids",
        "byte_token_ids",
        "vocab_size",
        "context_length",
        "token_bytes",
    )

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        model_name: str,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_eos_token_ids: Sequence[int] = (),
        context_length: int | None = None,
    ) -> None:
        self.backend = backend
        self.model_name = model_name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.chat_template = chat_template
        self.special_token_ids = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special
        )
        # Byte-fallback tokens <0x80>..<0xBF> (sentencepiece vocabularies): the detokenizer must not start
        # a context window on one, or the decoder turns the whole run of byte tokens into U+FFFD.
        self.continuation_byte_ids = frozenset(
            token_id for b in range(0x80, 0xC0) if (token_id := backend.token_to_id(f"<0x{b:02X}>")) is not None
        )
        # All byte-fallback tokens <0x00>..<0xFF>: the decoder reads a run of them as a whole.
        self.byte_token_ids = frozenset(
            token_id for b in range(256) if (token_id := backend.token_to_id(f"<0x{b:02X}>")) is not None
        )
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = self._stop_token_ids(extra_eos_token_ids)
        # The longest prompt plus output the model was trained for, from the same metadata (None: not stated).
        self.context_length = context_length
        # Each token's bytes before UTF-8 decoding (logprobs' `bytes`).
        self.token_bytes = TokenBytes(backend)

    @classmethod
    def from_model_path(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face folder (tokenizer.json) or a `.gguf` file."""
        path = Path(path)
        start = time.perf_counter()
        if path.is_dir():
            tokenizer = _from_hf_folder(path)
        elif path.is_file():
            tokenizer = _from_gguf(path)
        else:
            raise TokenizerError(f"{path}: no such model file or folder")
        logger.info(
            "loaded tokenizer %s from %s: %d tokens in %.3f s",
            tokenizer.model_name,
            path,
            tokenizer.vocab_size,
            time.perf_counter() - start,
        )
        return tokenizer

    @classmethod
    def from_definition(cls, tokenizer_json: str, model_name: str) -> Tokenizer:
        """A tokenizer another process serialized (tokenizer_svc's GetDefinition), for detokenizing:
        its vocabulary, added tokens and decoder; no chat template or BOS/EOS metadata."""
        try:
            backend = BackendTokenizer.from_str(tokenizer_json)
        except Exception as exc:  # noqa: BLE001 - the Rust parser raises a bare Exception
            raise TokenizerError(f"not a serialized tokenizer: {exc}") from None
        return cls(backend, model_name=model_name, bos_token=None, eos_token=None, chat_template=None)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text; one call into the Rust batch encoder."""
        return [enc.ids for enc in self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of one sequence of token ids."""
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """The text of each sequence; one call into the Rust batch decoder."""
        return self.backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    def _stop_token_ids(self, extra: Sequence[int]) -> list[int]:
        ids: list[int] = []
        eos_id = self.backend.token_to_id(self.eos_token) if self.eos_token is not None else None
        candidates = [eos_id, *extra]
        if self.chat_template:
            candidates += [self.backend.token_to_id(t) for t in _END_OF_TURN_TOKENS if t in self.chat_template]
        for token_id in candidates:
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
        return ids


def _from_gguf(path: Path) -> Tokenizer:
    try:
        gguf = GGUFFile(path)
    except GGUFError as exc:
        raise TokenizerError(str(exc)) from exc
    metadata = gguf.metadata  # plain Python values, independent of the file mapping
    gguf.close()
    try:
        built = build_gguf_backend(metadata)
    except ValueError as exc:
        raise TokenizerError(f"{path}: {exc}") from exc
    return Tokenizer(
        built.backend,
        model_name=path.stem,
        bos_token=built.bos_token,
        eos_token=built.eos_token,
        chat_template=metadata.get("tokenizer.chat_template"),
        extra_eos_token_ids=built.end_of_turn_ids,
        context_length=metadata.get(f"{metadata.get('general.architecture')}.context_length"),
    )


def _from_hf_folder(folder: Path) -> Tokenizer:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerError(f"{folder}: no tokenizer.json in this model folder")
    try:
        backend = BackendTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises a bare Exception for any parse error
        raise TokenizerError(f"{tokenizer_file}: unreadable tokenizer file ({exc})") from exc
    try:
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise TokenizerError(f"{folder}: unreadable tokenizer config ({exc})") from exc
    bos = _token_content(config.get("bos_token", special_map.get("bos_token")))
    eos = _token_content(config.get("eos_token", special_map.get("eos_token")))
    if "add_bos_token" in config or "add_eos_token" in config:
        # transformers rebuilds the post-processor from these flags whenever the config states them.
        backend.post_processor = post_processor(
            backend, bos if config.get("add_bos_token") else None, eos if config.get("add_eos_token") else None
        )
    generation_eos = generation.get("eos_token_id", [])
    return Tokenizer(
        backend,
        model_name=folder.name,
        bos_token=bos,
        eos_token=eos,
        chat_template=_hf_chat_template(folder, config),
        extra_eos_token_ids=generation_eos if isinstance(generation_eos, list) else [generation_eos],
        context_length=model_config.get("max_position_embeddings") or model_config.get("n_positions"),
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token: str | dict[str, Any] | None) -> str | None:
    # tokenizer_config.json writes a special token either as its text or as a serialized AddedToken.
    return token.get("content") if isinstance(token, dict) else token


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    # transformers >= 4.43 saves the template beside the config; older configs embed it.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template

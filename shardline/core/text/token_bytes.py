"""The bytes each token spells before any UTF-8 decoding: OpenAI's logprobs `bytes`.

A token can end in the middle of a character (an emoji is often two tokens). Its text alone is
then U+FFFD, and `bytes` is how a client puts the character back together from several tokens.
Two kinds of vocabulary hold bytes rather than text:
- byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen2): each character of a vocabulary entry stands for
  one byte, through GPT-2's table of printable stand-ins;
- sentencepiece with byte fallback (Llama 2, Mistral): `<0xNN>` entries are one byte each, and
  `▁` is a space.
Added tokens (special or not) are their text, read as the decoder reads them. A vocabulary of
another kind gives the token's decoded text, encoded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from tokenizers import Tokenizer as BackendTokenizer

_SPACE_MARK = "▁"


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte -> printable character map, inverted: printable bytes stand for themselves, the
    other 68 are shifted to 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


class TokenBytes:
    """Maps token ids to their bytes, from one backend tokenizer's vocabulary and decoder."""

    def __init__(self, backend: BackendTokenizer) -> None:
        self._backend = backend
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        kinds = {step.get("type") for step in steps}
        self._byte_level = _byte_level_table() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        self._space_mark = "Metaspace" in kinds or any(
            step.get("type") == "Replace" and step.get("pattern", {}).get("String") == _SPACE_MARK for step in steps
        )
        self._added = {token_id: added.content for token_id, added in backend.get_added_tokens_decoder().items()}

    def __call__(self, ids: Sequence[int]) -> bytes:
        """The bytes of these tokens, one after another."""
        return b"".join(self._one(token_id) for token_id in ids)

    def _one(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        piece = added if added is not None else self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        # An added token goes through the byte table too, as the ByteLevel decoder reads it
        # ("<|im_end|>" stands for itself; an added "Ġx" would be " x").
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        if added is not None:
            return added.encode()
        if self._byte_fallback and _is_byte_piece(piece):
            return bytes([int(piece[3:5], 16)])
        if self._space_mark:
            return piece.replace(_SPACE_MARK, " ").encode()
        return self._backend.decode([token_id], skip_special_tokens=False).encode()


def _is_byte_piece(piece: str) -> bool:
    """Sentencepiece's spelling of a byte-fallback token: <0x00> .. <0xFF>."""
    return (
        len(piece) == 6
        and piece.startswith("<0x")
        and piece.endswith(">")
        and all(c in "0123456789ABCDEFabcdef" for c in piece[3:5])
    )

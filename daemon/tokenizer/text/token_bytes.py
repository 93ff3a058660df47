"""The raw bytes one token stands for, as OpenAI's logprobs report them (`bytes`).

A token's decoded text is not enough: a token that holds part of a UTF-8 character
(an emoji split over three byte-level tokens) decodes alone to U+FFFD, whose UTF-8 is
not the token's bytes. Joining the `bytes` of a request's tokens must give the UTF-8 of
its text, so the bytes come from the vocabulary entry itself, read by the rule of the
tokenizer's decoder:

- ByteLevel (GPT-2, Llama 3, Qwen, SmolLM): each character of the entry stands for one
  byte through GPT-2's byte <-> printable-character table.
- ByteFallback (Llama 2, Mistral, Gemma): an entry `<0xNN>` is the byte NN; other entries
  (and every entry under a Metaspace decoder) are text with "▁" marking a space.
- Added and special tokens, and any other decoder: the UTF-8 of the token's text.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

METASPACE = "\u2581"  # "▁", sentencepiece's mark for a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class VocabTokenizer(Protocol):
    """What TokenBytes reads: `tokenizers.Tokenizer` has these."""

    decoder: Any

    def id_to_token(self, id: int) -> str | None: ...

    def get_added_tokens_decoder(self) -> dict[int, Any]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def byte_level_table() -> dict[str, int]:
    """GPT-2's map from the printable character standing for a byte to that byte.

    Bytes that are printable and not whitespace stand for themselves; the others, in
    order, take the characters from U+0100 on.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in table.values())
    for n, b in enumerate(others):
        table[chr(0x100 + n)] = b
    return table


def _decoder_types(decoder: Any) -> set[str]:
    """The types of a decoder and of the decoders inside a Sequence."""
    if decoder is None:
        return set()
    state = json.loads(decoder.__getstate__())
    parts = state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]
    return {part.get("type", "") for part in parts}


class TokenBytes:
    """Token id -> its raw bytes, cached (a vocabulary entry never changes)."""

    MAX_ENTRIES = 1 << 17  # past it, start over

    def __init__(self, tokenizer: VocabTokenizer) -> None:
        self._tokenizer = tokenizer
        types = _decoder_types(tokenizer.decoder)
        self._byte_level = byte_level_table() if "ByteLevel" in types else None
        self._byte_fallback = "ByteFallback" in types
        # "▁" reads as a space (Metaspace, or a Replace decoder as Llama 2 has)
        self._metaspace = bool(types & {"ByteFallback", "Metaspace", "Replace"})
        added = tokenizer.get_added_tokens_decoder().items()
        self._added: dict[int, str] = {i: str(t.content) for i, t in added}
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> list[int]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = list(self._bytes(token_id))
            if len(self._cache) >= self.MAX_ENTRIES:
                self._cache.clear()
            self._cache[token_id] = cached
        return cached

    def _bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:  # not in the vocabulary: what decode makes of it
            return self._tokenizer.decode([token_id]).encode("utf-8")
        if self._byte_level is not None:
            table = self._byte_level
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        else:
            match = _BYTE_PIECE.fullmatch(piece) if self._byte_fallback else None
            if match is not None:
                return bytes([int(match.group(1), 16)])
            if self._metaspace:
                return piece.replace(METASPACE, " ").encode("utf-8")
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

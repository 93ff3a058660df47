"""Incremental detokenization of one request's generated tokens.

Life cycle of a request's Detokenizer:
  Detokenizer(decoder, prompt_ids=...) --feed(ids)*--> each call returns the new text
                                                       (possibly "": text is held while
                                                       it ends in an incomplete character)
                                       --finish()-->   the held rest, once; state freed

Contract: "".join(all returned deltas) == decoder.decode(ids, skip_special_tokens=...)
for the concatenation `ids` of everything fed. With `prompt_ids` given, the deltas
instead equal decode(context + ids) minus decode(context), where the context is the
prompt's last few tokens: that keeps the leading space of the first generated word for
tokenizers (sentencepiece, Metaspace) that drop a leading space at the start of a text.

How (the prefix-offset/read-offset scheme of vLLM and TGI): the text of a token depends
on its neighbours (merged bytes of one UTF-8 character, leading-space rules, skipped
special tokens), so each step decodes a short window `ids[prefix:]` and the part of it
already emitted, `ids[prefix:read]`, and returns the difference. When the window's text
ends in U+FFFD the last bytes are an incomplete character: nothing past the last
complete point is emitted until more tokens arrive (or finish() flushes it). The offsets
only ever move to such complete points, so a window never starts inside a character.
Only the window is kept: the state is a handful of token ids, not the whole output.

One known difference from the full decode (shared with vLLM and TGI): tokenizers with a
ByteFallback decoder (Llama 2 style `<0xNN>` tokens) turn a whole run of byte tokens into
U+FFFD when any byte in the run is not valid UTF-8, so valid characters of that run that
were already streamed stay as they were. Valid output is never affected.

Pass the fast tokenizer's `tokenizers.Tokenizer` (`hf_tokenizer.backend_tokenizer`):
its decode is transformers' decode without `clean_up_tokenization_spaces`, which would
rewrite model output (" ." -> ".") and is off for the models lmd serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output for context (vLLM uses the same count).
NUM_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, so at most 3 trailing tokens (>= 1 byte each)
# can hold the incomplete part of one: feed() looks back at most this far.
MAX_INCOMPLETE_TOKENS = 3


class TokenDecoder(Protocol):
    """What a Detokenizer needs: `tokenizers.Tokenizer` has this method."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class CachedDecoder:
    """A TokenDecoder that remembers the text of single tokens.

    After every token it emits, a Detokenizer decodes its window's head, which is one
    token in the steady state (see `_advance`); a token's own text never changes, so that
    second decode per token becomes a dict lookup. Several ids decode as they always do.
    """

    __slots__ = ("_decoder", "_keep_special", "_skip_special")

    MAX_ENTRIES = 1 << 17  # per skip_special_tokens value; past it, start over

    def __init__(self, decoder: TokenDecoder) -> None:
        self._decoder = decoder
        self._skip_special: dict[int, str] = {}
        self._keep_special: dict[int, str] = {}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) != 1:
            return self._decoder.decode(ids, skip_special_tokens=skip_special_tokens)
        cache = self._skip_special if skip_special_tokens else self._keep_special
        token = ids[0]
        text = cache.get(token)
        if text is None:
            text = self._decoder.decode(ids, skip_special_tokens=skip_special_tokens)
            if len(cache) >= self.MAX_ENTRIES:
                cache.clear()
            cache[token] = text
        return text


class Detokenizer:
    """Turns one request's token ids, fed as they are generated, into text deltas."""

    __slots__ = ("_decoder", "_ids", "_prefix_text", "_read", "_skip_special")

    def __init__(
        self,
        decoder: TokenDecoder,
        *,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._decoder = decoder
        self._skip_special = skip_special_tokens
        context = list(prompt_ids[max(0, len(prompt_ids) - NUM_CONTEXT_TOKENS) :])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: a window must not start there.
            context, context_text = [], ""
        # The window. ids[:read] were emitted already (or are context) and are decoded
        # again only so that ids[read:] get their neighbours' effect on the text.
        self._ids: list[int] = context
        self._read = len(context)
        self._prefix_text = context_text  # decode(ids[:read])

    @property
    def num_held_tokens(self) -> int:
        """Tokens fed whose text has not been returned yet (incomplete characters)."""
        return len(self._ids) - self._read

    @property
    def num_window_tokens(self) -> int:
        """Token ids kept: the decoding window, a few tokens, not the whole output."""
        return len(self._ids)

    def feed(self, ids: Sequence[int]) -> str:
        """Add newly generated ids (one or several); return the text they complete."""
        if not ids:
            return ""
        self._ids.extend(ids)
        end = len(self._ids)
        lowest = max(self._read + 1, end - MAX_INCOMPLETE_TOKENS)
        while end >= lowest:
            text = self._decode(self._ids[:end])
            if not text.endswith(REPLACEMENT_CHAR):
                return self._advance(text, end)
            # Emit the tokens before the incomplete character, if several were fed.
            end -= 1
        return ""

    def finish(self) -> str:
        """Generation ended: return whatever is still held (an incomplete character
        decodes as U+FFFD, as the full decode would), and free the state."""
        text = self._decode(self._ids)
        delta = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self._ids = []
        self._read = 0
        self._prefix_text = ""
        return delta

    def _advance(self, text: str, end: int) -> str:
        """`text` = decode(ids[:end]) ends in a complete character: return its new part
        and move the window so that it starts at the old read offset."""
        if len(text) <= len(self._prefix_text):
            # Only skipped special tokens (or nothing visible) so far: keep the window,
            # so the next visible token is decoded next to the text before it.
            return ""
        delta = text[len(self._prefix_text) :]
        # The window now starts at the old read offset (a complete point, like `end`).
        del self._ids[: self._read]
        self._read = end - self._read
        self._prefix_text = self._decode(self._ids[: self._read])
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special)

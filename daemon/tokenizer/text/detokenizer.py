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

How: tokenizers' DecodeStream does the per-token work in Rust: 0.8 us a token with the
Python around it, where this module's own window in Python took 1.6-1.9 (SmolLM2 and
Qwen3, docs/benchmarks.md, 2026-11-25). It is the prefix-offset/read-offset scheme of
vLLM and TGI: the text of a token depends on its neighbours (merged bytes of one UTF-8
character, leading-space rules, skipped special tokens), so each step decodes a short
window, the ids since the last-but-one point where the text was complete, and returns
the part past what the window's head already gave; nothing (None) while the text ends
in U+FFFD, an incomplete character, or has nothing new (skipped special tokens).
Around it the Detokenizer:
- passes the context as the stream's first ids, or none where the prompt ends inside a
  character (the stream would return the context's own text with the first delta);
- steps several ids one by one: the stream given them says nothing while the last one
  ends in an incomplete character, and the text before that character is due now;
- keeps the ids of the window (the last complete step and those held since), a handful:
  the stream has no flush, so finish() decodes them once;
- starts a new stream where the old one cannot go on (below).
A decoder that is not a `tokenizers.Tokenizer` (the tests' fakes) gets the same step in
Python (PythonDecodeStream).

One known difference from the full decode (shared with vLLM and TGI): tokenizers with a
ByteFallback decoder (Llama 2 style `<0xNN>` tokens) turn a whole run of byte tokens into
U+FFFD when any byte in the run is not valid UTF-8, so valid characters of that run that
were already streamed stay as they were (DecodeStream raises there, "Invalid prefix":
the new text is cut at the old one's length and a new stream starts). Valid output is
never affected.

Pass the fast tokenizer's `tokenizers.Tokenizer` (`hf_tokenizer.backend_tokenizer`):
its decode is transformers' decode without `clean_up_tokenization_spaces`, which would
rewrite model output (" ." -> ".") and is off for the models lmd serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output for context (vLLM uses the same count).
NUM_CONTEXT_TOKENS = 5
INVALID_PREFIX = "Invalid prefix"  # how DecodeStream's error starts


class TokenDecoder(Protocol):
    """What a Detokenizer needs: `tokenizers.Tokenizer` has this method."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class Stream(Protocol):
    """DecodeStream's one method: the text the new ids complete, or None."""

    def step(self, tokenizer: Any, id: Any, /) -> str | None: ...


class CachedDecoder:
    """A TokenDecoder that remembers the text of single tokens.

    A token's own text never changes, and it is asked for often: the logprobs' pieces
    (TextStream) decode each sampled token and its top alternatives one by one; there a
    decode becomes a dict lookup. Several ids decode as they always do, and a Detokenizer
    given a CachedDecoder streams through the decoder it wraps.
    """

    __slots__ = ("_decoder", "_keep_special", "_skip_special")

    MAX_ENTRIES = 1 << 17  # per skip_special_tokens value; past it, start over

    def __init__(self, decoder: TokenDecoder) -> None:
        self._decoder = decoder
        self._skip_special: dict[int, str] = {}
        self._keep_special: dict[int, str] = {}

    @property
    def decoder(self) -> TokenDecoder:
        return self._decoder

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

    def decode_batch(
        self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """Several decodes in one call: the tokenizer's own batch (Rust, over the cores)
        where it has one."""
        decode_batch = getattr(self._decoder, "decode_batch", None)
        if decode_batch is None:
            return [
                self._decoder.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch
            ]
        return list(
            decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)
        )


class PythonDecodeStream:
    """DecodeStream's step in Python, for a TokenDecoder that is not a tokenizers.Tokenizer
    (the tests' fakes): the window is ids[:read] (the last complete step, whose text is
    `prefix`) and ids[read:] (held)."""

    __slots__ = ("_ids", "_prefix", "_read", "_skip_special")

    def __init__(self, ids: Sequence[int] = (), skip_special_tokens: bool = False) -> None:
        self._ids = list(ids)
        self._read = len(self._ids)
        self._prefix: str | None = None  # decode(ids[:read]), at the first step
        self._skip_special = skip_special_tokens

    def step(self, tokenizer: TokenDecoder, id: int, /) -> str | None:
        if self._prefix is None:
            self._prefix = tokenizer.decode(self._ids, skip_special_tokens=self._skip_special)
        self._ids.append(id)
        text = tokenizer.decode(self._ids, skip_special_tokens=self._skip_special)
        if len(text) <= len(self._prefix) or text.endswith(REPLACEMENT_CHAR):
            return None
        if not text.startswith(self._prefix):
            raise ValueError(f"{INVALID_PREFIX}: {self._prefix!r} is not the start of {text!r}")
        delta = text[len(self._prefix) :]
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix = tokenizer.decode(self._ids, skip_special_tokens=self._skip_special)
        return delta


class Detokenizer:
    """Turns one request's token ids, fed as they are generated, into text deltas."""

    __slots__ = ("_decoder", "_emitted", "_held", "_skip_special", "_stream", "_tokenizer")
    # The window, as the stream has it (set by _start): the ids of its last step that
    # returned text (or the context), and those fed since, whose text is held.
    _emitted: list[int]
    _held: list[int]
    _stream: Stream

    def __init__(
        self,
        decoder: TokenDecoder,
        *,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._decoder = decoder  # finish()'s decodes: the CachedDecoder if given one
        # What the stream steps with: a CachedDecoder's own decoder.
        self._tokenizer = decoder.decoder if isinstance(decoder, CachedDecoder) else decoder
        self._skip_special = skip_special_tokens
        self._start(prompt_ids[max(0, len(prompt_ids) - NUM_CONTEXT_TOKENS) :])

    @property
    def num_held_tokens(self) -> int:
        """Tokens fed whose text has not been returned yet (incomplete characters)."""
        return len(self._held)

    @property
    def num_window_tokens(self) -> int:
        """Token ids kept: the decoding window, a few tokens, not the whole output."""
        return len(self._emitted) + len(self._held)

    def feed(self, ids: Sequence[int]) -> str:
        """Add newly generated ids (one or several); return the text they complete."""
        if len(ids) == 1:  # one sampled token, as nearly always
            return self._step(ids[0])
        # One by one: a stream given several returns nothing while the last one ends in
        # an incomplete character, and the text before that character is due now.
        return "".join([self._step(token) for token in ids])

    def finish(self) -> str:
        """Generation ended: return whatever is still held (an incomplete character
        decodes as U+FFFD, as the full decode would), and free the state."""
        context, held = self._emitted, self._held
        self._start(())
        if not held:
            return ""
        head = self._decode(context)
        text = self._decode(context + held)
        return text[len(head) :] if len(text) > len(head) else ""

    def _step(self, token: int) -> str:
        self._held.append(token)
        try:  # an int: given a list, DecodeStream first fails to read it as one (0.4 us)
            text = self._stream.step(self._tokenizer, token)
        except Exception as error:  # DecodeStream raises a bare Exception
            if not str(error).startswith(INVALID_PREFIX):
                raise
            return self._restart()
        if text is None:
            return ""
        self._emitted = self._held
        self._held = []
        return text

    def _restart(self) -> str:
        """The window's text no longer starts with what was returned (an invalid byte
        ended a ByteFallback run): return its new part past the old text's length, and
        go on with a new stream whose context is the ids since the last step."""
        head = self._decode(self._emitted)
        text = self._decode(self._emitted + self._held)
        self._start(self._held)
        return text[len(head) :] if len(text) > len(head) else ""

    def _start(self, context: Sequence[int]) -> None:
        """A new stream with `context` as its first ids, or none where their text ends
        inside a character: a window must start at a complete point."""
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = ()
        self._emitted = list(context)
        self._held = []
        skip = self._skip_special
        self._stream = (
            DecodeStream(self._emitted, skip_special_tokens=skip)
            if isinstance(self._tokenizer, Tokenizer)
            else PythonDecodeStream(self._emitted, skip_special_tokens=skip)
        )

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special)

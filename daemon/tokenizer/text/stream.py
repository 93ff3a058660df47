"""One request's output text: incremental detokenizer + stop strings + counters.

Feed each sampled token (with the engine's finish reason on the last one) and get the
text to send now. A stop string ends the request with finish_reason "stop" and is not
part of the text; the caller must then abort the request in the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmd.tokenizer.text.detokenizer import Detokenizer, TokenDecoder
from lmd.tokenizer.text.stop_strings import StopMatcher


@dataclass(slots=True)
class StreamUpdate:
    text: str
    finish_reason: str | None  # set once: stop, length, abort
    stopped_by_string: bool  # the text hit a stop string: abort it in the engine
    logprobs: list[dict[str, Any]] | None = field(default=None)


class TextStream:
    def __init__(
        self,
        decoder: TokenDecoder,
        *,
        prompt_ids: Sequence[int],
        stops: Iterable[str] = (),
        skip_special_tokens: bool = True,
        token_bytes: Callable[[int], list[int]] | None = None,
    ) -> None:
        """`token_bytes` (a TokenBytes) is given when the request wants logprobs."""
        self.decoder = decoder
        self.num_prompt_tokens = len(prompt_ids)
        self.num_completion_tokens = 0
        self.finish_reason: str | None = None
        self._detok = Detokenizer(
            decoder, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids
        )
        self._stops = StopMatcher(stops)
        self._token_bytes = token_bytes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(
        self, token_id: int, finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> StreamUpdate:
        """One sampled token; `finish_reason` is the engine's, on the request's last token."""
        if self.finished:
            return StreamUpdate("", None, False)
        self.num_completion_tokens += 1
        check = self._stops.feed(self._detok.feed([token_id]))
        text = check.text
        if not check.stopped and finish_reason is not None:
            tail = self._stops.feed(self._detok.finish())
            text += tail.text
            check = tail
            if not tail.stopped:
                text += self._stops.finish()
        stopped = check.stopped
        if stopped:
            self.finish_reason = "stop"
        elif finish_reason is not None:
            self.finish_reason = finish_reason
        entry = self._logprob_entry(token_id, logprobs)
        return StreamUpdate(text, self.finish_reason, stopped, entry)

    def _logprob_entry(
        self, token_id: int, logprobs: dict[str, Any] | None
    ) -> list[dict[str, Any]] | None:
        if logprobs is None or self._token_bytes is None:
            return None
        raw = self._token_bytes
        top = [[self._piece(t), lp, raw(t)] for t, lp in logprobs["top"]]
        piece = self._piece(token_id)
        return [
            {"token": piece, "logprob": logprobs["logprob"], "bytes": raw(token_id), "top": top}
        ]

    def _piece(self, token_id: int) -> str:
        return self.decoder.decode([int(token_id)], skip_special_tokens=False)

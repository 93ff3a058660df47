"""What the pipeline returns (LMDeploy's Response), and how one request's output is built.

`RequestOutput` follows one request from the engine's TokenEvents to its Response: each
token goes through the request's TextStream (the tokenizer process's incremental
detokenizer + stop strings), so the text is what the daemon would send. `delta()` is what
came since the last delta (stream_infer), `response()` the whole output.

Counts are the daemon's: `generate_token_len` counts every token the engine sampled up to
the end, the one that ended it too (EOS or a stop token id, as the daemon's
completion_tokens do); the text never shows special tokens (skip_special_tokens) nor a stop
string. A request ended by a stop string keeps the tokens up to the one that completed it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmd.engine.events import TokenEvent
from lmd.engine.sampler import TokenLogprobs
from lmd.pipeline.config import GenerationConfig
from lmd.pipeline.prompts import WholeText, whole_texts
from lmd.tokenizer.text.stream import TextStream


@dataclass(slots=True)
class Response:
    """One prompt's output (LMDeploy's Response); in stream_infer, the part that is new.

    finish_reason: "stop" (EOS, a stop token or stop word), "length" (max_new_tokens or
    the session length), "abort" (cut off), None while it runs. logprobs: per output
    token, {token id: logprob} of the chosen token and the `logprobs` most likely.
    logits / last_hidden_state: float32 on the CPU, [rows, vocab] / [rows, hidden], rows
    as GenerationConfig.output_logits says; only on the last Response of a request.
    index: the prompt's position in the call.
    """

    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    index: int = 0


class RequestOutput:
    """One request's output as its tokens arrive (used by one thread: the caller's)."""

    def __init__(
        self,
        index: int,
        request_id: str,
        prompt_ids: list[int],
        gen: GenerationConfig,
        text: TextStream | WholeText | None,
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.gen = gen
        self.stream = text if isinstance(text, TextStream) else None
        self.whole_text = text if isinstance(text, WholeText) else None
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = None if gen.logprobs is None else []
        self.text: list[str] = []
        self.text_due = False  # ended with a whole_text not made yet (make_texts makes it)
        self.finish_reason: str | None = None
        self.logits: torch.Tensor | None = None
        self.last_hidden_state: torch.Tensor | None = None
        self._sent_tokens = 0  # how much delta() has returned
        self._sent_text = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, events: list[TokenEvent]) -> bool:
        """This request's new tokens, in order. True when a stop string ended it while the
        engine still runs it: the caller aborts it there."""
        if self.stream is None and self.logprobs is None:  # ids only: as few steps as can be
            if not self.finished:
                self.token_ids += [event.token_id for event in events]
                self._finish(events[-1].finish_reason)  # only a last token carries one
            return False
        cut = False
        for event in events:
            if self.finished:
                break
            reason = None if event.finish_reason is None else str(event.finish_reason)
            self.token_ids.append(event.token_id)
            if self.logprobs is not None:
                self.logprobs.append(_logprob_dict(event.logprobs))
            if self.stream is None:
                self._finish(reason)
                continue
            update = self.stream.feed(event.token_id, reason)
            self.text.append(update.text)
            self.finish_reason = update.finish_reason
            cut = update.stopped_by_string and reason is None
        return cut

    def end(self, token_ids: list[int], reason: str | None) -> None:
        """Every token at once, when the request ended (a call delivered at its ends)."""
        if not self.finished:
            self.token_ids = token_ids
            self._finish(reason)

    def _finish(self, reason: str | None) -> None:
        """The engine's finish reason (None: not yet); the whole text once it ends."""
        if reason is None:
            return
        self.finish_reason = str(reason)
        self.text_due = self.whole_text is not None

    def abort(self) -> None:
        """Cut off before it finished (the caller stopped reading, or the pipeline closed)."""
        if not self.finished:
            self.finish_reason = "abort"

    @property
    def scored_ids(self) -> list[int]:
        """What a scoring pass runs for logits / hidden states: the prompt and every
        generated token but the last (whose logits no step computed either)."""
        return self.prompt_ids + self.token_ids[:-1]

    def first_row(self, mode: str | None) -> int | None:
        """The first row of the scoring pass an output mode keeps (None: not asked)."""
        if mode is None or not self.token_ids:
            return None
        return 0 if mode == "all" else len(self.prompt_ids) - 1

    def delta(self) -> Response:
        """What is new since the last delta (the tensors come with the last one)."""
        start, text_start = self._sent_tokens, self._sent_text
        self._sent_tokens, self._sent_text = len(self.token_ids), len(self.text)
        out = self._response("".join(self.text[text_start:]), start)
        out.generate_token_len = len(self.token_ids)
        return out

    def response(self) -> Response:
        return self._response("".join(self.text), 0)

    def _response(self, text: str, start: int) -> Response:
        return Response(
            text=text,
            generate_token_len=len(self.token_ids) - start,
            input_token_len=len(self.prompt_ids),
            finish_reason=self.finish_reason,
            token_ids=self.token_ids[start:],
            logprobs=None if self.logprobs is None else self.logprobs[start:],
            logits=self.logits if self.finished else None,
            last_hidden_state=self.last_hidden_state if self.finished else None,
            index=self.index,
        )


def make_texts(outputs: list[RequestOutput]) -> None:
    """The whole texts of the outputs that ended since the last call, in one batch."""
    due = [out for out in outputs if out.text_due]
    jobs = [(out.whole_text, out.token_ids) for out in due if out.whole_text is not None]
    for out, text in zip(due, whole_texts(jobs), strict=True):
        out.text.append(text)
        out.text_due = False


def _logprob_dict(logprobs: TokenLogprobs | None) -> dict[int, float]:
    if logprobs is None:
        return {}
    out = {logprobs.token_id: logprobs.logprob}
    out.update(logprobs.top)
    return out

"""The choices of a request (OpenAI's `n`) in the tokenizer, and its table of requests.

Life cycle of a request with n > 1 in the tokenizer (worker.py does the I/O):
  1. Its prompt is rendered, tokenized, checked and routed once. Each choice is an engine
     request of its own, `<id>-<index>` (`choice_ids`), with its own TextStream
     (detokenizer, stop strings) and seed (`choice_seed`), on the same engine workers as
     choice 0 (`Router.follow`): their prefix cache is where the prompt will be.
  2. Choice 0's Generate goes to the engine; the others' are held (`TokenizerRequest.held`).
  3. Choice 0's first token is back: its engine has computed the prompt and cached its
     full blocks, so the held Generates go out, and each of those choices computes only
     the prompt's last, partial block (its `cached_tokens` show the hit). With prefix
     caching off nothing is held: there would be nothing to wait for.
  4. Each choice's text goes to the api in TextDelta entries under the api's request id
     with the choice's index; a choice that finishes leaves the table (`finish`), and the
     request is over when its last choice is.
  5. An Abort from the api, an engine's RequestError for any choice, or a worker of the
     route restarting ends every choice (`drop`): those sent are aborted in the engines,
     those held are forgotten, and the api gets one error for the request.
A request with n = 1 is one choice whose engine id is the request's own id.
"""

from __future__ import annotations

from lmd.tokenizer.request import TokenizerRequest

_INT64 = 1 << 64


def choice_ids(request_id: str, n: int) -> list[str]:
    """The engine request ids of a request's n choices."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice `index` samples with: the request's seed + index, wrapped into
    int64 (choice 0 samples as the same request with n = 1 would); None stays None (each
    choice random)."""
    if seed is None:
        return None
    return (seed + index + (_INT64 >> 1)) % _INT64 - (_INT64 >> 1)


def num_uncached(num_prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens a later choice computes once choice 0's prompt is cached: those
    past the last full block before the prompt's last token (whose logits every request
    computes)."""
    return num_prompt_tokens - (num_prompt_tokens - 1) // block_size * block_size


class Requests:
    """The choices a tokenizer holds, by engine request id, grouped by the api's id."""

    def __init__(self) -> None:
        self._choices: dict[str, TokenizerRequest] = {}  # engine id -> choice
        self._by_request: dict[str, list[str]] = {}  # api id -> its choices' engine ids

    def __len__(self) -> int:
        """Choices in flight (each is an engine request, sent or held)."""
        return len(self._choices)

    def __contains__(self, request_id: str) -> bool:
        """Is the api's request `request_id` in flight?"""
        return request_id in self._by_request

    def get(self, engine_id: str) -> TokenizerRequest | None:
        return self._choices.get(engine_id)

    def items(self) -> list[tuple[str, TokenizerRequest]]:
        """Every choice, as (engine id, choice): a copy, to drop from while reading it."""
        return list(self._choices.items())

    def add(self, request_id: str, choices: list[tuple[str, TokenizerRequest]]) -> None:
        self._by_request[request_id] = [engine_id for engine_id, _ in choices]
        self._choices.update(choices)

    def held(self, request_id: str) -> list[TokenizerRequest]:
        """The request's choices whose Generate is still held, by index."""
        choices = (self._choices[e] for e in self._by_request.get(request_id, ()))
        return [choice for choice in choices if choice.held is not None]

    def finish(self, engine_id: str) -> None:
        """A choice ended by itself; the request goes with its last choice."""
        choice = self._choices.pop(engine_id)
        siblings = self._by_request[choice.request_id]
        siblings.remove(engine_id)
        if not siblings:
            del self._by_request[choice.request_id]

    def drop(self, request_id: str) -> list[tuple[str, TokenizerRequest]]:
        """Forget every choice of the request still in flight; they are returned."""
        engine_ids = self._by_request.pop(request_id, [])
        return [(e, self._choices.pop(e)) for e in engine_ids]

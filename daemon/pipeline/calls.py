"""One pipeline call's requests: what they ask of the engine, and their outputs so far.

A call is built in the caller's thread (prompts tokenized, lengths checked, every
argument checked before anything reaches the engine), its sequences go to the engine
thread together, and the tokens that come back are fed to each request's RequestOutput
by `take`, in the caller's thread. A call that nobody reads before its requests end gets
only their last tokens (Delivery.ENDS) and takes the ids from each request's Sequence.
The sync and async forms of the pipeline differ only in how they wait for the next item.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf
from functools import cached_property

from torch import Tensor

from lmd.engine.engine import Engine
from lmd.engine.events import TokenEvent
from lmd.engine.sequence import Sequence, are_ints, first_outside
from lmd.pipeline import scoring
from lmd.pipeline.config import GenerationConfig
from lmd.pipeline.engine_thread import Delivery, EngineThread, Item
from lmd.pipeline.outputs import RequestOutput, make_texts
from lmd.pipeline.prompts import Prompter, Tokenized

_request_ids = itertools.count()


class Call:
    def __init__(
        self, outputs: list[RequestOutput], seqs: list[Sequence], *, streamed: bool
    ) -> None:
        self.outputs = outputs
        self.seqs = seqs
        self.streamed = streamed  # read as it comes (stream_infer), not only at the end
        self._by_id = {out.request_id: out for out in outputs}
        self._seqs = {seq.request_id: seq for seq in seqs}

    @cached_property
    def delivery(self) -> Delivery:
        """Every step's tokens where something reads them as they come (a stream, a stop
        string); else none before a request ends: with logprobs every token's event
        (held), without only the last, whose Sequence holds the ids."""
        if self.streamed or any(out.stream is not None for out in self.outputs):
            return Delivery.STEPS
        if any(out.logprobs is not None for out in self.outputs):
            return Delivery.HELD
        return Delivery.ENDS

    @property
    def done(self) -> bool:
        return all(out.finished for out in self.outputs)

    def take(self, item: Item, engine: EngineThread) -> list[RequestOutput]:
        """Feed one item from the engine thread; the outputs it changed, in order of their
        first token. An error item cuts off every request left and is raised."""
        if isinstance(item, BaseException):
            self.abort(engine)
            raise item
        if self.delivery is Delivery.ENDS:
            changed = [self._end(event) for event in item]
            make_texts(changed)
            return changed
        by_output: dict[str, list[TokenEvent]] = {}
        for event in item:
            by_output.setdefault(event.request_id, []).append(event)
        changed = []
        for request_id, events in by_output.items():
            out = self._by_id[request_id]
            if out.feed(events):  # a stop string ended it: the engine stops too
                engine.abort([request_id])
            changed.append(out)
        make_texts(changed)
        return changed

    def _end(self, last: TokenEvent) -> RequestOutput:
        """A request's last token (Delivery.ENDS): its ids are its Sequence's, which the
        engine thread no longer touches (a finished Sequence takes no token)."""
        out = self._by_id[last.request_id]
        ids = self._seqs[last.request_id].output_token_ids[: last.position + 1]
        out.end(ids, last.finish_reason)
        return out

    def abort(self, engine: EngineThread) -> None:
        """Cut off every request that has not finished (the caller stopped reading)."""
        left = [out for out in self.outputs if not out.finished]
        for out in left:
            out.abort()
        engine.abort(out.request_id for out in left)


def build_request(
    index: int,
    tokenized: Tokenized,
    gen: GenerationConfig,
    prompter: Prompter,
    session_len: int,
    *,
    streamed: bool,
) -> tuple[RequestOutput, Sequence]:
    """One request of a call (`streamed`: its text is read as it comes); ValueError says
    what is wrong with it."""
    ids = tokenized.token_ids
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= session_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens and session_len is {session_len} (prompt and "
            f"output together): shorten it, or raise session_len in the backend config"
        )
    room = session_len - len(ids)  # no max_new_tokens: as much as the session leaves
    params = gen.sampling_params(min(gen.max_new_tokens or room, room))
    request_id = f"pipeline-{next(_request_ids)}"
    text = prompter.text(
        tokenized, gen.stop_words or [], skip_special=gen.skip_special_tokens, incremental=streamed
    )
    return RequestOutput(index, request_id, ids, gen, text), Sequence(request_id, ids, params)


def output_tensors(out: RequestOutput, engine: Engine) -> tuple[Tensor | None, Tensor | None]:
    """The logits and last hidden states `out.gen` asks for (run in the engine thread)."""
    gen = out.gen
    logits_from = out.first_row(gen.output_logits)
    hidden_from = out.first_row(gen.output_last_hidden_state)
    firsts = [r for r in (logits_from, hidden_from) if r is not None]
    if not firsts:
        return None, None
    first = min(firsts)
    logits, hidden = scoring.tensors(
        engine.backend,
        out.scored_ids,
        first,
        block_size=engine.pool.block_size,
        rows=scoring.max_rows(engine.backend, engine.config.max_prefill_token_num),
        hidden=hidden_from is not None,
    )
    return (
        None if logits_from is None else logits[logits_from - first :],
        None if hidden is None or hidden_from is None else hidden[hidden_from - first :],
    )


def perplexity_inputs(input_ids: object, vocab_size: int, session_len: int) -> list[list[int]]:
    """get_ppl's argument as sequences of ids, or ValueError saying what is wrong."""
    if _is_ids(input_ids):
        seqs: SequenceOf[object] = [input_ids]
    elif isinstance(input_ids, list | tuple) and input_ids:
        seqs = input_ids
    else:
        raise ValueError("input_ids must be a list of token ids or a non-empty list of such lists")
    out = []
    for i, seq in enumerate(seqs):
        if not _is_ids(seq):
            raise ValueError(f"input_ids[{i}] must be a list of ints (token ids)")
        assert isinstance(seq, list | tuple)
        if not 2 <= len(seq) <= session_len:
            raise ValueError(
                f"input_ids[{i}] has {len(seq)} tokens: a perplexity needs 2 to "
                f"session_len ({session_len})"
            )
        bad = first_outside(seq, vocab_size)
        if bad is not None:
            raise ValueError(
                f"input_ids[{i}]: token id {bad} is outside the vocabulary (0-{vocab_size - 1})"
            )
        out.append(list(seq))
    return out


def _is_ids(value: object) -> bool:
    return isinstance(value, list | tuple) and bool(value) and are_ints(value)

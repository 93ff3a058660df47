"""What the tokenizer sends the api: TextDelta entries, batched per turn of the loop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from lmd import protocol
from lmd.stage_times import StageTimes
from lmd.tokenizer.request import DeltaOutbox, TokenizerRequest, text_delta
from lmd.tokenizer.routing import Route
from lmd.tokenizer.text.stream import StreamUpdate, TextStream


class Decoder:
    """Each id is one letter."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def tokenizer_request(reply_to: str = "api-0") -> TokenizerRequest:
    stream = TextStream(Decoder(), prompt_ids=[0, 1, 2])
    request = TokenizerRequest("r", reply_to, Route("hybrid-0", "", None, None), stream)
    request.cached_tokens = 2
    return request


class Sent:
    def __init__(self) -> None:
        self.messages: list[tuple[str, protocol.Message]] = []

    def __call__(self, worker: str, msg: protocol.Message) -> bool:
        self.messages.append((worker, msg))
        return True


def test_a_delta_entry_keeps_the_counts_it_was_made_with() -> None:
    request = tokenizer_request()
    first = request.delta_entry(request.stream.feed(3, None))
    second = request.delta_entry(request.stream.feed(4, "length"))
    msg = text_delta([first, second])
    assert msg.request_ids == ["r", "r"] and msg.texts == ["d", "e"]
    assert msg.completion_tokens == [1, 2] and msg.prompt_tokens == [3, 3]
    assert msg.finish_reasons == [None, "length"] and msg.cached_tokens == [2, 2]
    assert msg.indexes == [0, 0]
    msg.check()


def test_a_choice_s_entries_name_the_api_s_request_and_the_choice() -> None:
    stream = TextStream(Decoder(), prompt_ids=[0, 1, 2])
    choice = TokenizerRequest("cmpl-7", "api-0", Route("hybrid-0", "", None, None), stream, 2)
    msg = text_delta([choice.delta_entry(choice.stream.feed(3, None))])
    assert msg.request_ids == ["cmpl-7"] and msg.indexes == [2]
    msg.check()


async def test_entries_of_one_turn_go_out_as_one_text_delta_per_api_worker() -> None:
    sent = Sent()
    stages = StageTimes()
    outbox = DeltaOutbox(sent, stages)
    a, b = tokenizer_request("api-0"), tokenizer_request("api-1")
    for step in range(3):  # three Tokens messages handled in one turn
        outbox.arrived()
        outbox.add("api-0", a.delta_entry(a.stream.feed(step, None)))
        outbox.add("api-1", b.delta_entry(b.stream.feed(step, None)))
    assert sent.messages == [] and len(outbox) == 6
    await asyncio.sleep(0)  # the turn ends
    assert [worker for worker, _ in sent.messages] == ["api-0", "api-1"]
    first = sent.messages[0][1]
    assert isinstance(first, protocol.TextDelta)
    assert first.texts == ["a", "b", "c"] and first.completion_tokens == [1, 2, 3]
    assert len(outbox) == 0
    # stamped for the api's to_api stage; the turn's wait counted once for detokenize
    assert first.sent_at > 0 and stages.count("detokenize") == 1


async def test_another_message_goes_after_the_text_held() -> None:
    sent = Sent()
    outbox = DeltaOutbox(sent, StageTimes())
    request = tokenizer_request()
    outbox.add("api-0", request.delta_entry(StreamUpdate("x", None, False)))
    outbox.send("api-0", protocol.RequestError("r", "internal_error", "the engine failed"))
    await asyncio.sleep(0)  # nothing is left for the end of the turn
    kinds = [type(msg).__name__ for _, msg in sent.messages]
    assert kinds == ["TextDelta", "RequestError"]


async def test_a_full_outbox_does_not_wait_for_the_turn_to_end() -> None:
    sent = Sent()
    outbox = DeltaOutbox(sent, StageTimes())
    request = tokenizer_request()
    for _ in range(DeltaOutbox.MAX_ENTRIES):
        outbox.add("api-0", request.delta_entry(StreamUpdate("x", None, False)))
    assert len(sent.messages) == 1 and len(outbox) == 0

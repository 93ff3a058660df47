"""Chat responses whose reply is read by parsers (openai_responses.ChatFormat with a
parsers.reply.ReplyParser): message.tool_calls and reasoning_content, stream deltas that
carry them, finish_reason tool_calls; checked against OpenAI's own schemas and against
the api's OpenAPI document (docs.py)."""

from __future__ import annotations

import json
from itertools import zip_longest
from typing import Any

import pytest

from lmd.api.deltas import Answer, Delta
from lmd.api.docs import ChatCompletion, ChatCompletionChunk
from lmd.api.openai_responses import ChatFormat, SseFraming, sse
from lmd.api.parsers.reasoning import QWEN3
from lmd.api.parsers.reply import ReplyParser
from lmd.api.parsers.tool_calls import HERMES, MISTRAL
from tests.openai_spec import assert_schema
from tests.qwen3 import assistant_turns, render

MODEL = "Qwen3-8B"
QWEN3_REPLY = ReplyParser(think=QWEN3, opened=None, tools=HERMES)
THOUGHT_AND_CALLS = (
    "<think>\nTwo cities: two calls.\n</think>\n\nLet me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
)


def deltas(text: str, pieces: int, reason: str = "stop") -> list[Delta]:
    """The reply as the tokenizer would send it: `pieces` deltas, the last finishing."""
    size = max(1, -(-len(text) // pieces))
    parts = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    last = len(parts) - 1
    return [Delta(p, reason if i == last else None, 9, i + 1, None) for i, p in enumerate(parts)]


def full_body(reply: ReplyParser | None, text: str, reason: str = "stop") -> dict[str, Any]:
    answer = Answer()
    for d in deltas(text, 3, reason):
        answer.add(d)
    body = ChatFormat("chatcmpl-1", 1, MODEL, reply=reply).response([answer])
    assert_schema(body, "CreateChatCompletionResponse")
    ChatCompletion.model_validate(body)  # as /openapi.json describes it
    return body


def stream_chunks(reply: ReplyParser | None, text: str, pieces: int) -> list[dict[str, Any]]:
    fmt = ChatFormat("chatcmpl-1", 1, MODEL, reply=reply)
    chunks = [c for c in map(fmt.chunk, deltas(text, pieces)) if c is not None]
    for chunk in chunks:
        assert_schema(chunk, "CreateChatCompletionStreamResponse")
        ChatCompletionChunk.model_validate(chunk)
    return chunks


def added_up(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A client's view of a stream: each field's pieces joined, calls merged by index."""
    out: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        out["content"] += delta.get("content", "")
        out["reasoning_content"] += delta.get("reasoning_content", "")
        for entry in delta.get("tool_calls", []):
            call = out["tool_calls"].setdefault(entry["index"], {"arguments": ""})
            if "id" in entry:
                call["name"] = entry["function"]["name"]
            call["arguments"] += entry["function"]["arguments"]
    out["tool_calls"] = [out["tool_calls"][i] for i in sorted(out["tool_calls"])]
    out["finish_reason"] = chunks[-1]["choices"][0]["finish_reason"]
    return out


def test_a_reply_with_reasoning_and_calls_is_one_message() -> None:
    message = full_body(QWEN3_REPLY, THOUGHT_AND_CALLS)["choices"][0]["message"]
    assert message["content"] == "Let me look."
    assert message["reasoning_content"] == "Two cities: two calls."
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris"},
        {"city": "Lyon"},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


def test_finish_reason_is_tool_calls_when_a_reply_that_stopped_called_tools() -> None:
    body = full_body(QWEN3_REPLY, THOUGHT_AND_CALLS)
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert (
        full_body(QWEN3_REPLY, THOUGHT_AND_CALLS, "length")["choices"][0]["finish_reason"]
        == "length"
    )
    plain = full_body(QWEN3_REPLY, "No tools needed.")
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert plain["choices"][0]["message"]["content"] == "No tools needed."
    assert "tool_calls" not in plain["choices"][0]["message"]


def test_a_reply_of_calls_only_has_null_content() -> None:
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    message = full_body(ReplyParser(tools=MISTRAL), text)["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1
    assert "reasoning_content" not in message  # no reasoning parser configured


def test_without_parsers_the_message_is_the_text() -> None:
    message = full_body(None, THOUGHT_AND_CALLS)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": THOUGHT_AND_CALLS, "refusal": None}


@pytest.mark.parametrize("pieces", [1, 2, 7, len(THOUGHT_AND_CALLS)])
def test_a_stream_adds_up_to_the_message_exactly(pieces: int) -> None:
    message = full_body(QWEN3_REPLY, THOUGHT_AND_CALLS)["choices"][0]["message"]
    got = added_up(stream_chunks(QWEN3_REPLY, THOUGHT_AND_CALLS, pieces))
    assert got["content"] == message["content"]
    assert got["reasoning_content"] == message["reasoning_content"]
    assert got["tool_calls"] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message["tool_calls"]
    ]
    assert got["finish_reason"] == "tool_calls"


def test_stream_deltas_are_shaped_as_openais() -> None:
    chunks = stream_chunks(QWEN3_REPLY, THOUGHT_AND_CALLS, len(THOUGHT_AND_CALLS))
    entries = [e for c in chunks for e in c["choices"][0]["delta"].get("tool_calls", [])]
    firsts = [e for e in entries if "id" in e]
    assert [e["index"] for e in firsts] == [0, 1]
    assert all(e["type"] == "function" and e["function"]["name"] for e in firsts)
    later = [e for e in entries if "id" not in e]
    assert later and all(e.keys() == {"index", "function"} for e in later)
    assert all(e["function"].keys() == {"arguments"} for e in later)
    # held text makes no chunk; each delta carries only the fields it has something for
    assert all(c["choices"][0]["delta"] or c["choices"][0]["finish_reason"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_sse_bytes_are_the_chunks_encoded() -> None:
    sent = ChatFormat("chatcmpl-1", 1, MODEL, reply=QWEN3_REPLY)
    built = ChatFormat("chatcmpl-1", 1, MODEL, reply=QWEN3_REPLY)
    framing = SseFraming(sent)
    for delta in deltas(THOUGHT_AND_CALLS, 9):
        frame, chunk = framing.frame(delta), built.chunk(delta)
        if chunk is None:
            assert frame is None
            continue
        assert frame is not None
        ids = [e.get("id") for e in chunk["choices"][0]["delta"].get("tool_calls", [])]
        got = json.loads(frame[6:])
        entries = got["choices"][0]["delta"].get("tool_calls", [])
        for entry, call_id in zip(entries, ids, strict=True):
            entry["id"] = call_id  # ids are random per stream
            if call_id is None:
                del entry["id"]
        assert sse(got) == sse(chunk)


def test_qwen3s_own_rendering_streams_and_parses_alike() -> None:
    """Qwen3's template's text for a turn with reasoning and two calls, through the
    whole api response and through its stream."""
    calls = [
        {"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c1", "type": "function", "function": {"name": "g", "arguments": '{"b": [2]}'}},
    ]
    turn = {"role": "assistant", "content": "Calling.", "reasoning_content": "Two."}
    chat: list[dict[str, Any]] = [{"role": "user", "content": "Go"}, {**turn, "tool_calls": calls}]
    (reply,) = assistant_turns(render(chat))
    message = full_body(QWEN3_REPLY, reply)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Two.", "Calling.")
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"a": 1}', '{"b": [2]}']
    for pieces in (1, 5, len(reply)):
        got = added_up(stream_chunks(QWEN3_REPLY, reply, pieces))
        assert (got["reasoning_content"], got["content"]) == ("Two.", "Calling.")
        assert [c["arguments"] for c in got["tool_calls"]] == ['{"a": 1}', '{"b": [2]}']


def test_each_choice_has_its_own_reply_parser() -> None:
    """n = 2: choice 0 thinks and calls tools, choice 1 answers in plain text; their
    pieces arrive mixed, each choice's stream adds up to its own message."""
    plain = "It is sunny."
    mixed = [
        Delta(d.text, d.finish_reason, 9, d.completion_tokens, None, 0, 0, index)
        for pair in zip_longest(deltas(THOUGHT_AND_CALLS, 9), deltas(plain, 4))
        for index, d in enumerate(pair)
        if d is not None
    ]
    answers = [Answer(), Answer()]
    for d in mixed:
        answers[d.index].add(d)
    body = ChatFormat("chatcmpl-1", 1, MODEL, reply=QWEN3_REPLY, n=2).response(answers)
    assert_schema(body, "CreateChatCompletionResponse")
    ChatCompletion.model_validate(body)
    calling, talking = body["choices"]
    assert (calling["index"], calling["finish_reason"]) == (0, "tool_calls")
    assert len(calling["message"]["tool_calls"]) == 2
    assert (talking["index"], talking["finish_reason"]) == (1, "stop")
    assert talking["message"]["content"] == plain and "tool_calls" not in talking["message"]

    fmt = ChatFormat("chatcmpl-1", 1, MODEL, reply=QWEN3_REPLY, n=2)
    chunks = [c for c in map(fmt.chunk, mixed) if c is not None]
    for chunk in chunks:
        assert_schema(chunk, "CreateChatCompletionStreamResponse")
        ChatCompletionChunk.model_validate(chunk)
    by_choice = [[c for c in chunks if c["choices"][0]["index"] == i] for i in (0, 1)]
    streamed = [added_up(by_choice[0]), added_up(by_choice[1])]
    assert streamed[0]["reasoning_content"] == calling["message"]["reasoning_content"]
    assert [c["arguments"] for c in streamed[0]["tool_calls"]] == [
        c["function"]["arguments"] for c in calling["message"]["tool_calls"]
    ]
    assert streamed[0]["finish_reason"] == "tool_calls"
    assert streamed[1]["content"] == talking["message"]["content"]
    assert (streamed[1]["tool_calls"], streamed[1]["finish_reason"]) == ([], "stop")

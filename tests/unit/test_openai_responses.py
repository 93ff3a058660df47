"""Response and chunk assembly (openai_responses), checked against OpenAI's own OpenAPI
schemas, and the SSE framing."""

from __future__ import annotations

import pytest

from lmd import protocol
from lmd.api.deltas import Answer, Delta, Tally
from lmd.api.openai_responses import (
    SSE_DONE,
    VERY_UNLIKELY_LOGPROB,
    ChatFormat,
    CompletionFormat,
    sse,
)
from tests.openai_spec import assert_schema

MODEL = "SmolLM2-135M-Instruct"

TOP = [["Paris", -0.1, list(b"Paris")], ["Lyon", float("-inf"), list(b"Lyon")]]
LOGPROBS = [{"token": "Paris", "logprob": -0.1, "bytes": list(b"Paris"), "top": TOP}]


def deltas(logprobs: bool = False) -> list[Delta]:
    msgs = [
        protocol.TextDelta(
            ["a", "b"],
            ["Par", "x"],
            [None, None],
            [7, 3],
            [1, 1],
            [None, None],
            [4, 0],
            [0, 0],
            [0, 0],
        ),
        protocol.TextDelta(["a"], ["is"], ["stop"], [7], [2], [None], [4], [0], [0]),
    ]
    out = [d for m in msgs for rid, d in Delta.split(m) if rid == "a"]
    if logprobs:
        out = [Delta(d.text, d.finish_reason, 7, d.completion_tokens, LOGPROBS, 4) for d in out]
    return out


def test_chat_response_matches_openai() -> None:
    answer = Answer()
    for d in deltas():
        answer.add(d)
    body = ChatFormat("chatcmpl-1", 1700000000, MODEL).response([answer])
    assert_schema(body, "CreateChatCompletionResponse")
    assert body["choices"][0]["message"]["content"] == "Paris"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 2,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 4},  # the prefix cache served 4
    }


def test_chat_logprobs_match_openai() -> None:
    answer = Answer()
    for d in deltas(logprobs=True):
        answer.add(d)
    body = ChatFormat("chatcmpl-1", 1, MODEL).response([answer])
    assert_schema(body, "CreateChatCompletionResponse")
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and content[0]["bytes"] == list(b"Paris")
    assert content[0]["top_logprobs"][1]["logprob"] == VERY_UNLIKELY_LOGPROB  # -inf has no JSON


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_chunks_match_openai(include_usage: bool) -> None:
    fmt = ChatFormat("chatcmpl-1", 1, MODEL, include_usage)
    middle = [fmt.chunk(d) for d in deltas(logprobs=True)]
    chunks = [*fmt.first_chunks(), *(c for c in middle if c is not None), fmt.usage_chunk(7, 2, 4)]
    assert len(chunks) == 4
    for chunk in chunks:
        assert_schema(chunk, "CreateChatCompletionStreamResponse")
        assert ("usage" in chunk) == (include_usage or chunk["choices"] == [])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 9
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


@pytest.mark.parametrize("shape", [ChatFormat, CompletionFormat])
@pytest.mark.parametrize("include_usage", [False, True])
def test_sse_chunks_are_the_chunks_encoded(
    shape: type[ChatFormat | CompletionFormat], include_usage: bool
) -> None:
    """The stream's pre-rendered envelope gives exactly the bytes of sse(chunk)."""
    fmt = shape('cmpl-"1\\é', 1700000000, 'model "ü"\n', include_usage)
    check = shape('cmpl-"1\\é', 1700000000, 'model "ü"\n', include_usage)
    samples = [
        *deltas(logprobs=True),
        Delta('日本 😀 "quoted"\n', None, 3, 1, None),
        Delta("", "length", 3, 2, None),
        Delta("", None, 3, 2, None),
    ]
    for delta in samples:
        chunk = check.chunk(delta)
        assert fmt.sse_chunk(delta) == (None if chunk is None else sse(chunk))


def test_empty_delta_makes_no_chunk() -> None:
    empty = Delta("", None, 3, 1, None)  # e.g. a token held back by a partial stop string
    assert ChatFormat("c", 1, MODEL).chunk(empty) is None
    assert CompletionFormat("c", 1, MODEL).chunk(empty) is None
    last = ChatFormat("c", 1, MODEL).chunk(Delta("", "length", 3, 2, None))
    assert last is not None and last["choices"][0]["delta"] == {}


def test_completion_response_and_chunks_match_openai() -> None:
    answer = Answer()
    for d in deltas(logprobs=True):
        answer.add(d)
    body = CompletionFormat("cmpl-1", 1, MODEL).response([answer])
    assert_schema(body, "CreateCompletionResponse")
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Paris", "Paris"] and lp["text_offset"] == [0, 5]
    assert lp["top_logprobs"][0] == {"Paris": -0.1, "Lyon": VERY_UNLIKELY_LOGPROB}
    # The schema is the non-stream body's, where finish_reason and usage are never null:
    # the last chunk of a stream without include_usage is checked against it as is.
    chunks = [CompletionFormat("cmpl-1", 1, MODEL).chunk(d) for d in deltas()]
    assert chunks[0] is not None and chunks[0]["choices"][0]["finish_reason"] is None
    assert chunks[-1] is not None and chunks[-1]["choices"][0]["text"] == "is"
    assert_schema(chunks[-1], "CreateCompletionResponse")
    fmt = CompletionFormat("cmpl-1", 1, MODEL, include_usage=True)
    assert all(c is not None and c["usage"] is None for c in map(fmt.chunk, deltas()))
    assert_schema(fmt.usage_chunk(7, 2, 4), "CreateCompletionResponse")
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def test_sse_framing() -> None:
    assert sse({"a": "é\n"}) == b'data: {"a":"\xc3\xa9\\n"}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


# n > 1: one choice per index --------------------------------------------------------------


def interleaved(n: int, logprobs: bool = False) -> list[Delta]:
    """n choices' deltas as they arrive, mixed: choice i says "c<i>" then "!" and stops
    (the odd ones at max_tokens). Choice 0 computed the 7-token prompt, 4 of it cached;
    the later choices found 6 cached."""
    lps = LOGPROBS if logprobs else None
    firsts = [Delta(f"c{i}", None, 7, 1, lps, 4 if i == 0 else 6, 0, i) for i in range(n)]
    lasts = [
        Delta("!", "length" if i % 2 else "stop", 7, 2, lps, 4 if i == 0 else 6, 0, i)
        for i in reversed(range(n))
    ]
    return firsts + lasts


def answers_of(deltas: list[Delta], n: int) -> list[Answer]:
    answers = [Answer() for _ in range(n)]
    for d in deltas:
        answers[d.index].add(d)
    return answers


def test_a_chat_body_has_each_choice_with_its_index_and_finish() -> None:
    body = ChatFormat("chatcmpl-1", 1, MODEL, n=3).response(answers_of(interleaved(3), 3))
    assert_schema(body, "CreateChatCompletionResponse")
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["message"]["content"] for c in choices] == ["c0!", "c1!", "c2!"]
    assert [c["finish_reason"] for c in choices] == ["stop", "length", "stop"]
    # the prompt counted once, as choice 0 computed it; the tokens of every choice
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 6,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_a_chat_stream_carries_each_choice_s_index() -> None:
    fmt = ChatFormat("chatcmpl-1", 1, MODEL, include_usage=True, n=3)
    tally = Tally(3)
    chunks = [*fmt.first_chunks()]
    for d in interleaved(3):
        tally.add(d)
        chunk = fmt.chunk(d)
        assert chunk is not None and fmt.sse_chunk(d) == sse(chunk)
        chunks.append(chunk)
    chunks.append(
        fmt.usage_chunk(tally.prompt_tokens, tally.completion_tokens, tally.cached_tokens)
    )
    for chunk in chunks:
        assert_schema(chunk, "CreateChatCompletionStreamResponse")
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]  # each one's role
    assert all(c["choices"][0]["delta"]["role"] == "assistant" for c in chunks[:3])
    text = {i: "" for i in range(3)}
    finish: dict[int, str] = {}
    for chunk in chunks[3:-1]:
        (choice,) = chunk["choices"]  # one choice per chunk, as OpenAI streams them
        text[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"] is not None:
            finish[choice["index"]] = choice["finish_reason"]
    assert text == {0: "c0!", 1: "c1!", 2: "c2!"}
    assert finish == {0: "stop", 1: "length", 2: "stop"}
    assert tally.done and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["usage"]["prompt_tokens"] == 7


def test_completion_choices_count_their_text_offsets_apart() -> None:
    fmt = CompletionFormat("cmpl-1", 1, MODEL, n=2)
    body = CompletionFormat("cmpl-1", 1, MODEL, n=2).response(answers_of(interleaved(2, True), 2))
    assert_schema(body, "CreateCompletionResponse")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == ["c0!", "c1!"]
    assert [c["logprobs"]["text_offset"] for c in body["choices"]] == [[0, 5], [0, 5]]
    assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens"] == 7
    offsets: dict[int, list[int]] = {0: [], 1: []}
    for d in interleaved(2, True):
        chunk = fmt.chunk(d)
        assert chunk is not None
        (choice,) = chunk["choices"]
        offsets[choice["index"]] += choice["logprobs"]["text_offset"]
    assert offsets == {0: [0, 5], 1: [0, 5]}  # each choice's own text, streamed too


def test_the_tally_ends_with_the_last_choice() -> None:
    tally = Tally(2)
    firsts = [Delta("a", "stop", 7, 1, None, 0, 0, 1), Delta("b", "stop", 7, 3, None, 64, 0, 0)]
    ended = [tally.add(firsts[0]), tally.done]  # choice 1 finished first: not the end
    assert ended == [False, False]
    assert [tally.add(firsts[1]), tally.done] == [True, True]
    assert (tally.completion_tokens, tally.cached_tokens, tally.cached) == (4, 64, [64, 0])

"""Tool calls read from replies (api/parsers: tool_calls, call_reader, named_call,
json_scan, registry): every format, whole and streamed, split anywhere.

Model outputs are written as the formats' public documentation shows them: Hermes 2 Pro's
model card and Qwen's function-calling guide (<tool_call>), Meta's Llama 3.1 prompt
format page (JSON tool calls, <|python_tag|>), Mistral's v0.3 model card ([TOOL_CALLS]).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from lmd import config
from lmd.api.parsers.json_scan import Step, ValueScanner
from lmd.api.parsers.named_call import NamedCallStream
from lmd.api.parsers.registry import (
    AUTO,
    REASONING_PARSERS,
    TOOL_PARSERS,
    detect_tool_format,
)
from lmd.api.parsers.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    REQUIRED,
    CallStream,
    Syntax,
    ToolStream,
    assemble,
    parse_calls,
)
from tests.qwen3 import assistant_turns, qwen3_template, render

Calls = list[tuple[str, str]]  # (name, arguments) of each call


def new_stream(kind: Syntax | str) -> CallStream:
    return NamedCallStream(kind) if isinstance(kind, str) else ToolStream(kind)


def whole(kind: Syntax | str, text: str) -> tuple[str, Calls]:
    content, calls = parse_calls(new_stream(kind), text)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def streamed(kind: Syntax | str, pieces: list[str]) -> tuple[str, Calls]:
    """The pieces through one stream; every entry checked for OpenAI's stream shape."""
    stream = new_stream(kind)
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    entries = [e for d in deltas for e in d.tool_calls]
    seen: set[int] = set()
    for entry in entries:
        if entry["index"] in seen:  # a later piece: index and arguments only
            assert entry.keys() == {"index", "function"}
            assert entry["function"].keys() == {"arguments"}
        else:  # a call's first entry: id, type and name too
            assert entry["index"] == len(seen)
            assert entry["id"].startswith("call_") and len(entry["id"]) == 29
            assert entry["type"] == "function" and entry["function"]["name"]
            seen.add(entry["index"])
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in assemble(entries)]
    return "".join(d.content for d in deltas), calls


def assert_split_anywhere(kind: Syntax | str, text: str) -> tuple[str, Calls]:
    """Streamed in two pieces at every boundary, one character at a time, and in random
    pieces, the reply adds up to exactly the non-streamed answer."""
    expected = whole(kind, text)
    for cut in range(len(text) + 1):
        assert streamed(kind, [text[:cut], text[cut:]]) == expected, f"split at {cut}"
    assert streamed(kind, list(text)) == expected
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(kind, pieces) == expected
    return expected


PARIS = '{"location": "Paris, France", "format": "celsius"}'
ESCAPED = '{"q": "x\\u00e9 \\"y\\""}'
SF_DATE = '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}'
SCALARS = '{"n": -1.5e+3, "ok": true, "v": null, "l": [[], {}]}'

# (format, reply, content, calls)
REPLIES: list[tuple[Syntax, str, str | None, Calls]] = [
    (  # Qwen2.5 / Qwen3: several calls, text before them
        HERMES,
        "Let me check both.\n\n<tool_call>\n"
        '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}'
        f'\n</tool_call>\n<tool_call>\n{{"name": "get_temperature_date", "arguments": {SF_DATE}}}'
        "\n</tool_call>",
        "Let me check both.",
        [
            ("get_current_temperature", '{"location": "San Francisco, CA, USA"}'),
            ("get_temperature_date", SF_DATE),
        ],
    ),
    (  # Hermes 2 Pro writes the arguments before the name
        HERMES,
        '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n'
        "</tool_call>",
        "",
        [("get_stock_fundamentals", '{"symbol": "TSLA"}')],
    ),
    (  # a function without parameters; text after the call
        HERMES,
        '<tool_call>\n{"name": "get_time"}\n</tool_call>\nOne moment.',
        "One moment.",
        [("get_time", "{}")],
    ),
    (  # arguments as a JSON string: the string's text
        HERMES,
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>',
        "",
        [("f", '{"a": [1, 2]}')],
    ),
    (  # the call's closing brace forgotten before </tool_call>
        HERMES,
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
        "",
        [("f", '{"a": 1}')],
    ),
    (  # Llama 3.1 JSON tool calling
        LLAMA3_JSON,
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
        '"unit": "Fahrenheit"}}',
        "",
        [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')],
    ),
    (  # <|python_tag|> kept (skip_special_tokens false), several calls with `;`
        LLAMA3_JSON,
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        "",
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    (  # Mistral v0.3, the special token kept
        MISTRAL,
        f'[TOOL_CALLS] [{{"name": "get_current_weather", "arguments": {PARIS}}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]',
        "",
        [("get_current_weather", PARIS), ("get_time", '{"tz": "CET"}')],
    ),
    (  # the tokenizer dropped [TOOL_CALLS]: the array opens the reply
        MISTRAL,
        f'[{{"name": "get_current_weather", "arguments": {PARIS}}}]',
        "",
        [("get_current_weather", PARIS)],
    ),
    (  # tool_choice "required" under constrained decoding
        REQUIRED,
        f'[{{"name": "a", "parameters": {ESCAPED}}}, {{"name": "b", "parameters": {SCALARS}}}]',
        "",
        [("a", ESCAPED), ("b", SCALARS)],
    ),
]


@pytest.mark.parametrize(("syntax", "text", "content", "calls"), REPLIES)
def test_documented_replies_whole_and_split_anywhere(
    syntax: Syntax, text: str, content: str, calls: Calls
) -> None:
    assert assert_split_anywhere(syntax, text) == (content, calls)
    for _, arguments in calls:
        json.loads(arguments)


# Not calls, or not valid: the text stays content, exactly, and nothing raises.
NOT_CALLS: list[tuple[Syntax, str]] = [
    (HERMES, "Paris is the capital of France."),
    (HERMES, "<tool_call>\nnot json\n</tool_call> sorry"),
    (HERMES, "<tool_call>\n{'name': 'f', 'arguments': {}}\n</tool_call>"),  # Python, not JSON
    (HERMES, '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'),
    (HERMES, "Tags look like <tool_ and <tool_call but are not."),
    (HERMES, "<tool_call><tool"),
    (LLAMA3_JSON, '{"answer": 42}'),  # JSON, but not a call
    (LLAMA3_JSON, '{"name": "Bob", "age": 3}'),  # a name but no parameters: not a call
    (LLAMA3_JSON, 'The call would be {"name": "f", "parameters": {}}'),  # not at the start
    (LLAMA3_JSON, "<|python_tag|>brave_search.call(query='x')"),  # a built-in tool
    (MISTRAL, "[1, 2, 3] are numbers"),
    (MISTRAL, "[TOOL_CALLS] nothing"),
    (REQUIRED, "no array"),
]


@pytest.mark.parametrize(("syntax", "text"), NOT_CALLS)
def test_text_that_is_no_call_stays_content_exactly(syntax: Syntax, text: str) -> None:
    assert assert_split_anywhere(syntax, text) == (text, [])


def test_a_marker_split_across_deltas_is_held_then_read_or_released() -> None:
    stream = ToolStream(HERMES)
    assert stream.feed("Checking <tool_").content == "Checking"  # the rest may be a marker
    first = stream.feed('call>\n{"name": "f", "arguments": {"a"')
    assert first.content == ""
    assert first.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a"'}
    rest = stream.feed(": 1}}\n</tool_call>")
    assert rest.tool_calls == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert stream.finish().content == ""

    stream = ToolStream(HERMES)
    assert stream.feed("a <tool_").content == "a"
    assert stream.feed("box> b").content == " <tool_box> b"  # not the marker after all
    stream = ToolStream(HERMES)
    assert stream.feed("ends with <tool_").content == "ends with"
    assert stream.finish().content == " <tool_"  # released when the stream ends


def test_a_call_cut_short_keeps_what_was_written_and_loses_nothing() -> None:
    """max_tokens inside the arguments: the call stands with them cut, as OpenAI's do;
    before the arguments began, what was written is content."""
    cut = '<tool_call>\n{"name": "f", "arguments": {"city": "Par'
    assert assert_split_anywhere(HERMES, cut) == ("", [("f", '{"city": "Par')])
    early = 'Sure.\n<tool_call>\n{"name": "f", "argu'
    assert assert_split_anywhere(HERMES, early) == (early, [])


def test_random_and_broken_replies_never_raise_and_split_alike() -> None:
    rng = random.Random(20)
    texts = [t for _, t, _, _ in REPLIES] + [t for _, t in NOT_CALLS]
    alphabet = '{}[]",:; \n<>/_abcnrtu\\0123.-e'
    for _ in range(150):
        base = rng.choice(texts)
        cut = base[: rng.randrange(len(base) + 1)]
        noise = "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
        text = cut + noise if rng.random() < 0.5 else noise + cut
        for syntax in (HERMES, LLAMA3_JSON, MISTRAL, REQUIRED):
            expected = whole(syntax, text)
            cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            assert streamed(syntax, pieces) == expected


def test_a_named_tool_choice_reads_the_reply_as_the_arguments() -> None:
    args = '{"city": "Paris", "days": [1, 2]}'
    assert assert_split_anywhere("get_weather", f"  {args}\n") == ("", [("get_weather", args)])
    assert whole("get_weather", "") == ("", [])  # nothing written: no call
    stream = NamedCallStream("f")
    head = stream.feed('{"a"')
    assert head.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert stream.feed(": 1} ").tool_calls == [{"index": 0, "function": {"arguments": ": 1}"}}]


def test_call_ids_are_openai_shaped_and_unique() -> None:
    _, calls = parse_calls(ToolStream(REQUIRED), '[{"name": "a"}, {"name": "b"}]')
    ids = [c["id"] for c in calls]
    assert len(set(ids)) == 2 and all(i[5:].isalnum() and len(i) == 29 for i in ids)


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ('{"a": [1, -0.5e10, true, false, null, "x\\u00e9\\n"], "b": {}}', True),
        ("[]", True),
        ('"\\ud83d\\ude00"', True),
        ("{'a': 1}", False),
        ('{"a": 01}', False),
        ('{"a": 1,}', False),
        ('{"a" 1}', False),
        ('"tab\there"', False),  # a raw control character inside a string
        ("[1 2]", False),
        ("nul", False),
    ],
)
def test_the_json_scanner_agrees_with_json_loads(text: str, valid: bool) -> None:
    scanner = ValueScanner()
    steps = [scanner.feed(ch) for ch in text]
    ok = Step.ERROR not in steps and (scanner.done or scanner.finish())
    assert ok == valid
    if valid:
        json.loads(text)


def test_a_number_ends_on_the_character_after_it() -> None:
    scanner = ValueScanner()
    assert [scanner.feed(ch) for ch in "12"] == [Step.MORE, Step.MORE]
    assert scanner.feed(" ") is Step.BEFORE


@pytest.mark.parametrize(
    ("template", "name"),
    [
        ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ("{%- if message.role == 'ipython' %}", "llama3_json"),
        ("{{ '<|im_start|>' + message.role }}", "hermes"),  # names none: hermes
    ],
)
def test_the_tool_format_is_read_from_the_chat_template(template: str, name: str) -> None:
    assert detect_tool_format(template)[0].name == name


def test_qwen3s_template_asks_for_hermes() -> None:
    assert detect_tool_format(qwen3_template())[0] is HERMES


def test_the_registry_has_the_configs_names() -> None:
    assert (AUTO, *TOOL_PARSERS) == config.TOOL_CALL_PARSERS
    assert tuple(REASONING_PARSERS) == config.REASONING_PARSERS


def test_argument_pieces_are_the_models_text_verbatim() -> None:
    """Spacing, key order and escapes are the model's: the arguments are what it wrote."""
    args = '{ "b" :2,"a":"\\u0041\\/" }'
    text = f'<tool_call>{{"name":"f","arguments":{args}}}</tool_call>'
    assert whole(HERMES, text) == ("", [("f", args)])


def stream_entries(syntax: Syntax, pieces: list[str]) -> list[dict[str, Any]]:
    stream = ToolStream(syntax)
    return [e for p in pieces for e in stream.feed(p).tool_calls] + stream.finish().tool_calls


def test_a_stream_sends_arguments_as_they_come() -> None:
    pieces = ["[TOOL_CALLS] [", '{"name": "f", "arg', 'uments": {"x', '": 1}}, {"name"', ': "g"}]']
    entries = stream_entries(MISTRAL, pieces)
    assert [e["function"].get("name") for e in entries] == ["f", None, "g"]
    assert [e["function"]["arguments"] for e in entries] == ['{"x', '": 1}', "{}"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize("content", ["", "Let me check both cities."])
def test_qwen3s_template_round_trip(content: str) -> None:
    """What Qwen3's template writes for an assistant's calls (what the model learned to
    write) parses back into those calls, streamed or not; sent back in the next turn
    with the tool results, the parsed message renders the same prompt."""
    arguments = ['{"city": "Paris"}', '{"city": "Lyon", "unit": "C"}']
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": a}}
        for i, a in enumerate(arguments)
    ]
    chat: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "content": content, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_1", "content": "20C"},
    ]
    prompt = render(chat, tools=[WEATHER_TOOL], add_generation_prompt=True)
    (reply,) = assistant_turns(prompt)
    parsed = assert_split_anywhere(HERMES, reply)
    assert parsed == (content, [("get_weather", a) for a in arguments])

    got_content, got_calls = parse_calls(ToolStream(HERMES), reply)
    again = [*chat[:1], {"role": "assistant", "content": got_content, "tool_calls": got_calls}]
    assert render([*again, *chat[2:]], tools=[WEATHER_TOOL], add_generation_prompt=True) == prompt

"""The hostile requests of test_hostile_http.py, as data: each route's valid body and the
ways to break it (bodies, media types, field types, huge, negative and n-abusing numbers,
values that overflowed the engine), each with the 4xx it must get."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MODEL = "SmolLM2-135M-Instruct"
CHAT, COMPLETIONS, INTERACTIVE = "/v1/chat/completions", "/v1/completions", "/v1/chat/interactive"
ROUTES = (CHAT, COMPLETIONS, INTERACTIVE)
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
OPENAI = (CHAT, COMPLETIONS)  # the fields the two OpenAI routes share
VALID: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    INTERACTIVE: {"prompt": "hi", "max_tokens": 4},
}
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class Hostile:
    """One request and the 4xx it must get."""

    id: str
    route: str
    body: bytes
    status: int = 400
    param: str | None = None  # the field the error must name
    headers: tuple[tuple[str, str], ...] = tuple(JSON.items())


def encoded(route: str, **fields: Any) -> bytes:
    # json, not orjson: it writes integers past 64 bits
    return json.dumps({**VALID[route], **fields}).encode()


def replaced(route: str, old: bytes, new: bytes) -> bytes:
    """The valid body with its text `"hi"` spliced: bytes JSON encoders would not make."""
    body = encoded(route)
    assert old in body
    return body.replace(old, new)


NAME = {CHAT: "chat", COMPLETIONS: "completions", INTERACTIVE: "interactive"}


def on(
    routes: tuple[str, ...], kind: str, field: str, *values: Any, param: str = ""
) -> list[Hostile]:
    """`field` set to each value on each route; the error must name `param` (default the field)."""
    return [
        Hostile(
            f"{NAME[r]}-{kind}-{field}={_show(v)}", r, encoded(r, **{field: v}), 400, param or field
        )
        for r in routes
        for v in values
    ]


def _show(value: Any) -> str:
    text = json.dumps(value, separators=(",", ":"))
    return text if len(text) <= 48 else text[:45] + "..."


def body_cases() -> list[Hostile]:
    cases = []
    for r in ROUTES:
        valid = encoded(r)
        raw = {
            "garbage": b"\x00\xff\xfe\x80garbage\x1b[0m\xc0\xaf",
            "truncated": valid[: len(valid) // 2],
            "empty": b"",
            "blank": b" \r\n\t ",
            "utf8-outside-strings": b'{"model": \xff\xfe}',
            "utf8-in-a-string": replaced(r, b'"hi"', b'"h\xc3\x28\xff\xfei"'),
            "lone-surrogate": replaced(r, b'"hi"', b'"h\\ud800i"'),
            "nan": valid[:-1] + b', "temperature": NaN}',
            "infinity": valid[:-1] + b', "temperature": Infinity}',
            "minus-infinity": valid[:-1] + b', "temperature": -Infinity}',
            "1e999": valid[:-1] + b', "temperature": 1e999}',
            "deep-arrays": b"[" * 30_000 + b"]" * 30_000,
            "deep-objects": b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
            "deep-in-a-field": valid[:-1] + b', "stop": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
            "array": b"[1, 2]",
            "null": b"null",
            "string": b'"hi"',
            "number": b"42",
            "true": b"true",
        }
        cases += [Hostile(f"{NAME[r]}-body-{k}", r, v) for k, v in raw.items()]
        for media in ("text/plain", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x", "application/xml"):  # fmt: skip
            headers = (("content-type", media),)
            cases.append(
                Hostile(f"{NAME[r]}-media-{media.split(';')[0]}", r, valid, 415, None, headers)
            )
    return cases


def type_cases() -> list[Hostile]:
    t = "type"
    return [
        *on(OPENAI, t, "model", 5, None, ["m"]),
        *on(ROUTES, t, "max_tokens", "16", 1.5, True, [1], {}),
        *on(ROUTES, t, "temperature", [0.5], "0.5", {}, True),
        *on(ROUTES, t, "top_p", "1", [1]),
        *on(ROUTES, t, "top_k", 1.5, "5"),
        *on(ROUTES, t, "min_p", []),
        *on(ROUTES, t, "repetition_penalty", "1.1"),
        *on(ROUTES, t, "seed", "7", 1.5),
        *on(ROUTES, t, "stop", {"a": 1}, 5),
        *on(ROUTES, t, "stop", [1], param="stop.0"),
        *on(OPENAI, t, "stop_token_ids", "2", {}),
        *on(OPENAI, t, "stop_token_ids", [1.5], param="stop_token_ids.0"),
        *on(OPENAI, t, "n", "1", 1.0, [1]),
        *on(ROUTES, t, "ignore_eos", "false", 0),
        *on(ROUTES, t, "stream", "yes", 1),
        *on(OPENAI, t, "stream_options", [], "usage"),
        *on(
            OPENAI,
            t,
            "stream_options",
            {"include_usage": "yes"},
            param="stream_options.include_usage",
        ),
        *on(OPENAI, t, "min_tokens", "1"),
        *on(ROUTES, t, "skip_special_tokens", "no"),
        # chat
        *on((CHAT,), t, "messages", "hi", {}, 5, None, []),
        *on((CHAT,), t, "messages", ["hi"], [5], param="messages.0"),
        *on(
            (CHAT,),
            t,
            "messages",
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": {"text": "hi"}}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            param="messages.0.content",
        ),
        *on(
            (CHAT,),
            t,
            "messages",
            [{"role": "wizard", "content": "hi"}],
            [{"content": "hi"}],
            [{"role": 1, "content": "hi"}],
            param="messages.0.role",
        ),
        *on((CHAT,), t, "logprobs", "yes", 1),
        *on((CHAT,), t, "max_completion_tokens", "5"),
        *on(OPENAI, t, "response_format", "json"),
        *on(OPENAI, t, "response_format", {"type": "xml"}, param="response_format.type"),
        *on(OPENAI, t, "guided_json", 5, "{oops", "[1]"),
        *on(OPENAI, t, "guided_choice", "yes", []),
        *on((CHAT,), t, "tools", {"type": "function"}, "f"),
        *on((CHAT,), t, "tools", [{"type": "function"}], param="tools.0.function"),
        *on((CHAT,), t, "tool_choice", "always", "required"),
        *on((CHAT,), t, "tool_choice", {"type": "function"}, param="tool_choice.function"),
        *on((CHAT,), t, "chat_template_kwargs", [], "x", {"tokenize": True}),
        *on((CHAT,), t, "functions", [{"name": "f"}]),
        # completions
        *on(
            (COMPLETIONS,),
            t,
            "prompt",
            5,
            {},
            None,
            [],
            "",
            [-1],
            [1.5],
            [2**31],
            ["a", "b"],
            [[1], [2]],
            [True],
        ),
        *on((COMPLETIONS,), t, "logprobs", "3", True),
        *on((COMPLETIONS,), t, "echo", True),
        *on((COMPLETIONS,), t, "suffix", "x"),
        *on((COMPLETIONS,), t, "best_of", "1"),
        # interactive
        *on((INTERACTIVE,), t, "prompt", 5, {}, None),
        *on((INTERACTIVE,), t, "prompt", [5], param="prompt.0"),
        *on(
            (INTERACTIVE,),
            t,
            "prompt",
            [{"role": "wizard", "content": "hi"}],
            param="prompt.0.role",
        ),
        *on((INTERACTIVE,), t, "session_id", "1", 1.5),
        *on((INTERACTIVE,), t, "interactive_mode", "yes"),
        *on((INTERACTIVE,), t, "cancel", "yes"),
        *on((INTERACTIVE,), t, "request_output_len", "5"),
        *on((INTERACTIVE,), t, "image_url", "http://example.com/cat.png"),
        *on((INTERACTIVE,), t, "adapter_name", "lora"),
        # /tokenize and /detokenize
        *(
            Hostile(f"{route[1:]}-type-{name}", route, json.dumps(body).encode(), 400, param)
            for route, name, body, param in (
                (TOKENIZE, "prompt-and-messages", {"prompt": "a", "messages": []}, "messages"),
                (TOKENIZE, "neither", {"model": MODEL}, None),
                (TOKENIZE, "prompt", {"prompt": 5}, "prompt"),
                (TOKENIZE, "tools-without-messages", {"prompt": "a", "tools": []}, None),
                (DETOKENIZE, "tokens", {"tokens": "1 2"}, "tokens"),
                (DETOKENIZE, "negative-token", {"tokens": [1, -1]}, "tokens.1"),
                (DETOKENIZE, "token-past-the-vocabulary", {"tokens": [2**31 - 1]}, None),
            )
        ),
        Hostile(
            "tokenize-type-model", TOKENIZE, b'{"model": "gpt-4", "prompt": "a"}', 404, "model"
        ),
        # constraints xgrammar cannot compile (the api checks them before admission)
        *on(OPENAI, t, "guided_regex", "(unclosed"),
        *on(OPENAI, t, "guided_grammar", "root ::= "),
        *on(
            OPENAI,
            t,
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}},
            param="response_format.json_schema.schema",
        ),
        # cross-field rules: no single field to name
        Hostile(
            "interactive-type-interactive_mode-without-session",
            INTERACTIVE,
            encoded(INTERACTIVE, interactive_mode=True),
        ),
        Hostile(
            "interactive-type-cancel-without-session",
            INTERACTIVE,
            encoded(INTERACTIVE, cancel=True),
        ),
        Hostile(
            "chat-type-top_logprobs-without-logprobs",
            CHAT,
            encoded(CHAT, top_logprobs=2),
            400,
            "top_logprobs",
        ),
    ]


def number_cases() -> list[Hostile]:
    huge, n, neg, engine = "huge", "n", "negative", "engine"
    return [
        *on(ROUTES, huge, "max_tokens", 10**12, 2**31, 2**63, 2**64, 10**30),
        *on(ROUTES, huge, "seed", 2**63, 2**64, -(2**63) - 1, 10**30),
        *on(ROUTES, huge, "top_k", 2**40),
        *on(ROUTES, huge, "temperature", 2.001, 5, 100),  # OpenAI's range is 0 to 2
        *on(OPENAI, huge, "min_tokens", 10**12),
        *on(OPENAI, huge, "stop_token_ids", [2**40], param="stop_token_ids.0"),
        *on((CHAT,), huge, "max_completion_tokens", 2**64),
        *on((CHAT,), huge, "top_logprobs", 10**6, 2**64, param="top_logprobs"),
        *on((COMPLETIONS,), huge, "logprobs", 10**6),
        *on((INTERACTIVE,), huge, "request_output_len", 10**12),
        *on((INTERACTIVE,), huge, "min_new_tokens", 10**12),
        *on((INTERACTIVE,), huge, "session_id", 2**63, 2**64),
        *on(OPENAI, n, "n", 0, -1, 17, 10**6, 2**64),
        *on((COMPLETIONS,), n, "best_of", 0, 10**6),
        *on(ROUTES, neg, "max_tokens", -1, 0),
        *on(ROUTES, neg, "temperature", -1, -1e-9),
        *on(ROUTES, neg, "top_p", 2, 0, -0.5),
        *on(ROUTES, neg, "top_k", -5, -(2**63)),
        *on(ROUTES, neg, "min_p", -0.1, 1.5),
        *on(ROUTES, neg, "repetition_penalty", 0, -1),
        *on(OPENAI, neg, "min_tokens", -1),
        *on(OPENAI, neg, "presence_penalty", -3),
        *on(OPENAI, neg, "frequency_penalty", 5),
        *on(OPENAI, neg, "stop_token_ids", [-1], param="stop_token_ids.0"),
        *on((COMPLETIONS,), neg, "logprobs", -1),
        *on((INTERACTIVE,), neg, "session_id", -2),
        *on((INTERACTIVE,), neg, "request_output_len", -1),
        *on((INTERACTIVE,), neg, "min_new_tokens", -1),
        # Past float32: a logit scaled by these overflows, the softmax is NaN and the
        # engine's step fails (the worker exited and took every request it held).
        *on(ROUTES, engine, "repetition_penalty", 1e39, 1e308, 1e-39, 5e-324),
        *on(ROUTES, engine, "temperature", 1e39, 1e308),
        Hostile(
            "chat-engine-top_logprobs-with-logprobs",
            CHAT,
            encoded(CHAT, logprobs=True, top_logprobs=21),
            400,
            "top_logprobs",
        ),
    ]


CASES = body_cases() + type_cases() + number_cases()

"""OpenAI request validation and mapping (openai_schema), and its error bodies checked
against OpenAI's own OpenAPI schemas."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from pydantic import ValidationError

from lmd import protocol
from lmd.api.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest
from lmd.engine.sequence import SamplingParams
from tests.openai_spec import assert_schema

MODEL = "SmolLM2-135M-Instruct"


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"model": MODEL, **fields}))


def error_of(make: Any, **fields: Any) -> ApiError:
    with pytest.raises(ValidationError) as exc:
        make(**fields)
    err = ApiError.from_validation(exc.value)
    assert err.status == 400 and err.type == "invalid_request_error"
    assert set(err.body["error"]) == {"message", "type", "param", "code"}
    return err


# Requests ------------------------------------------------------------------------------


def test_chat_defaults_map_to_engine_defaults() -> None:
    req = chat()
    sampling = req.sampling()
    assert "max_tokens" not in sampling  # absent: the engine side picks the limit
    assert sampling["temperature"] == 1.0 and sampling["logprobs"] is None
    SamplingParams(**sampling)  # what the engine will build from it
    assert not req.stream and not req.include_usage


def test_every_sampling_field_maps() -> None:
    req = chat(
        temperature=0, top_p=0.9, top_k=-1, min_p=0.05, repetition_penalty=1.2, seed=-5,
        max_tokens=100, max_completion_tokens=20, min_tokens=3, stop_token_ids=[2, 7],
        ignore_eos=True, logprobs=True, top_logprobs=4, presence_penalty=0.5, n=1,
        frequency_penalty=-0.5, logit_bias={"9": -100},
    )  # fmt: skip
    assert req.sampling() == {
        "temperature": 0.0, "top_p": 0.9, "top_k": 0, "min_p": 0.05, "repetition_penalty": 1.2,
        "seed": -5, "max_tokens": 20, "min_new_tokens": 3, "stop_token_ids": [2, 7],
        "ignore_eos": True, "logprobs": 4, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "logit_bias": [[9, -100]], "bad_words": [],
    }  # fmt: skip
    SamplingParams(**req.sampling())
    assert chat(logprobs=True).sampling()["logprobs"] == 0


def test_chat_text_request() -> None:
    req = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "you"}],
            },
            {"role": "assistant", "content": None},
        ],
        stop="END",
        skip_special_tokens=False,
        stream=True,
        stream_options={"include_usage": True},
    )
    msg = req.text_request("chatcmpl-1", "api-0")
    assert msg.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello you"},
        {"role": "assistant", "content": ""},
    ]
    assert msg.stop == ["END"] and msg.skip_special_tokens is False and msg.prompt_ids == b""
    assert req.include_usage
    assert protocol.decode(protocol.encode(msg)) == msg  # passes the wire checks


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [
        ("Once upon", "Once upon", None),
        (["Once upon"], "Once upon", None),
        ([5, 6, 7], None, [5, 6, 7]),
        ([[5, 6]], None, [5, 6]),
    ],
)
def test_completion_prompt_forms(prompt: Any, text: str | None, ids: list[int] | None) -> None:
    msg = completion(prompt=prompt).text_request("cmpl-1", "api-0")
    assert msg.prompt == text and msg.messages is None
    assert (protocol.unpack_ids(msg.prompt_ids) if ids else msg.prompt_ids) == (ids or b"")
    assert protocol.decode(protocol.encode(msg)) == msg
    assert msg.sampling["max_tokens"] == 16  # OpenAI's completions default


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"temperature": "1"}, "temperature", "valid number"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"top_k": -2}, "top_k", ""),
        ({"min_p": 2}, "min_p", ""),
        ({"repetition_penalty": 0}, "repetition_penalty", ""),
        ({"max_tokens": 0}, "max_tokens", ""),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens", "valid integer"),
        ({"seed": True}, "seed", "valid integer"),
        ({"n": 17}, "n", "less than or equal to 16"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"presence_penalty": -2.1}, "presence_penalty", "greater than or equal to -2"),
        ({"frequency_penalty": 3}, "frequency_penalty", "less than or equal to 2"),
        ({"logit_bias": {"x": -100}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias", "[-100, 100]"),
        ({"bad_words": "foo"}, "bad_words", "valid array"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
        ({"stop": ["a"] * 17}, "stop", "at most 16"),
        ({"stop": [""]}, "stop", "empty"),
        ({"stop": 5}, "stop", ""),
        ({"stream": 1}, "stream", "valid boolean"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", ""),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
        ({"functions": [{"name": "f"}]}, "functions", "use tools"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", ""),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
            "only text",
        ),
        ({"model": 3}, "model", "valid string"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0", ""),
        # past what travels inside lmd (int32 counts, int64 JSON) or what float32 sampling
        # survives: a 400 here, not a 500 from the encoder or a failed engine step
        ({"max_tokens": 2**31}, "max_tokens", "less than 2147483648"),
        ({"max_tokens": 2**64}, "max_tokens", "less than 2147483648"),
        ({"max_completion_tokens": 10**30}, "max_completion_tokens", "less than"),
        ({"min_tokens": 10**12}, "min_tokens", "less than"),
        ({"top_k": 2**40}, "top_k", "less than"),
        ({"seed": 2**63}, "seed", "less than 9223372036854775808"),
        ({"seed": -(2**63) - 1}, "seed", "greater than or equal to -9223372036854775808"),
        ({"temperature": 1e308}, "temperature", "less than or equal to 2"),
        # OpenAI's range is 0 to 2 (issue 19: 5 was accepted)
        ({"temperature": 5}, "temperature", "less than or equal to 2"),
        ({"temperature": 2.000001}, "temperature", "less than or equal to 2"),
        ({"repetition_penalty": 1e39}, "repetition_penalty", "less than or equal to 10000"),
        ({"repetition_penalty": 1e-39}, "repetition_penalty", "greater than or equal to 0.0001"),
    ],
)
def test_chat_errors_name_the_field(fields: dict[str, Any], param: str, says: str) -> None:
    err = error_of(chat, **fields)
    assert err.param == param
    assert err.message.startswith(f"{param}: ") and says in err.message


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"prompt": ["a", "b"]}, "prompt", "one request per prompt"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [1, -2]}, "prompt", "-2 at position 1"),
        ({"prompt": [1, "a"]}, "prompt", "'a' at position 1"),
        ({"prompt": {"text": "a"}}, "prompt", "a string or a list of token ids"),
        ({"prompt": "x", "logprobs": 6}, "logprobs", "less than or equal to 5"),
        ({"prompt": "x", "echo": True}, "echo", "not supported"),
        ({"prompt": "x", "best_of": 2}, "best_of", "equal to n (1)"),
        ({"prompt": "x", "n": 3, "best_of": 4}, "best_of", "equal to n (3)"),
        ({"prompt": "x", "suffix": "end"}, "suffix", "not supported"),
        ({}, "prompt", "required"),
    ],
)
def test_completion_errors_name_the_field(fields: dict[str, Any], param: str, says: str) -> None:
    err = error_of(completion, **fields)
    assert err.param == param and says in err.message


def test_a_union_field_reports_the_type_the_client_meant() -> None:
    # messages in an interactive prompt (str | list of messages): the bad role, not "should
    # be a valid string"
    from lmd.api.interactive import InteractiveRequest

    with pytest.raises(ValidationError) as exc:
        InteractiveRequest.model_validate_json(b'{"prompt": [{"role": "wizard"}]}')
    assert ApiError.from_validation(exc.value).param == "prompt.0.role"


def test_edges_of_the_integer_ranges_are_accepted() -> None:
    req = chat(max_tokens=2**31 - 1, seed=-(2**63), top_k=2**31 - 1, temperature=1e-39)
    sent = protocol.decode(protocol.encode(req.text_request("c", "api-0")))  # the wire takes it
    assert isinstance(sent, protocol.TextRequest) and sent.sampling["seed"] == -(2**63)
    assert SamplingParams(**req.sampling()).is_greedy  # a temperature this small is greedy


def test_n_choices_go_to_the_tokenizer() -> None:
    """n up to protocol.MAX_CHOICES reaches the tokenizer; best_of only as n itself."""
    assert chat().text_request("c", "api-0").n == 1
    sent = chat(n=protocol.MAX_CHOICES).text_request("c", "api-0")
    assert protocol.decode(protocol.encode(sent)) == sent and sent.n == 16
    req = completion(prompt="x", n=3, best_of=3)
    assert req.num_choices == 3 and req.text_request("c", "api-0").n == 3


def test_unknown_fields_are_ignored() -> None:
    req = chat(user="u1", metadata={"a": "b"}, parallel_tool_calls=False, service_tier="auto")
    assert req.sampling() == chat().sampling()


def test_unknown_top_level_fields_are_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """OpenAI's policy (ignore them), with their names in the debug log (issue 19)."""
    from lmd.api.interactive import InteractiveRequest

    with caplog.at_level(logging.DEBUG, logger="lmd.api.openai_schema"):
        chat(frobnicate=1, user="u1", stream_options={"include_usage": True, "nested": 1})
        completion(prompt="x", zzz=None)
        InteractiveRequest.model_validate_json(b'{"prompt": "x", "wat": 1}')
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert said == [
        "ChatCompletionRequest: ignoring unknown fields frobnicate, user",  # top level only
        "CompletionRequest: ignoring unknown fields zzz",
        "InteractiveRequest: ignoring unknown fields wat",
    ]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="lmd.api.openai_schema"):
        chat(temperature=2, max_tokens=3)  # known fields only, and 2 is in range
    assert not caplog.records


@pytest.mark.parametrize(
    ("body", "says"),
    [(b"{oops", "not valid JSON"), (b"[1]", "must be a JSON object"), (b"", "not valid JSON")],
)
def test_body_that_is_not_an_object(body: bytes, says: str) -> None:
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate_json(body)
    err = ApiError.from_validation(exc.value)
    assert says in err.message and err.param is None


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("invalid_request_error", 400),
        ("overloaded", 503),
        ("service_unavailable", 503),
        ("internal_error", 500),
        ("something_new", 500),
    ],
)
def test_request_errors_map_to_http(code: str, status: int) -> None:
    err = ApiError.from_request_error(protocol.RequestError("r1", code, "the prompt is too long"))
    assert err.status == status and err.type == code
    assert ("Retry-After" in err.headers) == (status == 503)


def test_error_bodies_match_openai() -> None:
    assert_schema(error_of(chat, temperature=-1).body, "ErrorResponse")
    assert_schema(ApiError(404, "no such model", code="model_not_found").body, "ErrorResponse")
    lost = protocol.RequestError("r", "service_unavailable", "the tokenizer restarted")
    assert_schema(ApiError.from_request_error(lost).body, "ErrorResponse")

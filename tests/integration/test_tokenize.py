"""/tokenize, /detokenize and chat requests with tools against one real daemon
(disaggregated, model-less engines, SmolLM2's tokenizer) served with a Jinja
--chat-template that renders the tools; and a template that does not parse stopping lmdd
at once."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from lmd.engine.model_source import resolve_model
from tests.integration.daemon import DISAGGREGATED, Daemon, served
from tests.unit.test_chat_template_tools import JINJA
from tests.unit.test_openai_tools import ROUND_TRIP, TIME, WEATHER

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-lmd-tokenize"
SESSION_LEN = 512
QUESTION = ROUND_TRIP[:1]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(JINJA)
    yield from served(Daemon(
        *DISAGGREGATED, "--session-len", str(SESSION_LEN), "--chat-template", str(template),
        "--api-keys", KEY, "--heartbeat-timeout", "10",
    ))  # fmt: skip


@pytest.fixture(scope="module")
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{daemon.url}/v1", api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(resolve_model(None).path / "tokenizer.json"))


def post(http: httpx.Client, path: str, **body: Any) -> Any:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_a_prompt(http: httpx.Client, tokenizer: Tokenizer) -> None:
    answer = post(http, "/tokenize", model=MODEL, prompt="The capital of France")
    ids = tokenizer.encode("The capital of France").ids
    assert answer == {"count": len(ids), "max_model_len": SESSION_LEN, "tokens": ids}
    with_strs = post(http, "/tokenize", prompt="Hello world", return_token_strs=True)
    assert with_strs["token_strs"] == ["Hello", "Ġworld"]  # `model` may be left out


def test_tokenize_a_chat_as_the_template_renders_it(http: httpx.Client) -> None:
    answer = post(
        http,
        "/tokenize",
        model=MODEL,
        messages=QUESTION,
        tools=[WEATHER, TIME],
        chat_template_kwargs={"greeting": "bot"},
    )
    text = post(http, "/detokenize", model=MODEL, tokens=answer["tokens"])["prompt"]
    assert text == "TOOLS:get_weather;get-time_2;|user: Weather in Paris?\nbot:"
    closed = post(http, "/tokenize", messages=QUESTION, add_generation_prompt=False)
    assert post(http, "/detokenize", tokens=closed["tokens"]) == {
        "prompt": "user: Weather in Paris?\n"
    }


def test_detokenize_refuses_what_it_cannot_decode(http: httpx.Client) -> None:
    r = http.post("/detokenize", json={"model": MODEL, "tokens": [1, 10**9]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = http.post("/tokenize", json={"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert post(http, "/detokenize", tokens=[]) == {"prompt": ""}


def test_tokenize_needs_the_api_key(daemon: Daemon) -> None:
    for path in ("/tokenize", "/detokenize"):
        r = httpx.post(f"{daemon.url}{path}", json={"prompt": "a", "tokens": [1]})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


def create(client: openai.OpenAI, **fields: Any) -> Any:
    """A chat completion of at most 2 tokens (fields unchecked by the SDK's types)."""
    return client.chat.completions.create(model=MODEL, max_tokens=2, **fields)


def test_chat_with_tools_renders_them_into_the_prompt(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    def prompt_tokens(**fields: Any) -> int:
        usage = create(client, messages=QUESTION, **fields).usage
        assert usage is not None
        return int(usage.prompt_tokens)

    plain = prompt_tokens()
    tooled = prompt_tokens(tools=[WEATHER, TIME], tool_choice="auto")
    assert tooled > plain
    assert tooled == post(http, "/tokenize", messages=QUESTION, tools=[WEATHER, TIME])["count"]
    kwargs = {"chat_template_kwargs": {"greeting": "a long greeting from the bot"}}
    assert prompt_tokens(extra_body=kwargs) > plain  # the variable reached the template


def test_a_tool_round_trip_is_accepted_and_rendered(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    usage = create(client, messages=ROUND_TRIP, tools=[WEATHER]).usage
    count = post(http, "/tokenize", messages=ROUND_TRIP, tools=[WEATHER])["count"]
    assert usage is not None and usage.prompt_tokens == count


def test_a_constraint_that_does_not_compile_is_a_400_naming_it(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}
    with pytest.raises(openai.BadRequestError) as info:
        create(client, messages=QUESTION, response_format=bad)
    assert info.value.param == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as info:
        create(
            client, messages=QUESTION, tools=[WEATHER], tool_choice="required",
            extra_body={"guided_regex": "a+"},
        )  # fmt: skip
    assert info.value.param == "tool_choice"


def test_a_template_that_does_not_parse_stops_lmdd_at_once(tmp_path: Path) -> None:
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}")
    runtime = tmp_path / "rt"
    out = subprocess.run(
        [sys.executable, "-m", "lmd", "serve", "--runtime-dir", str(runtime),
         "--chat-template", str(template)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.startswith(f"lmdd: {template}: not a valid Jinja chat template: line 1: ")
    assert out.stderr.count("\n") == 1
    assert not runtime.exists()  # nothing was spawned

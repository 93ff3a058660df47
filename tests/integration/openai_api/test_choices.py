"""OpenAI's `n` through the daemon on SmolLM2, with the official SDK: n = 3 choices whole
and streamed, the prompt computed once (the later choices find its full blocks in the
prefix cache), the seed rule (choice i samples as a request with seed + i), greedy
choices alike, and a streamed n = 3 request whose client leaves freeing everything."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.daemon import Daemon, wait_until
from tests.integration.openai_api.shared_daemon import MODEL, QUESTION, idle

BLOCK_SIZE = 64  # the daemon's default --block-size


def long_prompt() -> str:
    """A prompt of several KV blocks no other request has sent (a fresh prefix)."""
    words = " ".join(f"w{i}" for i in range(120))
    return f"Note {uuid.uuid4().hex}: {words}. Go on:"


def cached_metric(http: httpx.Client) -> float:
    """lmd_prompt_tokens_cached_total: prompt tokens the prefix cache served, per choice."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("lmd_prompt_tokens_cached_total "):
            return float(line.split()[1])
    raise AssertionError("no lmd_prompt_tokens_cached_total in /metrics")


def test_three_choices_share_the_prompt_s_blocks(client: openai.OpenAI, http: httpx.Client) -> None:
    before = cached_metric(http)
    r = client.completions.create(
        model=MODEL, prompt=long_prompt(), n=3, max_tokens=8, temperature=1.0, seed=11, logprobs=0
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.usage is not None and r.usage.prompt_tokens > 2 * BLOCK_SIZE
    tokens = [len(c.logprobs.tokens or []) for c in r.choices if c.logprobs]
    assert len(tokens) == 3 and r.usage.completion_tokens == sum(tokens)  # every choice's
    # Choice 0 computed the fresh prompt; choices 1 and 2 found its full blocks cached.
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    full_blocks = (r.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cached_metric(http) - before == 2 * full_blocks


def test_a_streamed_chat_of_three_choices(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": long_prompt()}]

    def ask(stream: bool) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=messages,
            n=3,
            temperature=1.0,
            seed=3,
            max_tokens=12,
            stream=stream,
            stream_options={"include_usage": True} if stream else None,
        )

    whole = ask(stream=False)
    stream = ask(stream=True)
    chunks = list(stream)
    assert {c.id for c in chunks} == {chunks[0].id}
    texts = {i: "" for i in range(3)}
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # one choice per chunk
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1, 2]
    # seeded: the stream and the whole answer are the same three choices
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_choice_i_samples_as_the_request_with_seed_plus_i(client: openai.OpenAI) -> None:
    def tokens(n: int, seed: int) -> list[list[str]]:
        r = client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            n=n,
            max_tokens=10,
            temperature=1.2,
            seed=seed,
            logprobs=0,
        )
        return [c.logprobs.tokens or [] if c.logprobs else [] for c in r.choices]

    # Only the first tokens are compared: later ones come from decode steps whose batches
    # differ (one choice alone, or three together, joining at moments that vary from run
    # to run), and SmolLM2's logits on the CPU differ in their last bits with the batch,
    # which can tip a draw near a boundary (docs/architecture.md, "Sampler").
    three = tokens(3, 100)
    assert [t[0] for t in three] == [t[0] for t in tokens(3, 100)]  # reproducible
    assert len({"".join(t) for t in three}) > 1  # independent samples
    # Choice i draws the numbers of the request with seed 100 + i.
    alone = [tokens(1, 100 + i)[0] for i in range(3)]
    assert [t[0] for t in three] == [t[0] for t in alone]


def test_greedy_choices_are_alike(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=3, temperature=0, max_tokens=16
    )
    assert len({c.message.content for c in r.choices}) == 1
    assert r.choices[0].message.content and "Paris" in r.choices[0].message.content


def test_n_over_the_bound_is_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=QUESTION, n=17)
    assert exc.value.param == "n" and "16" in exc.value.message


def test_a_client_leaving_a_stream_of_three_frees_everything(
    daemon: Daemon, http: httpx.Client
) -> None:
    body = {
        "model": MODEL, "prompt": long_prompt(), "max_tokens": 900, "n": 3,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    seen: set[int] = set()
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        while seen != {0, 1, 2}:  # every choice runs in the engine
            line = next(lines)
            if line.startswith("data: {"):
                seen.add(httpx.Response(200, content=line[6:]).json()["choices"][0]["index"])
        # the choices, each an engine request (inflight comes with the next heartbeat)
        held = lambda: daemon.worker("tokenizer-0")["inflight"] == 3  # noqa: E731
        wait_until(held, 5, "the tokenizer's heartbeat counting three choices")
    wait_until(lambda: idle(daemon), 20, "the aborted choices' blocks freed")

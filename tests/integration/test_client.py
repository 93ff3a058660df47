"""lmd_client.AsyncClient and Client against a real daemon (hybrid mode, SmolLM2)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from lmd_client import AsyncClient, Client, Delta, LmdError
from tests.integration.daemon import Daemon, alive, served, wait_until

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 24}


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    yield from served(Daemon("--mode", "hybrid", "--heartbeat-timeout", "10"))


def idle(daemon: Daemon) -> bool:
    engine, api = daemon.worker("hybrid-0"), daemon.worker("api-0")
    kv = engine["kv"]
    return bool(kv["free_blocks"] == kv["total_blocks"] and api["inflight"] == 0)


async def test_chat_stream_and_completions(daemon: Daemon) -> None:
    async with AsyncClient(daemon.url) as client:
        assert await client.models() == ["SmolLM2-135M-Instruct"]
        assert (await client.health())["status"] == "ok"
        reply = await client.chat(QUESTION, **GREEDY)
        assert "Paris" in reply.text and reply.finish_reason == "stop"
        assert reply.usage.completion_tokens > 0
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
        deltas = [
            d
            async for d in client.stream_chat(
                QUESTION, **GREEDY, stream_options={"include_usage": True}
            )
        ]
        assert "".join(d.text for d in deltas) == reply.text
        assert deltas[-1].usage == reply.usage
        assert [d.finish_reason for d in deltas if d.finish_reason] == ["stop"]
        done = await client.complete("The capital of France is", temperature=0, max_tokens=4)
        assert done.finish_reason == "length" and done.usage.completion_tokens == 4
        pieces = [d.text async for d in client.stream_complete([504, 3575, 282], max_tokens=3)]
        assert len("".join(pieces)) > 0


async def test_errors_raise_with_the_openai_type(daemon: Daemon) -> None:
    async with AsyncClient(daemon.url) as client:
        with pytest.raises(LmdError) as err:
            await client.chat(QUESTION, temperature=-1)
        assert err.value.status == 400 and err.value.type == "invalid_request_error"
        assert "temperature" in err.value.message
    async with AsyncClient("http://127.0.0.1:9", max_retries=1, backoff_s=0.01) as nobody:
        with pytest.raises(LmdError, match="connection_error"):
            await nobody.models()


async def test_cancelling_a_stream_aborts_it_on_the_server(daemon: Daemon) -> None:
    got: list[Delta] = []

    async def consume(client: AsyncClient) -> None:
        async for delta in client.stream_chat(QUESTION, max_tokens=1500, ignore_eos=True):
            got.append(delta)

    async with AsyncClient(daemon.url) as client:
        task = asyncio.create_task(consume(client))
        while len(got) < 3:
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await asyncio.to_thread(wait_until, lambda: idle(daemon), 15, "the request aborted")


async def test_retries_through_an_api_restart(daemon: Daemon) -> None:
    old = daemon.worker("api-0")["pid"]
    daemon.control().post("/v1/workers/api-0/restart")
    # Ask only once the old api is gone: the port refuses until the new one listens.
    await asyncio.to_thread(wait_until, lambda: not alive(old), 15, "old api gone")
    async with AsyncClient(daemon.url, max_retries=20, backoff_s=0.2) as client:
        reply = await client.chat(QUESTION, **GREEDY)
    assert "Paris" in reply.text
    assert daemon.worker("api-0")["pid"] != old


def test_sync_client(daemon: Daemon) -> None:
    with Client(daemon.url) as client:
        reply = client.chat(QUESTION, **GREEDY)
        assert "Paris" in reply.text
        streamed = "".join(d.text for d in client.stream_chat(QUESTION, **GREEDY))
        assert streamed == reply.text
        for i, _ in enumerate(client.stream_complete("Once upon a time", max_tokens=200)):
            if i == 2:
                break  # leaving early closes the stream
    wait_until(lambda: idle(daemon), 15, "the abandoned stream aborted")


async def test_session_keeps_history_and_reuses_its_kv(daemon: Daemon) -> None:
    intro = (
        "Here is some background about me. I live in a small town by the sea, I work as a "
        "carpenter, I like long walks on the beach at sunset, I have two cats called Pepper "
        "and Salt, and my favourite food is fresh bread with butter. My name is Ada."
    )
    client = AsyncClient(daemon.url)
    async with client, client.session(temperature=0, max_tokens=16) as chat:
        first = await chat.send(intro)
        assert first.history_tokens == 0 and first.input_tokens > 64
        second = await chat.send("What is my name?")
        # Turn 2 brings turn 1 (prompt + answer) as history: its full blocks are cached.
        assert second.history_tokens >= first.input_tokens + first.tokens - 1
        assert second.cached_tokens >= 64
        pieces = [t async for t in chat.stream("Thank you!")]
        assert pieces[-1].finish_reason in ("stop", "length")
        assert "".join(t.text for t in pieces)
    wait_until(lambda: idle(daemon), 15, "session turns done")

from __future__ import annotations

from lmd.bench import main
from lmd.bench.ipc import measure_ipc


def test_ipc_benchmark_moves_every_message_between_two_processes() -> None:
    result = measure_ipc(num_messages=2000, num_round_trips=50)
    assert result["messages"] == 2000 and result["round_trips"] == 50
    assert result["messages_per_s"] > 0 and result["message_bytes"] > 100
    assert 0 < result["rtt_us"]["p50"] <= result["rtt_us"]["p99"]


def test_bad_arguments_are_a_usage_error(capsys: object) -> None:
    assert main(["ipc", "--messages", "0"]) == 2


async def test_front_load_counts_every_unit_of_concurrent_workers() -> None:
    import asyncio

    from lmd.bench.front import _drive

    async def one(conn: int) -> int:
        await asyncio.sleep(0.001)  # every worker is suspended here at once
        return 3

    _, latencies, units, failures = await _drive(200, list(range(16)), one)
    assert (units, failures, len(latencies)) == (600, 0, 200)


async def test_front_requests_ask_every_token_they_count() -> None:
    """The front benchmark counts max_tokens a request: an EOS sampled early (the fake
    engine at temperature 1 samples nearly uniformly) must not end one."""
    from collections.abc import AsyncIterator

    import orjson

    from lmd.bench.front import _requester, _streamer

    sent: list[bytes] = []

    class Conn:
        async def send(self, request: bytes) -> bytes:
            sent.append(request)
            return b'{"usage": {"completion_tokens": 1}}'

        async def stream(self, request: bytes) -> AsyncIterator[bytes]:
            sent.append(request)
            yield b'data: {"choices": []}\n\ndata: {"usage":{"completion_tokens": 2}}\n\n'

    assert await _requester(1.0)(Conn()) == 1  # type: ignore[arg-type]
    assert await _streamer(2, 1.0)(Conn()) == 2  # type: ignore[arg-type]
    for request in sent:
        body = orjson.loads(request.split(b"\r\n\r\n", 1)[1])
        assert body["ignore_eos"] is True

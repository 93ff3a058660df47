"""Hostile HTTP input against one real daemon (disaggregated, model-less engines).

Every hostile request below goes to /v1/chat/completions, /v1/completions and, where the
field exists, /v1/chat/interactive, and must be answered with a 4xx whose body is exactly
an OpenAI error object ({"error": {"message", "type", "param", "code"}}, `param` naming
the field when one is to blame):
  bodies      garbage bytes, truncated JSON, empty and blank bodies, invalid UTF-8 (in the
              body and inside a string), a lone surrogate escape, NaN / Infinity / 1e999,
              30,000-deep arrays, 10,000-deep objects, an array / null / string / number
              as the body
  media type  text/plain, form, multipart, XML                                   -> 415
  types       a wrong JSON type for every main field of each route
  huge        max_tokens 10**12, 2**63, 2**64, 10**30; seeds past int64; top_k 2**40;
              temperature 2.001, 5, 100 (OpenAI's range is 0 to 2), ...
  n abuse     n 0, -1, 17, 10**6, 2**64; best_of 0, 10**6
  negative    max_tokens -1, temperature -1, top_p 2, top_k -5, min_p 1.5, ...
  engine      past float32: repetition_penalty 1e39, 1e308, 1e-39, 5e-324 (each made the
              prefill worker fail its step and exit), temperature 1e39, 1e308 (inf)
  size        bodies over --max-request-bytes, with and without Content-Length  -> 413
  raw         random bytes, a TLS hello, a 100 KB header, a negative Content-Length on
              the port -> uvicorn's 400
Odd but valid requests (charset parameter, no Content-Type, unknown fields, NUL and emoji,
a temperature of 1e-39, max_tokens 2**31 - 1) are served. After all of it the daemon is
unharmed: /health is ok, requests are served, no worker restarted, no inner message was
dropped, every KV block is free.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.daemon import DISAGGREGATED, Daemon, served, wait_until
from tests.integration.hostile_requests import (
    CASES,
    CHAT,
    COMPLETIONS,
    INTERACTIVE,
    JSON,
    NAME,
    ROUTES,
    VALID,
    Hostile,
    encoded,
    replaced,
)

MAX_BODY = 65536
SESSION_LEN = 256


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    yield from served(Daemon(
        *DISAGGREGATED, "--session-len", str(SESSION_LEN), "--max-request-bytes", str(MAX_BODY),
        "--heartbeat-timeout", "10",
    ))  # fmt: skip


@pytest.fixture(scope="module")
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, timeout=30) as client:
        yield client


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """The response is `status` with exactly OpenAI's error body; returns its `error`."""
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert list(body) == ["error"]
    err: dict[str, Any] = body["error"]
    assert list(err) == ["message", "type", "param", "code"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_request_is_a_4xx_openai_error(http: httpx.Client, case: Hostile) -> None:
    r = http.post(case.route, content=case.body, headers=dict(case.headers))
    err = assert_openai_error(r, case.status, case.param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("route", ROUTES, ids=NAME.values())
def test_bodies_over_the_limit_are_413(http: httpx.Client, route: str) -> None:
    big = encoded(route, stop=["x" * MAX_BODY])
    err = assert_openai_error(http.post(route, content=big, headers=JSON), 413)
    assert err["code"] == "request_too_large" and str(MAX_BODY) in err["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while it streams in
        yield big[:1000]
        yield big[1000:]

    assert_openai_error(http.post(route, content=chunked(), headers=JSON), 413)


@pytest.mark.parametrize("route", ROUTES, ids=NAME.values())
def test_a_prompt_over_the_session_length_is_400(http: httpx.Client, route: str) -> None:
    text = "hello " * 2000  # within the body limit, ~2,000 tokens
    body = {**VALID[route], "messages": [{"role": "user", "content": text}], "prompt": text}
    err = assert_openai_error(http.post(route, json=body), 400)
    assert f"session_len {SESSION_LEN}" in err["message"]


RAW_JUNK = {
    "random-bytes": bytes(range(256)) * 4,
    "tls-client-hello": bytes.fromhex("16030100a5010000a10303") + b"\x00" * 64,
    "huge-header": b"POST /v1/completions HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n",
    "bad-content-length": b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
}


@pytest.mark.parametrize("data", RAW_JUNK.values(), ids=RAW_JUNK.keys())
def test_raw_junk_on_the_port_is_400(daemon: Daemon, data: bytes) -> None:
    """Not HTTP at all: uvicorn's own 400 (plain text: no OpenAI client sends this)."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as s:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            s.sendall(data)
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]


def odd_but_valid() -> list[tuple[str, str, bytes, dict[str, str]]]:
    out = []
    for r in ROUTES:
        n = NAME[r]
        out += [
            (f"{n}-charset", r, encoded(r), {"content-type": "application/json; charset=utf-8"}),
            (f"{n}-no-content-type", r, encoded(r), {}),
            (f"{n}-unknown-fields", r, encoded(r, frobnicate=[1, {"x": None}], user="u"), JSON),
            (f"{n}-nul-and-emoji", r, replaced(r, b'"hi"', b'"h\\u0000i \xf0\x9f\x90\x8d"'), JSON),
            (f"{n}-tiny-temperature", r, encoded(r, temperature=1e-39), JSON),  # greedy
            (f"{n}-seed-int64-edges", r, encoded(r, seed=-(2**63)), JSON),
        ]
    return out


@pytest.mark.parametrize(
    ("route", "body", "headers"),
    [c[1:] for c in odd_but_valid()],
    ids=[c[0] for c in odd_but_valid()],
)
def test_odd_but_valid_requests_are_served(
    http: httpx.Client, route: str, body: bytes, headers: dict[str, str]
) -> None:
    r = http.post(route, content=body, headers=headers)
    assert r.status_code == 200, r.text[:300]
    answer = r.json()
    tokens = answer["tokens"] if route == INTERACTIVE else answer["usage"]["completion_tokens"]
    assert 1 <= tokens <= 4


def test_max_tokens_within_int32_is_capped_by_the_session_length(http: httpx.Client) -> None:
    body = {**VALID[COMPLETIONS], "max_tokens": 2**31 - 1, "ignore_eos": True}
    r = http.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text[:300]
    usage = r.json()["usage"]
    assert usage["total_tokens"] == SESSION_LEN
    assert r.json()["choices"][0]["finish_reason"] == "length"


def assert_unharmed(daemon: Daemon) -> None:
    """Healthy and serving; nothing restarted, dropped or left allocated."""
    assert httpx.get(f"{daemon.url}/health").json() == {"status": "ok"}
    for route in ROUTES:
        r = httpx.post(f"{daemon.url}{route}", json=VALID[route], timeout=30)
        assert r.status_code == 200, r.text[:300]
    with httpx.stream("POST", f"{daemon.url}{CHAT}", json={**VALID[CHAT], "stream": True}) as r:
        assert r.status_code == 200
        assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""]
    engines = ("prefill-0", "decode-0")

    def idle() -> bool:
        workers = {w["name"]: w for w in daemon.status()["workers"]}
        kv_free = all(
            workers[n]["kv"]["free_blocks"] == workers[n]["kv"]["total_blocks"] for n in engines
        )
        return kv_free and not any(w["inflight"] for w in workers.values())

    wait_until(idle, 10, "every KV block free and nothing in flight")
    status = daemon.status()
    assert status["num_dropped"] == 0
    for w in status["workers"]:
        assert (w["state"], w["restarts"], w["num_dropped"]) == ("running", 0, 0), w


def test_the_daemon_is_unharmed(daemon: Daemon) -> None:
    """Runs last: after every hostile request above."""
    assert_unharmed(daemon)

"""Readiness is one truth (issue 18): until every role can serve, /v1/models answers 503
with Retry-After exactly as the completion routes do, and /health names the roles that are
missing. An H100 run answered /v1/models 200 three seconds after start, while the engines
still loaded and completions got 503.

api-0 runs over real HTTP with a fake supervisor and tokenizer (api_stack.py); the cluster
states it is told are the ones the supervisor publishes while the daemon starts.
"""

from __future__ import annotations

from typing import Any

import httpx

from lmd import protocol
from tests.integration.api_stack import MODEL, Stack, assert_error, chat_body


async def answers(stack: Stack) -> dict[str, httpx.Response]:
    """What a client gets from each route that needs the engines, and from /health."""
    return {
        "models": await stack.http.get("/v1/models"),
        "model": await stack.http.get(f"/v1/models/{MODEL}"),
        "chat": await stack.http.post("/v1/chat/completions", json=chat_body()),
        "health": await stack.http.get("/health"),
    }


def assert_unavailable(got: dict[str, httpx.Response], *reason: str) -> dict[str, Any]:
    """Every route 503 with Retry-After and an OpenAI error naming `reason`; /health's body."""
    for route in ("models", "model", "chat"):
        err = assert_error(got[route], 503)
        assert err["type"] == "service_unavailable", (route, err)
        assert int(got[route].headers["retry-after"]) > 0, route
        assert all(word in err["message"] for word in reason), (route, err["message"])
    assert got["health"].status_code == 503
    health: dict[str, Any] = got["health"].json()
    assert all(word in health["reason"] for word in reason), health
    return health


async def test_models_answer_503_until_every_role_runs() -> None:
    stack = Stack()
    await stack.start(running=False)  # api-0 is up; the supervisor has said nothing yet
    try:
        health = assert_unavailable(await answers(stack), "starting")
        assert health["status"] == "starting"

        # Prefill and decode still load their weights (the H100 case): no 200 anywhere.
        await stack.tell(protocol.ClusterState("starting", ["prefill", "decode"]))
        health = assert_unavailable(await answers(stack), "starting", "prefill, decode")
        assert health["missing_roles"] == ["prefill", "decode"]

        await stack.tell(protocol.ClusterState("running", []))
        got = await answers(stack)
        assert got["models"].status_code == 200, got["models"].text
        assert [m["id"] for m in got["models"].json()["data"]] == [MODEL]
        assert got["model"].json()["id"] == MODEL
        assert got["chat"].status_code == 200, got["chat"].text
        assert got["health"].json() == {"status": "ok"}

        # A role lost while running: the model list goes with the completions.
        await stack.tell(protocol.ClusterState("running", ["decode"]))
        health = assert_unavailable(await answers(stack), "decode")
        assert health["status"] == "degraded" and health["missing_roles"] == ["decode"]
    finally:
        await stack.close()


async def test_models_answer_503_while_draining(stack: Stack) -> None:
    await stack.tell(protocol.ClusterState("draining", []))
    health = assert_unavailable(await answers(stack), "draining")
    assert "missing_roles" not in health
    # An unknown model is still a 404: the route's own answer comes before readiness.
    assert assert_error(await stack.http.get("/v1/models/nope"), 404)["code"] == "model_not_found"

"""Requests the daemon refuses, as OpenAI's errors: a bad parameter or an over-long
prompt (400), no or a wrong API key (401), an unknown model (404), draining (503)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.daemon import Daemon, wait_until
from tests.integration.openai_api.shared_daemon import MODEL, QUESTION, SESSION_LEN


def test_bad_parameter_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
    assert exc.value.param == "temperature" and "temperature" in exc.value.message
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, presence_penalty=2.5)


def test_prompt_over_the_session_length_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="word " * (SESSION_LEN + 10), max_tokens=4)
    assert str(SESSION_LEN - 1) in exc.value.message  # says the limit


def test_missing_or_wrong_key_is_401(daemon: Daemon) -> None:
    assert httpx.get(f"{daemon.url}/health").status_code == 200  # exempt
    for key in ("", "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.get(f"{daemon.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with (
        openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="wrong", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.chat.completions.create(model=MODEL, messages=QUESTION)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert exc.value.code == "model_not_found"


def test_drained_is_503_with_retry_after(daemon: Daemon, http: httpx.Client) -> None:
    assert daemon.control().post("/v1/drain").status_code == 200
    try:
        daemon.wait_state("draining", 10)
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        r = wait_until(
            lambda: (x := http.post("/v1/completions", json=body)).status_code == 503 and x,
            10,
            "503 from the api",
        )
        assert int(r.headers["retry-after"]) > 0
        assert r.json()["error"]["type"] == "service_unavailable"
    finally:
        daemon.control().post("/v1/resume")
        daemon.wait_state("running", 10)
    wait_until(lambda: http.get("/health").status_code == 200, 10, "healthy again")

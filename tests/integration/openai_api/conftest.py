from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.daemon import Daemon, served
from tests.integration.openai_api.shared_daemon import KEY, SESSION_LEN


@pytest.fixture(scope="package")
def daemon() -> Iterator[Daemon]:
    yield from served(Daemon(
        "--mode", "hybrid", "--heartbeat-timeout", "10", "--api-keys", KEY,
        "--session-len", str(SESSION_LEN), "--drain-timeout", "5",
    ))  # fmt: skip


@pytest.fixture(scope="package")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{daemon.url}/v1", api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=60) as c:
        yield c

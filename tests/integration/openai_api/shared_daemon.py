"""The daemon this package's tests share (conftest.py starts it): what it serves, the
flags it runs with, an async client for it, and a probe of it."""

from __future__ import annotations

import openai
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.daemon import Daemon

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-lmd-test"
SESSION_LEN = 1024
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]


def async_client(daemon: Daemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{daemon.url}/v1", api_key=KEY, max_retries=0)


def idle(daemon: Daemon) -> bool:
    """Nothing held anywhere: every KV block free, no request open in any process."""
    workers = {w["name"]: w for w in daemon.status()["workers"]}
    kv = workers["hybrid-0"].get("kv")
    busy = any(workers[n]["inflight"] for n in ("api-0", "tokenizer-0", "hybrid-0"))
    return bool(kv and kv["free_blocks"] == kv["total_blocks"] and not busy)

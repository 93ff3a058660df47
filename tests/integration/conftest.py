from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.integration.api_stack import Stack
from tests.integration.daemon import DISAGGREGATED, Daemon, served


@pytest.fixture(autouse=True, scope="session")
def _default_model_converted(smollm2_dir: Path) -> Path:
    """Every daemon's tokenizer loads the default model: convert it once, before any starts."""
    return smollm2_dir


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    """A running daemon with default settings; stopped and cleaned after the test."""
    yield from served(Daemon(*DISAGGREGATED, "--heartbeat-timeout", "4", "--drain-timeout", "5"))


@pytest.fixture
def make_daemon() -> Iterator[type[Daemon]]:
    """For tests that start daemons with their own flags; all are cleaned up."""
    made: list[Daemon] = []

    class Tracked(Daemon):
        def __init__(self, *args: str, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    try:
        yield Tracked
    finally:
        for d in made:
            d.close()


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    """api-0 in the test's event loop with a fake tokenizer and supervisor (api_stack.py)."""
    s = Stack()
    await s.start()
    try:
        yield s
    finally:
        await s.close()

"""An engine worker whose step ran out of GPU memory answers that step's requests with a
503-class error and keeps the others (hybrid/worker.py, on_out_of_memory)."""

from __future__ import annotations

from lmd import protocol
from lmd.engine.memory_plan import StepOutOfMemory
from lmd.hybrid.worker import EngineWorker
from lmd.protocol import Role
from lmd.roles import WorkerSpec


class Worker(EngineWorker):
    """The worker's request table and replies, without a process or an engine."""

    def __init__(self) -> None:
        self.spec = WorkerSpec("hybrid-0", Role.HYBRID, 0, supervisor_pid=1, config={})
        self.engine = None  # type: ignore[assignment]
        self._reply_to = {"a": "tokenizer-0", "b": "tokenizer-0", "c": "tokenizer-1"}
        self.sent: list[tuple[str, protocol.Message]] = []

    def push(self, peer: str, msg: protocol.Message) -> bool:
        self.sent.append((peer, msg))
        return True


def test_the_failed_steps_requests_get_a_retryable_error_and_the_rest_go_on() -> None:
    worker = Worker()
    worker.on_out_of_memory(StepOutOfMemory(["a", "c", "gone"], "Tried to allocate 64 MiB"))
    errors = [(peer, m) for peer, m in worker.sent if isinstance(m, protocol.RequestError)]
    assert len(errors) == len(worker.sent)
    assert [(peer, m.request_id, m.code) for peer, m in errors] == [
        ("tokenizer-0", "a", "service_unavailable"),
        ("tokenizer-1", "c", "service_unavailable"),
    ]
    assert "retry" in errors[0][1].message
    assert worker._reply_to == {"b": "tokenizer-0"}  # b was in no failed step

"""Drive an engine worker of a real daemon over ZeroMQ as its tokenizer does: Generate
in, Tokens out. The test binds tokenizer-0's inbox, which takes the socket file over
(libzmq replaces it); the daemon's own tokenizer then gets nothing from the engines, and
an engine answers only workers of its cluster, so the name must be tokenizer-0's."""

from __future__ import annotations

import zmq

from lmd import protocol
from tests.integration.daemon import Daemon

CLIENT = "tokenizer-0"


class Client:
    """Sends Generate/Abort to an engine worker (hybrid-0, or a prefill worker naming its
    decode worker) and collects what comes back on its own inbox."""

    def __init__(self, daemon: Daemon, engine: str = "hybrid-0", decode: str = "") -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(f"ipc://{daemon.runtime_dir}/{CLIENT}.ipc")
        self.engine = self.ctx.socket(zmq.PUSH)
        self.engine.connect(f"ipc://{daemon.runtime_dir}/{engine}.ipc")
        self.decode = decode

    def generate(self, request_id: str, prompt: list[int], **sampling: object) -> None:
        msg = protocol.Generate(
            request_id, CLIENT, sampling, protocol.pack_ids(prompt), decode=self.decode
        )
        self.engine.send_multipart(protocol.encode(msg))

    def abort(self, request_id: str) -> None:
        self.engine.send_multipart(protocol.encode(protocol.Abort(request_id)))

    def recv(self, timeout_ms: int = 20_000) -> protocol.Message:
        if not self.inbox.poll(timeout_ms):
            raise AssertionError("no message from the engine")
        return protocol.decode(self.inbox.recv_multipart())

    def collect(self, request_ids: set[str]) -> dict[str, list[int]]:
        """Tokens of each request until all of them finished, in position order. Prefill
        and decode send theirs over different sockets, so the prefill's first token may
        land after decode's last: a request is done once its finishing token and every
        one before it (positions count output tokens from 0) are in."""
        got: dict[str, dict[int, int]] = {r: {} for r in request_ids}
        last: dict[str, int] = {}  # the finishing token's position
        open_ids = set(request_ids)
        while open_ids:
            msg = self.recv()
            assert isinstance(msg, protocol.Tokens), msg
            ids, positions = protocol.unpack_ids(msg.token_ids), protocol.unpack_ids(msg.positions)
            for rid, tok, pos, reason in zip(
                msg.request_ids, ids, positions, msg.finish_reasons, strict=True
            ):
                got[rid][pos] = tok
                if reason is not None:
                    last[rid] = pos
            for rid in list(open_ids):
                if rid in last and len(got[rid]) == last[rid] + 1:
                    open_ids.discard(rid)
        return {rid: [toks[p] for p in sorted(toks)] for rid, toks in got.items()}

    def close(self) -> None:
        self.inbox.close(0)
        self.engine.close(0)
        self.ctx.term()

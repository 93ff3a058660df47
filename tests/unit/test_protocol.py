from __future__ import annotations

import pytest

from lmd import protocol
from lmd.protocol import ProtocolError

MESSAGES: list[protocol.Message] = [
    protocol.Ready("decode-0", 1234, {"backend": "torch", "device": "cpu"}),
    protocol.Heartbeat("api-0", 3, 7, {"kv": {"free_blocks": 10}}),
    protocol.Drain(),
    protocol.Resume(),
    protocol.Stop(),
    protocol.ClusterState("running", ["decode"]),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: protocol.Message) -> None:
    frames = protocol.encode(msg)
    assert frames[0] == bytes((msg.TYPE,))
    assert protocol.decode(frames) == msg


def test_no_pickle_on_the_wire() -> None:
    frames = protocol.encode(protocol.Heartbeat("x", 0, 0, {"a": [1, 2]}))
    assert frames[1] == b'{"name":"x","inflight":0,"num_dropped":0,"stats":{"a":[1,2]}}'


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], "at least 2 frames"),
        ([b"\x02"], "at least 2 frames"),
        ([b"", b"{}"], "1 byte"),
        ([b"\xfe", b"{}"], "unknown message type 254"),
        ([b"\x02", b'{"name": '], "not JSON"),
        ([b"\x02", b"[1]"], "JSON object"),
        ([b"\x02", b'{"name": "a"}'], "header keys"),
        ([b"\x02", b'{"name":"a","inflight":0,"num_dropped":0,"stats":{},"x":1}'], "header keys"),
        ([b"\x02", b'{"name":"a","inflight":true,"num_dropped":0,"stats":{}}'], "inflight"),
        ([b"\x02", b'{"name":"a","inflight":1.5,"num_dropped":0,"stats":{}}'], "inflight"),
        ([b"\x02", b'{"name":null,"inflight":0,"num_dropped":0,"stats":{}}'], "name"),
        ([b"\x0c", b"{}", b"extra"], "expected 2 frames"),
    ],
)
def test_malformed_is_a_protocol_error(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        protocol.decode(frames)


def test_message_types_are_unique_bytes() -> None:
    types = [int(t) for t in protocol.MsgType]
    assert len(types) == len(set(types)) and all(0 < t < 256 for t in types)

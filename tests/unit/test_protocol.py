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
    protocol.Generate("r1", "tokenizer-0", {"temperature": 0.0}, protocol.pack_ids([1, 2, 3])),
    protocol.Abort("r1"),
    protocol.Tokens(
        ["r1", "r2"],
        [None, "stop"],
        [None, {"logprob": -0.5, "top": [[7, -0.5], [9, -1.5]]}],
        [0, 128],
        protocol.pack_ids([7, 2]),
        protocol.pack_ids([0, 5]),
    ),
    protocol.RequestError("r1", "invalid_request_error", "temperature must be >= 0"),
    protocol.TextRequest(
        "chat-1", "api-0", None, "Hello", {"temperature": 0.0}, [], True, b"", 7, True
    ),
    protocol.TextDelta(
        ["r1", "r2"],
        ["Par", ""],
        [None, "abort"],
        [9, 70],
        [1, 3],
        [None, None],
        [0, 64],
        [0, 60],
        [0, 2],
    ),
    protocol.SessionControl(7, "cancel"),
    protocol.TextRequest(
        "chat-2",
        "api-0",
        [{"role": "user", "content": "Weather?"}],
        None,
        {},
        [],
        True,
        b"",
        tools=[{"type": "function", "function": {"name": "get_weather"}}],
        chat_template_kwargs={"enable_thinking": False},
        n=3,
    ),
    protocol.Tokenize("t1", "api-0", "Hello", None, True, True, False),
    protocol.Tokenize(
        "t2",
        "api-0",
        None,
        [{"role": "user", "content": "Hi"}],
        False,
        True,
        True,
        [{"type": "function", "function": {"name": "f"}}],
        {"enable_thinking": True},
    ),
    protocol.Detokenize("t3", "api-0", protocol.pack_ids([9, 10])),
    protocol.Detokenize("t4", "api-0", b""),  # nothing to decode: ""
    protocol.Tokenized("t1", protocol.pack_ids([1, 2]), "", ["He", "llo"], 2048),
    protocol.Tokenized("t3", b"", "Hello", None, 2048),
    protocol.ClusterState("running", [], {"prefill-0": 41, "decode-0": 42}),
    protocol.Generate(
        "r2", "tokenizer-0", {"seed": 3}, protocol.pack_ids([5, 6]), decode="decode-1"
    ),
    protocol.Reserve("r2", "prefill-0", "tokenizer-0", {"seed": 3}, protocol.pack_ids([5, 6])),
    protocol.Reserved(
        "r2", "decode-1", "host", 4096, 64, 1, [2, 2], b"desc", protocol.pack_ids([3, 9])
    ),
    protocol.Migrated("r2", "prefill-0", 17, {"logprob": -0.1, "top": []}, 64),
    protocol.Release("r2", "prefill-0"),
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
        (
            [
                b"\x14",
                b'{"request_id":"a","reply_to":"t","sampling":{},"decode":"","sent_at":0}',
                b"\x01\x00",
            ],
            "int32",
        ),
        (
            [
                b"\x14",
                b'{"request_id":"a","reply_to":"t","sampling":{},"decode":"","sent_at":0}',
                b"",
            ],
            "int32",
        ),
        (
            [
                b"\x14",
                b'{"request_id":"a","reply_to":"../../x","sampling":{},"decode":"","sent_at":0}',
                b"\x01\x00\x00\x00",
            ],
            "not a worker name",
        ),
        (
            [
                b"\x16",
                b'{"request_ids":["a",2],"finish_reasons":[null,null],"logprobs":[null,null],'
                b'"cached_tokens":[0,0],"sent_at":0}',
                b"\x00" * 8,
                b"\x00" * 8,
            ],
            "element",
        ),
        (
            [
                b"\x16",
                b'{"request_ids":["a"],"finish_reasons":[null],"logprobs":[null],'
                b'"cached_tokens":[0],"sent_at":0}',
                b"\x00" * 8,
                b"\x00" * 4,
            ],
            "1 requests but 2 token ids",
        ),
        (
            [
                b"\x16",
                b'{"request_ids":["a"],"finish_reasons":[null],"logprobs":[null],'
                b'"cached_tokens":[0],"sent_at":0}',
                b"\x00" * 4,
                b"\x00" * 8,
            ],
            "1 requests but 2 positions",
        ),
        (
            [
                b"\x16",
                b'{"request_ids":["a"],"finish_reasons":[],"logprobs":[null],"cached_tokens":[0]'
                b',"sent_at":0}',
                b"\x00" * 4,
                b"\x00" * 4,
            ],
            "differ in length",
        ),
        (
            [
                b"\x16",
                b'{"request_ids":["a"],"finish_reasons":[null],"logprobs":[null],'
                b'"cached_tokens":[],"sent_at":0}',
                b"\x00" * 4,
                b"\x00" * 4,
            ],
            "cached_tokens differ in length",
        ),
        (
            [
                b"\x16",
                b'{"request_ids":["a"],"finish_reasons":[null],"logprobs":[null],'
                b'"cached_tokens":[1.5],"sent_at":0}',
                b"\x00" * 4,
                b"\x00" * 4,
            ],
            "cached_tokens: an element",
        ),
        (
            [
                b"\x16",
                b'{"request_ids":["a"],"finish_reasons":[null],"logprobs":[null],'
                b'"cached_tokens":[true],"sent_at":0}',
                b"\x00" * 4,
                b"\x00" * 4,
            ],
            "cached_tokens: an element",  # a JSON true is not a count
        ),
        (
            [
                b"\x16",
                b'{"request_ids":["a"],"finish_reasons":[1],"logprobs":[null],"cached_tokens":[0]'
                b',"sent_at":0}',
                b"\x00" * 4,
                b"\x00" * 4,
            ],
            "finish_reasons: an element",
        ),
        (
            [
                b"\x19",
                b'{"request_ids":["a"],"texts":["x"],"finish_reasons":[null],'
                b'"prompt_tokens":[3],"completion_tokens":[1],"logprobs":[null],'
                b'"cached_tokens":[0],"history_tokens":[0,0],"indexes":[0],"sent_at":0}',
            ],
            "TextDelta: per-request lists differ in length",
        ),
        (
            [
                b"\x19",
                b'{"request_ids":["a"],"texts":["x"],"finish_reasons":[null],'
                b'"prompt_tokens":[3],"completion_tokens":[1],"logprobs":[null],'
                b'"cached_tokens":[0],"history_tokens":[0],"indexes":[16],"sent_at":0}',
            ],
            "TextDelta.indexes: a choice index is out of range",
        ),
        (
            [
                b"\x18",
                b'{"request_id":"a","reply_to":"api-0","messages":null,"prompt":"hi",'
                b'"sampling":{},"stop":[],"skip_special_tokens":true,"session_id":null,'
                b'"interactive_mode":false,"tools":null,"chat_template_kwargs":null,"n":17'
                b',"sent_at":0}',
                b"",
            ],
            "TextRequest.n 17 is out of range",
        ),
        (
            [
                b"\x18",
                b'{"request_id":"a","reply_to":"api-0","messages":null,"prompt":"hi",'
                b'"sampling":{},"stop":[],"skip_special_tokens":true,"session_id":3,'
                b'"interactive_mode":false,"tools":null,"chat_template_kwargs":null,"n":2'
                b',"sent_at":0}',
                b"",
            ],
            "TextRequest.n 2 is out of range",
        ),
        (
            [
                b"\x18",
                b'{"request_id":"a","reply_to":"api-0","messages":null,"prompt":"hi",'
                b'"sampling":{},"stop":[],"skip_special_tokens":true,"session_id":-2,'
                b'"interactive_mode":true,"tools":null,"chat_template_kwargs":null,"n":1'
                b',"sent_at":0}',
                b"",
            ],
            "session_id must be >= 0",
        ),
        (
            [
                b"\x18",
                b'{"request_id":"a","reply_to":"api-0","messages":null,"prompt":"hi",'
                b'"sampling":{},"stop":[],"skip_special_tokens":true,"session_id":null,'
                b'"interactive_mode":false,"tools":[],"chat_template_kwargs":null,"n":1'
                b',"sent_at":0}',
                b"",
            ],
            "tools and chat_template_kwargs need messages",
        ),
        (
            [
                b"\x18",
                b'{"request_id":"a","reply_to":"api-0","messages":[],"prompt":null,'
                b'"sampling":{},"stop":[],"skip_special_tokens":true,"session_id":null,'
                b'"interactive_mode":false,"tools":["f"],"chat_template_kwargs":null,"n":1'
                b',"sent_at":0}',
                b"",
            ],
            "TextRequest.tools: an element has the wrong type",
        ),
        (
            [
                b"\x1b",
                b'{"request_id":"a","reply_to":"api-0","prompt":"hi","messages":[],'
                b'"add_special_tokens":true,"add_generation_prompt":true,'
                b'"return_token_strs":false,"tools":null,"chat_template_kwargs":null}',
            ],
            "Tokenize needs exactly one of prompt, messages",
        ),
        ([b"\x1c", b'{"request_id":"a","reply_to":"api-0"}', b"\x01\x00"], "int32"),
        (
            [
                b"\x1d",
                b'{"request_id":"a","text":"","token_strs":["a","b"],"max_model_len":8}',
                b"\x01\x00\x00\x00",
            ],
            "token_strs and token_ids differ in length",
        ),
        ([b"\x1a", b'{"session_id":1,"action":"delete"}'], "is not cancel or end"),
    ],
)
def test_malformed_is_a_protocol_error(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        protocol.decode(frames)


def test_message_types_are_unique_bytes() -> None:
    types = [int(t) for t in protocol.MsgType]
    assert len(types) == len(set(types)) and all(0 < t < 256 for t in types)


def test_token_ids_travel_as_int32_little_endian() -> None:
    ids = [0, 1, 49151, 2**31 - 1]
    raw = protocol.pack_ids(ids)
    assert raw[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert protocol.unpack_ids(raw) == ids


def test_every_kind_has_a_size_cap() -> None:
    assert set(protocol.MAX_BYTES) == {int(t) for t in protocol.MsgType}


def test_a_generate_of_a_million_token_ids_fits_its_cap() -> None:
    msg = protocol.Generate("r", "tokenizer-0", {"max_tokens": 8}, protocol.pack_ids([7] * 10**6))
    assert protocol.oversize(protocol.encode(msg)) is None
    assert protocol.decode(protocol.encode(msg)) == msg


def test_a_message_over_its_kinds_cap_is_refused_before_parsing() -> None:
    """A 64 MB message stalled the api's event loop while it was parsed and handled."""
    text = "x" * (8 << 20)  # TextDelta's cap is 8 MiB, all frames together
    big = protocol.TextDelta(["r"], [text], [None], [1], [1], [None], [0], [0], [0])
    frames = protocol.encode(big)
    with pytest.raises(ProtocolError, match="over its cap of 8,388,608 bytes"):
        protocol.decode(frames)
    # Not parsed: a header that is not even JSON says the same.
    with pytest.raises(ProtocolError, match="over its cap"):
        protocol.decode([frames[0], b"{" * len(frames[1])])

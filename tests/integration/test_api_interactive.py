"""/v1/chat/interactive on the api worker (api_stack.py): session turns, cancel and end as
session controls, and the prefix caching it needs."""

from __future__ import annotations

from tests.integration.api_stack import REPLY, Stack, wait_for


async def test_interactive_turn_goes_to_the_tokenizer_as_a_session_turn(stack: Stack) -> None:
    body = {"prompt": "What is the capital of France?", "session_id": 9, "interactive_mode": True}
    r = await stack.http.post("/v1/chat/interactive", json=body)
    assert r.status_code == 200
    assert r.json() == {
        "text": "".join(REPLY),
        "tokens": len(REPLY),
        "input_tokens": 6,
        "history_tokens": 0,
        "finish_reason": "stop",
        "cached_tokens": 0,
    }
    sent = stack.tokenizer.requests[-1]
    assert (sent.session_id, sent.interactive_mode) == (9, True)
    assert sent.prompt == body["prompt"] and sent.messages is None
    assert sent.sampling["temperature"] == 0.8 and sent.sampling["top_k"] == 40  # LMDeploy's
    one_off = await stack.http.post("/v1/chat/interactive", json={"prompt": "Hi"})
    assert one_off.status_code == 200
    sent = stack.tokenizer.requests[-1]
    assert sent.session_id is None and sent.messages == [{"role": "user", "content": "Hi"}]


async def test_interactive_cancel_and_end_are_session_controls(stack: Stack) -> None:
    done = {"text": "", "tokens": 0, "input_tokens": 0, "history_tokens": 0,
            "finish_reason": "stop", "cached_tokens": 0}  # fmt: skip
    r = await stack.http.post(
        "/v1/chat/interactive", json={"prompt": "", "session_id": 3, "cancel": True}
    )
    assert r.status_code == 200 and r.json() == done
    r = await stack.http.post("/v1/chat/interactive", json={"prompt": "", "session_id": 3})
    assert r.status_code == 200 and r.json() == done
    await wait_for(lambda: len(stack.tokenizer.controls) == 2, "both controls")
    assert [(c.session_id, c.action) for c in stack.tokenizer.controls] == [
        (3, "cancel"),
        (3, "end"),
    ]
    assert not stack.tokenizer.requests  # no turn ran


async def test_interactive_needs_prefix_caching() -> None:
    s = Stack(enable_prefix_caching=False)
    await s.start()
    try:
        body = {"prompt": "Hi", "session_id": 1, "interactive_mode": True}
        r = await s.http.post("/v1/chat/interactive", json=body)
        assert r.status_code == 400 and "--enable-prefix-caching" in r.json()["error"]["message"]
        assert not s.tokenizer.requests
    finally:
        await s.close()

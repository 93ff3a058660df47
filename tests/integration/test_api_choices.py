"""n > 1 choices on the api worker (api_stack.py, whose fake tokenizer answers each choice
alike): the official SDK's view of whole and streamed answers, and an abort that names
the request once."""

from __future__ import annotations

from tests.integration.api_stack import MODEL, REPLY, Stack, chat_body, wait_for


async def test_n_choices_in_one_body(stack: Stack) -> None:
    r = await stack.openai.completions.create(model=MODEL, prompt="hello there", n=3)
    assert stack.tokenizer.requests[-1].n == 3
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.text == "".join(REPLY) and c.finish_reason == "stop" for c in r.choices)
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (2, 15)  # the prompt once
    assert stack.worker.inflight() == 0


async def test_a_stream_of_n_choices(stack: Stack) -> None:
    stream = await stack.openai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    roles = [c.choices[0].index for c in chunks[:2]]
    assert roles == [0, 1] and all(c.choices[0].delta.role == "assistant" for c in chunks[:2])
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
    assert texts == {0: "".join(REPLY), 1: "".join(REPLY)}
    finishes = [c.choices[0] for c in chunks[:-1] if c.choices[0].finish_reason]
    assert sorted((f.index, f.finish_reason) for f in finishes) == [(0, "stop"), (1, "stop")]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 10
    await wait_for(lambda: stack.worker.inflight() == 0, "request closed")


async def test_a_client_gone_aborts_the_request_once(stack: Stack) -> None:
    body = chat_body("slow", max_tokens=1000, stream=True, n=3)
    async with stack.http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.aiter_lines()
        while '"index":2,"delta":{"content":"tok"' not in await anext(lines):
            pass
    rid = stack.tokenizer.requests[-1].request_id
    await wait_for(lambda: rid in stack.tokenizer.aborted, "Abort at the tokenizer")
    assert stack.tokenizer.aborted == {rid}  # the api's id: the tokenizer ends every choice
    assert stack.worker.inflight() == 0

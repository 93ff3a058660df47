"""lmd.pipeline on the embedded SmolLM2 on CPU: call shapes, batching, streams, chat,
asyncio, stop words, logprobs, and closing."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import lmd
from lmd import GenerationConfig, Pipeline, PytorchEngineConfig, Response, Session, pipeline
from lmd.pipeline.engine_thread import Delivery
from lmd.pipeline.prompts import Tokenized, WholeText, whole_texts
from lmd.tokenizer.text.stream import TextStream
from tests.models import QUESTIONS

GREEDY = GenerationConfig(max_new_tokens=8)
SHORT = GenerationConfig(max_new_tokens=4)
QUESTION = QUESTIONS[0]  # "What is the capital of France?"


@pytest.fixture(scope="module")
def pipe(smollm2_dir: Path) -> Iterator[Pipeline]:
    # fp32 GEMMs: a batch's outputs are compared with each prompt's alone, and bf16's
    # (cpu_matmul_dtype auto on a CPU with bf16 dot products) depend on the batch.
    config = PytorchEngineConfig(device_type="cpu", cpu_matmul_dtype="float32")
    with pipeline(None, backend_config=config) as p:
        yield p


def idle(pipe: Pipeline) -> bool:
    stats = pipe.stats()
    kv = stats["kv"]
    return bool(kv["free_blocks"] == kv["total_blocks"] and stats["running"] == 0)


def test_lmd_exports_the_pipeline_without_loading_it_for_the_daemon() -> None:
    check = (
        "import sys, lmd; assert 'lmd.pipeline' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", check], check=True)
    assert callable(lmd.pipeline) and lmd.pipeline is pipeline
    assert lmd.GenerationConfig is GenerationConfig


def test_64_prompts_in_one_call_equal_64_one_at_a_time(pipe: Pipeline) -> None:
    prompts = [f"{q} Answer in {n} words." for q in QUESTIONS for n in range(2, 10)]
    assert len(prompts) == 64
    # As they are (no chat template): short prompts, so that the 64 calls alone are quick.
    together = pipe(prompts, gen_config=SHORT, do_preprocess=False)
    assert isinstance(together, list)
    alone = [pipe(p, gen_config=SHORT, do_preprocess=False) for p in prompts]
    assert [r.index for r in together] == list(range(64))
    for a, b in zip(together, alone, strict=True):
        assert isinstance(b, Response)
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert a.generate_token_len == len(a.token_ids) and a.input_token_len > 0
    assert idle(pipe)


def test_a_string_is_a_user_turn_and_the_same_chat_as_messages_or_ids(pipe: Pipeline) -> None:
    as_text = pipe(QUESTION, gen_config=GREEDY)
    as_chat = pipe([{"role": "user", "content": QUESTION}], gen_config=GREEDY)
    ids = pipe.tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_dict=False
    )
    as_ids = pipe(list(ids), gen_config=GREEDY)
    raw = pipe(QUESTION, gen_config=GREEDY, do_preprocess=False)
    assert isinstance(as_text, Response) and isinstance(raw, Response)
    assert "Paris" in as_text.text
    assert as_text == as_chat == as_ids
    assert (
        raw.input_token_len == len(pipe.tokenizer(QUESTION)["input_ids"]) < as_text.input_token_len
    )


def test_a_stream_adds_up_to_the_whole_response(pipe: Pipeline) -> None:
    prompts = [QUESTION, "Write a haiku about the sea."]
    whole = pipe(prompts, gen_config=GREEDY)
    assert isinstance(whole, list)
    deltas = list(pipe.stream_infer(prompts, gen_config=GREEDY))
    for r in whole:
        mine = [d for d in deltas if d.index == r.index]
        assert "".join(d.text for d in mine) == r.text
        assert [t for d in mine for t in d.token_ids] == r.token_ids
        assert [d.finish_reason for d in mine if d.finish_reason] == [r.finish_reason]
        assert mine[-1].finish_reason and mine[-1].generate_token_len == r.generate_token_len


def test_a_call_read_at_its_end_equals_its_stream(pipe: Pipeline) -> None:
    """A blocking call that nothing reads before its requests end gets only their last
    tokens from the engine thread and takes the ids from their Sequences: the same
    tokens, text and finish as a stream of the same prompts, or a call with logprobs."""
    prompts = [QUESTION, "Write a haiku about the sea.", [42] * 3]
    gen = GenerationConfig(max_new_tokens=12)
    logprobs = GenerationConfig(max_new_tokens=12, logprobs=1)
    assert pipe._call(prompts, gen, False, streamed=False)[0].delivery is Delivery.ENDS
    assert pipe._call(prompts, logprobs, False, streamed=False)[0].delivery is Delivery.HELD
    whole = pipe(prompts, gen_config=gen, do_preprocess=False)
    held = pipe(prompts, gen_config=logprobs, do_preprocess=False)
    deltas = list(pipe.stream_infer(prompts, gen_config=gen, do_preprocess=False))
    awaited = asyncio.run(pipe.async_infer(prompts, gen_config=gen, do_preprocess=False))
    assert isinstance(whole, list) and isinstance(held, list) and whole == awaited
    for r, h in zip(whole, held, strict=True):
        mine = [d for d in deltas if d.index == r.index]
        assert [t for d in mine for t in d.token_ids] == r.token_ids == h.token_ids
        assert "".join(d.text for d in mine) == r.text == h.text
        assert mine[-1].finish_reason == r.finish_reason == h.finish_reason
        assert r.generate_token_len == len(r.token_ids) > 0
    assert {r.finish_reason for r in whole} == {"stop", "length"}  # both ends taken
    assert idle(pipe)


def test_leaving_a_stream_early_cuts_the_requests_off(pipe: Pipeline) -> None:
    long = GenerationConfig(max_new_tokens=500, ignore_eos=True)
    stream = pipe.stream_infer([QUESTION, QUESTION], gen_config=long)
    for n, _delta in enumerate(stream, 1):
        if n == 3:
            break
    stream.close()  # type: ignore[attr-defined]  # a generator
    assert idle(pipe)


def test_stop_words_end_the_text_and_the_request(pipe: Pipeline) -> None:
    plain = pipe(QUESTION, gen_config=GREEDY)
    assert isinstance(plain, Response) and plain.text.startswith("The capital of France is")
    stopped = pipe(QUESTION, gen_config=GenerationConfig(max_new_tokens=8, stop_words=[" is"]))
    assert isinstance(stopped, Response)
    assert stopped.text == "The capital of France" and stopped.finish_reason == "stop"
    assert stopped.generate_token_len < plain.generate_token_len
    assert idle(pipe)


def test_logprobs_per_token(pipe: Pipeline) -> None:
    r = pipe(QUESTION, gen_config=GenerationConfig(max_new_tokens=4, logprobs=3))
    assert isinstance(r, Response) and r.logprobs is not None
    assert len(r.logprobs) == r.generate_token_len == 4
    for token, lp in zip(r.token_ids, r.logprobs, strict=True):
        assert token in lp and lp[token] <= 0 and len(lp) in (3, 4)
        assert lp[token] == max(lp.values())  # greedy: the chosen one is the most likely


def test_chat_keeps_the_conversation(pipe: Pipeline) -> None:
    session = pipe.chat("My name is Ada. Say hi.", gen_config=GREEDY)
    assert isinstance(session, Session) and session.response is not None
    first = session.response
    streamed = pipe.chat("What is my name?", session, GREEDY, stream_response=True)
    assert not isinstance(streamed, Session)
    text = "".join(d.text for d in streamed)
    assert [h[0] for h in session.history] == ["My name is Ada. Say hi.", "What is my name?"]
    assert session.history[1][1] == text and session.response.text == text
    # The second turn's prompt is the first turn's prompt, answer and the new question.
    assert session.response.input_token_len > first.input_token_len + first.generate_token_len
    assert session.step > session.response.input_token_len
    session.reset()
    assert session.history == [] and session.step == 0


async def test_async_calls_batch_together_and_equal_the_blocking_ones(pipe: Pipeline) -> None:
    prompts = QUESTIONS[:4]
    blocking = pipe(prompts, gen_config=GREEDY)

    async def one(prompt: str) -> str:
        return "".join([d.text async for d in pipe.async_stream_infer(prompt, GREEDY)])

    streamed = await asyncio.gather(*(one(p) for p in prompts))
    together = await pipe.async_infer(prompts, gen_config=GREEDY)
    assert isinstance(blocking, list) and isinstance(together, list)
    assert streamed == [r.text for r in blocking] == [r.text for r in together]


async def test_cancelling_an_async_stream_cuts_it_off(pipe: Pipeline) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        long = GenerationConfig(max_new_tokens=500, ignore_eos=True)
        async for _delta in pipe.async_stream_infer(QUESTION, long):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(idle, pipe)


def test_calls_from_threads_share_the_engine(pipe: Pipeline) -> None:
    expected = pipe(QUESTIONS[:3], gen_config=GREEDY)
    got: dict[int, Response] = {}

    def run(i: int) -> None:
        r = pipe(QUESTIONS[i], gen_config=GREEDY)
        assert isinstance(r, Response)
        got[i] = r

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(expected, list)
    assert [got[i].text for i in range(3)] == [r.text for r in expected]


def test_close_frees_the_engine_and_refuses_calls(smollm2_dir: Path) -> None:
    settings = PytorchEngineConfig(device_type="cpu", cache_max_entry_count=32)
    with pipeline(smollm2_dir, backend_config=settings) as pipe:
        stream = pipe.stream_infer(QUESTION, GenerationConfig(max_new_tokens=400))
        next(stream)
    assert pipe._engine.engine is None  # the model and pool with it
    with pytest.raises(RuntimeError, match="the pipeline is closed"):
        pipe.backend  # noqa: B018
    with pytest.raises(RuntimeError, match="the pipeline was closed"):
        list(stream)  # the tokens that came before close, then the cut
    with pytest.raises(RuntimeError, match="the pipeline is closed"):
        pipe(QUESTION)
    pipe.close()  # again: nothing happens


def assert_whole_text_is_streamed(pipe: Pipeline, prompt: Tokenized, ids: list[int]) -> None:
    """The text infer() makes at the end = stream_infer's, token by token, both ways of
    treating special tokens."""
    for skip in (True, False):
        whole = pipe.prompter.text(prompt, [], skip_special=skip, incremental=False)
        stream = pipe.prompter.text(prompt, [], skip_special=skip, incremental=True)
        assert isinstance(whole, WholeText) and isinstance(stream, TextStream)
        reasons = [None] * (len(ids) - 1) + ["length"]
        streamed = "".join(stream.feed(t, r).text for t, r in zip(ids, reasons, strict=True))
        assert whole(ids) == streamed


def test_text_made_at_the_end_is_the_streamed_text(pipe: Pipeline) -> None:
    """infer() decodes an output once at its end; stream_infer token by token (as the
    daemon does): the same text, for random ids too (split characters, special tokens)."""
    rng = random.Random(0)
    vocab = pipe.backend.vocab_size
    for _ in range(20):
        prompt = Tokenized([rng.randrange(vocab) for _ in range(5)], chat=False)
        ids = [rng.randrange(vocab) for _ in range(40)]
        assert_whole_text_is_streamed(pipe, prompt, ids)


def test_whole_text_after_a_prompt_that_ends_inside_a_character(pipe: Pipeline) -> None:
    """The Detokenizer starts without context there, and the text made at the end is the
    output's own decode, U+FFFD (invalid bytes) and all on SmolLM2's ByteLevel decoder:
    the streamed text, as the daemon makes it."""
    rng = random.Random(3)
    vocab = pipe.backend.vocab_size
    assert pipe.prompter.byte_level
    cases = 0
    while cases < 20:
        prompt = Tokenized([rng.randrange(300) for _ in range(5)], chat=False)  # bytes
        if not pipe.prompter.decode(prompt.token_ids).endswith("\ufffd"):
            continue
        cases += 1
        ids = [rng.randrange(rng.choice((300, vocab))) for _ in range(40)]
        assert_whole_text_is_streamed(pipe, prompt, ids)


def test_whole_texts_in_one_batch_are_each_ones_alone(pipe: Pipeline) -> None:
    """Requests that end in the same step are decoded in one batch (per decoder and
    skip_special_tokens): each text is the one it would get alone."""
    rng = random.Random(2)
    vocab = pipe.backend.vocab_size
    jobs = []
    for i in range(12):
        prompt = Tokenized([rng.randrange(vocab) for _ in range(rng.randrange(0, 6))], chat=False)
        whole = pipe.prompter.text(prompt, [], skip_special=i % 2 == 0, incremental=False)
        assert isinstance(whole, WholeText)
        jobs.append((whole, [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]))
    assert whole_texts(jobs) == [whole(ids) for whole, ids in jobs]
    assert whole_texts([]) == []


def test_whole_text_is_the_detokenizers_on_qwen3s_vocabulary() -> None:
    """Two decodes in Rust (context + output, context) give what feeding the ids one by
    one gives: random ids over Qwen3's 151k tokens (split characters, special tokens,
    prompts that end inside a character)."""
    from tests.qwen3 import QWEN3_DIR

    if not (QWEN3_DIR / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer in {QWEN3_DIR}")
    from transformers import AutoTokenizer

    from lmd.tokenizer.text.detokenizer import CachedDecoder, Detokenizer

    decoder = CachedDecoder(AutoTokenizer.from_pretrained(QWEN3_DIR).backend_tokenizer)
    rng = random.Random(1)
    for _ in range(200):
        prompt = [rng.randrange(151_669) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(151_669) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            detok = Detokenizer(decoder, skip_special_tokens=skip, prompt_ids=prompt)
            streamed = "".join(detok.feed([t]) for t in ids) + detok.finish()
            for byte_level in (False, True):  # Qwen3's decoder is ByteLevel alone
                assert WholeText(decoder, prompt, skip, byte_level)(ids) == streamed

"""Reasoning split from the answer (api/parsers/reasoning.py): `<think>...</think>` as
DeepSeek-R1 and Qwen3 write it, whole and streamed, however the prompt began it."""

from __future__ import annotations

import random

import pytest

from lmd.api.parsers.reasoning import DEEPSEEK_R1, QWEN3, ThinkStream
from tests.qwen3 import assistant_turns, render


def streamed(opened: bool | None, pieces: list[str]) -> tuple[str, str]:
    stream = ThinkStream(opened)
    out = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


def assert_split_anywhere(opened: bool | None, text: str) -> tuple[str, str]:
    expected = ThinkStream(opened).parse(text)
    for cut in range(len(text) + 1):
        assert streamed(opened, [text[:cut], text[cut:]]) == expected, f"split at {cut}"
    assert streamed(opened, list(text)) == expected
    rng = random.Random(len(text))
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(opened, pieces) == expected
    return expected


THOUGHT = "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\nThe answer is 4."
SPLIT = ("The user asks for 2+2. That is 4.", "The answer is 4.")

# (prompt opened <think>?, reply, reasoning, content)
CASES = [
    # the reply opens <think> itself (Qwen3's template): whatever the prompt did
    *((opened, THOUGHT, *SPLIT) for opened in (True, False, None)),
    # the prompt opened it (DeepSeek-R1, Qwen3 thinking templates): only </think> shows
    (True, "Thinking...\n</think>\n\nDone.", "Thinking...", "Done."),
    (None, "Thinking...\n</think>\n\nDone.", "Thinking...", "Done."),
    # the prompt opened none: a stray </think> is content
    (False, "Thinking...</think>Done.", "", "Thinking...</think>Done."),
    # no thinking at all
    (False, "  Just an answer.\n", "", "  Just an answer.\n"),
    (None, "  Just an answer.\n", "", "  Just an answer.\n"),
    (True, "Cut short while thin", "Cut short while thin", ""),  # max_tokens in the reasoning
    (None, "<think>\nCut short", "Cut short", ""),
    # an empty thought (Qwen3 with enable_thinking false when the model writes it)
    (None, "<think>\n\n</think>\n\nHi", "", "Hi"),
    # look-alikes
    (False, "<thinking>is not a tag</thinking>", "", "<thinking>is not a tag</thinking>"),
    (None, "<thin", "", "<thin"),
    (True, "a </thin", "a </thin", ""),
    (None, "<think>x</think", "x</think", ""),
]


@pytest.mark.parametrize(("opened", "text", "reasoning", "content"), CASES)
def test_replies_whole_and_split_anywhere(
    opened: bool | None, text: str, reasoning: str, content: str
) -> None:
    assert assert_split_anywhere(opened, text) == (reasoning, content)


def test_a_stream_sends_reasoning_as_it_comes_and_holds_only_a_tags_start() -> None:
    stream = ThinkStream(None)
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>\nStep one") == ("Step one", "")
    assert stream.feed(", step two.\n</th") == (", step two.", "")  # "\n</th" held
    assert stream.feed("ink>\n\nFour") == ("", "Four")
    assert stream.feed(" it is.") == ("", " it is.")
    assert stream.finish() == ("", "")


def test_not_knowing_whether_the_prompt_opened_holds_until_it_is_known() -> None:
    stream = ThinkStream(None)
    assert stream.feed("Hmm, 2+2") == ("", "")  # reasoning if </think> comes, else content
    assert stream.feed(" is 4.</think>Four.") == ("Hmm, 2+2 is 4.", "Four.")
    stream = ThinkStream(None)
    assert stream.feed("Four.") == ("", "")
    assert stream.finish() == ("", "Four.")
    stream = ThinkStream(False)  # known: streamed at once
    assert stream.feed("Four.") == ("", "Four.")


def test_the_parsers_by_name() -> None:
    assert DEEPSEEK_R1.opened is True  # its template ends the prompt with <think>
    assert QWEN3.opened is None  # Qwen3's templates differ by version


def test_qwen3s_template_round_trip() -> None:
    """What Qwen3's template writes for an assistant turn with reasoning (what the model
    learned to write) splits back into that reasoning and content."""
    chat = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "It is 4.", "reasoning_content": "Add them: 4."},
    ]
    (reply,) = assistant_turns(render(chat))
    assert reply.startswith("<think>\n")
    assert assert_split_anywhere(None, reply) == ("Add them: 4.", "It is 4.")


def test_qwen3s_template_with_thinking_off_opens_no_thinking() -> None:
    """enable_thinking false: the prompt closes an empty thought, the reply is content."""
    prompt = render(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert assert_split_anywhere(False, "It is 4.") == ("", "It is 4.")

"""Stop strings across delta boundaries: what a streaming client receives."""

from __future__ import annotations

import random

from lmd.tokenizer.text.stop_strings import StopCheck, StopMatcher


def stream(stops: list[str], deltas: list[str]) -> tuple[list[str], str | None]:
    """The texts emitted per delta (plus the flush when no stop matched) and the stop."""
    matcher = StopMatcher(stops)
    out = []
    for delta in deltas:
        check = matcher.feed(delta)
        out.append(check.text)
        if check.stopped:
            return out, check.stop
    out.append(matcher.finish())
    return out, None


def reference(stops: list[str], text: str) -> str:
    """Non-streaming: cut before the stop that is complete first in the text."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s and s in text]
    return text[: min(ends)[1]] if ends else text


def test_without_stops_every_delta_passes_through() -> None:
    assert stream([], ["Hel", "lo", ""]) == (["Hel", "lo", "", ""], None)


def test_stop_split_over_deltas_is_held_then_cut() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("Hello S") == StopCheck("Hello ")
    assert matcher.held == "S"
    assert matcher.feed("T") == StopCheck("")
    assert matcher.held == "ST"
    assert matcher.feed("OP and more") == StopCheck("", "STOP")
    assert matcher.stop == "STOP" and matcher.held == ""
    assert matcher.feed("ignored") == StopCheck("", "STOP")
    assert matcher.finish() == ""


def test_held_text_that_is_not_a_stop_is_released() -> None:
    assert stream(["</s>"], ["a<", "/", "x>"]) == (["a", "", "</x>", ""], None)


def test_held_tail_is_flushed_on_finish() -> None:
    assert stream(["STOP"], ["abc ST"]) == (["abc ", "ST"], None)


def test_stop_at_the_very_beginning() -> None:
    assert stream(["<|im_end|>"], ["<|im_end|>tail"]) == ([""], "<|im_end|>")
    assert stream(["<|im_end|>"], ["<|im", "_end|>"]) == (["", ""], "<|im_end|>")


def test_overlapping_prefixes_pick_the_stop_that_completes() -> None:
    assert stream(["abc", "abd"], ["xab", "d!"]) == (["x", ""], "abd")
    # A self-overlapping stop: "aab" inside "aaab".
    assert stream(["aab"], ["a", "a", "a", "b"]) == (["", "", "a", ""], "aab")


def test_first_completed_stop_wins_regardless_of_list_order() -> None:
    # "bc" is complete before "abcd" could be: generation stops there.
    assert stream(["abcd", "bc"], ["abcd"]) == (["a"], "bc")
    assert stream(["abcd", "bc"], ["a", "b", "c", "d"]) == (["", "", "a"], "bc")
    # Ending together, the longer one (starting earlier) wins.
    assert stream(["b", "ab"], ["xab"]) == (["x"], "ab")


def test_empty_and_repeated_stops_are_ignored() -> None:
    matcher = StopMatcher(["", "END", "END"])
    assert matcher.stops == ("END",)
    assert matcher.feed("the END") == StopCheck("the ", "END")


def test_unicode_stop_strings() -> None:
    assert stream(["。\n"], ["你好", "。", "\n再见"]) == (["你好", "", ""], "。\n")


def test_random_splits_match_the_non_streaming_cut() -> None:
    rng = random.Random(7)
    alphabet = "ab\n<>/é😀"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        ]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 4)))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        out, stop = stream(stops, deltas)
        expected = reference(stops, text)
        assert "".join(out) == expected, (text, stops, deltas)
        assert (stop is not None) == any(s in text for s in stops)

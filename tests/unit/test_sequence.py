"""Sequence and SamplingParams: validation, token bookkeeping, finish reasons."""

from __future__ import annotations

import pytest

from lmd.engine.sequence import (
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceStatus,
    banned_token_ids,
)

EOS = frozenset({2})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, r"temperature must be >= 0 \(0 = greedy\), got -0.1"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\], got 1.01"),
        ({"top_k": -1}, "top_k must be >= 0, got -1"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0 \(1 = off\), got 0.0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"min_new_tokens": -1}, "min_new_tokens must be >= 0, got -1"),
        ({"logprobs": 21}, "logprobs must be in 0..20, got 21"),
        ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"top_k": True}, "top_k must be an integer, got True"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"stop_token_ids": (5, -2)}, "stop_token_ids entry must be >= 0, got -2"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false, got 1"),
        # float32 logits scaled by these overflow: NaN probabilities, a failed step
        ({"temperature": 1e308}, r"temperature must be <= 10000, got 1e\+308"),
        ({"repetition_penalty": 1e39}, r"repetition_penalty must be in \[0.0001, 10000\]"),
        ({"repetition_penalty": 1e-39}, r"repetition_penalty must be in \[0.0001, 10000\]"),
    ],
)
def test_out_of_range_sampling_params_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_edges_of_the_allowed_ranges_are_accepted() -> None:
    params = SamplingParams(
        temperature=0, top_p=1, top_k=0, min_p=1, repetition_penalty=0.5, logprobs=20, seed=-7
    )
    assert params.is_greedy
    assert params.top_p == 1.0 and isinstance(params.top_p, float)
    assert SamplingParams(stop_token_ids=[7, 8]).stop_token_ids == (7, 8)  # type: ignore[arg-type]


def test_a_temperature_too_small_to_divide_by_is_greedy() -> None:
    assert SamplingParams(temperature=1e-39).is_greedy  # x / 1e-39 overflows float32
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(ValueError, match="request r1: the prompt has no tokens"):
        Sequence("r1", [])


def test_token_bookkeeping() -> None:
    seq = Sequence("r", [5, 6, 7])
    assert seq.status is SequenceStatus.WAITING
    assert seq.last_token_id == 7
    seq.append_token(9, eos_token_ids=EOS, max_seq_len=None)
    assert seq.token_ids == [5, 6, 7, 9]
    assert (seq.num_prompt_tokens, seq.num_output_tokens, seq.num_tokens) == (3, 1, 4)
    assert seq.last_token_id == 9
    seq.num_cached_tokens = 3
    assert seq.num_uncached_tokens == 1


def test_eos_stops_and_is_kept_in_the_output() -> None:
    seq = Sequence("r", [5])
    assert seq.append_token(2, eos_token_ids=EOS, max_seq_len=None) is FinishReason.STOP
    assert seq.output_token_ids == [2]
    assert seq.is_finished and seq.finish_reason == "stop"


def test_ignore_eos_keeps_going_until_max_tokens() -> None:
    seq = Sequence("r", [5], SamplingParams(ignore_eos=True, max_tokens=2))
    assert seq.append_token(2, eos_token_ids=EOS, max_seq_len=None) is None
    assert seq.append_token(2, eos_token_ids=EOS, max_seq_len=None) is FinishReason.LENGTH
    assert seq.output_token_ids == [2, 2]


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    seq = Sequence("r", [5], SamplingParams(ignore_eos=True, stop_token_ids=(11,)))
    assert seq.append_token(11, eos_token_ids=EOS, max_seq_len=None) is FinishReason.STOP


def test_min_new_tokens_delays_stopping() -> None:
    seq = Sequence("r", [5], SamplingParams(min_new_tokens=2, stop_token_ids=(11,)))
    assert seq.append_token(2, eos_token_ids=EOS, max_seq_len=None) is None
    assert seq.append_token(11, eos_token_ids=EOS, max_seq_len=None) is None
    assert seq.append_token(2, eos_token_ids=EOS, max_seq_len=None) is FinishReason.STOP
    assert seq.output_token_ids == [2, 11, 2]


def test_session_len_finishes_with_length() -> None:
    seq = Sequence("r", [1, 1, 1], SamplingParams(max_tokens=100))
    assert seq.append_token(4, eos_token_ids=EOS, max_seq_len=5) is None
    assert seq.append_token(4, eos_token_ids=EOS, max_seq_len=5) is FinishReason.LENGTH
    assert seq.num_tokens == 5


def test_appending_to_a_finished_sequence_is_refused() -> None:
    seq = Sequence("r", [5], SamplingParams(max_tokens=1))
    seq.append_token(4, eos_token_ids=EOS, max_seq_len=None)
    with pytest.raises(RuntimeError, match="request r is finished; cannot append"):
        seq.append_token(4, eos_token_ids=EOS, max_seq_len=None)


def test_banned_tokens_until_min_new_tokens() -> None:
    seq = Sequence("r", [5], SamplingParams(min_new_tokens=1, stop_token_ids=(11,)))
    assert sorted(banned_token_ids(seq, [2])) == [2, 11]
    seq.append_token(7, eos_token_ids=EOS, max_seq_len=None)
    assert banned_token_ids(seq, [2]) == []
    ignoring = Sequence("q", [5], SamplingParams(min_new_tokens=1, ignore_eos=True))
    assert banned_token_ids(ignoring, [2]) == []

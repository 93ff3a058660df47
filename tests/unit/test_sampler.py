"""Sampler: greedy, warpers, penalties, seeds and logprobs on a [B, V] logits batch."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from lmd.engine.sampler import Sampler
from lmd.engine.sequence import SamplingParams, Sequence

EOS = 2


def seq(request_id: str = "r", prompt: list[int] | None = None, **params: object) -> Sequence:
    return Sequence(request_id, prompt or [0], SamplingParams(**params))  # type: ignore[arg-type]


def random_logits(batch: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_picks_the_argmax_of_each_row() -> None:
    logits = random_logits(3)
    out = Sampler().sample(logits, [seq(temperature=0) for _ in range(3)])
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(4)
    seqs = [seq(temperature=0.9, top_k=1), seq(temperature=1.5, top_k=1, seed=3)] * 2
    out = Sampler().sample(logits, seqs)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_same_seed_gives_the_same_tokens_whatever_the_batch() -> None:
    logits = torch.zeros(1, 1000)  # uniform: every token equally likely
    alone = Sampler().sample(logits, [seq(seed=1234)]).token_ids.tolist()
    crowd = [seq("x", seed=99), seq(seed=1234), seq("y")]
    batched = Sampler().sample(torch.zeros(3, 1000), crowd).token_ids.tolist()
    assert batched[1] == alone[0]
    assert Sampler().sample(logits, [seq(seed=1234)]).token_ids.tolist() == alone


def test_seeded_stream_is_reproducible_and_varies_per_step() -> None:
    def run(seed: int) -> list[int]:
        s = seq(seed=seed, max_tokens=100)
        for _ in range(8):
            token = int(Sampler().sample(torch.zeros(1, 1000), [s]).token_ids[0])
            s.append_token(token, eos_token_ids=(), max_seq_len=None)
        return s.output_token_ids

    first = run(7)
    assert run(7) == first
    assert len(set(first)) > 1  # a new draw each step, not one token repeated
    assert run(8) != first


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    counts = Counter(int(Sampler().sample(logits, [seq(seed=i)]).token_ids[0]) for i in range(3000))
    assert abs(counts[0] / 3000 - 0.6) < 0.04
    assert abs(counts[1] / 3000 - 0.3) < 0.04
    assert abs(counts[2] / 3000 - 0.1) < 0.03


def draws(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> set[int]:
    """Every token drawn over 300 seeds."""
    seqs = [seq(seed=i, top_k=top_k, top_p=top_p, min_p=min_p) for i in range(300)]
    return {int(Sampler().sample(logits, [s]).token_ids[0]) for s in seqs}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert draws(logits, top_p=0.45) == {0}
    assert draws(logits, top_p=0.7) == {0, 1}
    assert draws(logits, top_p=0.85) == {0, 1, 2}


def test_top_k_keeps_the_k_most_likely() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert draws(logits, top_k=2) == {0, 1}


def test_min_p_drops_tokens_below_a_share_of_the_top_one() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    assert draws(logits, min_p=0.3) == {0, 1}  # 0.1 < 0.3 * 0.6


def test_repetition_penalty_covers_prompt_and_output() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, -1.0, 1.5]])
    s = seq(prompt=[3], temperature=0, repetition_penalty=2.0)
    assert Sampler().sample(logits, [s]).token_ids.tolist() == [5]  # 2.0 / 2 < 1.5
    s.append_token(5, eos_token_ids=(), max_seq_len=None)
    # 3 -> 1.0, 5 -> 0.75; negative logits are multiplied, so 4 stays last.
    logits = torch.tensor([[0.9, 0.0, 0.0, 2.0, -1.0, 1.5]])
    assert Sampler().sample(logits, [s]).token_ids.tolist() == [3]
    plain = seq(prompt=[3], temperature=0)
    assert Sampler().sample(logits, [plain]).token_ids.tolist() == [3]


def test_min_new_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])  # eos (2) then stop token 3 lead
    early = seq(temperature=0, min_new_tokens=1, stop_token_ids=(3,))
    assert Sampler(eos_token_ids=[EOS]).sample(logits, [early]).token_ids.tolist() == [4]
    ignoring = seq(temperature=0, min_new_tokens=1, ignore_eos=True)
    assert Sampler(eos_token_ids=[EOS]).sample(logits, [ignoring]).token_ids.tolist() == [2]
    early.append_token(4, eos_token_ids=(EOS,), max_seq_len=None)
    assert Sampler(eos_token_ids=[EOS]).sample(logits, [early]).token_ids.tolist() == [2]


def test_logprobs_of_the_chosen_token_and_top_alternatives() -> None:
    logits = random_logits(3)
    seqs = [seq(temperature=0, logprobs=3), seq(temperature=0), seq(temperature=0, logprobs=0)]
    tokens, rows = Sampler().sample(logits, seqs).tolist()
    expected = logits.log_softmax(-1)
    first = rows[0]
    assert first is not None
    assert first.token_id == tokens[0]
    assert first.logprob == pytest.approx(float(expected[0, tokens[0]]), abs=1e-5)
    top_ids = expected[0].topk(3).indices.tolist()
    assert [token for token, _ in first.top] == top_ids
    assert first.top[0][1] == pytest.approx(first.logprob, abs=1e-5)  # greedy: top is chosen
    assert rows[1] is None
    last = rows[2]
    assert last is not None and last.top == []
    assert last.logprob == pytest.approx(float(expected[2, tokens[2]]), abs=1e-5)


def test_half_precision_logits_are_accepted() -> None:
    logits = random_logits(2).to(torch.bfloat16)
    out = Sampler().sample(logits, [seq(temperature=0), seq(seed=5, top_p=0.9)])
    assert out.token_ids.dtype == torch.int64
    assert int(out.token_ids[0]) == int(logits.float().argmax(-1)[0])


def test_batch_size_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"logits must be \[B, V\] with B = 1 sequences"):
        Sampler().sample(torch.zeros(2, 5), [seq()])


def test_top_k_draws_only_from_the_k_most_likely_of_a_large_vocabulary() -> None:
    logits = random_logits(1, vocab=5000, seed=4) * 0.2  # flat: many tokens are plausible
    assert draws(logits, top_k=5) == set(logits[0].topk(5).indices.tolist())


def test_seeded_rows_draw_the_same_in_a_mixed_batch_as_alone() -> None:
    vocab = 3000
    logits = random_logits(1, vocab=vocab, seed=9) * 0.3
    kinds: list[dict[str, Any]] = [
        {},
        {"top_k": 20},
        {"top_p": 0.5},  # needs more than the first stage's 64 candidates
        {"min_p": 0.5},
        {"temperature": 0.7, "top_k": 300, "top_p": 0.9, "min_p": 0.02},
    ]
    others = [
        seq("greedy", temperature=0),
        seq("unseeded", top_k=7),
        seq("penalized", prompt=[1, 2, 3], repetition_penalty=1.3, seed=5),
        seq("banned", min_new_tokens=2, stop_token_ids=(4,), top_p=0.8),
    ]
    for kind in kinds:
        for seed in range(5):
            alone = Sampler(eos_token_ids=[EOS]).sample(logits, [seq(seed=seed, **kind)])
            crowd = [*others[:2], seq(seed=seed, **kind), *others[2:]]
            mixed = Sampler(eos_token_ids=[EOS]).sample(logits.expand(len(crowd), vocab), crowd)
            assert int(mixed.token_ids[2]) == int(alone.token_ids[0]), (kind, seed)


def test_logprobs_for_some_sampled_rows_are_of_the_raw_distribution() -> None:
    logits = random_logits(3, vocab=400)
    seqs = [seq(seed=1, top_p=0.9, logprobs=2), seq(seed=2), seq(temperature=0, logprobs=0)]
    tokens, rows = Sampler().sample(logits, seqs).tolist()
    expected = logits.log_softmax(-1)
    first, last = rows[0], rows[2]
    assert first is not None and rows[1] is None and last is not None
    assert first.logprob == pytest.approx(float(expected[0, tokens[0]]), abs=1e-5)
    assert [token for token, _ in first.top] == expected[0].topk(2).indices.tolist()
    assert last.logprob == pytest.approx(float(expected[2].max()), abs=1e-5)


def test_a_sampler_reused_over_steps_of_any_size_samples_as_a_fresh_one() -> None:
    kinds: list[dict[str, Any]] = [
        {"min_p": 0.3},
        {"top_p": 0.6},
        {"top_k": 4, "logprobs": 2},
        {"temperature": 0, "repetition_penalty": 1.2},
        {"temperature": 0.5},
    ]
    reused = Sampler()
    for step, size in enumerate([5, 2, 7, 1, 6]):
        logits = random_logits(size, vocab=700, seed=step)
        seqs = [seq(f"r{i}", seed=i, **kinds[i % len(kinds)]) for i in range(size)]
        tokens, rows = reused.sample(logits, seqs).tolist()
        assert (tokens, rows) == Sampler().sample(logits, seqs).tolist()

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmd.engine.backends import select_backend
from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.fake_backend import FakeBackend
from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.sequence import SamplingParams, Sequence
from tests.models import TINY_EOS, save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_fake_backend_is_selected_by_name_and_reads_the_model_facts(model_dir: Path) -> None:
    cls = select_backend("fake", "LlamaForCausalLM", "cpu")
    assert cls is FakeBackend
    fake = cls(model_dir, torch.device("cpu"), torch.float32)
    assert (fake.num_layers, fake.num_kv_heads, fake.head_dim) == (2, 2, 16)
    assert fake.vocab_size == 512 and fake.eos_token_ids == (TINY_EOS,)


def test_engine_runs_on_it_with_fixed_tokens_and_frees_everything(model_dir: Path) -> None:
    engine = Engine.build(
        model_dir, EngineConfig(block_size=16, cache_max_entry_count=32), backend="fake"
    )
    params = SamplingParams(temperature=0.0, max_tokens=20)
    seqs = [Sequence(f"r{i}", [5 + i] * (10 + 7 * i), params) for i in range(4)]
    for seq in seqs:
        engine.add(seq)
    while engine.has_work:
        engine.step()
    fake = engine.backend
    assert isinstance(fake, FakeBackend)
    for seq in seqs:
        assert len(seq.output_token_ids) == 20  # never an EOS, so always max_tokens
        expected = fake.next_token(torch.tensor(seq.prompt_token_ids[-1])).item()
        assert seq.output_token_ids[0] == expected
        assert TINY_EOS not in seq.output_token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_forward_gives_one_hot_logits_with_nothing_left_from_earlier_steps(
    model_dir: Path,
) -> None:
    fake = FakeBackend(model_dir, torch.device("cpu"), torch.float32)
    for last_tokens in ([3, 9, 40], [7], [1, 2, 3, 4, 5, 6, 7], [11, 12]):
        batch = ForwardBatch.pack(
            [[t] for t in last_tokens], [0] * len(last_tokens), [[0]] * len(last_tokens), 16
        )
        logits = fake.forward(batch, torch.empty(0))
        expected = torch.zeros(len(last_tokens), fake.vocab_size)
        expected[range(len(last_tokens)), fake.next_token(torch.tensor(last_tokens))] = 1.0
        assert torch.equal(logits, expected)

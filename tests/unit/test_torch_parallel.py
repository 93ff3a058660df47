"""The torch backend split over a tensor-parallel group of two gloo processes (CPU):
every rank's logits equal the whole model's, for prefill chunks, prefix hits and decode
steps; each rank's KV pool holds its own heads of the whole model's cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lmd.engine.parallel import SINGLE, ParallelError, TensorParallel
from tests.models import save_tiny_llama
from tests.parallel import run_group

BLOCK = 16


def _steps(tp: TensorParallel, model_dir: str, **kwargs: Any) -> dict[str, np.ndarray]:
    """Three steps through the torch backend (a rank's shard when tp has a group):
    two prompts, a decode step of both, then a chunk after a cached prefix."""
    from lmd.engine.forward_batch import ForwardBatch
    from lmd.engine.kv_pool import KVPool
    from lmd.engine.torch_backend import TorchBackend

    torch.set_num_threads(1)
    # fp32 GEMMs: two ranks' shards against the whole model, to fp32 rounding.
    kwargs.setdefault("cpu_matmul_dtype", "float32")
    backend = TorchBackend(Path(model_dir), torch.device("cpu"), torch.float32, tp=tp, **kwargs)
    pool = KVPool.for_backend(backend, 8, BLOCK)
    prompts = ForwardBatch.pack([list(range(3, 23)), [7, 8, 9]], [0, 0], [[0, 1], [2]], BLOCK)
    decode = ForwardBatch.pack([[5], [6]], [20, 3], [[0, 1], [2]], BLOCK)
    chunk = ForwardBatch.pack([[11, 12, 13, 14]], [4], [[2]], BLOCK)
    out = {
        name: backend.forward(batch, pool.kv).numpy().copy()
        for name, batch in (("prompts", prompts), ("decode", decode), ("chunk", chunk))
    }
    out["kv"] = pool.kv[:3].numpy().copy()  # [3, L, 2, S, Hkv / N, D]
    out["heads"] = np.array([backend.num_kv_heads, backend.vocab_size])
    return out


def _whole(model_dir: Path, **kwargs: Any) -> dict[str, np.ndarray]:
    return _steps(SINGLE, str(model_dir), **kwargs)


@pytest.mark.parametrize("overrides", [{}, {"vocab_size": 509, "tie_word_embeddings": True}])
def test_two_ranks_compute_the_whole_models_logits(
    tmp_path: Path, overrides: dict[str, Any]
) -> None:
    """Vocabularies that split unevenly (509 over 2 ranks) and tied embeddings too."""
    model = save_tiny_llama(tmp_path / "model", **overrides)
    whole = _whole(model)
    ranks = run_group(2, _steps, str(model))
    for rank, got in enumerate(ranks):
        for step in ("prompts", "decode", "chunk"):
            assert got[step].shape == whole[step].shape
            np.testing.assert_allclose(got[step], whole[step], rtol=0, atol=2e-5)
        heads, vocab = got["heads"]
        assert heads == 1 and vocab == whole["heads"][1]
        # rank r's pool holds KV head r of the whole model's (2 KV heads)
        np.testing.assert_allclose(got["kv"], whole["kv"][..., rank : rank + 1, :], atol=2e-5)


def test_heads_that_do_not_split_are_refused_in_one_line(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model", num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(
        AssertionError, match=r"KV heads \(1\) is not divisible by the tensor-parallel size 2"
    ):
        run_group(2, _steps, str(model))


def test_a_rank_takes_its_share_or_says_why() -> None:
    tp = TensorParallel(1, 2)
    assert tp.part(8, "heads") == slice(4, 8)
    assert tp.vocab_part(509) == slice(255, 509)
    assert TensorParallel(3, 4).vocab_part(9) == slice(9, 9)  # ceil(9 / 4) = 3: none left
    with pytest.raises(ParallelError, match=r"kv heads \(3\) is not divisible"):
        tp.part(3, "kv heads")
    with pytest.raises(ValueError, match="not a tensor-parallel rank"):
        TensorParallel(2, 2)


def test_ranks_that_cannot_each_hold_the_checkpoint_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers loads the whole checkpoint in every rank: N copies must fit the host."""
    import psutil

    from lmd.engine.memory_needs import weight_bytes
    from lmd.engine.torch_backend.parallel import check_host_memory

    model = save_tiny_llama(tmp_path / "model")
    weights = weight_bytes(model, torch.float32)
    memory = psutil.virtual_memory()._replace(available=weights * 2 - 1)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    check_host_memory(model, TensorParallel(0, 1), torch.float32)
    with pytest.raises(ParallelError, match=r"its 2 ranks each load the whole checkpoint"):
        check_host_memory(model, TensorParallel(0, 2), torch.float32)

"""The turbo backend split over a tensor-parallel group (engine/parallel.py).

Two gloo processes on the CPU, the Triton kernels through the interpreter (as
tests/unit/test_turbo_model.py), float32: for a Llama (biases on every projection, a
vocabulary that splits unevenly), a Qwen3 (RMSNorm over each q and k head), a Qwen3-MoE
(experts and a dense layer) and a Gemma 3 (norms after attention and MLP, tied and
scaled embedding), every rank's logits equal the whole model's for prefill, a decode
step and a chunk after a cached prefix, and each rank's KV pool holds its own heads of
the whole model's. Each rank reads only its part of each tensor, and a model that does
not split is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma3ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

# First: without CUDA this switches Triton to its interpreter before turbo is imported
# (the ranks' processes inherit TRITON_INTERPRET and import this module to find _steps).
from tests.unit.test_turbo_families import build, gemma3, qwen3, qwen3_moe

pytest.importorskip("triton")

from lmd.engine.backend import BackendError
from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.parallel import SINGLE, ParallelError, TensorParallel
from lmd.engine.turbo import checkpoint
from lmd.engine.turbo.backend import TurboBackend
from lmd.engine.turbo.config import TurboConfig
from lmd.engine.turbo.quant.scheme import QuantScheme
from lmd.engine.turbo.quant.w4a16 import W4A16Weight
from lmd.engine.turbo.weights import ExpertWeights, ModelWeights, load_weights
from tests.models import save_tiny_llama
from tests.parallel import run_group
from tests.unit.test_turbo_weights import sixteen

BLOCK = 8  # the first prompt spans two blocks; few tokens: the interpreter is slow
CPU = torch.device("cpu")
FAMILIES = ("llama", "qwen3", "qwen3-moe", "gemma3")


def save_family(family: str, path: Path) -> Path:
    if family == "llama":
        return save_tiny_llama(path, vocab_size=509, attention_bias=True, mlp_bias=True)
    if family == "qwen3":
        return build(path, Qwen3ForCausalLM, qwen3())
    if family == "qwen3-moe":  # layer 0 of experts (normalized top-k), layer 1 dense
        config = qwen3_moe(num_hidden_layers=2, norm_topk_prob=True, mlp_only_layers=[1])
        return build(path, Qwen3MoeForCausalLM, config)
    # A local layer (window 9, shorter than the first prompt) and a global one.
    layers = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    return build(path, Gemma3ForCausalLM, gemma3(**layers))


def _pool(backend: TurboBackend, tp: TensorParallel, num_blocks: int = 4) -> torch.Tensor:
    """Rank tp.rank's heads of one random whole pool (the same on every rank): the
    kernels must read only the slots a step wrote, never what was there before."""
    shape = list(backend.kv_cache_shape(num_blocks, BLOCK))  # [N, L, 2, S, Hkv / N, D]
    heads = shape[4]
    shape[4] = heads * tp.size
    whole = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    return whole[..., tp.rank * heads : (tp.rank + 1) * heads, :].contiguous()


def _steps(tp: TensorParallel, model_dir: str) -> dict[str, np.ndarray]:
    """Three steps through turbo (a rank's shard when tp has a group): two prompts, a
    decode step of both, then a chunk after a cached prefix of block 2."""
    torch.set_num_threads(1)
    backend = TurboBackend(Path(model_dir), CPU, torch.float32, tp=tp)
    kv = _pool(backend, tp)
    prompts = ForwardBatch.pack([list(range(3, 14)), [7, 8, 9]], [0, 0], [[0, 1], [2]], BLOCK)
    decode = ForwardBatch.pack([[5], [6]], [11, 3], [[0, 1], [2]], BLOCK)
    chunk = ForwardBatch.pack([[11, 12, 13, 14]], [4], [[2]], BLOCK)
    out = {
        name: backend.forward(batch, kv).numpy().copy()
        for name, batch in (("prompts", prompts), ("decode", decode), ("chunk", chunk))
    }
    out["kv"] = kv[:3].numpy().copy()  # [3, L, 2, S, Hkv / N, D]
    out["heads"] = np.array([backend.num_kv_heads, backend.vocab_size])
    return out


def _every_family(tp: TensorParallel, model_dirs: dict[str, str]) -> dict[str, Any]:
    return {family: _steps(tp, path) for family, path in model_dirs.items()}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {f: str(save_family(f, tmp_path_factory.mktemp(f))) for f in FAMILIES}


@pytest.fixture(scope="module")
def ranks(model_dirs: dict[str, str]) -> list[dict[str, Any]]:
    """Every family's steps on each rank of one group of two (one spawn for all)."""
    results: list[dict[str, Any]] = run_group(2, _every_family, model_dirs)
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_compute_the_whole_models_logits(
    family: str, model_dirs: dict[str, str], ranks: list[dict[str, Any]]
) -> None:
    whole = _steps(SINGLE, model_dirs[family])
    kv_heads = int(whole["heads"][0]) // 2
    for rank, steps in enumerate(ranks):
        got = steps[family]
        for step in ("prompts", "decode", "chunk"):
            assert got[step].shape == whole[step].shape
            np.testing.assert_allclose(got[step], whole[step], rtol=0, atol=2e-5, err_msg=step)
        assert list(got["heads"]) == [kv_heads, whole["heads"][1]]
        mine = whole["kv"][..., rank * kv_heads : (rank + 1) * kv_heads, :]
        np.testing.assert_allclose(got["kv"], mine, rtol=0, atol=2e-5)


def _ranks_weights(model_dir: Path, size: int = 2, **kwargs: Any) -> list[ModelWeights]:
    """Each rank's shard as it loads (no group: loading meets no other rank)."""
    config = TurboConfig.load(model_dir)
    return [
        load_weights(model_dir, config, CPU, torch.float32, tp=TensorParallel(r, size), **kwargs)
        for r in range(size)
    ]


def test_each_rank_holds_its_heads_and_its_part_of_the_width(tmp_path: Path) -> None:
    model_dir = save_family("llama", tmp_path)
    config = TurboConfig.load(model_dir)
    whole = load_weights(model_dir, config, CPU, torch.float32)
    ranks = _ranks_weights(model_dir)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i, layer in enumerate(whole.layers):
        parts = [r.layers[i] for r in ranks]
        # qkv: [(H + 2 Hkv) D / N, hidden], each rank its q heads | k heads | v heads
        for name in ("qkv", "qkv_bias"):
            by_rank = [torch.split(getattr(p, name), [q // 2, kv // 2, kv // 2]) for p in parts]
            whole_parts = torch.split(getattr(layer, name), [q, kv, kv])
            for j, expected in enumerate(whole_parts):
                assert torch.equal(torch.cat([r[j] for r in by_rank]), expected)
        for name in ("gate_up", "gate_up_bias"):  # [2 I / N], each rank its gate | its up
            halves = [torch.chunk(getattr(p, name), 2) for p in parts]
            expected = torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]])
            assert torch.equal(expected, getattr(layer, name))
        for name in ("o", "down"):  # input columns
            assert torch.equal(
                torch.cat([getattr(p, name) for p in parts], 1), getattr(layer, name)
            )
        for name in ("o_bias", "down_bias"):  # added once, to the group's sum, by rank 0
            assert torch.equal(getattr(parts[0], name), getattr(layer, name))
            assert getattr(parts[1], name) is None
    # The vocabulary splits unevenly: 509 rows as 255 + 254.
    assert [r.embed.shape[0] for r in ranks] == [255, 254]
    assert torch.equal(torch.cat([r.embed for r in ranks]), whole.embed)
    assert torch.equal(torch.cat([r.lm_head for r in ranks]), whole.lm_head)


def _experts(weights: ModelWeights) -> ExpertWeights:
    experts = weights.layers[0].experts
    assert experts is not None
    return experts


class RecordingHandle:
    """A safetensors handle that notes the tensors read whole."""

    def __init__(self, handle: Any, whole: list[str]) -> None:
        self.handle, self.whole = handle, whole

    def __enter__(self) -> RecordingHandle:
        self.handle.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self.handle.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        self.whole.append(name)
        tensor: torch.Tensor = self.handle.get_tensor(name)
        return tensor

    def get_slice(self, name: str) -> Any:
        return self.handle.get_slice(name)


def test_a_rank_reads_no_split_tensor_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only norms are read whole: a rank never holds a whole projection on its device."""
    import safetensors

    whole: list[str] = []
    monkeypatch.setattr(
        checkpoint,
        "safe_open",
        lambda *args, **kwargs: RecordingHandle(safetensors.safe_open(*args, **kwargs), whole),
    )
    _ranks_weights(save_family("llama", tmp_path))
    assert whole and all(
        name.endswith(("norm.weight", "o_proj.bias", "down_proj.bias")) for name in whole
    )


@pytest.mark.parametrize("stacked", [False, True])
def test_each_rank_holds_its_part_of_every_expert(tmp_path: Path, stacked: bool) -> None:
    model_dir = save_family("qwen3-moe", tmp_path / "model")
    if stacked:  # the form transformers 5 keeps in memory: [E, 2I, hidden], [E, hidden, I]
        tensors = load_file(model_dir / "model.safetensors")
        prefix = "model.layers.0.mlp.experts"
        experts = range(8)
        gates, ups, downs = (
            [tensors.pop(f"{prefix}.{j}.{n}_proj.weight") for j in experts]
            for n in ("gate", "up", "down")
        )
        stacked_gate_up = [torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(stacked_gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack(downs)
        save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    whole = load_weights(model_dir, TurboConfig.load(model_dir), CPU, torch.float32)
    ranks = _ranks_weights(model_dir)
    x, parts = _experts(whole), [_experts(r) for r in ranks]
    assert parts[0].gate_up.shape == (8, 32, 64)  # 8 experts: gate | up, 16 rows each of 32
    halves = [torch.chunk(sixteen(p.gate_up), 2, dim=1) for p in parts]
    gate_up = torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]], dim=1)
    assert torch.equal(gate_up, sixteen(x.gate_up))
    downs = [sixteen(p.down) for p in parts]
    assert torch.equal(torch.cat(downs, dim=2), sixteen(x.down))
    assert all(torch.equal(p.router, x.router) for p in parts)  # the router stays whole
    dense = ranks[0].layers[1]  # layer 1's dense MLP: its own intermediate_size, split
    assert dense.gate_up is not None and dense.gate_up.shape == (128, 64)


def test_a_rank_left_without_vocabulary_rows_has_a_zero_row(tmp_path: Path) -> None:
    """ceil(9 / 4) = 3 rows a rank: the fourth rank gets none."""
    model_dir = save_tiny_llama(tmp_path, vocab_size=9, num_key_value_heads=4)
    last = _ranks_weights(model_dir, size=4)[3]
    assert torch.equal(last.embed, torch.zeros(1, 64)) and torch.equal(last.lm_head, last.embed)


def test_weights_quantized_at_load_quantize_the_ranks_part(tmp_path: Path) -> None:
    model_dir = save_family("llama", tmp_path)
    whole = load_weights(model_dir, TurboConfig.load(model_dir), CPU, torch.float32)
    ranks = _ranks_weights(model_dir, scheme=QuantScheme("w4a16", "load"))
    o = ranks[1].layers[0].o
    assert isinstance(o, W4A16Weight) and isinstance(whole.layers[0].o, torch.Tensor)
    mine = W4A16Weight.quantize(whole.layers[0].o[:, 32:])  # rank 1's heads 2 and 3
    assert torch.equal(o.dequantize(), mine.dequantize())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"num_key_value_heads": 1},
            r"KV heads \(1\) is not divisible by the tensor-parallel size 2",
        ),
        (
            {"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 48},
            r"attention heads \(3\)",
        ),
        ({"intermediate_size": 129}, r"intermediate_size \(129\) is not divisible"),
    ],
)
def test_a_model_that_does_not_split_is_refused_in_one_line(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    model_dir = save_tiny_llama(tmp_path, **overrides)
    with pytest.raises(BackendError, match=f"cannot split .* over 2 ranks: {message}") as info:
        TurboBackend(model_dir, CPU, torch.float32, tp=TensorParallel(0, 2))
    assert "\n" not in str(info.value)


def _moe_config(**overrides: Any) -> TurboConfig:
    raw = qwen3_moe(**overrides).to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}
    return TurboConfig.from_dict(raw)


def test_a_rank_config_has_its_share_of_heads_and_widths() -> None:
    config = _moe_config()
    rank = config.for_rank(TensorParallel(1, 2))
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size) == (2, 1, 64)
    assert rank.moe is not None and rank.moe.intermediate_size == 16
    assert rank.vocab_size == config.vocab_size  # the logits are gathered whole
    assert config.for_rank(SINGLE) is config
    odd = _moe_config(moe_intermediate_size=33)
    with pytest.raises(ParallelError, match=r"the experts' intermediate_size \(33\) is not"):
        odd.for_rank(TensorParallel(0, 2))

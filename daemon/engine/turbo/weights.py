"""Load a Llama-family checkpoint (safetensors) into the turbo decoder's fused layout.

Per layer, q/k/v become one [(H + 2 Hkv) * D, hidden] matrix and gate/up one
[2 I, hidden] matrix, so each runs as one GEMM; a layer of experts stacks them, gate/up
as [E, 2 I, hidden] and down as [E, hidden, I] (one grouped GEMM each, kernels/moe.py);
everything else keeps its Hugging Face shape. With a quantization scheme (quant/), the
layers' linears are W4A16 or FP8 weights of those same [N, K] shapes. Names are transformers'
(`model.layers.{i}.self_attn.q_proj.weight`, ...), which is also what lmd's GGUF
conversion writes. Tensors the decoder does not use (e.g. old
`rotary_emb.inv_freq` buffers) are ignored; a missing one is an error that names it.

A rank of a tensor-parallel group (engine/parallel.py) loads its shard, read part by
part from the files (checkpoint.py): the shapes below are then the rank's (its H and
Hkv heads, its part of I, its vocabulary rows, config.for_rank), and the biases of o and
down, added to the group's sum, are rank 0's alone.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lmd.engine.parallel import SINGLE, TensorParallel
from lmd.engine.turbo.checkpoint import CheckpointReader, Shard
from lmd.engine.turbo.config import TurboConfig, UnsupportedModel
from lmd.engine.turbo.quant.fp8 import Fp8Weight
from lmd.engine.turbo.quant.fp8_experts import Fp8Experts
from lmd.engine.turbo.quant.load import Experts, Linear, fold_down_order, load_linear, read_dense
from lmd.engine.turbo.quant.scheme import QuantScheme, quantized_experts
from lmd.engine.turbo.quant.w4a16 import W4A16Weight
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts


@dataclass(slots=True)
class ExpertWeights:
    router: Tensor  # [E, hidden]
    gate_up: Experts  # [E, 2 I, hidden], each expert's rows gate | up
    down: Experts  # [E, hidden, I]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.router, self.gate_up, self.down))


@dataclass(slots=True)
class LayerWeights:
    input_norm: Tensor  # [hidden]
    qkv: Linear  # [(H + 2 Hkv) * D, hidden], rows q | k | v (16-bit or quantized)
    qkv_bias: Tensor | None  # [(H + 2 Hkv) * D]
    q_norm: Tensor | None  # [D], the RMSNorm of each q head (Qwen3, Gemma 3)
    k_norm: Tensor | None  # [D], of each k head
    o: Linear  # [hidden, H * D]
    o_bias: Tensor | None  # [hidden]; None on ranks > 0 (rank 0 adds it to the sum)
    attn_out_norm: Tensor | None  # [hidden], Gemma's norm of the attention's output
    post_norm: Tensor  # [hidden], before the MLP
    # The dense MLP, or (a layer of experts) None and `experts`.
    gate_up: Linear | None  # [2 I, hidden], rows gate | up
    gate_up_bias: Tensor | None  # [2 I]
    down: Linear | None  # [hidden, I]
    down_bias: Tensor | None  # [hidden]; as o_bias
    mlp_out_norm: Tensor | None  # [hidden], Gemma's norm of the MLP's output
    experts: ExpertWeights | None

    @property
    def plain_dense(self) -> bool:
        """A dense layer of unquantized weights without norms after attention or the MLP."""
        linears = (self.qkv, self.o, self.gate_up, self.down)
        no_norms = self.attn_out_norm is None and self.mlp_out_norm is None
        return self.experts is None and no_norms and all(isinstance(x, Tensor) for x in linears)


@dataclass(slots=True)
class ModelWeights:
    embed: Tensor  # [V, hidden]; a rank's vocabulary rows (one zero row if it has none)
    layers: list[LayerWeights]
    norm: Tensor  # [hidden]
    lm_head: Tensor  # [V, hidden], rows as embed's; the embedding itself when tied

    @property
    def nbytes(self) -> int:
        tensors: list[Linear | None] = [self.embed, self.norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        experts = 0
        for layer in self.layers:
            tensors.extend(getattr(layer, n) for n in LayerWeights.__slots__ if n != "experts")
            experts += layer.experts.nbytes if layer.experts is not None else 0
        return experts + sum(t.nbytes for t in tensors if t is not None)


def load_weights(
    model_dir: Path,
    config: TurboConfig,
    device: torch.device,
    dtype: torch.dtype,
    scheme: QuantScheme | None = None,
    *,
    tp: TensorParallel = SINGLE,
) -> ModelWeights:
    """Read the checkpoint in `model_dir` (of the whole model's `config`) into fused
    tensors on `device` in `dtype`, the layers' linears as `scheme` has them
    (quant/load.py); rank tp.rank's shard of them with a group (ParallelError when
    `config` does not split: see TurboConfig.for_rank)."""
    if scheme is not None and scheme.act_order and tp.enabled:
        raise UnsupportedModel(
            "tensor parallelism does not split act-order (desc_act) GPTQ checkpoints: a "
            "rank's inputs of o and down would span every group"
        )
    rank = config.for_rank(tp)
    # A row-parallel layer's bias (o, down) is added once, by rank 0, to the group's sum.
    row_bias = tp.rank == 0
    with ExitStack() as stack:
        reader = CheckpointReader(model_dir, device, stack, Shard(config, tp, scheme))

        def linear(prefixes: list[str]) -> Linear:
            return load_linear(reader, prefixes, scheme, dtype, device)

        def get(name: str) -> Tensor:
            return reader.get(name, dtype, device)

        def cat(names: list[str]) -> Tensor:
            return torch.cat([get(n) for n in names])

        def norm(name: str) -> Tensor:
            """An RMSNorm's weight; Gemma's scale by 1 + weight, added here in float32."""
            if not config.norm_plus_one:
                return get(name)
            return (reader.get(name, torch.float32, device) + 1.0).to(dtype)

        sandwich = config.sandwich_norms

        layers = []
        for i in range(config.num_layers):
            layer = f"model.layers.{i}"
            attn, mlp = f"{layer}.self_attn", f"{layer}.mlp"
            qkv = [f"{attn}.{p}_proj" for p in "qkv"]
            gate_up = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
            sparse = config.moe is not None and config.moe.sparse_layers[i]
            dense = not sparse
            mlp_in, mlp_bias, mlp_out = None, None, None
            if dense:
                mlp_in, mlp_bias, mlp_out = fold_down_order(
                    linear(gate_up),
                    cat([f"{p}.bias" for p in gate_up]) if config.mlp_bias else None,
                    linear([f"{mlp}.down_proj"]),
                )
            layers.append(
                LayerWeights(
                    input_norm=norm(f"{layer}.input_layernorm.weight"),
                    qkv=linear(qkv),
                    qkv_bias=cat([f"{p}.bias" for p in qkv]) if config.qkv_bias else None,
                    q_norm=norm(f"{attn}.q_norm.weight") if config.qk_norm else None,
                    k_norm=norm(f"{attn}.k_norm.weight") if config.qk_norm else None,
                    o=linear([f"{attn}.o_proj"]),
                    o_bias=get(f"{attn}.o_proj.bias") if config.o_bias and row_bias else None,
                    # Gemma names the norm after attention "post_attention" and the one
                    # before the MLP "pre_feedforward"; the others have only the latter,
                    # under the former's name.
                    attn_out_norm=(
                        norm(f"{layer}.post_attention_layernorm.weight") if sandwich else None
                    ),
                    post_norm=norm(
                        f"{layer}.pre_feedforward_layernorm.weight"
                        if sandwich
                        else f"{layer}.post_attention_layernorm.weight"
                    ),
                    gate_up=mlp_in,
                    gate_up_bias=mlp_bias,
                    down=mlp_out,
                    down_bias=(
                        get(f"{mlp}.down_proj.bias")
                        if dense and config.mlp_bias and row_bias
                        else None
                    ),
                    mlp_out_norm=(
                        norm(f"{layer}.post_feedforward_layernorm.weight") if sandwich else None
                    ),
                    experts=(
                        load_experts(reader, rank, i, dtype, device, scheme=scheme)
                        if sparse
                        else None
                    ),
                )
            )
        embed = get("model.embed_tokens.weight")  # [V, hidden] (a rank's rows)
        if embed.shape[0] == 0:  # a last rank left no rows: one zero row to look up
            embed = torch.zeros(1, config.hidden_size, dtype=dtype, device=device)
        # transformers ties the head to the embedding whenever the config says so, even
        # if the file also holds an lm_head tensor.
        lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
        if lm_head.shape[0] == 0:
            lm_head = torch.zeros_like(embed)
        weights = ModelWeights(
            embed=embed, layers=layers, norm=norm("model.norm.weight"), lm_head=lm_head
        )
    check_shapes(weights, rank, tp)
    return weights


# Where each architecture keeps a layer's experts: the block, the router, and each
# expert's gate, up and down projections.
EXPERT_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
    "Qwen3MoeForCausalLM": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
}


def load_experts(
    reader: CheckpointReader,
    config: TurboConfig,
    layer: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    scheme: QuantScheme | None = None,
) -> ExpertWeights:
    """Layer `layer`'s router and experts, stacked: per-expert tensors as published
    (`experts.{j}.gate_proj.weight`, or quantized as `scheme` reads them), or the
    stacked form transformers 5 keeps in memory (`experts.gate_up_proj`,
    `experts.down_proj`) when a checkpoint has that. Under an FP8 scheme the experts are
    FP8 (Fp8Experts: a checkpoint's codes and scales, or quantized here per channel);
    under W4A16 4-bit (W4A16Experts: a checkpoint's words, or rounded here) where
    `quantized_experts` allows, else 16-bit (a checkpoint's dequantized). `config` is the
    rank's (its part of each expert's width), as `reader` reads them."""
    moe = config.moe
    if moe is None:
        raise ValueError("a dense model has no experts")
    block, router_name, (gate, up, down) = EXPERT_NAMES[config.architecture]
    prefix = f"model.layers.{layer}.{block}"
    router = read_dense(reader, f"{prefix}.{router_name}", scheme, dtype, device)
    e, i, hidden = moe.num_experts, moe.intermediate_size, config.hidden_size
    kept = scheme if scheme is not None and quantized_experts(scheme, config) else None
    if f"{prefix}.experts.gate_up_proj" in reader:
        gate_up, down_all = (
            reader.get(f"{prefix}.experts.{name}", dtype, device)
            for name in ("gate_up_proj", "down_proj")
        )
        if kept is None:
            return ExpertWeights(router, gate_up, down_all)
        if kept.method == "w4a16":
            four_bit = [W4A16Experts.quantize(t, kept.group_size) for t in (gate_up, down_all)]
            return ExpertWeights(router, *four_bit)
        quantized = [Fp8Experts.quantize(t, dtype, kept.block_size) for t in (gate_up, down_all)]
        return ExpertWeights(router, *quantized)
    # Filled in place: a torch.stack of the experts would hold the layer twice.
    stacks = (
        _empty_experts((e, 2 * i, hidden), kept, dtype, device),
        _empty_experts((e, hidden, i), kept, dtype, device),
    )
    for j in range(e):
        expert = f"{prefix}.experts.{j}"
        for name, stack, row, shape in (
            (gate, 0, 0, (i, hidden)),
            (up, 0, i, (i, hidden)),
            (down, 1, 0, (hidden, i)),
        ):
            at = f"{expert}.{name}"
            part: Linear = (
                read_dense(reader, at, scheme, dtype, device)
                if kept is None
                else load_linear(reader, [at], kept, dtype, device)
            )
            _put(stacks[stack], j, row, part, name=at, shape=shape)
    return ExpertWeights(router, *stacks)


def _empty_experts(
    shape: tuple[int, int, int],
    kept: QuantScheme | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Experts:
    """Room for a layer's experts of one projection in the form `kept` keeps them: FP8
    (its blocks, none when quantized at load), W4A16 (its groups), or 16-bit."""
    if kept is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if kept.method == "w4a16":
        return W4A16Experts.empty(shape, kept.group_size, dtype, device)
    return Fp8Experts.empty(shape, kept.block_size, dtype, device)


def _put(
    stack: Experts, j: int, row: int, part: Linear, *, name: str, shape: tuple[int, int]
) -> None:
    """Expert j's rows from `row` are `part`'s, read from `name` and expected of `shape`."""
    if tuple(part.shape) != shape:
        raise UnsupportedModel(f"{name} is {tuple(part.shape)}, not {shape}")
    if isinstance(stack, Fp8Experts) and isinstance(part, Fp8Weight):
        stack.put(j, row, part)  # whole blocks: load_linear refused a part off them
    elif isinstance(stack, W4A16Experts) and isinstance(part, W4A16Weight):
        try:
            stack.put(j, row, part)
        except ValueError as exc:  # groups or an order other than the scheme's
            raise UnsupportedModel(f"{name}: {exc}") from None
    elif isinstance(stack, Tensor) and isinstance(part, Tensor):
        stack[j, row : row + shape[0]] = part
    else:
        raise UnsupportedModel(f"{name}: a {type(part).__name__} among {type(stack).__name__}")


def check_shapes(weights: ModelWeights, config: TurboConfig, tp: TensorParallel = SINGLE) -> None:
    """Refuse a checkpoint whose tensors do not match its config (one line, the first);
    `config` is rank tp.rank's (TurboConfig.for_rank)."""
    c = config
    vocab = tp.vocab_part(c.vocab_size)
    vocab_rows = max(1, vocab.stop - vocab.start)  # a rank without rows has a zero row
    expected: dict[str, tuple[int, ...]] = {
        "embed": (vocab_rows, c.hidden_size),
        "lm_head": (vocab_rows, c.hidden_size),
        "norm": (c.hidden_size,),
    }
    for name, shape in expected.items():
        got = tuple(getattr(weights, name).shape)
        if got != shape:
            raise UnsupportedModel(f"{name} is {got}, the config says {shape}")
    per_layer: dict[str, tuple[int, ...]] = {
        "qkv": (c.qkv_size, c.hidden_size),
        "o": (c.hidden_size, c.num_heads * c.head_dim),
        "q_norm": (c.head_dim,),
        "k_norm": (c.head_dim,),
        "attn_out_norm": (c.hidden_size,),
        "mlp_out_norm": (c.hidden_size,),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }
    if c.moe is not None:
        e, i = c.moe.num_experts, c.moe.intermediate_size
        per_layer |= {
            "router": (e, c.hidden_size),
            "experts_gate_up": (e, 2 * i, c.hidden_size),
            "experts_down": (e, c.hidden_size, i),
        }
    for n, layer in enumerate(weights.layers):
        tensors: dict[str, Linear | Experts | None] = {
            name: getattr(layer, name) for name in per_layer if hasattr(layer, name)
        }
        if layer.experts is not None:
            x = layer.experts
            tensors |= {"router": x.router, "experts_gate_up": x.gate_up, "experts_down": x.down}
        for name, tensor in tensors.items():
            if tensor is not None and tuple(tensor.shape) != per_layer[name]:
                got = tuple(tensor.shape)
                raise UnsupportedModel(
                    f"layer {n} {name} is {got}, the config says {per_layer[name]}"
                )


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (as the torch backend)."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.exists():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(int(t) for t in eos) if isinstance(eos, list) else (int(eos),)
    return ()

"""The turbo backend's Triton kernels against float32 references on fresh random inputs.

On a machine without CUDA the kernels run on CPU tensors through Triton's interpreter
(see use_triton_interpreter), in float32 and float16 (the interpreter cannot feed
bfloat16 to tl.dot); with CUDA they run compiled, in float16 and bfloat16. Skipped
where triton is not installed (CI).
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from functools import partial

import pytest
import torch
from torch import Tensor

ON_CUDA = torch.cuda.is_available()


def use_triton_interpreter() -> None:
    """Without CUDA, run Triton kernels on CPU tensors through Triton's interpreter.

    Triton decides interpreter or compiler when a function is decorated, its own
    library (tl.sum, ...) at import; another test module may already have imported it
    (transformers does), so a compiling triton is dropped and imported again, with
    our kernels. Its C extension stays loaded.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    loaded = sys.modules.get("triton.language")
    if loaded is None or type(loaded.sum).__name__ == "InterpretedFunction":
        return
    for name in list(sys.modules):
        ours = name.startswith(("triton.", "lmd.engine.turbo")) or name == "triton"
        if ours and not name.startswith("triton._C"):
            del sys.modules[name]


if not ON_CUDA:
    use_triton_interpreter()
pytest.importorskip("triton")

from lmd.engine.turbo import kernels  # noqa: E402
from lmd.engine.turbo.kernels import kv_quant, rotary  # noqa: E402

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPES = [torch.float16, torch.bfloat16] if ON_CUDA else [torch.float32, torch.float16]
# Relative error bound per dtype (the output is rounded once to it; bf16 has 8 bits).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(out: Tensor, ref: Tensor) -> float:
    assert not out.isnan().any(), "NaN in the kernel's output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


# References --------------------------------------------------------------------------


def rms_norm_ref(x: Tensor, w: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def rope_table(max_pos: int, head_dim: int, theta: float = 10000.0) -> Tensor:
    """[P, D] float32: cos | sin of the D/2 frequencies, as the model builds it."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotate_ref(x: Tensor, positions: Tensor, table: Tensor) -> Tensor:
    """x: [T, heads, D] -> float32, transformers' rotate-half rotary."""
    half = x.shape[-1] // 2
    cos = table[positions, :half].float()[:, None].repeat(1, 1, 2)
    sin = table[positions, half:].float()[:, None].repeat(1, 1, 2)
    x = x.float()
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention_ref(
    q: Tensor,
    kv: Tensor,
    *,
    layer: int,
    tables: list[list[int]],
    seq_lens: list[int],
    context_lens: list[int],
    scale: float,
    window: int,
) -> Tensor:
    """[T, H, D] float32: each sequence's new tokens over its context gathered from the
    pool, causal (and windowed), in float32."""
    block_size, num_kv_heads = kv.shape[3], kv.shape[4]
    group = q.shape[1] // num_kv_heads
    out = []
    row = 0
    for table, n, ctx in zip(tables, seq_lens, context_lens, strict=True):
        slots = torch.arange(ctx, device=kv.device)
        blocks = torch.tensor(table, device=kv.device)[slots // block_size]
        k = kv[blocks, layer, 0, slots % block_size].float()  # [ctx, Hkv, D]
        v = kv[blocks, layer, 1, slots % block_size].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qs = q[row : row + n].float()  # [n, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        pos = torch.arange(ctx - n, ctx, device=kv.device)
        visible = slots[None, :] <= pos[:, None]
        if window:
            visible &= pos[:, None] - slots[None, :] < window
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        row += n
    return torch.cat(out)


@dataclass(frozen=True)
class Attention:
    """An attention shape: query heads, KV heads, head_dim, and the pool's block size."""

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int

    def pool(self, num_blocks: int, layers: int, dtype: torch.dtype) -> Tensor:
        """A random (never zero) pool [N, L, 2, S, Hkv, D]."""
        shape = (num_blocks, layers, 2, self.block_size, self.kv_heads, self.head_dim)
        return torch.randn(shape, device=DEVICE).to(dtype)


def random_tables(
    context_lens: list[int], block_size: int, num_blocks: int, seed: int
) -> tuple[list[list[int]], Tensor]:
    """Disjoint shuffled block ids per sequence, and the -1 padded [B, W] int32 table."""
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = []
    for ctx in context_lens:
        need = -(-ctx // block_size)
        tables.append([free.pop() for _ in range(need)])
    width = max(1, *(len(t) for t in tables))
    padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return tables, padded.to(DEVICE)


# Tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (7, 576), (33, 1000)])
def test_rms_norm(dtype: torch.dtype, rows: int, cols: int) -> None:
    x = torch.randn(rows, cols, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(cols, device=DEVICE)).to(dtype)
    assert rel_err(kernels.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(3, 64), (20, 4096)])
def test_rms_norm_adds_residual_in_place(dtype: torch.dtype, rows: int, cols: int) -> None:
    x = torch.randn(rows, cols, device=DEVICE).to(dtype)
    residual = torch.randn(rows, cols, device=DEVICE).to(dtype)
    w = torch.randn(cols, device=DEVICE).to(dtype)
    summed = x.float() + residual.float()
    out = kernels.rms_norm(x, w, 1e-5, residual=residual)
    assert rel_err(residual, summed) < TOLERANCE[dtype]
    assert rel_err(out, rms_norm_ref(summed, w, 1e-5)) < 2 * TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 576), (20, 4096)])
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_in_an_order_and_the_gather(
    dtype: torch.dtype, rows: int, cols: int, add: bool
) -> None:
    """An act-order W4A16 weight's inputs: the norm's columns in its order, bit for bit
    what the norm makes, gathered (the residual stream as without an order)."""
    x, w = torch.randn(rows, cols, device=DEVICE).to(dtype), torch.randn(cols).to(DEVICE, dtype)
    residual = [torch.randn(rows, cols, device=DEVICE).to(dtype)] if add else []
    order, again = torch.randperm(cols, device=DEVICE), [r.clone() for r in residual]
    plain = kernels.rms_norm(x, w, 1e-5, *again)
    assert torch.equal(kernels.rms_norm(x, w, 1e-5, *residual, order=order), plain[:, order])
    assert all(torch.equal(a, b) for a, b in zip(residual, again, strict=True))
    assert torch.equal(kernels.gather_columns(x, order), x[:, order])
    with pytest.raises(ValueError, match="order"):
        kernels.rms_norm(x, w, 1e-5, order=order[1:])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 128), (5, 1536), (17, 3000)])
def test_gated_activation(dtype: torch.dtype, rows: int, width: int, activation: str) -> None:
    x = torch.randn(rows, 2 * width, device=DEVICE).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    if activation == "silu":
        act = torch.nn.functional.silu(gate)
    else:  # transformers' gelu_pytorch_tanh (Gemma)
        act = torch.nn.functional.gelu(gate, approximate="tanh")
    assert rel_err(kernels.silu_and_mul(x, activation), act * up) < TOLERANCE[dtype]


@pytest.mark.parametrize("q_heads", [8, 2, 0], ids=["q8", "q2", "q-all"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [Attention(4, 2, 16, 4), Attention(9, 3, 64, 64), Attention(8, 8, 128, 16)]
)
def test_rotary_and_cache_write(
    shape: Attention,
    dtype: torch.dtype,
    qk_norm: bool,
    q_heads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Also with a token's q heads spread over programs of 2 or 8 (k and v in one more)
    and all in one program (rotary.Q_HEADS_A_PROGRAM)."""
    monkeypatch.setattr(rotary, "Q_HEADS_A_PROGRAM", q_heads)
    heads, kv_heads, head_dim, block_size = (
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.block_size,
    )
    num_tokens, num_blocks, layers, layer = 11, 12, 3, 1
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    original = qkv.clone()
    positions = torch.randint(0, 500, (num_tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[3] = -1  # a padding row: writes nothing
    table = rope_table(512, head_dim).to(DEVICE)
    kv = torch.full(
        (num_blocks, layers, 2, block_size, kv_heads, head_dim), float("nan"), device=DEVICE
    ).to(dtype)
    # Qwen3's RMSNorm of each q and k head before rotation, with weights of their own.
    norms = [torch.rand(head_dim, device=DEVICE).add(0.5).to(dtype) for _ in "qk"]
    eps = 1e-6
    kernels.rotary_and_cache_write(
        qkv,
        positions=positions,
        slot_mapping=slots,
        rope=table,
        kv=kv,
        layer=layer,
        num_heads=heads,
        q_norm=norms[0] if qk_norm else None,
        k_norm=norms[1] if qk_norm else None,
        eps=eps,
    )

    parts = original.view(num_tokens, heads + 2 * kv_heads, head_dim)
    q_in, k_in = parts[:, :heads], parts[:, heads : heads + kv_heads]
    if qk_norm:
        q_in, k_in = rms_norm_ref(q_in, norms[0], eps), rms_norm_ref(k_in, norms[1], eps)
    q_ref = rotate_ref(q_in, positions, table)
    k_ref = rotate_ref(k_in, positions, table)
    v_ref = parts[:, heads + kv_heads :]
    assert rel_err(qkv.view_as(parts)[:, :heads], q_ref) < TOLERANCE[dtype]
    rotated = qkv.view_as(parts)
    assert torch.equal(rotated[:, heads + kv_heads :], v_ref)  # v untouched
    real = slots >= 0
    blocks, offsets = slots[real] // block_size, slots[real] % block_size
    assert rel_err(kv[blocks, layer, 0, offsets], k_ref[real]) < TOLERANCE[dtype]
    # k rotated in place too, as stored (padding rows included)
    assert torch.equal(rotated[real, heads : heads + kv_heads], kv[blocks, layer, 0, offsets])
    assert rel_err(rotated[:, heads : heads + kv_heads], k_ref) < TOLERANCE[dtype]
    assert torch.equal(kv[blocks, layer, 1, offsets], v_ref[real])
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    written[blocks, offsets] = True
    assert kv[:, layer].transpose(1, 2)[~written].isnan().all()  # nothing else touched
    assert kv[:, [0, 2]].isnan().all()


@dataclass(frozen=True)
class DecodeCase:
    shape: Attention
    contexts: list[int]  # tokens per sequence, the new one included (0: padding row)
    window: int = 0
    splits: int = 1


DECODE_CASES = [
    DecodeCase(Attention(4, 2, 16, 4), [1, 5, 37]),
    DecodeCase(Attention(9, 3, 64, 64), [64, 130, 700, 3], splits=4),
    DecodeCase(Attention(8, 1, 128, 16), [100, 1, 257], splits=2),
    DecodeCase(Attention(32, 8, 128, 64), [513, 2048], splits=16),
    DecodeCase(Attention(8, 2, 64, 16), [300, 40, 1], window=48, splits=4),
    DecodeCase(Attention(8, 2, 64, 64), [300, 70, 129], window=100, splits=2),  # tile-aligned
    DecodeCase(Attention(6, 2, 96, 8), [77, 0], splits=2),  # padding row: zeros out
]


def check_decode(case: DecodeCase, dtype: torch.dtype) -> None:
    shape, contexts = case.shape, case.contexts
    layer = 1
    num_blocks = sum(-(-c // shape.block_size) for c in contexts) + 3
    kv = shape.pool(num_blocks, 2, dtype)
    tables, padded = random_tables(contexts, shape.block_size, num_blocks, seed=len(contexts))
    q = torch.randn(len(contexts), shape.heads + 2 * shape.kv_heads, shape.head_dim, device=DEVICE)
    q = q.to(dtype)[:, : shape.heads]  # a strided view, as the model passes it
    scale = shape.head_dim**-0.5
    out = kernels.decode_attention(
        q,
        kv,
        layer=layer,
        block_tables=padded,
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        scale=scale,
        window=case.window,
        num_splits=case.splits,
    )
    live = [i for i, c in enumerate(contexts) if c]
    ref = attention_ref(
        q[live],
        kv,
        layer=layer,
        tables=[tables[i] for i in live],
        seq_lens=[1] * len(live),
        context_lens=[contexts[i] for i in live],
        scale=scale,
        window=case.window,
    )
    assert rel_err(out[live], ref) < TOLERANCE[dtype]
    padding = [i for i, c in enumerate(contexts) if not c]
    assert not out[padding].float().abs().sum()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_attention(case: DecodeCase, dtype: torch.dtype) -> None:
    check_decode(case, dtype)


@pytest.mark.parametrize("kind", ["float16", "int8"])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_in_either_grid_order(kind: str, splits: int) -> None:
    """A sequence's KV heads launched side by side (heads_first, the default) compute
    what the sequences-first order does, to the bit: the same programs, numbered
    otherwise."""
    call = _decode_call(kind, splits)
    assert torch.equal(call(), call(heads_first=False))


@pytest.mark.parametrize("kind", ["float16", "int8"])
@pytest.mark.parametrize("splits", [2, 8])
def test_decode_attention_merged_by_the_last_split(kind: str, splits: int) -> None:
    """Given counters, each group's last split to finish merges the splits in the decode
    launch (a 16-bit pool's): the merge kernel's output to the bit, the counters left at
    0 (twice over, as a graph replays them); too few counters for the groups, or a pool
    of codes: the merge kernel."""
    call = _decode_call(kind, splits)
    merged = call()
    counts = torch.zeros(4 * 3, dtype=torch.int32, device=DEVICE)  # sequences x KV heads
    for heads_first in (True, False, True):
        assert torch.equal(call(counts=counts, heads_first=heads_first), merged)
        assert not counts.any()
    assert torch.equal(call(counts=counts[:11]), merged)
    with pytest.raises(ValueError, match="counts"):
        call(counts=counts.long())


def _decode_call(kind: str, splits: int) -> partial[Tensor]:
    """decode_attention over 4 sequences (one a padding row) of a 3-KV-head pool, `kind`
    float16 or int8 codes, in `splits`."""
    contexts = [130, 7, 0, 64]
    shape = Attention(9, 3, 64, 16)
    num_blocks = sum(-(-c // 16) for c in contexts) + 3
    scales = None
    if kind == "int8":
        _, kv, scales = kv_quant.quantized_pool(num_blocks, 2, 16, 3, 64, "int8", DEVICE)
        codes, s = kv_quant.quantize_heads(torch.randn(kv.shape, device=DEVICE), "int8")
        kv.copy_(codes)
        scales.copy_(s)
    else:
        kv = shape.pool(num_blocks, 2, torch.float16)
    _, tables = random_tables(contexts, 16, num_blocks, seed=5)
    q = torch.randn(len(contexts), 9, 64, device=DEVICE).to(torch.float16)
    return partial(
        kernels.decode_attention,
        q,
        kv,
        layer=1,
        block_tables=tables,
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=DEVICE),
        scale=0.125,
        num_splits=splits,
        kv_scales=scales,
    )


def test_decode_splits_fill_the_gpu_and_stay_powers_of_two() -> None:
    assert kernels.decode_splits(1, 8, 8192, 132) == 16  # one long sequence: many splits
    assert kernels.decode_splits(1, 8, 100, 132) == 2  # ...but no more than its tiles
    assert kernels.decode_splits(512, 8, 8192, 132) == 1  # a big batch fills it alone
    for batch in (1, 3, 24, 64):
        splits = kernels.decode_splits(batch, 3, 4096, 132)
        assert splits & (splits - 1) == 0

"""One row times a matrix, y = x @ W^T (+ b), with the RMSNorm that makes x folded in:
a batch-1 decode step's products after a norm (qkv, gate|up, lm_head), without tl.dot.

Unlike kernels/gemv.py (x padded to tl.dot's 16 rows, where a folded norm ran 2.5-5x
slower: docs/benchmarks.md), x is one vector: each program owns BLOCK_N output columns,
streams their weight rows [BLOCK_N, K] in BLOCK_K slices (contiguous along K),
multiplies them by the slice of x in float32 and sums along K once at the end. With a
`Norm`, x = RMSNorm(hidden + residual) is made on BLOCK_K elements a slice: the row's
squares summed as it streams, the accumulator scaled by 1/rms at the end; the
normalized values rounded to x's dtype before that scale (kernels.rms_norm rounds
after it: the same size of error). Program 0 writes the summed stream after its
loop, when asked (`Norm.summed`), and x as kernels.rms_norm makes it (`Norm.normed`,
for a product that does not fold the norm in: 4-bit experts).

With `activation` (the MLP's gate|up product, weight [2I, K]) a program owns BLOCK_N / 2
outputs: it streams the gate rows and the up rows of its outputs, interleaved, and
writes act(gate) * up ([1, I]) instead of the product, each rounded to x's dtype first
as kernels/activation.py reads them: the same values as the product and silu_and_mul,
one launch fewer a layer.

With `experts` (a layer of experts at batch 1, kernels/moe_vector.py) the weight is [E,
N, K] and the launch makes one row for each of the token's chosen experts: a second grid
axis over the choices, each program reading the id of its choice's expert and streaming
that expert's rows (FP8 experts: codes, each slice's product scaled). With a `Route`
(the router's product, float32 logits) the last program to finish also chooses the
token's experts from all the logits (kernels/routing.py's `choose`) and writes their ids
and weights, where a top-k kernel of its own took a launch: each program counts itself
done on an atomic counter after its logits are stored, and the one that counts last
reads them back from L2 and resets it. With a `Rotary` (the qkv product of one token)
the same on a counter a head: the last program to finish a q head rotates it, the last
of a KV head's k and v writes them into the pool (kernels/rotary.py's
`rotate_head_when_last`), where rotary_and_cache_write took a launch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from lmd.engine.turbo.kernels.activation import check_activation, gate_up_rows, gated
from lmd.engine.turbo.kernels.common import expert_scales
from lmd.engine.turbo.kernels.native_kernels import device_index
from lmd.engine.turbo.kernels.norm import summed_row
from lmd.engine.turbo.kernels.rotary import Rotary, rotate_head_when_last
from lmd.engine.turbo.kernels.routing import choose_when_last
from lmd.engine.turbo.quant.fp8_experts import Fp8Experts, kernel_operands


@dataclass(frozen=True, slots=True)
class Norm:
    """x = RMSNorm(hidden + residual) with this weight; `summed` (hidden's shape, not the
    residual), if given, receives hidden + residual, and `normed` x as rms_norm would
    make it (its squares summed in another order). Without a residual, RMSNorm(hidden)."""

    weight: Tensor  # [K]
    eps: float
    residual: Tensor | None = None  # [1, K]
    summed: Tensor | None = None  # [1, K]: the stream after the add, for the next layer
    normed: Tensor | None = None  # [1, K]: x, for a product that does not fold the norm


@dataclass(frozen=True, slots=True)
class Route:
    """A router's product: after the logits, its experts chosen into `experts` ([k]
    int32, largest first) and `weights` ([k] float32, the softmax's, scaled to sum to 1
    if `normalize`). `count`: an int32 counter at 0, left at 0 (the launch's programs
    count themselves done on it)."""

    count: Tensor  # [1] int32
    weights: Tensor  # [k] float32
    experts: Tensor  # [k] int32
    normalize: bool


@triton.jit
def _vector_gemv_kernel(  # noqa: PLR0917  # Triton kernels take positional arguments
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    res_ptr,
    summed_ptr,
    normed_ptr,
    norm_ptr,
    experts_ptr,
    count_ptr,  # ROUTE: [1] int32, 0 before and after; ROTARY: [H + Hkv]
    chosen_w_ptr,  # ROUTE: [TOP_K] float32
    chosen_e_ptr,  # ROUTE: [TOP_K] int32
    positions_ptr,  # ROTARY: the token's position, slot, rope table, pool, head norms
    slots_ptr,
    rope_ptr,
    kv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    n,
    k,
    stride_w,
    stride_e,
    ws_ptr,  # FP8 experts: the codes' scales and their strides (fp8_experts.Operands)
    stride_se,
    stride_sn,
    stride_sk,
    head_eps,  # ROTARY: the head norms' epsilon, the pool's layer and strides
    layer,
    block_size,
    stride_kv_block,
    stride_kv_layer,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    EXPERTS: tl.constexpr,  # w is [E, N, K]: the expert of choice program_id(1)
    SCALES: tl.constexpr,  # experts: 16-bit (0), e4m3 codes with a scale a row (1), blocks (128)
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SUMMED: tl.constexpr,
    HAS_NORMED: tl.constexpr,
    GATED: tl.constexpr,  # W is gate | up, n = 2 I: write act(gate) * up
    GELU: tl.constexpr,  # (the activation: gelu_tanh, else silu)
    ROUTE: tl.constexpr,  # y is a router's float32 logits: choose TOP_K experts of them
    TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,  # ROUTE: n to a power of two
    ROTARY: tl.constexpr,  # y is one token's qkv: rotate it and write its k and v
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    choice = tl.program_id(1)
    if EXPERTS:  # this choice's expert's weights, its own output row
        expert = tl.load(experts_ptr + choice).to(tl.int64)
        w_ptr, ws_ptr = w_ptr + expert * stride_e, ws_ptr + expert * stride_se
        y_ptr += choice * (n // 2 if GATED else n)
    if GATED:  # W rows gate_0, up_0, gate_1, up_1, ... of this program's outputs
        cols, valid = gate_up_rows(pid, n, BLOCK_N)
    else:
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = W rows
        valid = cols < n
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k
        w = tl.load(
            w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :],
            mask=valid[:, None] & kmask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_K]
        if NORM:
            scale = tl.load(norm_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + ks, mask=kmask, other=0.0).to(tl.float32)  # [BLOCK_K]
        if NORM:
            if HAS_RESIDUAL:
                x = (x + res).to(res_ptr.dtype.element_ty).to(tl.float32)
            squares += x * x
            x = (x * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
        if SCALES:  # each row's scale of this slice
            ws = expert_scales(ws_ptr, cols, k0, stride_sn, stride_sk, valid, SCALES)
            w = w.to(tl.float32) * ws[:, None]
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if NORM:
        y *= tl.rsqrt(tl.sum(squares, axis=0) / k + eps)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)
    if GATED:
        gate, up = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
        half = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        act = gated(gate, up, GELU).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + half, act, mask=half < n // 2)
    else:
        tl.store(y_ptr + cols, y, mask=valid)
    if ROUTE:
        choose_when_last(y_ptr, n, count_ptr, chosen_w_ptr, chosen_e_ptr, TOP_K, NORMALIZE, BLOCK_E)
    if ROTARY:
        rotate_head_when_last(
            y_ptr, pid * BLOCK_N, count_ptr, positions_ptr, slots_ptr, rope_ptr, kv_ptr,
            q_norm_ptr, k_norm_ptr, head_eps, layer, block_size, stride_kv_block,
            stride_kv_layer, stride_kv_kv, stride_kv_slot, stride_kv_head, NUM_HEADS,
            NUM_KV_HEADS, HEAD_DIM, HAS_QK_NORM, BLOCK_N,
        )  # fmt: skip
    # The summed stream and x, once, after the weights. Two ifs: the first is decided
    # when the kernel compiles, the second at run time.
    if HAS_SUMMED or HAS_NORMED:  # noqa: SIM102
        if pid == 0 and choice == 0:
            summed_row(x_ptr, res_ptr, summed_ptr, normed_ptr, norm_ptr, squares, eps, k,
                       HAS_RESIDUAL, HAS_SUMMED, HAS_NORMED, BLOCK_K)  # fmt: skip


def vector_gemv(
    x: Tensor,
    weight: Tensor | Fp8Experts,
    bias: Tensor | None = None,
    *,
    norm: Norm | None = None,
    out_dtype: torch.dtype | None = None,
    tiles: tuple[int, int, int, int] | None = None,
    activation: str | None = None,
    experts: Tensor | None = None,
    route: Route | None = None,
    rotary: Rotary | None = None,
) -> Tensor:
    """x: [1, K], weight: [N, K], bias: [N] -> [1, N] in `out_dtype` (default: x's),
    from a float32 accumulator. `norm` makes the product's input first (the module
    docstring). tiles: (BLOCK_N, BLOCK_K, warps, stages) instead of default_tiles'.
    `activation` ("silu" or "gelu_tanh"): weight is gate | up [2I, K] and the result
    act(gate) * up [1, I] (the module docstring). `experts` ([C] int32, ids < E):
    weight is [E, N, K] (16-bit as x, or Fp8Experts) and the result [C, N] (or [C, I]),
    row c the product with expert experts[c]'s weights. `route`: weight is a router's
    [E, K] and out_dtype float32; its experts are chosen too (the module docstring).
    `rotary`: weight is a qkv projection's, and the result is rotated and its k and v
    stored as rotary.apply would (the module docstring), where rotary.folds(BLOCK_N)."""
    ops = kernel_operands(weight, x)
    weight = ops.codes
    if experts is not None:
        if weight.dim() != 3 or experts.dim() != 1 or experts.dtype != torch.int32:
            raise ValueError("vector_gemv's experts: int32 ids [C] against weights [E, N, K]")
        if bias is not None:
            raise ValueError("vector_gemv's experts take no bias")
        stride_e, num_rows = weight.stride(0), experts.shape[0]
        weight = weight[0]  # the shape and row stride of every expert's
    elif ops.scales:
        raise ValueError("vector_gemv takes fp8 codes for experts only")
    else:
        stride_e, num_rows = 0, 1
    n, k = weight.shape
    if x.shape != (1, k) or not x.is_contiguous() or weight.stride(1) != 1:
        raise ValueError(f"vector_gemv takes one contiguous row of {k}, got {tuple(x.shape)}")
    if activation is not None:
        check_activation(activation)
        if n % 2:
            raise ValueError(f"vector_gemv's activation needs gate | up rows, got {n}")
    residual = summed = normed = None
    if norm is not None:
        _check(norm, x, k)
        residual, summed, normed = norm.residual, norm.summed, norm.normed
    top_k = 1
    if route is not None:
        _check_route(route, n, out_dtype, experts, activation)
        top_k = route.experts.shape[0]
    if rotary is not None and (experts is not None or activation is not None or route):
        raise ValueError("vector_gemv's rotary takes a plain qkv product")
    width = n if activation is None else n // 2
    y = torch.empty(num_rows, width, dtype=out_dtype or x.dtype, device=x.device)
    if tiles is None and experts is not None and _is_h200(x.device):
        tiles = EXPERT_TILES_H200
    block_n, block_k, num_warps, num_stages = tiles or default_tiles(n, k, x.device)
    num_kv_heads, head_dim = rotary.check(n, block_n) if rotary is not None else (0, 0)
    grid = (triton.cdiv(n, block_n), num_rows)  # gated: BLOCK_N / 2 outputs a program
    _vector_gemv_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        residual if residual is not None else x,
        summed if summed is not None else x,
        normed if normed is not None else x,
        norm.weight if norm is not None else weight,
        experts if experts is not None else weight,
        route.count if route is not None else rotary.counts if rotary is not None else weight,
        route.weights if route is not None else weight,
        route.experts if route is not None else weight,
        *(rotary.tensor_args() if rotary is not None else (weight,) * 6),
        norm.eps if norm is not None else 0.0,
        n,
        k,
        weight.stride(0),
        stride_e,
        *ops.scale_args,
        rotary.eps if rotary is not None else 0.0,
        *(rotary.pool_args() if rotary is not None else (0,) * 7),
        EXPERTS=experts is not None,
        SCALES=ops.scales,
        HAS_BIAS=bias is not None,
        NORM=norm is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_SUMMED=summed is not None,
        HAS_NORMED=normed is not None,
        GATED=activation is not None,
        GELU=activation == "gelu_tanh",
        ROUTE=route is not None,
        TOP_K=top_k,
        NORMALIZE=route is not None and route.normalize,
        BLOCK_E=triton.next_power_of_2(n) if route is not None else 1,
        ROTARY=rotary is not None,
        NUM_HEADS=rotary.num_heads if rotary is not None else 0,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HAS_QK_NORM=rotary is not None and rotary.q_norm is not None,
        BLOCK_N=block_n,
        BLOCK_K=ops.block_k(block_k),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y


def default_tiles(n: int, k: int, device: torch.device | None = None) -> tuple[int, int, int, int]:
    """The fastest of scripts/gemv_bench.py's tilings at Llama-3-8B's and Qwen3-8B's
    shapes, whole and one rank of two (H100, bf16): 4 rows x 1024 of K for the layers'
    products, 16 x 512 for a vocabulary's (more programs than SMs either way). On an
    H200 (`device`; the same 132 multiprocessors, 1.4x the memory bandwidth) its own
    sweeps' where they differ: 8 x 512 for 4097-8192 outputs (qkv: 768 programs at
    6144, one wave; 15.7 against 17.0 us), 8 x 1024 in two stages for 8193-49999 with K
    of 4096 or more (gate|up with its activation: 53.8 us against 54.2-57.4 in two
    sweeps, Qwen3-8B) and 4 x 1024 for a vocabulary's (Llama-3-8B's lm_head 241.8
    against 256.4 us)."""
    h200 = device is not None and _is_h200(device)
    stages = 3
    if n >= 50000:
        block_n, block_k = (4, 1024) if h200 else (16, 512)
    elif h200 and n > 8192 and k >= 4096:
        block_n, block_k, stages = 8, 1024, 2
    else:
        block_n, block_k = (8, 512) if h200 and 4096 < n <= 8192 else (4, 1024)
    return block_n, min(block_k, triton.next_power_of_2(k)), 4, stages


# A layer of experts' gate|up at one token on an H200 (scripts/gemv_bench.py --experts at
# Qwen3-30B-A3B's shape, 8 x 1536 x 2048): 14.7 us against 16.4 for default_tiles'.
EXPERT_TILES_H200 = (16, 256, 4, 3)


def _is_h200(device: torch.device) -> bool:
    return device.type == "cuda" and _device_name(device_index(device)).startswith("NVIDIA H200")


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def plain_tiles(n: int, k: int, device: torch.device | None = None) -> tuple[int, int, int, int]:
    """Tiles for a product without a norm (o, down) at one row: the fastest of
    `gemv_bench.py --plain` (H200, bf16): 2 rows x 1024 of K in four stages where K is
    at most 4096 (o: 11.5 us against 12.1 for 4 x 1024 at 4096 x 4096, 6.7 against 8.2
    at 2048 x 4096), default_tiles' for a longer K (down: 29.0 us against 30.5). On an
    H200 (`device`) with 4096-49999 outputs and K of 4096 or more, 16 x 1024 on 8 warps
    in two stages (o 11.03 against 11.31 us, down 26.63 against 27.46, Qwen3-8B; 256
    programs or more, each 4 steps of K or more: the shapes swept)."""
    if device is not None and _is_h200(device) and 4096 <= n < 50000 and k >= 4096:
        return 16, 1024, 8, 2
    if k > 4096 or n >= 50000:
        return default_tiles(n, k)
    return 2, min(1024, triton.next_power_of_2(k)), 4, 4


def _check(norm: Norm, x: Tensor, k: int) -> None:
    if norm.weight.shape != (k,):
        raise ValueError("vector_gemv's norm needs a weight of K")
    for t in (norm.residual, norm.summed, norm.normed):
        if t is not None and (t.shape != x.shape or not t.is_contiguous()):
            raise ValueError("vector_gemv's residual, summed and normed are rows like x")
    if norm.summed is not None and (norm.residual is None or norm.summed is norm.residual):
        raise ValueError("vector_gemv's summed is a separate `summed` tensor beside a residual")
    if norm.normed is not None and any(norm.normed is t for t in (x, norm.residual, norm.summed)):
        raise ValueError("vector_gemv's normed is a tensor of its own")


def _check_route(
    route: Route,
    n: int,
    out_dtype: torch.dtype | None,
    experts: Tensor | None,
    activation: str | None,
) -> None:
    if out_dtype != torch.float32 or experts is not None or activation is not None:
        raise ValueError("vector_gemv's route takes a router's float32 logits, one product")
    w, e, count = route.weights, route.experts, route.count
    if (
        e.dim() != 1
        or not 0 < e.shape[0] <= n
        or w.shape != e.shape
        or (w.dtype, e.dtype, count.dtype) != (torch.float32, torch.int32, torch.int32)
        or count.shape != (1,)
    ):
        raise ValueError(
            "vector_gemv's route: experts [k] int32, weights [k] float32, count [1] int32"
        )

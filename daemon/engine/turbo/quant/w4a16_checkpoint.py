"""AutoAWQ's and AutoGPTQ / GPTQModel's packed tensors of one Linear read into a
W4A16Weight (quant/w4a16.py: the layout, repacked along K once at load).

AWQ (`WQLinear_GEMM`): qweight [K, N / 8] and qzeros [K / G, N / 8] int32, both packed
along N in the nibble order 0 2 4 6 1 3 5 7; scales [K / G, N].
GPTQ: qweight [K / 8, N] packed along K in plain order, qzeros [K / G, N / 8] along N in
plain order (v1: each zero point less one), scales [K / G, N], g_idx [K] the group of
each input. In act order (desc_act) g_idx is not k // G: the quantizer visited the
inputs by falling activation size and gave each run of G visited inputs a group, so the
inputs are packed sorted by group and the weight carries their order (`perm`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmd.engine.turbo.quant.w4a16 import PACK_K, W4A16Weight, pack

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's word: nibble i holds column 8 c + AWQ_ORDER[i]
NATURAL_ORDER = tuple(range(8))  # GPTQ's qzeros: nibble i holds column 8 c + i


def read_awq(
    qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int, dtype: torch.dtype
) -> W4A16Weight:
    """AutoAWQ's GEMM packing of one Linear: qweight [K, N / 8] and qzeros [K / G, N / 8]
    int32 packed along N in AWQ_ORDER, scales [K / G, N] -> ours, repacked along K."""
    _check_words("AWQ qweight", qweight)
    k, words = qweight.shape
    n = words * 8
    _check_words("AWQ qzeros", qzeros)
    _check("AWQ qzeros", qzeros, (k // group_size, words), k, n, group_size)
    _check("AWQ scales", scales, (k // group_size, n), k, n, group_size)
    q = unpack_along_n(qweight, AWQ_ORDER)  # [K, N]
    zeros = unpack_along_n(qzeros, AWQ_ORDER)
    return W4A16Weight(pack(q), scales.to(dtype).contiguous(), zeros, group_size)


def read_gptq(  # noqa: PLR0917  # the checkpoint's tensors, in its order
    qweight: Tensor,
    qzeros: Tensor | None,
    scales: Tensor,
    g_idx: Tensor | None,
    group_size: int,
    dtype: torch.dtype,
    sym: bool,
    *,
    zeros_minus_one: bool = True,
) -> W4A16Weight:
    """AutoGPTQ / GPTQModel's tensors of one Linear: qweight [K / 8, N] int32 packed
    along K in plain order (repacked), qzeros [K / G, N / 8] int32 packed along N, scales
    [K / G, N], g_idx [K] or None.

    `sym`: every zero point is 8 and qzeros is not read (as vLLM's uint4b8).
    `zeros_minus_one`: the "gptq" (v1) checkpoint format stores each zero point less
    one; GPTQModel's "gptq_v2" stores them as they are. A v1 zero of 0 was stored as
    -1 and reads back as nibble 15: it is taken as 0. An act-order checkpoint (desc_act:
    g_idx other than k // G) is packed sorted by group, with `perm` (see the module);
    its g_idx must put G inputs in each group, as GPTQ's does."""
    _check_words("GPTQ qweight", qweight)
    rows, n = qweight.shape
    k = rows * 8
    _check("GPTQ scales", scales, (k // group_size, n), k, n, group_size)
    perm = None if g_idx is None else _act_order(g_idx, k, group_size)
    if sym:
        zeros = torch.full((k // group_size, n), 8, dtype=torch.uint8, device=qweight.device)
    elif qzeros is None:
        raise ValueError("an asymmetric GPTQ checkpoint needs its qzeros")
    else:
        _check_words("GPTQ qzeros", qzeros)
        _check("GPTQ qzeros", qzeros, (k // group_size, n // 8), k, n, group_size)
        zeros = unpack_along_n(qzeros, NATURAL_ORDER)
        if zeros_minus_one:
            zeros = (zeros + 1) & 0xF
    q = unpack_gptq(qweight)  # [K, N], the inputs in their own order
    if perm is not None:
        q = q.index_select(0, perm)
    return W4A16Weight(pack(q), scales.to(dtype).contiguous(), zeros, group_size, perm=perm)


def unpack_gptq(qweight: Tensor) -> Tensor:
    """GPTQ's qweight [K / 8, N] int32 (input 8 r + j in bits 4 j of row r) -> [K, N] uint8."""
    rows, n = qweight.shape
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    return ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).to(torch.uint8).view(rows * 8, n)


def unpack_along_n(packed: Tensor, order: tuple[int, ...]) -> Tensor:
    """[R, N / 8] int32, nibble i of word c holding column 8 c + order[i] -> [R, N] uint8."""
    rows, words = packed.shape
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [R, N / 8, 8]: nibble i
    inverse = [order.index(col) for col in range(8)]  # the nibble holding column 8 c + col
    return nibbles[:, :, inverse].to(torch.uint8).reshape(rows, words * 8)


def _act_order(g_idx: Tensor, k: int, group_size: int) -> Tensor | None:
    """GPTQ's g_idx [K] (input k's group) -> the packed order of an act-order checkpoint
    (inputs sorted by group, stably), or None when every input is in group k // G."""
    in_order = torch.arange(k, device=g_idx.device) // group_size
    groups = g_idx.long()
    if tuple(groups.shape) != (k,):
        raise ValueError(f"GPTQ g_idx is {list(groups.shape)}, not [{k}] (one group an input)")
    if torch.equal(groups, in_order):
        return None
    perm = torch.argsort(groups, stable=True)
    if not torch.equal(groups[perm], in_order):
        raise ValueError(
            f"GPTQ g_idx does not put {group_size} inputs in each of its {k // group_size} "
            "groups, as an act-order (desc_act) checkpoint does"
        )
    return perm


def _check(  # noqa: PLR0917
    name: str, tensor: Tensor, expected: tuple[int, int], k: int, n: int, group: int
) -> None:
    """One line naming the tensor when its shape is not the one K, N and G ask for."""
    if group <= 0 or k % group or k % PACK_K or n % 8 or tuple(tensor.shape) != expected:
        raise ValueError(
            f"{name} is {list(tensor.shape)}, but weight [N={n}, K={k}] in groups of {group} "
            f"needs {list(expected)} (K a multiple of {PACK_K} and of the group, N of 8)"
        )


def _check_words(name: str, tensor: Tensor) -> None:
    if tensor.dtype != torch.int32 or tensor.dim() != 2:
        raise ValueError(
            f"{name} is a 2-D int32 tensor of packed nibbles, not {tensor.dtype} "
            f"of shape {list(tensor.shape)}"
        )

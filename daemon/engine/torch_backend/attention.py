"""Paged attention plugged into transformers' modules through its AttentionInterface.

The model runs the packed batch as one "sequence" of T tokens (batch dim 1) with
explicit position ids; the attention function, registered as `lmd_paged`, gets the
paging metadata as an extra keyword argument of the model's forward. Per layer:

1. Write each new token's K/V into `kv[block, layer, 0/1, offset]` (the slot mapping).
2. Decode rows (one new token each): copy the sequences' context blocks (whole blocks,
   one `index_select` for K and one for V) into padded batches and attend with one SDPA
   call per batch that reads them through strides, padding masked out. Sequences are
   bucketed by context blocks (powers of two), so one long sequence does not pad every
   short one to its length: padding stays under 2x. A plain decode step (one bucket, no
   prefill) uses the query and returns the output in place: no row gather or scatter.
3. Prefill rows (a chunk of new tokens): per sequence, attend causally over the chunk's
   own K/V, or, after a cached prefix, over the context gathered from its blocks.

Positions are token indices into the context (token p lives in slot p), so one mask
rule serves every case: key j is visible to a query at position p iff j <= p (and
p - j < window for sliding-window layers). The pool must have the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.torch_backend import native_cpu

ATTENTION_NAME = "lmd_paged"
METADATA_KWARG = "lmd_paged"


@dataclass(slots=True)
class DecodeRows:
    """Sequences of this step that add a single token, attended as one padded batch."""

    group: int  # mask cache key, negative (prefill sequences use their index)
    rows: Tensor  # [Bd] int64, rows of T holding those tokens
    block_ids: Tensor  # [Bd * nb] int64, block tables row after row, -1 -> 0 (masked out)
    num_blocks: int  # nb, blocks per sequence in this group
    positions: Tensor  # [Bd] int64, position of each new token (= context_len - 1)


@dataclass(slots=True)
class PrefillSeq:
    """A sequence that adds several tokens (rows start:end) this step."""

    start: int
    end: int
    context_len: int  # cached prefix + this chunk
    block_ids: Tensor | None  # [nb] int64, blocks of its context; None without a prefix

    @property
    def has_prefix(self) -> bool:
        return self.block_ids is not None


@dataclass(slots=True)
class PagedMetadata:
    """Everything the attention function needs, built once per forward for all layers."""

    kv: Tensor  # [N, L, 2, S, Hkv, D]
    slot_blocks: Tensor  # [T] int64, block of each new token
    slot_offsets: Tensor  # [T] int64, offset in that block
    positions: Tensor  # [T] int64
    decodes: list[DecodeRows]
    prefills: list[PrefillSeq]
    masks: dict[tuple[int, int | None], Tensor] = field(default_factory=dict)
    num_layers_run: int = 0  # counts attention calls, to catch models that bypass us
    # A CUDA-graph decode step's static inputs (turbo's StepInputs; graphs.py), or None.
    graph_step: Any = None

    @classmethod
    def for_graph(cls, step: Any, kv: Tensor) -> PagedMetadata:
        """A decode step of fixed shape: every row one new token, padding rows with slot
        -1 and context 0 (they write and read nothing). slot_blocks and slot_offsets go
        unused (`_graph_decode` writes through the slot mapping itself)."""
        return cls(
            kv, step.slot_mapping, step.slot_mapping, step.positions, [], [], graph_step=step
        )

    @property
    def is_one_decode_group(self) -> bool:
        """All rows are decode rows of one group, in row order (a plain decode step)."""
        return len(self.decodes) == 1 and not self.prefills

    @classmethod
    def build(cls, batch: ForwardBatch, kv: Tensor) -> PagedMetadata:
        device, block_size = kv.device, kv.shape[3]
        seq_lens: list[int] = batch.seq_lens.tolist()
        context_lens: list[int] = batch.context_lens.tolist()
        cu: list[int] = batch.cu_seqlens.tolist()
        slots = batch.slot_mapping.to(device, torch.int64, non_blocking=True)
        tables = batch.block_tables
        # Bucket single-token sequences by the power of two above their block count.
        buckets: dict[int, list[int]] = {}
        for i, n in enumerate(seq_lens):
            if n == 1:
                blocks = math.ceil(context_lens[i] / block_size)
                buckets.setdefault(1 << (blocks - 1).bit_length(), []).append(i)
        decodes = []
        for group, (width, members) in enumerate(sorted(buckets.items())):
            num_blocks = min(width, max(math.ceil(context_lens[i] / block_size) for i in members))
            decodes.append(
                DecodeRows(
                    group=-1 - group,
                    rows=torch.tensor([cu[i] for i in members]).to(device, non_blocking=True),
                    block_ids=tables[members, :num_blocks]
                    .flatten()
                    .to(device, torch.int64, non_blocking=True)
                    .clamp_(min=0),
                    num_blocks=num_blocks,
                    positions=torch.tensor([context_lens[i] - 1 for i in members]).to(
                        device, non_blocking=True
                    ),
                )
            )
        prefills = []
        for i, n in enumerate(seq_lens):
            if n == 1:
                continue
            block_ids = None
            if context_lens[i] > n:
                num_blocks = math.ceil(context_lens[i] / block_size)
                block_ids = tables[i, :num_blocks].to(device, torch.int64, non_blocking=True)
            prefills.append(PrefillSeq(cu[i], cu[i + 1], context_lens[i], block_ids))
        return cls(
            kv=kv,
            slot_blocks=slots // block_size,
            slot_offsets=slots % block_size,
            positions=batch.positions.to(device, torch.int64, non_blocking=True),
            decodes=decodes,
            prefills=prefills,
        )

    def mask(self, group: int, q_positions: Tensor, num_keys: int, window: int | None) -> Tensor:
        """[Q, K] bool: may the query at q_positions[i] see the key in slot j (j < num_keys)?

        Cached per (group, window): every layer of the step reuses it.
        """
        key = (group, window)
        found = self.masks.get(key)
        if found is not None:
            return found
        slots = torch.arange(num_keys, device=q_positions.device)  # [K]
        allowed = slots[None, :] <= q_positions[:, None]  # [Q, K]
        if window is not None:
            allowed &= slots[None, :] > q_positions[:, None] - window
        self.masks[key] = allowed
        return allowed


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    scale: float | None,
    softcap: float | None,
    is_causal: bool = False,
) -> Tensor:
    """Scaled dot-product attention; q: [B, Hk, Q, D], k/v: [B, Hk, K, D] -> [B, Hk, Q, D].

    `mask` (bool, True = visible) broadcasts to [B, Hk, Q, K]. With a logit soft cap
    (Gemma 2) SDPA cannot be used, so the scores are computed explicitly.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hk, Q, K]
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def repeat_heads(x: Tensor, groups: int) -> Tensor:
    """[B, Hkv, K, D] -> [B, Hkv * groups, K, D]: kv head i serves query heads i*groups...

    The same head order as transformers' repeat_kv.
    """
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def paged_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function; query: [1, H, T, D], key/value: [1, Hkv, T, D].

    Returns ([1, T, H, D], None); `attention_mask` is ignored (the model makes none for
    an implementation without a mask function; causality comes from the metadata).
    """
    meta = kwargs.get(METADATA_KWARG)
    if not isinstance(meta, PagedMetadata):
        raise RuntimeError(
            f"attention {ATTENTION_NAME!r} was called without paging metadata: "
            "run the model through TorchBackend.forward"
        )
    if kwargs.get("s_aux") is not None:
        raise RuntimeError("attention sinks (s_aux) are not supported by the torch backend")
    layer = cast(int, module.layer_idx)  # set by every transformers attention module
    window: int | None = kwargs.get("sliding_window")
    softcap: float | None = kwargs.get("softcap")
    kv = meta.kv  # [N, L, 2, S, Hkv, D]
    num_heads, num_kv_heads, head_dim = query.shape[1], key.shape[1], key.shape[3]
    if num_kv_heads != kv.shape[4] or head_dim != kv.shape[5]:
        raise RuntimeError(
            f"layer {layer} has {num_kv_heads} kv heads of dim {head_dim}, the KV pool "
            f"{kv.shape[4]} of dim {kv.shape[5]}: the pool was sized for another model"
        )
    groups = num_heads // num_kv_heads
    meta.num_layers_run += 1

    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)  # [T, Hkv, D]
    if meta.graph_step is not None:
        return _graph_decode(meta, q, k, v, layer, window, scaling, softcap)[None], None
    kv[:, layer, 0][meta.slot_blocks, meta.slot_offsets] = k
    kv[:, layer, 1][meta.slot_blocks, meta.slot_offsets] = v

    q_grouped = q.view(q.shape[0], num_kv_heads, groups, head_dim)  # [T, Hkv, G, D]
    if meta.is_one_decode_group:  # every row is a decode row, in order: no gather, no scatter
        o = _decode(
            meta, meta.decodes[0], q_grouped, layer, window=window, scaling=scaling, softcap=softcap
        )
        return o.reshape(1, q.shape[0], num_heads, head_dim), None
    out = torch.empty_like(q)  # [T, H, D]
    for dec in meta.decodes:
        q_dec = q_grouped[dec.rows]
        o = _decode(meta, dec, q_dec, layer, window=window, scaling=scaling, softcap=softcap)
        out[dec.rows] = o.reshape(-1, num_heads, head_dim)

    for index, seq in enumerate(meta.prefills):
        q_seq = q[seq.start : seq.end].transpose(0, 1)[None]  # [1, H, n, D]
        if seq.block_ids is None:
            k_seq = k[seq.start : seq.end].transpose(0, 1)[None]  # [1, Hkv, n, D]
            v_seq = v[seq.start : seq.end].transpose(0, 1)[None]
        else:
            k_seq = _context(kv, layer, 0, seq.block_ids)[None, :, : seq.context_len]
            v_seq = _context(kv, layer, 1, seq.block_ids)[None, :, : seq.context_len]
        if not seq.has_prefix and window is None and softcap is None:
            o = F.scaled_dot_product_attention(
                q_seq, k_seq, v_seq, scale=scaling, is_causal=True, enable_gqa=groups > 1
            )
        else:
            positions = meta.positions[seq.start : seq.end]
            mask = meta.mask(index, positions, seq.context_len, window)  # [n, ctx]
            o = attend(
                q_seq,
                repeat_heads(k_seq, groups),
                repeat_heads(v_seq, groups),
                mask[None, None],
                scale=scaling,
                softcap=softcap,
            )
        out[seq.start : seq.end] = o[0].transpose(0, 1)
    return out[None], None


def _graph_decode(  # noqa: PLR0917
    meta: PagedMetadata,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer: int,
    window: int | None,
    scaling: float | None,
    softcap: float | None,
) -> Tensor:
    """A CUDA-graph decode step's attention through turbo's Triton kernels, whose shapes
    do not depend on the contexts (graphs.py): K/V written (padding rows skipped), then
    paged decode attention. q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]."""
    from lmd.engine.turbo import kernels

    if softcap is not None:
        raise RuntimeError("logit soft-capping has no CUDA-graph decode path")
    step = meta.graph_step
    kernels.cache_write(k, v, step.slot_mapping, meta.kv, layer)
    return kernels.decode_attention(
        q,
        meta.kv,
        layer=layer,
        block_tables=step.block_tables,
        context_lens=step.context_lens,
        scale=q.shape[-1] ** -0.5 if scaling is None else scaling,
        window=window or 0,
        num_splits=step.num_splits,
    )


def _decode(
    meta: PagedMetadata,
    dec: DecodeRows,
    q: Tensor,
    layer: int,
    *,
    window: int | None,
    scaling: float | None,
    softcap: float | None,
) -> Tensor:
    """Attention of one decode group; q: [Bd, Hkv, G, D] (any strides) -> [Bd, Hkv, G, D].

    fp32 on a CPU with lmd._native's kernels: over the pool in place (native/
    paged_attention.h; the copies and SDPA below took ~15 ms of a ~77 ms SmolLM2 step at
    batch 8, docs/benchmarks.md 'CPU, third pass'). Otherwise query heads grouped by kv
    head attend to copies of the context [Bd, Hkv, K, D]: one SDPA call for the group.
    """
    kv = meta.kv  # [N, L, 2, S, Hkv, D]
    if (
        softcap is None
        and kv.device.type == "cpu"
        and kv.dtype == torch.float32
        and q.dtype == torch.float32
        and kv.is_contiguous()
        and native_cpu.supported()
    ):
        return _native_decode(kv, dec, q, layer, window=window, scaling=scaling)
    bd, num_kv_heads, _, head_dim = q.shape
    k_ctx = _context(kv, layer, 0, dec.block_ids).view(num_kv_heads, bd, -1, head_dim)
    v_ctx = _context(kv, layer, 1, dec.block_ids).view(num_kv_heads, bd, -1, head_dim)
    mask = meta.mask(dec.group, dec.positions, k_ctx.shape[2], window)  # [Bd, K]
    return attend(
        q,
        k_ctx.transpose(0, 1),
        v_ctx.transpose(0, 1),
        mask[:, None, None, :],
        scale=scaling,
        softcap=softcap,
    )


def _native_decode(
    kv: Tensor, dec: DecodeRows, q: Tensor, layer: int, *, window: int | None, scaling: float | None
) -> Tensor:
    """_decode through lmd._native.paged_decode_attention; q: [Bd, Hkv, G, D]."""
    from lmd._native import paged_decode_attention

    bd, num_kv_heads, groups, head_dim = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    tables, positions = dec.block_ids, dec.positions.contiguous()  # int64: [Bd * nb], [Bd]
    paged_decode_attention(
        q.data_ptr(), bd, num_kv_heads, groups, head_dim,
        kv.data_ptr(), kv.shape[0], kv.shape[1], kv.shape[3], layer,
        tables.data_ptr(), dec.num_blocks, positions.data_ptr(), window or 0,
        head_dim**-0.5 if scaling is None else scaling, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def _context(kv: Tensor, layer: int, k_or_v: int, block_ids: Tensor) -> Tensor:
    """Keys (0) or values (1) of `layer` in the blocks `block_ids`, one after the other.

    Whole blocks are copied once (one memcpy-like index_select on the block dim, not an
    element-wise gather); SDPA reads the heads-first result in place through its strides.
    kv: [N, L, 2, S, Hkv, D], block_ids: [n] -> [Hkv, n * S, D] (a strided view of the copy)
    """
    blocks = kv[:, layer, k_or_v].index_select(0, block_ids)  # [n, S, Hkv, D]
    return blocks.flatten(0, 1).transpose(0, 1)

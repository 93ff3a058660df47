"""The Llama-family decoder as plain functions over the fused weights (gpt-fast style).

One step runs the packed batch of T new tokens (ForwardBatch) through every layer:

    residual = embed(ids) (* sqrt(hidden) for Gemma)     # [T, hidden]
    per layer:
        h = rms_norm(residual)  (layer 0)  |  rms_norm(out, residual += out)
        qkv = h @ Wqkv (+ b)                             # [T, (H + 2 Hkv) D]
        (Qwen3: RMSNorm each q and k head,) rotate q and k, write k and v into the
        pool (in a one-row 16-bit qkv's launch, else in a decode step's attention's)
        attn = decode or prefill paged attention         # [T, H, D]
        out = attn @ Wo
        (Gemma: out = rms_norm(out) first)
        h = rms_norm(out, residual += out)
        out = silu(h @ Wgate) * (h @ Wup) @ Wdown        # or k experts' (kernels/moe.py)
        (Gemma: gelu for silu, then out = rms_norm(out))
    logits = rms_norm(rows of out, residual += out) @ Wlm   # only the sampled rows

A rank of a tensor-parallel group (engine/parallel.py) runs the same step on its shard
(weights.py): its own heads and KV heads (the pool holds only those), its part of the
MLP's width, its vocabulary rows. Three places then meet the other ranks: the embedding
(ids of other ranks' rows look up zeros; the rows are summed), after o and after the
MLP (partial sums over the heads or the width, summed before the norm and the residual
add, so Gemma's norms of those outputs see the whole), and the logits (every rank's
vocabulary columns gathered). The collectives are NCCL's on CUDA, which graphs capture;
a one-row step of a dense model sums after o and after the MLP through a peer exchange
instead (turbo/exchange.py: o's and down's programs write their columns into every
rank's memory, wait for the other ranks' and sum them themselves).

Matrix products go to cuBLAS through torch (small decode batches to kernels/gemv.py;
quantized weights to their own GEMMs, quant/); the rest are our Triton kernels. A
quantized KV pool (int8 or e4m3 codes + a float16 scale per token and head) is written
and read by the same kernels, given its scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lmd.engine.backend import mm_has_float_output
from lmd.engine.parallel import SINGLE, TensorParallel
from lmd.engine.turbo import kernels
from lmd.engine.turbo.config import TurboConfig
from lmd.engine.turbo.exchange import PeerExchange, Point
from lmd.engine.turbo.quant.fp8 import Fp8Rows, Fp8Weight
from lmd.engine.turbo.quant.load import Linear
from lmd.engine.turbo.quant.w4a16 import W4A16Weight
from lmd.engine.turbo.quant.w4a16_experts import W4A16Experts
from lmd.engine.turbo.step_inputs import StepInputs
from lmd.engine.turbo.weights import LayerWeights, ModelWeights

HALF_DTYPES = (torch.bfloat16, torch.float16)


class TurboModel:
    def __init__(
        self,
        config: TurboConfig,
        weights: ModelWeights,
        ropes: list[Tensor],
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.config = config  # rank tp.rank's (TurboConfig.for_rank)
        self.weights = weights
        self.tp = tp
        vocab = tp.vocab_part(config.vocab_size)  # the token ids whose rows this rank has
        self.vocab_start, self.vocab_end = vocab.start, vocab.stop
        self.ropes = ropes  # per layer: [max_positions, D] float32, cos | sin
        self.scale = config.attn_scale
        # Gemma scales the embedding by sqrt(hidden) rounded to the weights' dtype.
        self.embed_scale = torch.tensor(config.embed_scale, dtype=weights.embed.dtype).item()
        self.float_logits = mm_has_float_output(weights.embed)
        # Decode steps of up to 16 rows take the skinny-GEMM kernel (kernels/gemv.py),
        # faster than cuBLAS at those shapes in half precision (float32 keeps cuBLAS: the
        # kernel's tl.dot would round it to TF32); CPU (the interpreter tests) keeps F.linear.
        self.skinny = weights.embed.is_cuda and weights.embed.dtype in HALF_DTYPES
        # One-row steps through kernels/vector_gemv.py, the norms made in the products'
        # launches (2 kernels fewer a layer): ~0.15 ms of Qwen3-8B's kernels on an H100
        # (docs/benchmarks.md; scripts/families_bench.py --separate-batch1).
        self.fused_batch1 = True
        # ... and the MLP's activation made in gate|up's launch (one kernel fewer a
        # layer; scripts/families_bench.py --separate-activation measures it).
        self.fused_activation = True
        # ... and o and down there too, with their own tiles: faster than gemv's tl.dot
        # (gemv_bench.py --plain; families_bench.py --gemv-plain). Not in a group, whose
        # peer exchange sums what gemv's programs make and whose NCCL path must match.
        self.vector_plain = not tp.enabled
        # ... and a layer of experts in 3 launches (kernels/moe_vector.py) instead of 10
        # (scripts/families_bench.py --separate-experts measures it), its router's
        # programs counting themselves done on counts[0].
        self.vector_experts = True
        # `fused_rotary`: the rotary and K/V write in a one-row qkv product's launch (by
        # the last of its programs to finish a head), else in a decode step's attention's;
        # `fused_merge`: decode attention's splits merged by a group's last split. The
        # counters (at 0 between launches) are the last-to-finish counts, the experts'
        # choice's too. families_bench.py --separate-rotary / --separate-merge measure each.
        self.counts = torch.zeros(1024, dtype=torch.int32, device=weights.embed.device)
        self.fused_rotary = self.fused_merge = True
        # Past 16 rows, an FP8 product's input quantized per token by the RMSNorm or the
        # activation before it, in their launches (no quantizer launch a product).
        self.fp8_codes = True
        # A 4-bit weight's one-row product takes its RMSNorm (and SiLU's gate) in its launch
        # (kernels/w4a16_normed.py; families_bench.py --separate-w4a16-norms).
        self.w4a16_norms = True
        # A group's batch-1 all-reduces over peer memory (turbo/exchange.py), set by the
        # backend where exchange_fits().
        self.exchange: PeerExchange | None = None

    def forward(self, step: StepInputs, kv: Tensor, out: Tensor | None = None) -> Tensor:
        """Logits [R, V] float32 of the step's sampled rows, written into `out` if given.

        Writes the new tokens' K/V into kv: [N, L, 2, S, Hkv, D] (16-bit, or int8/e4m3
        codes with their scales after each block's: kv_pool.py). Makes no host sync and
        allocates only from torch's caching allocator, so it can be captured in a graph.
        """
        c, w = self.config, self.weights
        num_tokens = step.input_ids.shape[0]
        # A quantized pool's scales (kv_pool.py), a view of the same memory.
        scales = kernels.scales_of(kv) if kv.element_size() == 1 else None
        residual = self._embed(step.input_ids)  # [T, hidden]
        if self.embed_scale != 1.0:
            residual = residual * self.embed_scale
        exchange = self._exchange_for(step)
        if exchange is not None:
            exchange.begin_step()
        hidden: Tensor | None = None
        for i, layer in enumerate(w.layers):
            rotary = kernels.Rotary(step.positions, step.slot_mapping, self.ropes[i], kv, i,
                                    c.num_heads, layer.q_norm, layer.k_norm, c.rms_norm_eps,
                                    scales, self.counts)  # fmt: skip
            x = residual if hidden is None else hidden  # qkv's input
            later = step.is_decode and self.fused_rotary and not self._in_qkv(rotary, x, layer.qkv)
            now = None if later else rotary
            # [T, (H + 2 Hkv) D], rotated if `now`; residual += hidden first (but in layer 0)
            qkv, residual = self._norm_linear(hidden, residual, layer.input_norm, layer.qkv,
                                              layer.qkv_bias, rotary=now)  # fmt: skip
            heads = qkv.view(num_tokens, -1, c.head_dim)  # [T, H + 2 Hkv, D]
            attn = self._attention(heads, step, rotary, later)  # [T, H, D]
            # [T, hidden]: the sum over every rank's heads
            hidden = self._row_parallel(
                attn.view(num_tokens, -1), layer.o, layer.o_bias, exchange, 2 * i
            )
            if layer.attn_out_norm is not None:  # (never with an exchange: exchange_fits)
                hidden = kernels.rms_norm(hidden, layer.attn_out_norm, c.rms_norm_eps)
            # summed over the width's parts
            hidden, residual = self._mlp(hidden, residual, layer, exchange, 2 * i + 1)
            if layer.mlp_out_norm is not None:
                hidden = kernels.rms_norm(hidden, layer.mlp_out_norm, c.rms_norm_eps)
        if hidden is None:
            raise ValueError("a model without layers")
        if step.logits_indices is not None:
            hidden = hidden[step.logits_indices]
            residual = residual[step.logits_indices]
        if self._vector(hidden):  # [1, V]
            norm = kernels.Norm(w.norm, c.rms_norm_eps, residual)  # no stream after it
            logits = kernels.vector_gemv(hidden, w.lm_head, norm=norm, out_dtype=torch.float32)
            return self._gathered(logits, out)
        h = kernels.rms_norm(hidden, w.norm, c.rms_norm_eps, residual)
        if self.skinny and h.shape[0] <= kernels.GEMV_MAX_ROWS:
            logits = kernels.gemv(h, w.lm_head, out_dtype=torch.float32)  # [R, V]
        elif self.float_logits:
            # float32 straight out of the GEMM: rounding logits to bf16 alone flips ~1% of
            # the argmaxes of near-flat (random-weight) distributions.
            logits = torch.mm(h, w.lm_head.t(), out_dtype=torch.float32)  # [R, V]
        else:
            logits = F.linear(h, w.lm_head).float()
        return self._gathered(logits, out)

    def _gathered(self, logits: Tensor, out: Tensor | None) -> Tensor:
        """[R, this rank's vocabulary rows] -> [R, V], into `out` if given."""
        logits = self.tp.gather_columns(logits, self.config.vocab_size)
        if out is None:
            return logits
        return out.copy_(logits)

    def _embed(self, ids: Tensor) -> Tensor:
        """The embedding's rows of `ids` [T] -> [T, hidden]. A rank of a group looks up
        its own vocabulary rows, zeros for the others' ids, and sums over the group."""
        if not self.tp.enabled:
            return F.embedding(ids, self.weights.embed)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)  # [T]
        rows = F.embedding(torch.where(mine, ids - self.vocab_start, 0), self.weights.embed)
        rows *= mine.unsqueeze(-1).to(rows.dtype)
        return self.tp.all_reduce(rows)

    def _exchange_for(self, step: StepInputs) -> PeerExchange | None:
        """The group's peer exchange when this step's all-reduces take it: a one-row
        decode step through the fused batch-1 products (turbo/exchange.py)."""
        one_row = step.input_ids.shape[0] == 1 and step.logits_indices is None
        return self.exchange if one_row and self.fused_batch1 else None

    def exchange_fits(self) -> bool:
        """Whether a peer exchange can carry this model's batch-1 all-reduces: a group in
        half precision on CUDA, dense layers of unquantized weights without norms after
        attention or the MLP (those read the sum itself, not a product of it)."""
        w = self.weights
        plain = isinstance(w.lm_head, Tensor) and all(x.plain_dense for x in w.layers)
        return self.tp.enabled and self.skinny and plain

    def _row_parallel(
        self,
        x: Tensor | Fp8Rows,
        weight: Linear,
        bias: Tensor | None,
        exchange: PeerExchange | None,
        index: int,
    ) -> Tensor:
        """x @ weight^T summed over the group: through NCCL, or through point `index` of
        the exchange (the product's own programs)."""
        if exchange is not None and isinstance(weight, Tensor) and isinstance(x, Tensor):
            return kernels.gemv(x, weight, bias, send=Point(exchange, index))
        return self.tp.all_reduce(self._linear(x, weight, bias))

    def _mlp(
        self,
        hidden: Tensor,
        residual: Tensor,
        layer: LayerWeights,
        exchange: PeerExchange | None,
        index: int,
    ) -> tuple[Tensor, Tensor]:
        """The layer's gated MLP, or its experts, on RMSNorm(residual += hidden), summed
        over the group (through point `index` of the exchange if given): ([T, hidden],
        the residual stream after the add)."""
        if layer.experts is not None and self.config.moe is not None:
            x, moe, eps = layer.experts, self.config.moe, self.config.rms_norm_eps
            vector = self.vector_experts and self._vector(hidden)  # 4-bit: where native
            if vector and (
                not isinstance(x.gate_up, W4A16Experts)
                or 8 in kernels.native_blocks(hidden, x.gate_up, x.down)
            ):
                summed = torch.empty_like(residual)
                out = kernels.experts_vector(
                    hidden,
                    kernels.Norm(layer.post_norm, eps, residual, summed),
                    x.router,
                    x.gate_up,
                    x.down,
                    top_k=moe.top_k,
                    normalize=moe.normalize_top_k,
                    count=self.counts[:1],
                )
                return self.tp.all_reduce(out), summed
            h = kernels.rms_norm(hidden, layer.post_norm, eps, residual)
            out = kernels.fused_moe(h, x.router, x.gate_up, x.down, top_k=moe.top_k,
                                    normalize=moe.normalize_top_k,
                                    float_out=self.float_logits)  # fmt: skip
            return self.tp.all_reduce(out), residual
        if layer.gate_up is None or layer.down is None:
            raise ValueError("a dense layer without its MLP weights")
        activation, codes = self.config.activation, self._codes(layer.down, hidden)
        act, residual = self._norm_linear(  # [T, I], or gate | up [T, 2I] for codes
            hidden,
            residual,
            layer.post_norm,
            layer.gate_up,
            layer.gate_up_bias,
            activation=None if codes else activation,
        )
        down_in: Tensor | Fp8Rows = act
        if codes is not None:
            down_in = kernels.silu_and_mul_fp8(act, activation, group=codes.code_group)
        return self._row_parallel(down_in, layer.down, layer.down_bias, exchange, index), residual

    def _norm_linear(
        self,
        hidden: Tensor | None,
        residual: Tensor,
        norm: Tensor,
        weight: Linear,
        bias: Tensor | None,
        *,
        activation: str | None = None,
        rotary: kernels.Rotary | None = None,
    ) -> tuple[Tensor, Tensor]:
        """RMSNorm(residual += hidden) @ weight (RMSNorm(residual) with no hidden yet),
        and the residual stream after the add: a new tensor when one launch does both
        (vector_gemv's, or a 4-bit weight's one-row product's where w4a16_norms), else
        `residual`, added to in place. With `activation` the weight is gate | up and the
        result act(gate) * up (in vector_gemv's launch, where fused_activation, or a W4A16
        product's); with `rotary` qkv's, its work done too
        (in vector_gemv's, where fused_rotary). An act-order W4A16 weight's input comes
        from the norm in its packed order."""
        eps = self.config.rms_norm_eps
        x, res = (residual, None) if hidden is None else (hidden, residual)
        folded = None  # the activation vector_gemv or the W4A16 product made
        done = None  # a 4-bit weight's product of one row with its norm, and SiLU's gate
        if self._vector(x) and self.w4a16_norms and isinstance(weight, W4A16Weight):
            done = weight.matmul_normed(x, kernels.Norm(norm, eps, res), bias, activation)
        if done is not None:
            (y, summed), folded = done, activation
            residual = summed if summed is not None else residual
        elif self._vector(x) and isinstance(weight, Tensor):
            summed = torch.empty_like(residual) if res is not None else None
            folded = activation if self.fused_activation else None
            tiles = kernels.default_tiles(weight.shape[0], weight.shape[1], x.device)
            in_launch = rotary if self._in_qkv(rotary, x, weight) else None
            y = kernels.vector_gemv(
                x,
                weight,
                bias,
                norm=kernels.Norm(norm, eps, res, summed),
                activation=folded,
                tiles=tiles,
                rotary=in_launch,
            )
            residual = summed if summed is not None else residual
            rotary = None if in_launch is not None else rotary
        else:
            codes = self._codes(weight, x)
            order = weight.perm if isinstance(weight, W4A16Weight) else None
            h = (
                kernels.rms_norm(x, norm, eps, res, order=order)
                if codes is None
                else kernels.rms_norm_fp8(x, norm, eps, res, group=codes.code_group)
            )
            if isinstance(weight, W4A16Weight) and isinstance(h, Tensor):
                y, folded = weight.matmul(h, bias, activation, ordered=True), activation
            else:
                y = self._linear(h, weight, bias)
        if activation is not None and folded is None:
            y = kernels.silu_and_mul(y, activation)
        if rotary is not None:
            rotary.apply(y)
        return y, residual

    def _in_qkv(self, rotary: kernels.Rotary | None, x: Tensor, weight: Linear) -> bool:
        """Whether the one-row qkv product of x and weight (vector_gemv's launch, where
        fused_rotary) does `rotary`'s work; else a decode step's attention does it."""
        if rotary is None or not self.fused_rotary or not isinstance(weight, Tensor):
            return False
        n, k = weight.shape
        return self._vector(x) and rotary.folds(kernels.default_tiles(n, k, x.device)[0])

    def _codes(self, weight: Linear, x: Tensor) -> Fp8Weight | None:
        """`weight` where its product takes x as codes made in the launch that makes x
        (see fp8_codes), else None."""
        if self.fp8_codes and isinstance(weight, Fp8Weight) and weight.takes_codes(len(x)):
            return weight
        return None

    def _vector(self, x: Tensor) -> bool:
        """Whether this step's products take kernels/vector_gemv.py (see fused_batch1)."""
        return self.fused_batch1 and self.skinny and x.shape[0] == 1 and x.is_contiguous()

    def _linear(self, x: Tensor | Fp8Rows, weight: Linear, bias: Tensor | None) -> Tensor:
        if isinstance(weight, Fp8Weight):  # quantized: its own GEMMs (quant/)
            return weight.matmul(x, bias)
        if isinstance(x, Fp8Rows):
            raise TypeError("fp8 codes reach only an fp8 weight (TurboModel._codes)")
        if not isinstance(weight, Tensor):
            return weight.matmul(x, bias)
        if self.vector_plain and self._vector(x):
            n, k = weight.shape
            return kernels.vector_gemv(x, weight, bias, tiles=kernels.plain_tiles(n, k, x.device))
        if self.skinny and x.shape[0] <= kernels.GEMV_MAX_ROWS:
            return kernels.gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def _attention(
        self, heads: Tensor, step: StepInputs, rotary: kernels.Rotary, later: bool
    ) -> Tensor:
        """Attention of the step's q heads (heads: qkv as [T, H + 2 Hkv, D]) over rotary's
        pool and layer, `rotary` applied in a decode step's launch if `later`; a prompt over
        a quantized pool reads its own K and V from `heads`, unquantized."""
        kv, scales, layer = rotary.kv, rotary.kv_scales, rotary.layer
        window, h, hkv = self.config.windows[layer], self.config.num_heads, self.config.num_kv_heads
        q = heads[:, :h]  # [T, H, D], strided
        if step.is_decode:
            return kernels.decode_attention(
                q,
                kv,
                layer=layer,
                block_tables=step.block_tables,
                context_lens=step.context_lens,
                scale=self.scale,
                window=window,
                num_splits=step.num_splits,
                kv_scales=scales,
                counts=self.counts if self.fused_merge else None,
                rotary=rotary if later else None,
            )
        if step.cu_seqlens is None:
            raise ValueError("a step with several new tokens per sequence needs cu_seqlens")
        return kernels.prefill_attention(
            q,
            kv,
            layer=layer,
            block_tables=step.block_tables,
            cu_seqlens=step.cu_seqlens,
            context_lens=step.context_lens,
            max_seq_len=step.max_seq_len,
            scale=self.scale,
            window=window,
            kv_scales=scales,
            new_kv=None if scales is None else (heads[:, h : h + hkv], heads[:, h + hkv :]),
        )

"""Triton kernels of the turbo backend; each file holds one kernel and its launcher.

Every launcher takes torch tensors and returns (or fills) torch tensors; shapes are in
their docstrings. With `TRITON_INTERPRET=1` (set before triton is imported) the same
kernels run on CPU tensors through Triton's interpreter: that is how the CPU tests
check them; production runs them on CUDA only.
"""

from __future__ import annotations

from lmd.engine.turbo.kernels.activation import silu_and_mul, silu_and_mul_fp8
from lmd.engine.turbo.kernels.cache_write import cache_write
from lmd.engine.turbo.kernels.common import interpreting
from lmd.engine.turbo.kernels.decode_attention import decode_attention, decode_splits
from lmd.engine.turbo.kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
from lmd.engine.turbo.kernels.gemv import gemv
from lmd.engine.turbo.kernels.kv_quant import scales_of
from lmd.engine.turbo.kernels.moe import fused_moe
from lmd.engine.turbo.kernels.moe_align import native_blocks
from lmd.engine.turbo.kernels.moe_vector import experts_vector
from lmd.engine.turbo.kernels.norm import gather_columns, rms_norm, rms_norm_fp8
from lmd.engine.turbo.kernels.prefill_attention import prefill_attention
from lmd.engine.turbo.kernels.rotary import Rotary, rotary_and_cache_write
from lmd.engine.turbo.kernels.vector_gemv import Norm, default_tiles, plain_tiles, vector_gemv

__all__ = [
    "GEMV_MAX_ROWS",
    "Norm",
    "Rotary",
    "cache_write",
    "decode_attention",
    "decode_splits",
    "default_tiles",
    "experts_vector",
    "fused_moe",
    "gather_columns",
    "gemv",
    "interpreting",
    "native_blocks",
    "plain_tiles",
    "prefill_attention",
    "rms_norm",
    "rms_norm_fp8",
    "rotary_and_cache_write",
    "scales_of",
    "silu_and_mul",
    "silu_and_mul_fp8",
    "vector_gemv",
]

"""FP8 (e4m3) linear weights: quantized at load, or read from an FP8 checkpoint.

A weight W [N, K] is held as float8_e4m3fn codes and float32 scales, W ~= codes * scale:

- per output channel, scale [N]: what `Fp8Weight.quantize` makes from a bf16 checkpoint
  (absmax of each row / 448), and what compressed-tensors "FP8-Dynamic" checkpoints
  store as `weight_scale` ([N] or [N, 1]; a per-tensor scalar is broadcast to it);
- per 128x128 block, scale [ceil(N/128), ceil(K/128)]: DeepSeek-V3's and Qwen3-FP8's
  `weight_scale_inv` (despite the name, W = codes * scale, not codes / scale).

`matmul` quantizes the activations per token (per 128-group for blocks) and runs the fp8
GEMMs of kernels/fp8.py; it needs a GPU of CUDA capability 8.9 or newer (`fp8_supported`).
Everything else here (quantize, from_checkpoint, cat, dequantize) is plain torch and runs
on any device. e4m3 keeps 3 mantissa bits: a normal value is stored within 2^-4 of its
magnitude; values below 2^-6 (times the scale) are subnormal, within 2^-10 absolute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lmd.engine.turbo.quant.e4m3 import AMAX_FLOOR, BLOCK, FP8_MAX

_QUANTIZE_ROWS = 4096  # rows converted at a time in `quantize` (bounds the float32 copy)


def fp8_supported(device: torch.device | str) -> str | None:
    """One line saying why fp8 GEMMs cannot run on `device`, or None when they can."""
    if not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no float8_e4m3fn; fp8 weights need torch >= 2.1"
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"fp8 GEMMs need a CUDA GPU of capability 8.9+ and the device is {dev.type}"
    if not torch.cuda.is_available():
        return "fp8 GEMMs need CUDA and torch sees no CUDA device"
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(dev)
        return f"fp8 GEMMs need CUDA capability 8.9+ (Ada, Hopper) and {name} has {major}.{minor}"
    return None


def to_e4m3(values: Tensor) -> Tensor:
    """float32 -> float8_e4m3fn, nearest (ties to even), saturating at +-448 (torch's
    cast alone turns out-of-range values into NaN)."""
    return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_per_token_ref(x: Tensor, group: int | None = None) -> tuple[Tensor, Tensor]:
    """What kernels/fp8_quant.py's quantizers compute, in plain torch. x: [M, K] ->
    (codes [M, K] e4m3, scale [M, 1] float32, or [M, ceil(K/group)] with `group`)."""
    xf = x.float()
    num_rows, k = xf.shape
    width = group or k
    num_groups = -(-k // width)
    padded = F.pad(xf, (0, num_groups * width - k))
    grouped = padded.view(num_rows, num_groups, width)  # [M, G, width]
    scale = grouped.abs().amax(dim=2).clamp(min=AMAX_FLOOR) * (1 / FP8_MAX)  # [M, G]
    codes = to_e4m3(grouped * (1 / scale)[:, :, None]).view(num_rows, -1)[:, :k]
    return codes, scale


def block_scale_shape(n: int, k: int) -> tuple[int, int]:
    """The scales of a [N, K] weight in 128x128 blocks."""
    return (-(-n // BLOCK), -(-k // BLOCK))


@dataclass(slots=True)
class Fp8Rows:
    """M rows of activations quantized by the kernel that made them (kernels/norm.py's
    rms_norm_fp8, kernels/activation.py's silu_and_mul_fp8), x ~= codes * scale: per
    token (group None: codes [M, K] float8_e4m3fn, scale [M, 1] float32) or per 128-group
    (group 128, for block-scaled weights: codes [M', K] with zero rows up to M' a multiple
    of 4, scale [M', ceil(K/128)] column-major, as fp8_quant.quantize_per_token_group)."""

    codes: Tensor
    scale: Tensor
    num_rows: int
    group: int | None = None

    @classmethod
    def empty(cls, num_rows: int, k: int, group: int | None, device: torch.device) -> Fp8Rows:
        """Room for the codes of num_rows x k values by `group` (None or 128); per group
        the rows are padded to a multiple of 4 (cuBLAS's 1x128 scales want 16-byte
        aligned columns) and the scales are column-major."""
        if group is None:
            scale = torch.empty(num_rows, 1, dtype=torch.float32, device=device)
        elif group == BLOCK:
            num_rows_4 = -(-num_rows // 4) * 4
            scale = torch.empty(-(-k // BLOCK), num_rows_4, dtype=torch.float32, device=device).t()
        else:
            raise ValueError(f"fp8 codes come per token or per {BLOCK}-group, not per {group}")
        codes = torch.empty(scale.shape[0], k, dtype=torch.float8_e4m3fn, device=device)
        return cls(codes, scale, num_rows, group)


@dataclass(slots=True)
class Fp8Weight:
    """weight: [N, K] float8_e4m3fn; scale: float32 [N] (per channel) or [ceil(N/128),
    ceil(K/128)] (block_size (128, 128)); dtype: the activations' (and output's) dtype."""

    weight: Tensor
    scale: Tensor
    block_size: tuple[int, int] | None
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.weight.dtype != torch.float8_e4m3fn or self.weight.dim() != 2:
            raise ValueError(
                f"an fp8 weight is a [N, K] float8_e4m3fn matrix, "
                f"not {self.weight.dtype} of shape {tuple(self.weight.shape)}"
            )
        if self.scale.dtype != torch.float32:
            raise ValueError(f"fp8 weight scales are float32, not {self.scale.dtype}")
        n, k = self.weight.shape
        if self.block_size is None:
            expected: tuple[int, ...] = (n,)
        elif tuple(self.block_size) == (BLOCK, BLOCK):
            self.block_size = (BLOCK, BLOCK)
            expected = block_scale_shape(n, k)
        else:
            raise ValueError(f"fp8 weight blocks must be (128, 128), not {self.block_size}")
        if tuple(self.scale.shape) != expected:
            raise ValueError(
                f"fp8 weight [{n}, {k}] with blocks {self.block_size} needs scale "
                f"{list(expected)}, not {list(self.scale.shape)}"
            )
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"fp8 matmuls take bfloat16 or float16 activations, not {self.dtype}")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): output features, input features."""
        n, k = self.weight.shape
        return (n, k)

    @property
    def nbytes(self) -> int:
        """Bytes on the device: codes and scales."""
        return self.weight.nbytes + self.scale.nbytes

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def takes_codes(self, num_rows: int) -> bool:
        """Whether `num_rows` rows multiply as codes (Fp8Rows, which the kernel that makes
        them can make in its own launch: rms_norm_fp8, silu_and_mul_fp8, with
        `code_group`): more rows than kernels/fp8.py's SMALL_ROWS."""
        from lmd.engine.turbo.kernels import fp8  # triton, imported on first use

        return num_rows > fp8.SMALL_ROWS

    @property
    def code_group(self) -> int | None:
        """The codes this weight multiplies: per token (None) or per 128-group (blocks)."""
        return None if self.block_size is None else BLOCK

    def matmul(self, x: Tensor | Fp8Rows, bias: Tensor | None = None) -> Tensor:
        """x: [..., K] in `dtype` -> x @ W^T (+ bias): [..., N] in `dtype`, with x quantized
        per token; or x as codes already (Fp8Rows, [M, K]: per-channel weights only).
        Raises RuntimeError where fp8 GEMMs cannot run (`fp8_supported`)."""
        rows = x.codes if isinstance(x, Fp8Rows) else x
        reason = fp8_supported(rows.device)
        if reason is not None:
            raise RuntimeError(reason)
        from lmd.engine.turbo.kernels import fp8  # triton, imported on first use

        n, k = self.shape
        if isinstance(x, Fp8Rows):
            if x.group != self.code_group or x.codes.shape[-1] != k or x.codes.dim() != 2:
                raise ValueError(
                    f"fp8 codes {tuple(x.codes.shape)} by group {x.group} for a [N={n}, "
                    f"K={k}] weight with blocks {self.block_size} (it takes [M, K] codes "
                    f"by group {self.code_group})"
                )
            if x.group is None:
                return fp8.fp8_matmul_rows(
                    x.codes, x.scale, self.weight, self.scale, bias, out_dtype=self.dtype
                )
            return fp8.fp8_matmul_groups(
                x.codes, x.scale, x.num_rows, self.weight, self.scale, bias, out_dtype=self.dtype
            )
        if x.shape[-1] != k or x.dtype != self.dtype:
            raise ValueError(
                f"fp8 matmul of [N={n}, K={k}] in {self.dtype} got x {tuple(x.shape)} in {x.dtype}"
            )
        flat = x.reshape(-1, k)
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        y = fp8.fp8_matmul(flat, self.weight, self.scale, bias, self.block_size)
        return y.view(*x.shape[:-1], n)

    def dequantize(self) -> Tensor:
        """W as float32 [N, K]: codes times their channel's or block's scale."""
        w = self.weight.float()
        if self.block_size is None:
            return w * self.scale[:, None]
        n, k = self.shape
        per_elem = self.scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
        return w * per_elem

    @classmethod
    def quantize(
        cls, weight: Tensor, dtype: torch.dtype, block_size: tuple[int, int] | None = None
    ) -> Fp8Weight:
        """A [N, K] half (or float32) weight -> fp8 on the same device: each row scaled by
        its absmax / 448 (an all-zero row by a tiny positive scale); with `block_size`
        (128, 128), each 128x128 block by its own, as Qwen3-FP8 checkpoints come."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"quantize takes a [N, K] float matrix, not {tuple(weight.shape)}")
        if block_size is not None and tuple(block_size) != (BLOCK, BLOCK):
            raise ValueError(f"fp8 weight blocks must be (128, 128), not {block_size}")
        n, k = weight.shape
        codes = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=weight.device)
        if block_size is None:
            scale = torch.empty(n, dtype=torch.float32, device=weight.device)
        else:
            scale = torch.empty(block_scale_shape(n, k), dtype=torch.float32, device=weight.device)
        for r0 in range(0, n, _QUANTIZE_ROWS):  # a multiple of 128 rows at a time
            rows = weight[r0 : r0 + _QUANTIZE_ROWS].float()
            num_rows = rows.shape[0]
            if block_size is None:
                s = rows.abs().amax(dim=1).clamp(min=AMAX_FLOOR) / FP8_MAX
                codes[r0 : r0 + num_rows] = to_e4m3(rows / s[:, None])
                scale[r0 : r0 + num_rows] = s
                continue
            nb, kb = block_scale_shape(num_rows, k)
            padded = F.pad(rows, (0, kb * BLOCK - k, 0, nb * BLOCK - num_rows))
            blocks = padded.view(nb, BLOCK, kb, BLOCK)
            s = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR) / FP8_MAX  # [nb, kb]
            q = to_e4m3(blocks / s[:, None, :, None]).view(nb * BLOCK, kb * BLOCK)
            codes[r0 : r0 + num_rows] = q[:num_rows, :k]
            scale[r0 // BLOCK : r0 // BLOCK + nb] = s
        return cls(codes, scale, (BLOCK, BLOCK) if block_size else None, dtype)

    @classmethod
    def from_checkpoint(
        cls,
        weight: Tensor,
        scale: Tensor,
        block_size: tuple[int, int] | list[int] | None,
        dtype: torch.dtype,
    ) -> Fp8Weight:
        """A checkpoint's float8_e4m3fn weight [N, K] with its scale: `weight_scale_inv`
        [ceil(N/128), ceil(K/128)] for `block_size` (128, 128) (Qwen3-FP8, DeepSeek-V3),
        else a per-channel `weight_scale` [N] or [N, 1], or a per-tensor scalar (broadcast
        to every channel). Scales in any float dtype become float32 on the weight's device."""
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(
                f"an fp8 checkpoint weight is a [N, K] float8_e4m3fn matrix, "
                f"not {weight.dtype} of shape {tuple(weight.shape)}"
            )
        if not scale.is_floating_point() or scale.dtype == torch.float8_e4m3fn:
            raise ValueError(f"an fp8 weight scale is a float tensor, not {scale.dtype}")
        n, k = weight.shape
        scale = scale.to(device=weight.device, dtype=torch.float32)
        blocks = None
        if block_size is not None:
            if len(block_size) != 2:
                raise ValueError(f"fp8 weight blocks are (rows, columns), not {block_size}")
            blocks = (int(block_size[0]), int(block_size[1]))
        if blocks is None:
            if scale.numel() == 1:
                scale = scale.reshape(1).expand(n)
            elif tuple(scale.shape) in ((n,), (n, 1)):
                scale = scale.reshape(n)
            else:
                raise ValueError(
                    f"a per-channel fp8 scale for weight [{n}, {k}] is [{n}], [{n}, 1] or a "
                    f"scalar, not {list(scale.shape)}"
                )
        elif tuple(scale.shape) != block_scale_shape(n, k):
            expected = list(block_scale_shape(n, k))
            raise ValueError(
                f"weight_scale_inv for weight [{n}, {k}] in {blocks} blocks is {expected}, "
                f"not {list(scale.shape)}"
            )
        return cls(weight.contiguous(), scale.contiguous(), blocks, dtype)

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        """The parts stacked along N (q|k|v, gate|up): same K, blocks, dtype and device;
        block-scaled parts each have N a multiple of 128 so no block spans two parts."""
        if not parts:
            raise ValueError("Fp8Weight.cat needs at least one part")
        first = parts[0]
        for part in parts:
            same = (part.shape[1], part.block_size, part.dtype, part.device)
            if same != (first.shape[1], first.block_size, first.dtype, first.device):
                raise ValueError(
                    f"Fp8Weight.cat: parts differ in K, blocks, dtype or device ({same} vs "
                    f"{(first.shape[1], first.block_size, first.dtype, first.device)})"
                )
            if part.block_size is not None and part.shape[0] % BLOCK:
                raise ValueError(
                    f"Fp8Weight.cat: a block-scaled part has N = {part.shape[0]}, "
                    f"not a multiple of {BLOCK}"
                )
        weight = torch.cat([p.weight for p in parts])
        scale = torch.cat([p.scale for p in parts])
        return Fp8Weight(weight, scale, first.block_size, first.dtype)

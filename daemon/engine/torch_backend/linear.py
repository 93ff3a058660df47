"""fp32 linear layers with weights packed once, for the torch backend on CPU.

torch runs an fp32 `nn.Linear` on CPU as an MKL sgemm. On the AMD EPYC dev machine MKL
takes a slow path: a decode step of SmolLM2-135M at batch 8 streams its weights far below
the machine's memory bandwidth, the lm_head [8, 576] @ [576, 49152] taking the largest
share. oneDNN with the weight reordered once into its blocked layout streams the same
weights several times faster and runs prefill GEMMs about twice as fast (docs/benchmarks.md,
'CPU, second pass: oneDNN linears, block copies, malloc, threads'). At decode sizes (up to
PANEL_ROWS rows) lmd._native's panel_gemm (native/panel_gemm.h: AVX2, W in panels of 8
outputs, on torch's own OpenMP threads) is 1.3-1.6x faster again at 8 rows, so a
`PackedWeight` keeps both forms, where the CPU has AVX2 and FMA: the weight's memory twice
('CPU, third pass' in docs/benchmarks.md).

`pack_linears(model)` swaps the `nn.Linear` leaves of a model; the modules' own forwards
(transformers' attention, MLP, lm_head) call them exactly as they called the Linears:

- sibling projections of one input (`q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj`)
  become parts of one `FusedLinear`: the first part called runs one GEMM over the
  concatenated weight, the others return their column slice of it (3-4 fewer weight
  passes and calls per layer; the saving per decode step is in the same section);
- every other Linear becomes a `PackedLinear`.

Results differ from MKL's only by fp32 rounding order (about 1e-6 relative), except
with `bf16` (the engine's cpu_matmul_dtype, on a CPU with bf16 dot products: AVX512-BF16
or AMX): there the oneDNN GEMMs (more than PANEL_ROWS rows: prompts, large decode
batches) multiply bf16 inputs, summed in fp32, at twice fp32's rate (two Zen 4 cores:
~215 -> ~430 GFLOP/s; a 256-token prompt step of SmolLM2 340 -> 240 ms), and hold the
weight in bf16; their outputs carry bf16's rounding (~0.3% relative). At decode sizes a
weight held as codes then goes through lmd._native's pair_gemm where the CPU has
AVX512-BF16 (native/pair_gemm.h: the codes exact, x rounded to bf16, float32 sums: one
dot-product instruction a pair of inputs, against a dequantization and an FMA an input);
other decode weights stay in panel_gemm's fp32 (docs/benchmarks.md, 'CPU, eighth pass').
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lmd.engine.torch_backend import native_cpu
from lmd.engine.torch_backend.weight_codes import (
    GROUP,
    CodePairs,
    WeightCodes,
    code_pairs,
    find_codes,
)

log = logging.getLogger(__name__)

# Children of one module that transformers' models call one after the other on the same
# input. A part called on another input, or twice, computes afresh: never a stale result.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing helps fp32 on CPU; elsewhere the stock path is kept."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


PANEL_ROWS = 16  # up to this many rows: panel_gemm; more (prefill): oneDNN


class PackedWeight:
    """A Linear's weight [out, in] in oneDNN's blocked layout, and where the CPU runs
    them, for panel_gemm: as codes when it is a GGUF's dequantized (weight_codes.py),
    else in panels [ceil(out / 8), in, 8] (outputs past `out` zero)."""

    def __init__(self, weight: Tensor, bf16: bool = False) -> None:
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.bf16 = bf16  # the oneDNN GEMM's inputs in bf16 (see the module docstring)
        onednn = weight.bfloat16() if bf16 else weight
        self.onednn: Tensor = torch.ops.mkldnn._reorder_linear_weight(onednn)  # opaque
        self.panels: Tensor | None = None
        self.codes: WeightCodes | None = None
        self.pairs: CodePairs | None = None
        # The decode kernel's arguments for W: (weights, bits, scales, mins, group), the
        # tensors by their addresses, for panel_gemm or pair_gemm.
        self._native: tuple[int, int, int, int, int] | None = None
        if native_cpu.supported():
            from lmd._native import pair_gemm, panel_gemm  # resolved once, not per call

            self._gemm: Callable[..., None] = panel_gemm
            num = -(-self.out_features // 8)
            padded = weight.new_zeros(num * 8, self.in_features)
            padded[: self.out_features] = weight
            c = find_codes(padded)
            held: WeightCodes | CodePairs | None = c
            if c is not None and bf16 and native_cpu.pair_gemm_supported():
                self.pairs = held = code_pairs(c)  # the same codes, paired for it
                self._gemm = pair_gemm
            else:
                self.codes = c
            if held is not None:
                self._native = (held.codes.data_ptr(), held.bits, held.scales.data_ptr(),
                                held.mins.data_ptr(), GROUP)  # fmt: skip
            else:
                self.panels = padded.view(num, 8, self.in_features).transpose(1, 2).contiguous()
                self._native = (self.panels.data_ptr(), 32, 0, 0, 0)

    def linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """x: [..., in] -> [..., out]"""
        rows = x.numel() // self.in_features if self.in_features else 0
        native = self._native
        if native is None or not 0 < rows <= PANEL_ROWS or x.dtype != torch.float32:
            if not self.bf16:
                y: Tensor = torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
                return y
            y = torch.ops.mkldnn._linear_pointwise(x.bfloat16(), self.onednn, None, "none", [], "")
            y = y.to(x.dtype)
            return y if bias is None else y.add_(bias)
        flat = x.reshape(rows, self.in_features)
        if flat.stride(1) != 1 or flat.stride(0) < self.in_features:
            flat = flat.contiguous()
        out = torch.empty(rows, self.out_features, dtype=x.dtype)
        self._gemm(
            flat.data_ptr(), rows, self.in_features, flat.stride(0), *native, self.out_features,
            out.data_ptr(), self.out_features, 0 if bias is None else bias.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out.view(*x.shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W reordered for oneDNN; x: [..., in_features]."""

    def __init__(self, linear: nn.Linear, bf16: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # Plain attributes, not Parameters: nothing trains or saves them.
        self.packed_weight = PackedWeight(linear.weight, bf16)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        return self.packed_weight.linear(x, self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


class FusedLinear:
    """Sibling Linears of one input as one GEMM over their concatenated weights.

    Holds the last input and its output until every part has taken its slice, so the
    memory held is one activation at most.
    """

    def __init__(self, linears: list[nn.Linear], bf16: bool = False) -> None:
        self.out_features = [lin.out_features for lin in linears]
        weight = torch.cat([lin.weight.detach() for lin in linears])
        self.packed_weight = PackedWeight(weight, bf16)
        biases = [lin.bias.detach() for lin in linears if lin.bias is not None]
        self.bias = torch.cat(biases) if biases else None  # all or none have one
        self._input: Tensor | None = None
        self._slices: tuple[Tensor, ...] = ()
        self._taken: set[int] = set()

    @property
    def holds_output(self) -> bool:
        """Is an output kept for parts that have not taken their slice yet?"""
        return self._input is not None

    def output(self, index: int, x: Tensor) -> Tensor:
        """Part `index` of the fused GEMM on x: [..., in] -> [..., out_features[index]]."""
        if x is not self._input or index in self._taken:
            y = self.packed_weight.linear(x, self.bias)  # [..., sum(out_features)]
            self._slices = tuple(y.split_with_sizes(self.out_features, -1))  # views of y
            self._input = x
            self._taken = set()
        self._taken.add(index)
        out = self._slices[index]
        if len(self._taken) == len(self.out_features):  # all parts served: let go
            self._input, self._slices = None, ()
        return out


class FusedPart(nn.Module):
    """One Linear of a FusedLinear group: its column slice of the shared GEMM."""

    def __init__(self, fused: FusedLinear, index: int, linear: nn.Linear) -> None:
        super().__init__()
        self.fused = fused
        self.index = index
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        return self.fused.output(self.index, x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, part={self.index}"
        )


def _siblings(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    """The Linears `names` of `module` if they can share one GEMM, else None."""
    found = [getattr(module, name, None) for name in names]
    linears = [lin for lin in found if type(lin) is nn.Linear]
    if len(linears) != len(names):
        return None
    first = linears[0]
    same = all(
        lin.in_features == first.in_features
        and (lin.bias is None) == (first.bias is None)
        and lin.weight.dtype == first.weight.dtype
        for lin in linears
    )
    return linears if same else None


def pack_linears(model: nn.Module, bf16: bool = False) -> tuple[int, int]:
    """Swap every nn.Linear in `model` (see the module docstring); `bf16`: the oneDNN
    GEMMs multiply in bf16.

    Returns (Linears fused into groups, Linears packed alone).
    """
    num_fused = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            linears = _siblings(parent, names)
            if linears is None:
                continue
            fused = FusedLinear(linears, bf16)
            for index, (name, linear) in enumerate(zip(names, linears, strict=True)):
                setattr(parent, name, FusedPart(fused, index, linear))
            num_fused += len(names)
    alone = [
        (name, module)
        for name, module in model.named_modules(remove_duplicate=False)
        if type(module) is nn.Linear
    ]
    for name, linear in alone:
        model.set_submodule(name, PackedLinear(linear, bf16))
    log.info(
        "packed linears (oneDNN%s%s): %d fused into groups, %d alone",
        " in bf16" if bf16 else "",
        f", panel_gemm up to {PANEL_ROWS} rows" if native_cpu.supported() else "",
        num_fused,
        len(alone),
    )
    return num_fused, len(alone)

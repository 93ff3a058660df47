"""Quantized linear weights for the turbo decoder.

`scheme` decides how a model's linear layers run (16-bit, W4A16 or FP8) from
`--quantization` or the checkpoint's quantization_config; `load` reads one fused linear
(q|k|v, gate|up, o, down) in that form; `w4a16` and `fp8` hold the weights and run their
GEMMs (kernels/w4a16.py, kernels/fp8.py); `fp8_experts` and `w4a16_experts` hold a layer
of MoE experts stacked (kernels/moe.py runs them). The embedding, the output head and
norms stay 16-bit, as do experts a 4-bit scheme cannot stack (`scheme.quantized_experts`:
dequantized at load, `load.read_dense`).
"""

from __future__ import annotations

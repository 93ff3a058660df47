"""4-bit codes to 16-bit floats in registers, for the W4A16 GEMM (kernels/w4a16.py, whose
docstring has the weights' layout).

A code q (0..15) OR'ed into the bits of 1024.0 (fp16; 128.0 for bf16, 2^23 for float32) is
the float 1024 + q, so subtracting 1024 + z leaves q - z exactly: no conversion
instruction. On CUDA in 16 bits the same bits come from PTX that makes two weights at
once (the kernels are bound by their instructions, not by memory).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def biased(q, DTYPE: tl.constexpr):
    """Integers 0..15 (int32) -> the float (magic + q) in DTYPE, by bits alone."""
    if tl.float16 == DTYPE:
        return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q
    elif tl.bfloat16 == DTYPE:
        return (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q
    else:
        return (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q


@triton.jit
def nibbles(words, J: tl.constexpr, DTYPE: tl.constexpr, PACKED: tl.constexpr):
    """Nibble J of each word as the float (magic + q) in DTYPE (biased). PACKED (CUDA,
    16-bit DTYPE): two words at a time in PTX, their nibbles' bytes gathered into one
    register (prmt), shifted once and masked and OR'ed into both halves' magic at once
    (lop3): 2-3 instructions a pair of weights where the element-wise form takes 6."""
    if PACKED:
        sel: tl.constexpr = (J // 2) | ((J // 2) << 4) | ((4 + J // 2) << 8) | ((4 + J // 2) << 12)
        magic: tl.constexpr = 0x64006400 if tl.float16 == DTYPE else 0x43004300
        shift: tl.constexpr = 4 * (J % 2)
        asm: tl.constexpr = f"""{{
            .reg .b32 t;
            prmt.b32 t, $1, $2, {sel};
            shr.u32 t, t, {shift};
            lop3.b32 $0, t, 0x000F000F, {magic}, 0xEA;
            }}"""
        if tl.float16 == DTYPE:
            return tl.inline_asm_elementwise(asm, "=r,r,r", [words], tl.float16, True, 2)
        else:
            return tl.inline_asm_elementwise(asm, "=r,r,r", [words], tl.bfloat16, True, 2)
    else:
        return biased((words >> (4 * J)) & 0xF, DTYPE)


@triton.jit
def block_words(q_ptr, kb, stride, cols, col_ok):
    """The 16 rows of words [16, BLOCK_N] int32 (rows `stride` apart) that hold the 128
    inputs kb ... kb + 127 of columns `cols`: nibble j is inputs kb + 16 j ... + 15."""
    rows = (kb // 8 + tl.arange(0, 16)).to(tl.int64)
    return tl.load(q_ptr + rows[:, None] * stride + cols[None, :], mask=col_ok[None, :], other=0)


@triton.jit
def block_weights(  # noqa: PLR0917  # Triton functions take positional arguments
    words,
    s_ptr,
    z_ptr,
    kb,
    n,
    cols,
    col_ok,
    GROUP: tl.constexpr,
    DTYPE: tl.constexpr,
    PACKED: tl.constexpr,
):
    """W^T for the 128 inputs kb ... kb + 127 from their 16 words [16, BLOCK_N], as one
    [128, BLOCK_N] tile in DTYPE, (q - z) * s rounded once: nibble j of word row r is
    input kb + 16 j + r, so the 8 nibbles stacked [8, 16, BLOCK_N] are the inputs in
    order. PACKED (CUDA, 16 bits): two weights at a time in PTX (two shifts, a permute,
    a lop3 for the magic, then the half2 subtract and multiply), bit-equal to the
    element-wise form (gate|up at 64 rows 9% faster, the other products within 4%)."""
    shifts = (4 * tl.arange(0, 8))[:, None, None]
    if GROUP >= 128:  # one group: a row of scales and zero points
        group = (kb // GROUP) * n + cols
        s = tl.load(s_ptr + group, mask=col_ok, other=0.0).to(DTYPE)[None, None, :]
        zq = tl.load(z_ptr + group, mask=col_ok, other=0).to(tl.int32)[None, None, :]
    else:  # nibble j's group
        group = ((kb + 16 * tl.arange(0, 8)) // GROUP)[:, None] * n + cols[None, :]
        s = tl.load(s_ptr + group, mask=col_ok[None, :], other=0.0).to(DTYPE)[:, None, :]
        zq = tl.load(z_ptr + group, mask=col_ok[None, :], other=0).to(tl.int32)[:, None, :]
    z = biased(zq, DTYPE)
    if PACKED:
        magic: tl.constexpr = 0x64006400 if tl.float16 == DTYPE else 0x43004300
        half2: tl.constexpr = "f16x2" if tl.float16 == DTYPE else "bf16x2"
        asm: tl.constexpr = f"""{{
            .reg .b32 a, b;
            shr.u32 a, $1, $3;
            shr.u32 b, $2, $4;
            prmt.b32 a, a, b, 0x5410;
            lop3.b32 a, a, 0x000F000F, {magic}, 0xEA;
            sub.rn.{half2} a, a, $5;
            mul.rn.{half2} $0, a, $6;
            }}"""
        args = [words[None, :, :], shifts, z, s]  # $1 $2, $3 $4: two each; $5, $6: a pair each
        if tl.float16 == DTYPE:
            w = tl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r", args, tl.float16, True, 2)
        else:
            w = tl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r", args, tl.bfloat16, True, 2)
    else:
        w = (biased((words[None, :, :] >> shifts) & 0xF, DTYPE) - z) * s  # [8, 16, BN]
    return tl.reshape(w, (128, words.shape[1]))

"""Values tagged with a step count, one word each: how a tensor-parallel group's batch-1
all-reduce moves partial rows between GPUs without fences (turbo/exchange.py).

A word is twice a value's width: the value's bits low, the step's count (mod 2^bits)
high. A word is written by one aligned store, so a reader that sees this step's tag in a
word also sees that word's value; the rows need no flag and the writer no release
before one. kernels/gemv.py packs (`tag`) the rows it sends, and polls and unpacks
(`received_row`) the ones it receives.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tag(value, step):
    """value (a 16- or 32-bit float) and step (int64) -> words of twice its width."""
    if value.dtype.primitive_bitwidth == 16:
        bits = value.to(tl.uint16, bitcast=True).to(tl.uint32)
        return (step.to(tl.uint32) << 16) | bits
    else:
        bits = value.to(tl.uint32, bitcast=True).to(tl.uint64)
        return (step.to(tl.uint32).to(tl.uint64) << 32) | bits


@triton.jit
def _untag(word, step, dtype: tl.constexpr):
    """Words of tag() -> (values in dtype, whether each carries this step's tag)."""
    if dtype.primitive_bitwidth == 16:
        w = word.to(tl.uint32, bitcast=True)
        now = (w >> 16) == (step.to(tl.uint32) & 0xFFFF)
        return (w & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True), now
    else:
        w = word.to(tl.uint64, bitcast=True)
        now = (w >> 32) == step.to(tl.uint32).to(tl.uint64)
        return w.to(tl.uint32).to(dtype, bitcast=True), now


@triton.jit
def _read(words_ptr, ks, kmask, step, dtype: tl.constexpr):
    """The values at ks (volatile: from memory), and 1 if every word there carries this
    step's tag, else 0."""
    word = tl.load(words_ptr + ks, mask=kmask, other=0, volatile=True)
    value, now = _untag(word, step, dtype)
    return value, tl.min((now | ~kmask).to(tl.int32), axis=0)


@triton.jit
def received_row(words_ptr, ks, kmask, step, dtype: tl.constexpr):
    """The values at ks of one row of tagged words, once every word there carries this
    step's tag. The words keep that tag until every rank has read them
    (turbo/exchange.py), so the values are read after the wait, always: Triton may load
    a tensor once for each layout its users want (one for the tags' check, one for the
    values), and a value loaded beside the check, not after it, can be the step
    before's (the PTX of gemv's send, which reads its peers' words as soon as it has
    written its own, showed it; with the values of the first look kept, its TP 2
    logits left NCCL's on two H200s from the third step, with them read after it they
    equal NCCL's)."""
    ready = 0
    while ready == 0:  # only a scalar carried round: Triton 3.6 cannot lay out more
        _, ready = _read(words_ptr, ks, kmask, step, dtype)
    value, _ = _read(words_ptr, ks, kmask, step, dtype)
    return value

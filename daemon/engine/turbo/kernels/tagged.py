"""Values tagged with a step count, one word each: how a tensor-parallel group's batch-1
all-reduce moves partial rows between GPUs without fences (turbo/exchange.py).

A word is twice a value's width: the value's bits low, the step's count (mod 2^BITS)
high. A word is written by one aligned store, so a reader that sees this step's tag in a
word also sees that word's value; the rows need no flag and the writer no release
before one. kernels/gemv.py packs (`tag`), kernels/vector_gemv.py polls and unpacks
(`untag`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tag(value, step, BITS: tl.constexpr):
    """value (a BITS-wide float) and step (int64) -> words of 2 x BITS."""
    if BITS == 16:
        bits = value.to(tl.uint16, bitcast=True).to(tl.uint32)
        return (step.to(tl.uint32) << 16) | bits
    else:
        bits = value.to(tl.uint32, bitcast=True).to(tl.uint64)
        return (step.to(tl.uint32).to(tl.uint64) << 32) | bits


@triton.jit
def untag(word, step, dtype: tl.constexpr, BITS: tl.constexpr):
    """Words of tag() -> (values in dtype, whether each carries this step's tag)."""
    if BITS == 16:
        w = word.to(tl.uint32, bitcast=True)
        now = (w >> 16) == (step.to(tl.uint32) & 0xFFFF)
        return (w & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True), now
    else:
        w = word.to(tl.uint64, bitcast=True)
        now = (w >> 32) == step.to(tl.uint32).to(tl.uint64)
        return w.to(tl.uint32).to(dtype, bitcast=True), now


@triton.jit
def received_row(words_ptr, ks, kmask, step, dtype: tl.constexpr, BITS: tl.constexpr):  # noqa: PLR0917
    """The values at ks of one row of tagged words, once every word there carries this
    step's tag (volatile loads: each reads memory). The words keep that tag until every
    rank has read them (turbo/exchange.py), so a read after the wait sees them still."""
    word = tl.load(words_ptr + ks, mask=kmask, other=0, volatile=True)
    value, now = untag(word, step, dtype, BITS)
    if tl.min((now | ~kmask).to(tl.int32), axis=0) == 0:  # not all here yet: wait, reread
        _wait(words_ptr, ks, kmask, step, dtype, BITS)
        word = tl.load(words_ptr + ks, mask=kmask, other=0, volatile=True)
        value, now = untag(word, step, dtype, BITS)
    return value


@triton.jit
def _wait(words_ptr, ks, kmask, step, dtype: tl.constexpr, BITS: tl.constexpr):  # noqa: PLR0917
    """Until every word at ks carries this step's tag. Only a scalar is carried round
    the loop: Triton 3.6 cannot lay out a while loop that carries the words."""
    ready = 0
    while ready == 0:
        word = tl.load(words_ptr + ks, mask=kmask, other=0, volatile=True)
        _, now = untag(word, step, dtype, BITS)
        ready = tl.min((now | ~kmask).to(tl.int32), axis=0)

"""Passes over whole token sequences beside the engine's schedule: LMDeploy's get_ppl, and
the logits and last hidden states a GenerationConfig asks for.

A pass packs sequences into ForwardBatches that return every row (not only each
sequence's last), whole sequences together up to `max_rows` tokens, a longer one in
chunks of `max_rows` (prefill chunks continuing from the KV written before them). It
writes K/V into a pool of its own, made for the pass and dropped after it: the engine's
pool, block manager and prefix cache are untouched. It runs in the engine thread between
two steps (EngineThread.call), through `Backend.forward_eager` (never turbo's graphs,
which belong to the engine's pool) or `forward_hidden`.

The logits of one forward are [rows, vocab] float32 on the device: `max_rows` keeps them
under LOGITS_BYTES (a 49k vocabulary: 1,365 rows; 128k: 512), which is what bounds a
pass's memory beside the engine's pool.

get_ppl (as LMDeploy's): per sequence, the mean cross-entropy of each token after the
first given the ones before it, in nats, not exponentiated: transformers'
`model(ids, labels=ids).loss`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lmd.engine.backend import Backend
from lmd.engine.forward_batch import ForwardBatch
from lmd.engine.kv_pool import KVPool

LOGITS_BYTES = 256 * 2**20


@dataclass(slots=True)
class Rows:
    """One forward's rows of one sequence: tokens start .. start + len(logits) - 1."""

    index: int  # which sequence
    start: int
    logits: Tensor  # [n, V] float32, on the backend's device
    hidden: Tensor | None  # [n, hidden_size], when asked


def max_rows(backend: Backend, max_prefill_token_num: int) -> int:
    return max(1, min(max_prefill_token_num, LOGITS_BYTES // (4 * backend.vocab_size)))


def run(
    backend: Backend,
    seqs: Sequence[Sequence[int]],
    *,
    block_size: int,
    rows: int,
    hidden: bool = False,
) -> Iterator[Rows]:
    """Every token of every sequence through the model, `rows` tokens per forward at most;
    the rows of each sequence come in order."""
    group: list[int] = []
    total = 0
    for i, seq in enumerate(seqs):
        if group and total + len(seq) > rows:
            yield from _run_group(
                backend, seqs, group, block_size=block_size, rows=rows, hidden=hidden
            )
            group, total = [], 0
        group.append(i)
        total += len(seq)
    if group:
        yield from _run_group(backend, seqs, group, block_size=block_size, rows=rows, hidden=hidden)


def _run_group(
    backend: Backend,
    seqs: Sequence[Sequence[int]],
    group: list[int],
    *,
    block_size: int,
    rows: int,
    hidden: bool,
) -> Iterator[Rows]:
    """Sequences that share one pool: together when they fit in `rows`, else in chunks."""
    tables: list[list[int]] = []
    num_blocks = 0
    for i in group:
        n = -(-len(seqs[i]) // block_size)
        tables.append(list(range(num_blocks, num_blocks + n)))
        num_blocks += n
    # Zeroed (as a pool starts), not empty: decode attention reads whole blocks, the
    # unwritten tail of the last one too (masked out, but a NaN there would still poison
    # the softmax).
    kv = KVPool.for_backend(backend, num_blocks, block_size).kv
    done = [0] * len(group)
    while any(d < len(seqs[i]) for d, i in zip(done, group, strict=True)):
        room = rows
        items: list[tuple[int, int, int]] = []  # (position in group, start, end)
        for k, i in enumerate(group):
            take = min(len(seqs[i]) - done[k], room)
            if take > 0:
                items.append((k, done[k], done[k] + take))
                room -= take
        batch = ForwardBatch.pack(
            [list(seqs[group[k]][s:e]) for k, s, e in items],
            [s for _k, s, _e in items],
            [tables[k] for k, _s, _e in items],
            block_size,
        )
        batch.logits_indices = torch.arange(batch.num_tokens)  # every row
        if hidden:
            logits, states = backend.forward_hidden(batch, kv)
        else:
            logits, states = backend.forward_eager(batch, kv), None
        offset = 0
        for k, s, e in items:
            n = e - s
            part = None if states is None else states[offset : offset + n]
            yield Rows(group[k], s, logits[offset : offset + n], part)
            offset += n
            done[k] = e


def cross_entropy(
    backend: Backend, seqs: Sequence[Sequence[int]], *, block_size: int, rows: int
) -> list[float]:
    """Per sequence, the mean cross-entropy (nats) of tokens 1.. given those before."""
    nll = [0.0] * len(seqs)
    for part in run(backend, seqs, block_size=block_size, rows=rows):
        seq = seqs[part.index]
        targets = list(seq[part.start + 1 : part.start + 1 + len(part.logits)])
        if not targets:
            continue  # the sequence's last row predicts nothing
        logits = part.logits[: len(targets)].float()
        target = torch.tensor(targets, device=logits.device)
        nll[part.index] += float(F.cross_entropy(logits, target, reduction="sum"))
    return [total / (len(seq) - 1) for total, seq in zip(nll, seqs, strict=True)]


def tensors(
    backend: Backend,
    token_ids: Sequence[int],
    first_row: int,
    *,
    block_size: int,
    rows: int,
    hidden: bool,
) -> tuple[Tensor, Tensor | None]:
    """(logits, last hidden states) of rows first_row.. of one sequence, on the CPU."""
    logits: list[Tensor] = []
    states: list[Tensor] = []
    for part in run(backend, [token_ids], block_size=block_size, rows=rows, hidden=hidden):
        skip = max(0, first_row - part.start)
        logits.append(part.logits[skip:].float().cpu())
        if part.hidden is not None:
            states.append(part.hidden[skip:].float().cpu())
    return torch.cat(logits), (torch.cat(states) if hidden else None)

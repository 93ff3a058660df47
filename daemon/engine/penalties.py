"""What a request asks to change in its logits before temperature and the warpers, in order:
  repetition_penalty   HF/LMDeploy: every token of prompt + output, divided (>0) or
                       multiplied (<0) by the penalty;
  presence_penalty,    OpenAI: each output token so far lowers its logit by presence (once)
  frequency_penalty    plus frequency x its count;
  logit_bias           OpenAI: a bias added to a token's logit (-100 bans, 100 forces);
  bans                 -inf for min_new_tokens' eos and stop tokens, and for bad_words
                       (vLLM: a word's last token where the tokens so far end with the rest
                       of it; a one-token word always).
`penalize` returns a copy with them applied, or the logits themselves when no row asks.

A step sampled ahead (`ahead=1`: its sequences lack the token sampled before) cannot count
that token: the engine samples a batch with a row whose settings need every earlier token
(SamplingParams.needs_history) only once that token is read back, and `penalize` refuses
one sampled ahead.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from lmd.engine.sequence import Sequence, banned_token_ids
from lmd.engine.workspace import Workspace


def penalize(
    raw: torch.Tensor,
    seqs: SequenceOf[Sequence],
    eos_token_ids: SequenceOf[int],
    workspace: Workspace,
    ahead: int = 0,
) -> torch.Tensor:
    """`raw` ([B, V] float32) with each row's adjustments: a copy, or `raw` if none."""
    if ahead and any(s.sampling.needs_history for s in seqs):
        raise ValueError(
            "a penalty, bad word or grammar needs every earlier token: cannot sample ahead"
        )
    bans = [banned_token_ids(s, eos_token_ids, ahead) for s in seqs]
    if not any(s.sampling.adjusts_logits for s in seqs) and not any(bans):
        return raw
    for banned, seq in zip(bans, seqs, strict=True):
        banned.extend(bad_word_bans(seq))
    x = workspace.get("penalized", raw.shape[0], raw.shape[1], raw.device).copy_(raw)
    _repetition(x, seqs)
    _presence_and_frequency(x, seqs)
    _logit_bias(x, seqs)
    _ban(x, bans)
    return x


def bad_word_bans(seq: Sequence) -> list[int]:
    """The last tokens of the bad words that the next token would complete."""
    return [w[-1] for w in seq.sampling.bad_words if _ends_with(seq, w[:-1])]


def _ends_with(seq: Sequence, tokens: tuple[int, ...]) -> bool:
    """Whether prompt + output ends with `tokens` (without joining the two each step)."""
    if not tokens:
        return True
    output, n = seq.output_token_ids, len(tokens)
    tail = output[-n:] if n <= len(output) else seq.prompt_token_ids[len(output) - n :] + output
    return tail == list(tokens)


def _rows(x: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.tensor(rows, dtype=torch.long, device=x.device)
    return index, x.index_select(0, index)  # [R], [R, V]


def _repetition(x: torch.Tensor, seqs: SequenceOf[Sequence]) -> None:
    rows = [i for i, s in enumerate(seqs) if s.sampling.repetition_penalty != 1.0]
    if not rows:
        return
    histories = [seqs[i].token_ids for i in rows]
    width = max(len(h) for h in histories)
    # Pad with a token already in the row: a repeated index rewrites the same value.
    padded = [h + [h[0]] * (width - len(h)) for h in histories]
    ids = torch.tensor(padded, dtype=torch.long, device=x.device)  # [R, T]
    penalty = torch.tensor(
        [seqs[i].sampling.repetition_penalty for i in rows], device=x.device
    ).unsqueeze(1)  # [R, 1]
    index, sub = _rows(x, rows)
    score = sub.gather(1, ids)  # [R, T]
    score = torch.where(score > 0, score / penalty, score * penalty)
    sub.scatter_(1, ids, score)
    x.index_copy_(0, index, sub)


def _presence_and_frequency(x: torch.Tensor, seqs: SequenceOf[Sequence]) -> None:
    rows = [i for i, s in enumerate(seqs) if s.sampling.counts_tokens and s.output_token_ids]
    if not rows:
        return
    outputs = [seqs[i].output_token_ids for i in rows]
    width = max(len(o) for o in outputs)
    ids = torch.tensor([o + [0] * (width - len(o)) for o in outputs], device=x.device)  # [R, T]
    real = torch.tensor([[1.0] * len(o) + [0.0] * (width - len(o)) for o in outputs])
    counts = torch.zeros(len(rows), x.shape[1], device=x.device)  # [R, V]
    counts.scatter_add_(1, ids, real.to(x.device))
    presence = torch.tensor([seqs[i].sampling.presence_penalty for i in rows], device=x.device)
    frequency = torch.tensor([seqs[i].sampling.frequency_penalty for i in rows], device=x.device)
    index, sub = _rows(x, rows)
    sub -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0)
    x.index_copy_(0, index, sub)


def _logit_bias(x: torch.Tensor, seqs: SequenceOf[Sequence]) -> None:
    rows = [i for i, s in enumerate(seqs) for _ in s.sampling.logit_bias]
    if not rows:
        return
    cols = [token for s in seqs for token, _ in s.sampling.logit_bias]
    bias = [value for s in seqs for _, value in s.sampling.logit_bias]
    r = torch.tensor(rows, dtype=torch.long, device=x.device)
    c = torch.tensor(cols, dtype=torch.long, device=x.device)
    x.index_put_((r, c), torch.tensor(bias, device=x.device), accumulate=True)


def _ban(x: torch.Tensor, bans: list[list[int]]) -> None:
    rows = [i for i, banned in enumerate(bans) for _ in banned]
    cols = [token for banned in bans for token in banned]
    if rows:
        r = torch.tensor(rows, dtype=torch.long, device=x.device)
        c = torch.tensor(cols, dtype=torch.long, device=x.device)
        x[r, c] = float("-inf")

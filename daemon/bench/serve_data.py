"""Prompts for `lmd-bench serve`: random words, a ShareGPT file, or shared prefixes.

Every generator is seeded, so one command sends the same prompts on every server.

- random: `input_len` words drawn from WORDS (each is one token after a space in the BPE
  tokenizers of Llama 3, Qwen2 and SmolLM2; the server's `usage` reports the real count),
  lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)] as in vLLM.
- sharegpt: the first human turn of each conversation is the prompt, the length of the
  answer that followed sets max_tokens (counted with --tokenizer, else ~4 characters a
  token), unless --output-len is given.
- shared-prefix: `num_prefixes` random prefixes of `prefix_len` words; prompt i is prefix
  i mod num_prefixes followed by its own random `input_len` words (exercises prefix caching).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

# Common English words that each encode to one token after a space (checked against the
# SmolLM2 tokenizer); a prompt of n words is n tokens there, about n elsewhere.
_WORD_LIST = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect class control care field development role effort rate heart drug show "
    "leader light voice wife police mind price report decision son view relationship town "
    "road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phase "
    "land cell simple river green small large early young important public bad able good new "
    "first last long great little own other old big high different local"
)
WORDS = tuple(_WORD_LIST.split())

CHARS_PER_TOKEN = 4  # the usual estimate for English text when no tokenizer is given


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request to send: its text, the prompt length we expect, and max_tokens."""

    text: str
    input_len: int  # expected prompt tokens; the server's usage replaces it when reported
    output_len: int


def _lengths(mean: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    low = max(1, round(mean * (1 - range_ratio)))
    high = max(low, round(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def _words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def random_prompts(
    num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[Prompt]:
    rng = random.Random(seed)
    inputs = _lengths(input_len, range_ratio, num, rng)
    outputs = _lengths(output_len, range_ratio, num, rng)
    return [Prompt(_words(i, rng), i, o) for i, o in zip(inputs, outputs, strict=True)]


def shared_prefix_prompts(
    num: int, num_prefixes: int, prefix_len: int, input_len: int, output_len: int, *, seed: int
) -> list[Prompt]:
    rng = random.Random(seed)
    prefixes = [_words(prefix_len, rng) for _ in range(num_prefixes)]
    return [
        Prompt(f"{prefixes[i % num_prefixes]} {_words(input_len, rng)}", prefix_len + input_len,
               output_len)
        for i in range(num)
    ]  # fmt: skip


def token_counter(tokenizer: str | None) -> Callable[[str], int]:
    """Counts tokens with a tokenizer.json (a file or a model directory), else estimates."""
    if tokenizer is None:
        return lambda text: max(1, round(len(text) / CHARS_PER_TOKEN))
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    path = path / "tokenizer.json" if path.is_dir() else path
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise ValueError(f"--tokenizer {tokenizer}: cannot load {path}: {exc}") from exc
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def _turns(conversation: Any) -> tuple[str, str] | None:
    """(first human turn, the answer to it) of one ShareGPT entry, or None."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    if first.get("from") not in ("human", "user") or not isinstance(first.get("value"), str):
        return None
    if not isinstance(second.get("value"), str) or not first["value"] or not second["value"]:
        return None
    return first["value"], second["value"]


def sharegpt_prompts(
    path: Path, num: int, output_len: int | None, count: Callable[[str], int], seed: int
) -> list[Prompt]:
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"--dataset {path}: cannot read a JSON file: {exc}") from exc
    if not isinstance(data, list):
        raise ValueError(f"--dataset {path}: expected a JSON list of ShareGPT conversations")
    pairs = [p for p in map(_turns, data) if p is not None]
    if not pairs:
        raise ValueError(f"--dataset {path}: no conversation with a human turn and an answer")
    random.Random(seed).shuffle(pairs)
    # Cycle when the file has fewer conversations than --num-prompts.
    chosen = [pairs[i % len(pairs)] for i in range(num)]
    return [
        Prompt(question, count(question), output_len or max(1, count(answer)))
        for question, answer in chosen
    ]

"""Structured output (engine/grammar.py): specs checked, grammars compiled off the step
loop and cached, and every output of a random-weight model inside its grammar, greedy
and sampled, with and without overlapped steps."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from lmd.engine.config import EngineConfig
from lmd.engine.engine import Engine
from lmd.engine.grammar import GrammarError, Grammars, check_guided, check_spec
from lmd.engine.sequence import SamplingParams, Sequence
from tests.models import save_tiny_llama

jsonschema = pytest.importorskip("jsonschema")

# Nested objects, arrays, enums, bounded strings and numbers, required fields.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}},
            "required": ["city"],
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "ok"],
    "additionalProperties": False,
}


def guided_llama(path: Path, tokenizer_dir: Path, **overrides: Any) -> Path:
    """A random Llama over a real tokenizer's vocabulary, its files beside the weights."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    save_tiny_llama(path, vocab_size=len(tokenizer), eos_token_id=eos, **overrides)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny, over SmolLM2's byte-level vocabulary of 49,152 tokens (control bytes too)."""
    return guided_llama(tmp_path_factory.mktemp("guided-llama"), smollm2_dir)


def run(
    model_dir: Path,
    guided: tuple[str, str],
    n: int,
    *,
    overlap: bool = False,
    ends: bool = True,
    **build: Any,
) -> list[str]:
    """n requests (odd ones greedy, even ones sampled with a seed) under one grammar;
    `ends`: the grammar is bounded, so each one ends within max_tokens. `build`: device,
    dtype, backend for Engine.build."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine.build(model_dir, EngineConfig(overlap_steps=overlap), **build)
    grammars = Grammars(model_dir, engine.backend.vocab_size, engine.backend.eos_token_ids)
    asyncio.run(grammars.prepare(guided))
    seqs = []
    for i in range(n):
        temperature = 0.0 if i % 2 else 1.0
        sampling = SamplingParams(temperature=temperature, seed=i, max_tokens=200, guided=guided)
        seq = Sequence(f"r{i}", [1, 2, 3 + i], sampling)
        seq.guide = grammars.guide(guided)
        engine.add(seq)
        seqs.append(seq)
    while engine.has_work:
        engine.step()
    assert not ends or all(s.finish_reason == "stop" for s in seqs)
    return [str(tokenizer.decode(s.output_token_ids, skip_special_tokens=True)) for s in seqs]


def test_every_output_is_json_that_validates_with_and_without_overlap(model_dir: Path) -> None:
    """Overlapped, a step's forward runs ahead and its sampling waits for the token in
    flight (engine.py): the same outputs as stepping one at a time."""
    plain = run(model_dir, ("json", json.dumps(PERSON)), 24, overlap=False)
    assert run(model_dir, ("json", json.dumps(PERSON)), 24, overlap=True) == plain
    for text in plain:
        jsonschema.validate(json.loads(text), PERSON)


def test_any_json_object_regex_and_grammar(model_dir: Path) -> None:
    # A random model may write one string for ever: only an output that ended must parse.
    for text in run(model_dir, ("json", ""), 4, ends=False):
        assert text.startswith("{")
        if text.endswith("}"):
            assert isinstance(json.loads(text), dict)
    pattern = r"(yes|no), [0-9]{1,3}"
    for text in run(model_dir, ("regex", pattern), 4):
        assert re.fullmatch(pattern, text)
    ebnf = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c] | "zz"'
    for text in run(model_dir, ("grammar", ebnf), 4):
        assert re.fullmatch(r"\[(?:[a-c]|zz)(?:,(?:[a-c]|zz))*\]", text)


def test_a_grammar_keeps_the_step_from_running_ahead() -> None:
    assert SamplingParams(guided=("json", "")).needs_history
    assert not SamplingParams().needs_history


def test_bad_specs_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="guided kind must be one of json, regex, grammar"):
        check_guided(["yaml", "x"])
    with pytest.raises(ValueError, match="needs a non-empty spec"):
        SamplingParams(guided=("regex", ""))
    with pytest.raises(GrammarError, match="Unsupported type"):
        check_spec("json", '{"type": "objectx"}')
    with pytest.raises(GrammarError, match=r"regex is not valid.*parenthesis"):
        check_spec("regex", "(ab")
    with pytest.raises(GrammarError, match="grammar is not valid"):
        check_spec("grammar", 'root ::= "a" |')


async def test_specs_compile_once_and_a_bad_one_fails_its_request_alone(model_dir: Path) -> None:
    grammars = Grammars(model_dir, 49152, [2])
    good = ("json", json.dumps(PERSON))
    await grammars.prepare(good)
    await grammars.prepare(good)
    assert grammars.num_compiled == 1
    grammars.guide(good)
    bad = ("regex", "(ab")
    await grammars.prepare(bad)  # compiling never raises: the request's guide() does
    with pytest.raises(GrammarError, match="parenthesis"):
        grammars.guide(bad)

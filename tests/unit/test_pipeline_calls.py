"""Bad arguments to pipeline() and its calls: a ValueError saying what is wrong, raised
before anything reaches the engine, which goes on serving (a tiny Llama without a
tokenizer: token-id prompts only)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmd.pipeline import GenerationConfig, Pipeline, PytorchEngineConfig, pipeline
from tests.models import save_tiny_llama

SETTINGS = PytorchEngineConfig(device_type="cpu", block_size=4, cache_max_entry_count=64)
OK = [5, 6, 7]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("pipeline-args"))


@pytest.fixture(scope="module")
def pipe(model_dir: Path) -> Iterator[Pipeline]:
    with pipeline(model_dir, backend_config=SETTINGS) as p:
        yield p


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_path": "/nonexistent/model"}, "does not exist"),
        ({"backend_config": {"session_len": 8}}, "backend_config must be a PytorchEngineConfig"),
        ({"chat_template_config": "chatml"}, "chat_template_config must be a ChatTemplateConfig"),
        ({"log_level": "LOUD"}, "log_level must be one of"),
    ],
)
def test_bad_pipeline_arguments(model_dir: Path, kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"model_path": model_dir, "backend_config": SETTINGS, **kwargs}
    with pytest.raises(ValueError, match=message):
        pipeline(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_a_gpu(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="no CUDA device here; use 'cpu'"):
        pipeline(model_dir, PytorchEngineConfig(device_type="cuda"))


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (123, "prompts must be a string, a chat"),
        ([], "got an empty list"),
        ([1.5, 2.5], "prompts\\[0\\] must be a string"),
        ([OK, 3], "prompts\\[1\\] must be a string"),
        ([OK, [5, True]], "prompts\\[1\\] must be a string"),
        ([OK, [-1, 5]], "prompts\\[1\\]: token id -1 is outside this model's vocabulary"),
        (
            [OK, [600]],
            "prompts\\[1\\]: token id 600 is outside this model's vocabulary",
        ),
        ([OK, [7] * 1024], "prompts\\[1\\]: the prompt has 1024 tokens and session_len is 1024"),
        ("Hello", "no tokenizer, so a string prompt cannot be used"),
        ([{"role": "user", "content": "Hi"}], "no chat template"),
        ([{"role": "robot", "content": "Hi"}], "messages\\[0\\].role must be one of"),
    ],
)
def test_bad_prompts(pipe: Pipeline, prompts: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pipe(prompts)


@pytest.mark.parametrize(
    ("gen_config", "message"),
    [
        ({"max_new_tokens": 4}, "gen_config must be a GenerationConfig, a list of them"),
        ([GenerationConfig()], "gen_config has 1 entries for 2 prompts"),
        (GenerationConfig(stop_words=["x"]), "stop_words need a tokenizer"),
    ],
)
def test_bad_gen_configs(pipe: Pipeline, gen_config: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pipe([OK, OK], gen_config=gen_config)


@pytest.mark.parametrize(
    ("input_ids", "message"),
    [
        ("some text", "input_ids must be a list of token ids"),
        ([[5]], "input_ids\\[0\\] has 1 tokens: a perplexity needs 2 to session_len \\(1024\\)"),
        ([OK, "x"], "input_ids\\[1\\] must be a list of ints"),
        ([OK, [1, 999]], "input_ids\\[1\\]: token id 999 is outside the vocabulary"),
    ],
)
def test_bad_perplexity_inputs(pipe: Pipeline, input_ids: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pipe.get_ppl(input_ids)


def test_bad_chat_arguments(pipe: Pipeline) -> None:
    with pytest.raises(ValueError, match="session must be a Session or None"):
        pipe.chat("Hi", session="s1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no chat template"):
        pipe.chat("Hi")


def test_a_refused_call_leaves_the_engine_serving(pipe: Pipeline) -> None:
    with pytest.raises(ValueError):
        pipe([OK, [600]])
    assert pipe.stats()["waiting"] == 0  # nothing of the refused call got in
    r = pipe(OK, gen_config=GenerationConfig(max_new_tokens=3, ignore_eos=True))
    assert not isinstance(r, list)
    assert r.generate_token_len == 3 and r.finish_reason == "length" and r.text == ""


def test_one_gen_config_per_prompt(pipe: Pipeline) -> None:
    gens = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (2, 5)]
    responses = pipe([OK, OK], gen_config=gens)
    assert isinstance(responses, list)
    assert [r.generate_token_len for r in responses] == [2, 5]


def test_a_failed_engine_fails_the_calls_and_refuses_more(model_dir: Path) -> None:
    def boom(*_args: object) -> torch.Tensor:
        raise RuntimeError("boom")

    with pipeline(model_dir, backend_config=SETTINGS) as broken:
        # Fault injection: the next forward raises, as a device error would.
        broken._engine.call(lambda engine: setattr(engine.backend, "forward", boom)).result()
        with pytest.raises(RuntimeError, match="the engine failed: RuntimeError: boom"):
            broken(OK)
        with pytest.raises(RuntimeError, match="boom; create a new pipeline"):
            broken(OK)

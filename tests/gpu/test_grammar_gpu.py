"""Structured output on a GPU (engine/grammar.py): the grammar's bitmask applied on the
device, under turbo's CUDA graphs and the torch backend. Needs a real tokenizer: SmolLM2's
files in .gpu-assets/smollm2-tokenizer (carried to the GPU machine) or the embedded model.
Skipped without CUDA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("xgrammar")  # lmd's dependency; the GPU image lacks it: carry its wheel

from tests.unit.test_grammar import PERSON, guided_llama, jsonschema, run

pytestmark = pytest.mark.gpu
TOKENIZER = Path(__file__).resolve().parents[2] / ".gpu-assets" / "smollm2-tokenizer"


@pytest.mark.parametrize("backend", ["turbo", "torch"])
def test_outputs_on_the_gpu_validate(tmp_path: Path, backend: str) -> None:
    if not TOKENIZER.is_dir():
        pytest.skip(f"no tokenizer at {TOKENIZER}")
    model_dir = guided_llama(tmp_path, TOKENIZER)
    for overlap in (True, False):
        guided = ("json", json.dumps(PERSON))
        texts = run(model_dir, guided, 16, overlap=overlap, device="cuda", backend=backend)
        assert len(texts) == 16
        for text in texts:
            value = json.loads(text)
            jsonschema.validate(value, PERSON)  # raises on the first field out of place
            assert set(value) == set(PERSON["required"])

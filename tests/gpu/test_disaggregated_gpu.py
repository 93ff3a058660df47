"""Disaggregated serving on a GPU: prefill and decode processes with KV migrating over
CUDA IPC give the same tokens as the hybrid engine. Skipped without CUDA.

The daemons load a small random-weight Llama with SmolLM2's tokenizer, whose files
scripts/gpu-migration.sh carries in `.gpu-assets/smollm2-tokenizer` (the GGUF itself is
too large to carry). On a machine with two GPUs a second test puts prefill on cuda:0
and decode on cuda:1.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.integration.daemon import Daemon, wait_until
from tests.models import random_prompts, save_tiny_llama

TOKENIZER = Path(__file__).resolve().parents[2] / ".gpu-assets" / "smollm2-tokenizer"
VOCAB = 49152
START_TIMEOUT_S = 300.0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not TOKENIZER.is_dir(), reason=f"no tokenizer files in {TOKENIZER}"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save_tiny_llama(
        tmp_path_factory.mktemp("gpu-disagg"),
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        initializer_range=0.05,
        bos_token_id=1,
        eos_token_id=2,
    )
    for f in TOKENIZER.iterdir():
        shutil.copy(f, path / f.name)
    return path


def serve_outputs(model_dir: Path, *args: str) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy completions of fixed token-id prompts, one at a time (batch of one in
    every step, so the kernels are the same in both modes), and the final status."""
    daemon = Daemon(str(model_dir), "--cache-max-entry-count", "256", "--block-size", "16", *args)
    try:
        # A cold GPU machine compiles the turbo kernels and captures graphs at start.
        daemon.start(wait=False).wait_state("running", START_TIMEOUT_S)
        outputs = []
        prompts = random_prompts([5, 17, 40, 70, 130], VOCAB, seed=3)
        with httpx.Client(base_url=daemon.url, timeout=120) as http:
            for prompt in prompts:
                body = {
                    "model": model_dir.name,
                    "prompt": prompt,
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 0,
                }
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                tokens = r.json()["choices"][0]["logprobs"]["tokens"]
                outputs.append(tokens)
        engines = [w["name"] for w in daemon.status()["workers"] if "kv" in w]

        def whole() -> bool:
            for name in engines:
                kv = daemon.worker(name)["kv"]
                if kv["free_blocks"] != kv["total_blocks"]:
                    return False
            return True

        wait_until(whole, 10, "every KV block free")

        def settled() -> dict[str, Any] | None:
            # Counters travel in heartbeats: wait until they show every migration.
            status = daemon.status()
            for w in status["workers"]:
                m = w.get("migration") or {}
                if m.get("count", len(prompts)) < len(prompts):
                    return None
                if m.get("received", len(prompts)) < len(prompts):
                    return None
            return status

        return outputs, wait_until(settled, 10, "migration counters")
    finally:
        daemon.close()


def test_disaggregated_equals_hybrid_on_gpu(model_dir: Path) -> None:
    hybrid, _ = serve_outputs(model_dir, "--mode", "hybrid")
    disagg, status = serve_outputs(model_dir, "--mode", "disaggregated")
    assert disagg == hybrid
    by_name = {w["name"]: w for w in status["workers"]}
    assert by_name["prefill-0"]["transport"] == "cuda_ipc"
    assert by_name["prefill-0"]["migration"]["count"] == 5
    assert by_name["decode-0"]["migration"]["received"] == 5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU")
def test_prefill_and_decode_on_two_gpus(model_dir: Path) -> None:
    same, _ = serve_outputs(model_dir, "--mode", "hybrid", "--device", "cuda:0")
    split, status = serve_outputs(
        model_dir, "--prefill-device", "cuda:0", "--decode-device", "cuda:1"
    )
    assert split == same
    by_name = {w["name"]: w for w in status["workers"]}
    assert by_name["prefill-0"]["device"] == "cuda:0"
    assert by_name["decode-0"]["device"] == "cuda:1"

"""Each GPU engine's part of its device, claimed in the device's ledger
(hybrid/gpu_budget.py), with a fake 80 GiB device: the configured engines share it as the
plan says, a restarted one gets its part back, an added one gets what is left."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmd.config import ServeConfig
from lmd.engine.memory_plan import MemoryPlanError
from lmd.hybrid.gpu_budget import claim_gpu_budget
from lmd.protocol.roles import Role
from lmd.roles import WorkerSpec, engines_on_gpu, plan_workers, worker_spec
from tests.models import save_tiny_llama

GiB = 1 << 30
TOTAL = 80 * GiB


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def mem_get_info(device: object = None) -> tuple[int, int]:
        return TOTAL - GiB, TOTAL

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def engines(config: ServeConfig) -> dict[str, WorkerSpec]:
    return {s.name: s for s in plan_workers(config, "cuda", 1) if s.role.is_engine}


def test_the_configured_engines_of_a_gpu_are_named_in_each_ones_spec(tmp_path: Path) -> None:
    config = ServeConfig(tmp_path, decode_workers=2)
    specs = engines(config)
    expected = (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"))
    assert all(s.device_engines == expected for s in specs.values())
    assert WorkerSpec(**specs["decode-1"].to_dict()) == specs["decode-1"]  # through a dict
    # prefill and decode on two GPUs: each alone on its own
    apart = ServeConfig(tmp_path, prefill_device="cuda:0", decode_device="cuda:1")
    assert engines_on_gpu(apart, "cuda", "cuda:1") == (("decode-0", "decode"),)
    assert engines_on_gpu(apart, "cuda", "cuda") == (("prefill-0", "prefill"),)
    assert engines_on_gpu(ServeConfig(tmp_path, device="cpu"), "cpu", "cpu") == ()


@pytest.mark.usefixtures("fake_gpu")
def test_prefill_and_decode_claim_their_parts_and_never_more_than_the_gpu_allows(
    tmp_path: Path, model: Path
) -> None:
    config = ServeConfig(tmp_path, model=str(model))
    specs = engines(config)
    cfg = config.engine_on("cuda")
    assert cfg.max_batch_size == 256  # the default on a GPU
    prefill, _ = claim_gpu_budget(specs["prefill-0"], config, cfg, model)
    decode, ledger = claim_gpu_budget(specs["decode-0"], config, cfg, model)
    assert prefill.budget_bytes + decode.budget_bytes <= int(0.9 * TOTAL)
    assert decode.share_bytes > prefill.share_bytes
    assert ledger.taken("x") == {
        "prefill-0": prefill.budget_bytes,
        "decode-0": decode.budget_bytes,
    }
    # decode-0 restarted: the same part again
    again, _ = claim_gpu_budget(specs["decode-0"], config, cfg, model)
    assert again == decode
    # an engine added by lmdctl scale: the configured ones hold all the daemon may use
    added = worker_spec(config, Role.DECODE, 1, "cuda", 1)
    with pytest.raises(MemoryPlanError, match="start the daemon with the workers it needs"):
        claim_gpu_budget(added, config, cfg, model)


@pytest.mark.usefixtures("fake_gpu")
def test_an_added_engine_gets_what_the_others_leave(tmp_path: Path, model: Path) -> None:
    config = ServeConfig(tmp_path, model=str(model))
    specs = engines(config)
    cfg = config.engine_on("cuda")
    prefill, ledger = claim_gpu_budget(specs["prefill-0"], config, cfg, model)
    decode, _ = claim_gpu_budget(specs["decode-0"], config, cfg, model)
    ledger.remove("prefill-0")  # prefill-0 stopped (scaled down to none, say)
    added, _ = claim_gpu_budget(worker_spec(config, Role.DECODE, 1, "cuda", 1), config, cfg, model)
    assert added.budget_bytes == int(0.9 * TOTAL) - decode.budget_bytes
    assert added.budget_bytes == pytest.approx(prefill.budget_bytes, abs=1)
    assert not added.alone


@pytest.mark.usefixtures("fake_gpu")
def test_a_tensor_parallel_group_has_a_part_on_each_of_its_gpus(
    tmp_path: Path, model: Path
) -> None:
    """prefill on cuda:0-1 and decode on cuda:2-3 as groups of 2: each GPU plans for the
    one rank it holds, whose needs are a rank's (half the weights), and each rank claims
    its part in its own GPU's ledger."""
    config = ServeConfig(
        tmp_path, model=str(model), prefill_device="cuda:0", decode_device="cuda:2", tp=2
    )
    specs = engines(config)
    prefill, decode = specs["prefill-0"], specs["decode-0"]
    assert prefill.device_engines == (("prefill-0", "prefill"),)
    assert prefill.rank_engines == ((("prefill-0.r1", "prefill"),),)
    rank1 = decode.rank(1)
    assert (rank1.name, rank1.device) == ("decode-0.r1", "cuda:3")
    assert rank1.device_engines == (("decode-0.r1", "decode"),)
    assert WorkerSpec(**decode.to_dict()) == decode  # the rank engines survive the dict form
    cfg = config.engine_on("cuda")
    alone = ServeConfig(tmp_path / "alone", model=str(model), decode_device="cuda:2")
    whole, _ = claim_gpu_budget(worker_spec(alone, Role.DECODE, 0, "cuda", 1), alone, cfg, model)
    ranks = [claim_gpu_budget(decode.rank(r), config, cfg, model)[0] for r in (0, 1)]
    assert [b.device for b in ranks] == ["cuda:2", "cuda:3"]
    assert all(b.weight_bytes == whole.weight_bytes // 2 for b in ranks)
    assert all(b.reserve_bytes < whole.reserve_bytes for b in ranks)
    # both GPUs hold one engine each: alone on its device
    assert all(b.alone for b in ranks)

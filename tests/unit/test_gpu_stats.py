"""gpu_stats.read_gpus: GPU numbers through NVML, and a reason instead of a crash when
there is no pynvml, no driver or no device. NVML is faked (the same calls pynvml has)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import pytest

from lmd.supervisor.gpu_stats import read_gpus

GIB = 1 << 30
RESERVED = 480 << 20  # what an H100's driver reserves; NVML v1 counts it as used


class NVMLError(Exception):
    pass


@dataclass
class Memory:
    used: int
    total: int


@dataclass
class Utilization:
    gpu: int


@dataclass
class FakeNvml:
    """Two GPUs by default; `init_error` plays a machine without a driver."""

    devices: list[tuple[str | bytes, int, int, int | None]] = field(
        default_factory=lambda: [
            ("NVIDIA H100 80GB HBM3", 12 * GIB, 80 * GIB, 45),
            (b"NVIDIA H100 80GB HBM3", 1 * GIB, 80 * GIB, None),  # old pynvml: bytes; no util
        ]
    )
    init_error: str | None = None
    memory_v2: bool = True  # False: a driver without the version 2 memory call
    num_open: int = 0
    NVMLError: type[Exception] = NVMLError
    nvmlMemory_v2: int = 0x02000028

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError(self.init_error)
        self.num_open += 1

    def nvmlShutdown(self) -> None:
        self.num_open -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str | bytes:
        return self.devices[h][0]

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> Memory:
        """Version 1 counts the driver's reserved memory as used, version 2 does not."""
        used, total = self.devices[h][1], self.devices[h][2]
        if version is None:
            return Memory(used=used + RESERVED, total=total)
        if not self.memory_v2 or version != self.nvmlMemory_v2:
            raise NVMLError("Function Not Found")
        return Memory(used=used, total=total)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Utilization:
        util = self.devices[h][3]
        if util is None:
            raise NVMLError("Not Supported")
        return Utilization(util)


def test_reads_memory_and_utilisation_of_every_gpu_and_closes_nvml() -> None:
    nvml = FakeNvml()
    out = read_gpus(nvml)
    assert out["available"] is True and out["reason"] is None
    first, second = out["devices"]
    assert first == {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "memory_used_bytes": 12 * GIB,
        "memory_total_bytes": 80 * GIB,
        "utilization_percent": 45,
    }
    assert second["name"] == "NVIDIA H100 80GB HBM3" and second["utilization_percent"] is None
    assert nvml.num_open == 0


def test_memory_used_leaves_out_the_reserved_memory_where_the_driver_can() -> None:
    assert read_gpus(FakeNvml())["devices"][0]["memory_used_bytes"] == 12 * GIB
    old_driver = FakeNvml(memory_v2=False)
    assert read_gpus(old_driver)["devices"][0]["memory_used_bytes"] == 12 * GIB + RESERVED


def test_no_driver_says_no_gpu() -> None:
    out = read_gpus(FakeNvml(init_error="Driver Not Loaded"))
    assert out == {"available": False, "reason": "no GPU (NVML: Driver Not Loaded)", "devices": []}


def test_no_device_says_no_gpu() -> None:
    nvml = FakeNvml(devices=[])
    assert read_gpus(nvml)["reason"] == "no GPU (NVML found no device)"
    assert nvml.num_open == 0


def test_without_pynvml_it_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    out = read_gpus()
    assert out["available"] is False
    assert out["reason"] == "pynvml not installed (pip install 'lmd[gpu]')"

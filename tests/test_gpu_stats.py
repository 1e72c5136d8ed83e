"""GPU metrics through NVML: device mapping, readings, and a machine without a GPU.

NVML cannot answer on a machine without an NVIDIA driver, so the readings are tested
against a stand-in module with NVML's function names and error class (the only mock
here); the real ``pynvml`` is used for the no-GPU path, which is what this machine has.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from gateway.gpu_stats import cuda_index, for_device, physical_index

pytestmark = pytest.mark.unit


class FakeNvml(types.SimpleNamespace):
    """NVML's calls, for one machine with two GPUs."""

    class NVMLError(Exception):
        pass

    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__(calls=0, fail_after=fail_after, opened=[], shut=False)

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index > 1:
            raise self.NVMLError("Invalid Argument")
        self.opened.append(index)
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise self.NVMLError("GPU is lost")
        return types.SimpleNamespace(gpu=40 + handle, memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return types.SimpleNamespace(used=3 * 2**30, total=80 * 2**30)


def test_devices_map_to_nvml_indices_through_cuda_visible_devices() -> None:
    assert cuda_index("cpu") is None and cuda_index("cuda") == 0 and cuda_index("cuda:3") == 3
    assert physical_index(0, "") == 0
    assert physical_index(1, "4,1") == 1 and physical_index(0, "4,1") == 4
    assert physical_index(0, "GPU-8f2e") == 0  # UUIDs are not mapped


def test_a_cuda_device_reports_utilisation_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    nvml = FakeNvml()
    stats = for_device("cuda:0", nvml)
    assert stats is not None and nvml.opened == [1]
    assert stats.snapshot() == {
        "1": {"util_pct": 41.0, "mem_util_pct": 10.0, "mem_used_mib": 3072.0, "mem_total_mib": 81920.0}
    }
    stats.close()
    assert nvml.shut


def test_nvml_failing_mid_run_leaves_the_readings_out_instead_of_raising() -> None:
    stats = for_device("cuda", FakeNvml(fail_after=1))
    assert stats is not None
    assert stats.snapshot()["0"]["util_pct"] == 40.0
    assert stats.snapshot() == {}


def test_a_missing_device_or_a_cpu_gives_no_readings() -> None:
    assert for_device("cpu", FakeNvml()) is None
    assert for_device("cuda:5", FakeNvml()) is None


def test_the_real_nvml_gives_readings_exactly_when_the_machine_has_a_driver() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        driver = pynvml.nvmlDeviceGetCount() > 0
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        driver = False
    stats = for_device("cuda:0")
    if not driver:
        assert stats is None
    else:
        assert stats is not None and set(stats.snapshot()["0"]) >= {"util_pct", "mem_used_mib"}
        stats.close()

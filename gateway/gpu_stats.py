"""GPU utilisation and memory through NVML, for the services that run on a GPU.

The inference servers and the trainer add ``{"gpu": {"<index>": {...}}}`` to their
metrics records when their device is a CUDA device and NVML answers (``pip install
nvidia-ml-py``, in the ``train`` extra; the NVML library comes with the NVIDIA driver).
On a machine without either, :func:`for_device` returns ``None`` and the records carry
no ``gpu`` key. Prometheus sees them as ``loopgate_<service>_gpu_<index>_util_pct`` and
so on (``gateway/prometheus.py``). Indices are NVML's (physical) ones: a
``CUDA_VISIBLE_DEVICES`` list is mapped back.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def physical_index(logical: int, visible: str | None = None) -> int:
    """NVML's index of CUDA device ``logical`` under ``CUDA_VISIBLE_DEVICES``.

    Only a list of integers is mapped; UUIDs or an unset variable leave the index as is.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if not visible:
        return logical
    parts = [p.strip() for p in visible.split(",") if p.strip()]
    if all(p.isdigit() for p in parts) and logical < len(parts):
        return int(parts[logical])
    return logical


def cuda_index(device: str) -> int | None:
    """The CUDA device index of a torch device string (``cuda``, ``cuda:1``); None if not CUDA."""
    if not device.startswith("cuda"):
        return None
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


class GpuStats:
    """NVML readings of a fixed set of GPUs."""

    def __init__(self, nvml: Any, handles: dict[int, Any]) -> None:
        self.nvml, self.handles = nvml, handles
        self._warned = False

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{index: {util_pct, mem_util_pct, mem_used_mib, mem_total_mib}}``; {} when NVML fails."""
        out: dict[str, dict[str, float]] = {}
        try:
            for index, handle in self.handles.items():
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = self.nvml.nvmlDeviceGetMemoryInfo(handle)
                out[str(index)] = {
                    "util_pct": float(rates.gpu),
                    "mem_util_pct": float(rates.memory),
                    "mem_used_mib": round(mem.used / 2**20, 1),
                    "mem_total_mib": round(mem.total / 2**20, 1),
                }
        except self.nvml.NVMLError as exc:
            if not self._warned:
                log.warning("NVML stopped answering (%s): GPU metrics are left out", exc)
                self._warned = True
            return {}
        return out

    def close(self) -> None:
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()


def for_device(device: str, nvml: Any = None) -> GpuStats | None:
    """Readings of the GPU behind a torch device string, or None (not CUDA, no NVML)."""
    logical = cuda_index(device)
    if logical is None:
        return None
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            log.info("GPU metrics need nvidia-ml-py (pip install nvidia-ml-py): left out")
            return None
    try:
        nvml.nvmlInit()
        index = physical_index(logical)
        return GpuStats(nvml, {index: nvml.nvmlDeviceGetHandleByIndex(index)})
    except nvml.NVMLError as exc:
        log.info("NVML is not available (%s): GPU metrics are left out", exc)
        return None

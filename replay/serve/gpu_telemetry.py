"""GPU telemetry through NVML (``nvidia-ml-py``), sampled beside the server's metrics.

Only meaningful when the GPUs serving the target are on this machine (the target is
localhost, or agentload started the server). Each sample holds, per GPU: utilization
(compute and memory), memory used, power, SM and memory clocks, temperature. When NVML
is missing or finds no GPU, ``open_sampler`` says why, and the run records "not
available" with that reason instead of inventing zeros.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


@dataclass(slots=True)
class GpuSampler:
    """Reads every GPU NVML sees; ``sample`` is cheap (microseconds per GPU)."""

    nvml: ModuleType
    handles: list[Any]
    names: list[str]

    def sample(self) -> list[dict[str, float | int]]:
        rows: list[dict[str, float | int]] = []
        nv = self.nvml
        for index, handle in enumerate(self.handles):
            util = nv.nvmlDeviceGetUtilizationRates(handle)
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            rows.append({
                "gpu": index,
                "util_pct": float(util.gpu),
                "mem_util_pct": float(util.memory),
                "mem_used_mib": mem.used / 2**20,
                "power_w": nv.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                "sm_clock_mhz": int(nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)),
                "mem_clock_mhz": int(nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM)),
                "temp_c": int(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)),
            })
        return rows

    def close(self) -> None:
        # NVML raises its own error types; closing is best effort.
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


def is_local(base_url: str) -> bool:
    return (urlsplit(base_url).hostname or "") in LOCAL_HOSTS


def open_sampler(base_url: str, managed: bool) -> tuple[GpuSampler | None, str]:
    """A sampler, or None and the reason telemetry is not available."""
    if not (managed or is_local(base_url)):
        return None, "the target's GPUs are not on this machine"
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install 'agentload[gpu]')"
    try:
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
    except Exception as exc:  # pynvml.NVMLError subclasses; NVML has no common import
        return None, f"NVML found no GPU ({exc})"
    if count == 0:
        nvml.nvmlShutdown()
        return None, "NVML found no GPU"
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    names = [str(nvml.nvmlDeviceGetName(h)) for h in handles]
    return GpuSampler(nvml, handles, names), f"{count} GPU(s): {', '.join(names)}"


def summarize_gpu(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-GPU means and maxima over the run's samples."""
    by_gpu: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        by_gpu.setdefault(int(s["gpu"]), []).append(s)
    out = []
    for gpu, rows in sorted(by_gpu.items()):
        def mean(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return sum(float(r[key]) for r in rows) / len(rows)

        out.append({"gpu": gpu, "samples": len(rows), "util_mean_pct": mean("util_pct"),
                    "power_mean_w": mean("power_w"),
                    "power_max_w": max(float(r["power_w"]) for r in rows),
                    "mem_used_max_mib": max(float(r["mem_used_mib"]) for r in rows),
                    "sm_clock_mean_mhz": mean("sm_clock_mhz")})
    return {"available": True, "gpus": out}

"""NVML telemetry with a stand-in pynvml (no GPU here), and its "not available" reasons."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from agentload.replay.serve.gpu_telemetry import open_sampler, summarize_gpu


def _fake_nvml(count: int) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    state: dict[str, Any] = {"shutdown": False}
    nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM, nv.NVML_TEMPERATURE_GPU = 1, 2, 0  # type: ignore[attr-defined]
    nv.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: count  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    nv.nvmlDeviceGetName = lambda h: "NVIDIA H200"  # type: ignore[attr-defined]
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        gpu=50 + 10 * h, memory=30)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2**30)  # type: ignore[attr-defined]
    nv.nvmlDeviceGetPowerUsage = lambda h: 400_000  # type: ignore[attr-defined]
    nv.nvmlDeviceGetClockInfo = lambda h, kind: 1980 if kind == 1 else 3200  # type: ignore[attr-defined]
    nv.nvmlDeviceGetTemperature = lambda h, kind: 55  # type: ignore[attr-defined]

    def shutdown() -> None:
        state["shutdown"] = True

    nv.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    nv.state = state  # type: ignore[attr-defined]
    return nv


def test_sampler_reads_every_gpu_and_summarizes(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_nvml(2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler, note = open_sampler("http://127.0.0.1:8000", managed=False)
    assert sampler is not None and note == "2 GPU(s): NVIDIA H200, NVIDIA H200"
    rows = sampler.sample() + sampler.sample()
    assert rows[0] == {"gpu": 0, "util_pct": 50.0, "mem_util_pct": 30.0, "mem_used_mib": 1024.0,
                       "power_w": 400.0, "sm_clock_mhz": 1980, "mem_clock_mhz": 3200,
                       "temp_c": 55}
    summary = summarize_gpu(rows)
    assert [g["util_mean_pct"] for g in summary["gpus"]] == [50.0, 60.0]
    assert summary["gpus"][1]["samples"] == 2
    sampler.close()
    assert fake.state["shutdown"]  # type: ignore[attr-defined]


def test_not_available_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    assert open_sampler("http://gpu-node:8000", managed=False) == (
        None, "the target's GPUs are not on this machine")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    sampler, note = open_sampler("http://localhost:8000", managed=False)
    assert sampler is None and "nvidia-ml-py is not installed" in note
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(0))
    assert open_sampler("http://localhost:8000", managed=True) == (None, "NVML found no GPU")

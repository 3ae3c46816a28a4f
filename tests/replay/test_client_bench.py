"""The client benchmark: exact merges, stamp errors that show a busy client, the JSON keys."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from array import array
from pathlib import Path

import numpy as np
import pytest

from agentload.replay.bench.client_bench import (
    ClientBenchConfig,
    client_benchmark,
    emulator,
    merge,
    merge_emulator_stats,
    report_lines,
)
from agentload.replay.bench.emulator import EMULATOR_MODEL
from agentload.replay.bench.workers import ShardResult, ShardSpec, play_shard, split
from tests.support import run_cli


def _shard(index: int, emit: list[int], late_kernel_ns: int, late_python_ns: int) -> ShardResult:
    r = ShardResult(index, kernel_stamps=True, ok=1, reads=len(emit), first_send_ns=emit[0] - 10,
                    last_event_ns=emit[-1] + late_kernel_ns, cpu_s=0.5)
    r.emit_ns = array("q", emit)
    r.event_ns = array("q", [e + late_kernel_ns for e in emit])
    r.user_ns = array("q", [e + late_kernel_ns + late_python_ns for e in emit])
    return r


def test_merge_is_exact_over_shards() -> None:
    a = _shard(0, list(range(1_000_000, 101_000_000, 1_000_000)), 10_000, 2_000_000)
    b = _shard(1, list(range(1_500_000, 101_500_000, 1_000_000)), 30_000, 4_000_000)
    m = merge([a, b])
    assert m["events"] == 200 and m["workers"] == 2 and m["kernel_stamps"]
    whole = m["timestamp_error_whole_run"]
    # Half the events 10 us late, half 30 us: the median lies between, the p99 at 30 us.
    assert whole["kernel_minus_emit"]["p50_ms"] == pytest.approx(0.02)
    assert whole["kernel_minus_emit"]["p99_ms"] == pytest.approx(0.03)
    assert whole["python_minus_kernel"]["max_ms"] == pytest.approx(4.0)
    assert m["cpu_per_event_us"] == pytest.approx(1e6 / 200)
    assert m["events_per_read"] == 1.0
    assert split(10, 3) == [4, 3, 3] and sum(split(1001, 2)) == 1001


def test_emulator_processes_merge_counts_and_keep_each_peak() -> None:
    a = {"requests": 3, "events": 30, "tokens": 30, "steps": 10, "max_running_streams": 5,
         "step_lag_p99_ms": 1.0, "saturated": False, "pid": 1}
    b = {"requests": 4, "events": 41, "tokens": 41, "steps": 12, "max_running_streams": 7,
         "step_lag_p99_ms": 9.0, "saturated": True, "verdict": "late steps", "pid": 2}
    out = merge_emulator_stats([a, b])
    assert (out["requests"], out["events"], out["steps"]) == (7, 71, 22)
    # peaks need not coincide: each is kept, the sum is only an upper bound
    assert out["max_running_streams_per_process"] == [5, 7]
    assert out["max_running_streams_at_most"] == 12
    assert "max_running_streams" not in out
    assert out["step_lag_p99_ms"] == 9.0 and out["saturated"] and out["verdict"] == "late steps"
    assert out["processes"] == 2


def test_a_blocked_loop_shows_as_python_stamp_error_not_kernel(tmp_path: Path) -> None:
    """The client's own error is measured: block its loop and only Python stamps move."""
    cfg = ClientBenchConfig(ttft_ms=10.0, itl_ms=10.0)
    with emulator(cfg, tmp_path / "emu.log") as url:
        async def main() -> ShardResult:
            async def blocker() -> None:
                while True:
                    await asyncio.sleep(0.03)
                    time.sleep(0.02)  # the loop cannot serve its sockets for 20 ms

            task = asyncio.create_task(blocker())
            try:
                spec = ShardSpec(0, 1, url, lanes=8, requests=16, max_tokens=30)
                return await play_shard(spec, time.perf_counter_ns(), EMULATOR_MODEL)
            finally:
                task.cancel()

        r = asyncio.run(main())
    assert r.kernel_stamps and r.ok == 16
    m = merge([r])
    err = m["timestamp_error_whole_run"]
    assert err["python_minus_kernel"]["p99_ms"] > 5.0   # the loop's stall
    assert err["kernel_minus_emit"]["p50_ms"] < 1.0      # the kernel saw the bytes on time
    assert m["loop_lag"]["max_ms"] > 10.0


def test_client_benchmark_small_run_keeps_up(tmp_path: Path) -> None:
    cfg = ClientBenchConfig(streams=20, requests=40, max_tokens=20, workers=2, ttft_ms=10.0,
                            itl_ms=10.0, vllm_bench=False)
    r = client_benchmark(cfg, workdir=tmp_path)
    a = r["agentload"]
    assert a["events"] == 40 * 20 and a["requests_failed"] == 0 and a["workers"] == 2
    assert a["kernel_stamps"]
    err = a["timestamp_error_whole_run"]
    assert err["python_minus_kernel"]["p50_ms"] >= 0.0
    # The kernel stamp is never later than the Python one, so never further from emission.
    assert err["kernel_minus_emit"]["p50_ms"] <= err["python_minus_emit"]["p50_ms"]
    assert err["kernel_minus_emit"]["p50_ms"] < 20.0
    assert a["events_per_read"] >= 1.0 and a["events_per_s"] > 0
    assert r["ratio_vs_vllm_bench"] is None and not r["vllm_bench"]["ran"]
    assert r["agentload"]["emulator"]["events"] == 800
    assert not r["aiperf"]["ran"] and r["aiperf"]["reason"]
    # Timed events are a subset of the delivered ones, and the table shows both.
    assert 0 < a["timed_events_per_s"] <= a["events_per_s"] * (1 + 1e-9)
    lines = "\n".join(report_lines(r))
    assert "timed on their own" in lines and "not timed (read with others)" in lines


def test_cli_json_keys() -> None:
    proc = run_cli("bench", "client", "--streams", "10", "--requests", "10", "--max-tokens",
                   "10", "--workers", "1", "--itl-ms", "5", "--ttft-ms", "5",
                   "--no-vllm-bench", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("agentload_events_per_s", "vllm_bench_events_per_s", "ratio_vs_vllm_bench",
                "p99_timestamp_error_ms", "aiperf_events_per_s", "agentload_timed_events_per_s",
                "vllm_bench_timed_events_per_s", "ratio_timed_vs_vllm_bench",
                "p99_python_minus_kernel_ms"):
        assert key in out
    assert out["agentload_events_per_s"] > 0 and out["p99_timestamp_error_ms"] is not None


@pytest.mark.vllm
def test_vllm_bench_serve_runs_against_the_same_emulator(tmp_path: Path) -> None:
    cfg = ClientBenchConfig(streams=10, requests=20, max_tokens=20, workers=1, ttft_ms=10.0,
                            itl_ms=10.0)
    r = client_benchmark(cfg, workdir=tmp_path)
    v = r["vllm_bench"]
    assert v["ran"], v.get("reason")
    assert v["completed"] == 20 and v["events"] == 20 * 20
    assert r["ratio_vs_vllm_bench"] is not None and r["ratio_vs_vllm_bench"] > 0
    assert np.isfinite(r["vllm_bench_events_per_s"])


def test_timed_events_drop_the_ones_read_together() -> None:
    """Events stamped within µs of the previous one of their request were read together."""
    from agentload.replay.bench.client_bench import timed_mask

    gaps = np.array([0, 20_000_000, 3_000, 19_000_000, 0], dtype=np.int64)
    first = np.array([True, False, False, False, True])
    assert timed_mask(gaps, first, 5_000_000).tolist() == [True, True, False, True, True]
    # merge applies the rule per request: two requests, the second read all at once.
    r = _shard(0, [10_000_000 * i for i in range(1, 9)], 10_000, 0)
    r.event_ns = array("q", [1, 20_000_001, 40_000_001, 60_000_001, 5, 5, 5, 5])
    r.request_events = array("q", [4, 4])
    r.first_send_ns, r.last_event_ns = 0, 80_000_000
    m = merge([r], min_gap=5_000_000)
    # Inside the steady window [20, 60) ms only events 2 and 3 of the first request fall.
    assert m["timed_events_per_s"] == pytest.approx(2 / 0.04)


def test_finding_vllm_bench_does_not_import_vllm(tmp_path: Path) -> None:
    # Importing vllm would bring torch and triton into agentload's process (and triton's
    # leak report onto the terminal at exit); the check only looks for the file.
    probe = ("import sys\n"
             "from agentload.replay.bench.client_bench import vllm_bench_available\n"
             "print(repr(vllm_bench_available()), 'vllm' in sys.modules, "
             "'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[1:] == ["False", "False"], out
    if importlib.util.find_spec("vllm") is not None:
        assert out[0] == "None"
    # A vllm without its benchmarks (another distribution of the name) is named as such.
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise SystemExit('must not be imported')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}).stdout
    assert "vllm.benchmarks.serve not found" in out and "False False" in out

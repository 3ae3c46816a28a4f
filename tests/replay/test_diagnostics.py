"""Self-diagnostics in every run: the client's stamp error, events per read and loop lag
land in summary.json, and a saturated client makes the run invalid with the reason."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from agentload.replay import ReplayOptions, run_replay
from agentload.replay.bench.client_bench import ClientBenchConfig, emulator
from agentload.replay.client.diagnostics import ClientDiagnostics, saturation_reasons, starved_by_os
from agentload.replay.client.sse import StreamResult
from agentload.replay.results.metrics import validity
from agentload.traces import Block, Request, Session, Trace


def _trace(n: int) -> Trace:
    return Trace("diag", tuple(Session(f"s{i}", (Request(f"s{i}/0", f"s{i}",
                                                         (Block(100 + i, 32),), 20),))
                               for i in range(n)), block_size=16)


def test_a_real_run_reports_the_client_in_summary_json(tmp_path: Path) -> None:
    with emulator(ClientBenchConfig(ttft_ms=10.0, itl_ms=5.0), tmp_path / "emu.log") as url:
        result = run_replay(_trace(12), tmp_path / "run", target_url=url,
                            options=ReplayOptions(users=4, time_scale=0.0, cache_salt=7),
                            progress="none", report=False, say=lambda _: None)
    client = json.loads((tmp_path / "run" / "summary.json").read_text())["client"]
    assert client == result.summary["client"]
    assert client["kernel_stamps"] is True
    assert client["stamp_error_p50_s"] is not None and client["stamp_error_p50_s"] >= 0
    assert client["events_per_read"] >= 1.0 and client["max_events_per_read"] >= 1
    assert client["loop_lag_p99_s"] is not None and client["cpu_cores"] is not None
    # A loaded machine may starve the client; then the run says so, and why.
    reasons = client["saturation_reasons"]
    assert all(r in result.summary["validity"]["reasons"] for r in reasons)
    if reasons:
        assert result.summary["validity"]["verdict"] == "invalid"
    assert result.summary["requests_completed"] == 12


def test_observe_counts_reads_and_stamp_error() -> None:
    d = ClientDiagnostics()
    res = StreamResult(sent_ns=0, chunks=3, reads=2, multi_event_reads=1, max_events_per_read=2)
    res.chunk_ns = [1_000, 2_000, 2_000]
    res.chunk_user_ns = [1_500, 4_000, 4_000]
    d.observe(res)
    d.observe(StreamResult(sent_ns=0, chunks=1, reads=1, max_events_per_read=1))
    s = d.summary()
    assert s["kernel_stamps"] and s["events_per_read"] == 4 / 3
    assert s["multi_event_read_share"] == 1 / 3
    assert s["stamp_error_max_s"] == 2e-6
    # A third of the reads had more than one event: the client was behind.
    assert any("more than one event" in r for r in s["saturation_reasons"])


def test_a_saturated_client_makes_the_run_invalid() -> None:
    client = {"cpu_cores": 0.97, "multi_event_read_share": 0.0, "loop_lag_p99_s": 0.2,
              "stamp_error_p99_s": 0.001}
    reasons = saturation_reasons(client)
    assert len(reasons) == 2 and "97%" in reasons[0] and "200.0 ms" in reasons[1]
    summary = {"requests_completed": 10, "requests_failed": 0,
               "client": {"saturation_reasons": reasons}}
    verdict = validity(summary)
    assert verdict["verdict"] == "invalid" and reasons[0] in verdict["reasons"]
    healthy = {"requests_completed": 10, "requests_failed": 0,
               "client": {"saturation_reasons": saturation_reasons(
                   {"cpu_cores": 0.3, "loop_lag_p99_s": 0.002})}}
    assert validity(healthy)["verdict"] == "valid"


def test_late_stamps_on_an_oversubscribed_machine_name_the_os() -> None:
    """A client at 1 % of a core whose loop waited 1.3 s for a CPU: still invalid (its
    stamps were late), and the reasons say the machine was the cause."""
    starved = {"cpu_cores": 0.01, "loop_lag_p99_s": 0.004, "stamp_error_p99_s": 1.06,
               "os_wait_max_s": 1.3}
    reasons = saturation_reasons(starved)
    assert len(reasons) == 2 and "1060.0 ms" in reasons[0]
    assert "waited up to 1300 ms for a CPU" in reasons[1] and "1% of a core" in reasons[1]
    assert starved_by_os(starved)
    # A CPU-bound client is its own cause, whatever the OS did.
    busy = {**starved, "cpu_cores": 0.97}
    assert not starved_by_os(busy)
    assert not any("the OS held" in r for r in saturation_reasons(busy))
    # The OS's wait alone, with stamps on time, leaves a valid run alone.
    assert saturation_reasons({**starved, "stamp_error_p99_s": 0.002}) == []


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(),
                    reason="needs Linux schedstat")
def test_the_probe_reads_the_loops_run_queue_wait() -> None:
    d = ClientDiagnostics()

    async def run() -> None:
        d.start()
        task = asyncio.create_task(d.probe(0.002))
        await asyncio.sleep(0.1)
        d.stop()
        task.cancel()

    t0 = time.monotonic()
    asyncio.run(run())
    wall_s = time.monotonic() - t0
    s = d.summary()
    # A thread cannot wait in the run queue longer than the time that passed (a busy CI
    # host has shown waits of 2.5 s, so no fixed bound holds).
    assert s["os_wait_s"] is not None and 0 <= s["os_wait_max_s"] <= s["os_wait_s"] <= wall_s
    assert len(d.loop_lag_ns) >= 10
    assert s["starved_by_os"] == starved_by_os(s)  # the verdict follows its own figures

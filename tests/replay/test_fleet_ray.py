"""``replay --ray``: shards as Ray actors on a local two-node Ray cluster (two ``ray
start`` on 127.0.0.1, one CPU each, stopped at the end) give the requests of a
one-process run; a killed actor is survived with what it had streamed; bad input is
one line and exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from agentload.replay.engine.core import ReplayOptions
from agentload.replay.journal import read_journal, shard_journal_path
from agentload.replay.run import run_replay
from agentload.replay.serve.server import free_port
from agentload.traces import demo_trace_path
from tests.support import ROOT, run_cli
from tests.support.fleet import KEY, start_replay, wait_requests, worker_pid

ray = pytest.importorskip("ray")
RAY = str(Path(sys.executable).with_name("ray"))
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}


def _ray(*args: str) -> None:
    subprocess.run([RAY, *args], check=True, env=ENV, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    port = free_port()
    while 10000 <= port < 20000:  # Ray's worker ports; the head's must be elsewhere
        port = free_port()
    address = f"127.0.0.1:{port}"
    # Small object stores: nothing big travels, and CI has 24 GiB for everything.
    small = ("--num-cpus", "1", "--object-store-memory", str(100 << 20))
    _ray("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), *small,
         "--include-dashboard", "false", "--disable-usage-stats")
    try:
        _ray("start", "--address", address, "--node-ip-address", "127.0.0.1", *small)
        yield address
    finally:
        # This process must have left the cluster first: Ray ends a driver whose cluster
        # goes away (exit status 1, in the middle of the suite).
        joined = ray.is_initialized()
        if joined:
            ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], env=ENV, capture_output=True, timeout=120)
        assert not joined, "a test left this process joined to the Ray cluster"


def test_ray_actors_on_two_nodes_send_the_requests_of_one_process(
        server: str, cluster: str, tmp_path: Path) -> None:
    opts = ReplayOptions(users=4, time_scale=0.05, cache_salt=7)
    run_replay(demo_trace_path(), tmp_path / "one", target_url=server, options=opts,
               workers=1, progress="none", report=False, say=lambda line: None)
    result = run_replay(demo_trace_path(), tmp_path / "ray", target_url=server,
                        options=opts, workers=None, ray_address=cluster, progress="none",
                        report=False, say=lambda line: None)
    one = pl.read_parquet(tmp_path / "one" / "requests.parquet").select(KEY).sort(KEY)
    two = pl.read_parquet(tmp_path / "ray" / "requests.parquet").select(KEY).sort(KEY)
    assert one.height > 20 and one.equals(two)
    run = json.loads((tmp_path / "ray" / "run.json").read_text())
    workers = run["workers"]
    # --workers auto: one per node, and the two actors were spread over both nodes.
    assert workers["placement"] == "ray" and workers["count"] == 2
    assert len({w["node_id"] for w in workers["where"].values()}) == 2
    for where in workers["where"].values():  # offsets measured at both ends
        clock = where["clock"]
        assert {"start", "end"} <= clock.keys()
        # One host: the true offset is 0, so the measured one is within half a round trip.
        assert abs(clock["start"]["offset_ns"]) <= clock["start"]["round_trip_ns"] / 2 + 1e5
    assert result.summary["workers"]["workers_lost"] == 0


def test_a_killed_ray_actor_keeps_what_it_streamed(server: str, cluster: str,
                                                   tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_replay(server, run_dir, "--duration", "8", "--ray", cluster)
    local = shard_journal_path(run_dir, 1)
    pid = worker_pid(local)
    wait_requests(local, 5)
    os.kill(pid, signal.SIGKILL)
    _, streamed = read_journal(local)  # what had reached the driver at the kill
    _out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    lost = summary["workers"]["lost"]
    assert summary["workers"]["workers_lost"] == 1 and lost[0]["worker"] == 1
    assert lost[0]["reason"].startswith("Ray actor lost")
    frame = pl.read_parquet(run_dir / "requests.parquet")
    kept = set(frame.filter(pl.col("lane").is_in([1, 3]))["request_id"])
    assert {r["request_id"] for r in streamed} <= kept
    survivors = frame.filter(pl.col("lane").is_in([0, 2]))
    assert survivors["sent_ns"].max() / 1e9 > lost[0]["at_s"] + 1.0


def test_ray_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # Ray missing: a `ray` module that fails to import shadows the installed one.
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "ray.py").write_text("raise ImportError('no ray here')\n")
    cases = [
        ({"PYTHONPATH": str(fake)}, ["--ray", "auto"], "--ray needs Ray, an optional extra"),
        ({}, ["--ray", "127.0.0.1:9"], "cannot reach the Ray cluster at 127.0.0.1:9"),
        ({}, ["--ray", "127.0.0.1:9", "--workers", "0"], "--workers must be at least 1"),
        ({}, ["--ray", "auto", "--cpus", "0"], "with --ray, Ray places them"),
    ]
    for env, args, message in cases:
        started = time.monotonic()
        result = run_cli("replay", str(demo_trace_path()), "--target", "http://127.0.0.1:9",
                         "-o", str(tmp_path / "run"), *args, env=env, cwd=ROOT)
        assert result.returncode == 2, (args, result.stderr)
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], (args, result.stderr)
        assert time.monotonic() - started < 60


def test_bench_client_runs_its_workers_as_ray_actors_beside_local_ones(cluster: str) -> None:
    from agentload.replay.bench.client_bench import (
        ClientBenchConfig,
        scaling_benchmark,
        scaling_lines,
    )

    cfg = ClientBenchConfig(streams=20, requests=40, max_tokens=20, ttft_ms=10.0,
                            itl_ms=5.0, vllm_bench=False, ray_address=cluster)
    result = scaling_benchmark(cfg, [1, 2])
    for row in result["rows"]:
        # Every request's events came back either way, at the emulator's schedule.
        assert row["ray_events_per_s"] > 0.5 * result["offered_events_per_s"]
        assert 0.5 < row["ray_over_local"] < 2.0
        assert not row["ray_emulator_saturated"]
    assert "x local" in "\n".join(scaling_lines(result))

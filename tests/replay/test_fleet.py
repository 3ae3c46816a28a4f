"""``replay --workers N``: lanes over processes give exactly a one-process run's requests,
a killed worker keeps every request it finished, Ctrl-C stops them all, and bad input is
one line with exit 2. The server is the small SSE server of ``tests/tui/test_live``."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import polars as pl
import pytest

from agentload.replay.engine.core import ReplayOptions
from agentload.replay.errors import ReplayError
from agentload.replay.fleet.local import auto_workers, merge_diagnostics, parse_cpus, parse_workers
from agentload.replay.journal import (
    JOURNAL_NAME,
    merge_shards,
    read_journal,
    shard_journal_path,
    shard_journals,
)
from agentload.replay.live import LiveBoard
from agentload.replay.run import run_replay
from agentload.traces import Block, Request, Session, Trace, demo_trace_path
from tests.support import run_cli
from tests.support.fleet import KEY, start_replay, wait_requests, worker_pid


class _Watcher:
    """A viewer that samples the published board ten times a second."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()

    def attach(self, board: LiveBoard, stop: Callable[[str], None]) -> None:
        def sample() -> None:
            while not self._stop.wait(0.1):
                snap = board.latest
                if snap is not None:
                    self.samples.append((time.monotonic(), snap.totals.requests_done))
        threading.Thread(target=sample, daemon=True).start()

    def finish(self, note: str) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()


def _replay(server: str, run_dir: Path, workers: int, **options: object) -> pl.DataFrame:
    opts = ReplayOptions(**{"users": 4, "time_scale": 0.05, "cache_salt": 7, **options})
    run_replay(demo_trace_path(), run_dir, target_url=server, options=opts, workers=workers,
               progress="none", report=False, say=lambda line: None)
    return pl.read_parquet(run_dir / "requests.parquet")


def test_two_workers_send_exactly_the_requests_of_one(server: str, tmp_path: Path) -> None:
    one = _replay(server, tmp_path / "one", 1)
    watcher = _Watcher()
    opts = ReplayOptions(users=4, time_scale=0.05, cache_salt=7)
    result = run_replay(demo_trace_path(), tmp_path / "two", target_url=server, options=opts,
                        workers=2, progress="dashboard", viewer=watcher, report=False,
                        say=lambda line: None)
    two = pl.read_parquet(tmp_path / "two" / "requests.parquet")
    assert one.height == two.height > 20
    assert two["request_id"].n_unique() == two.height  # no request twice
    assert one.select(KEY).sort(KEY).equals(two.select(KEY).sort(KEY))
    assert two["ok"].all()
    # Lane i ran in worker i % 2, and the merged journal left no worker journal behind.
    run = json.loads((tmp_path / "two" / "run.json").read_text())
    assert run["workers"]["lanes"] == {"0": [0, 2], "1": [1, 3]}
    assert not shard_journals(tmp_path / "two")
    # One start and one end of the run in the merged journal (each worker journals its own
    # worker_start and worker_end).
    kinds = [m.get("kind") for m in read_journal(tmp_path / "two" / JOURNAL_NAME)[0]]
    assert kinds.count("replay_start") == kinds.count("replay_end") == 1
    assert kinds.count("worker_end") == 2
    assert result.summary["workers"]["workers_lost"] == 0
    assert result.summary["requests_completed"] == result.summary["requests_sent"] == one.height
    # The dashboard's board saw every worker's requests, growing while the run went on.
    done = [n for _, n in watcher.samples]
    assert done and done[-1] == two.height and len(set(done)) > 2


def test_recycled_lanes_plan_the_same_plays_in_any_process(server: str,
                                                           tmp_path: Path) -> None:
    runs = {}
    for workers in (1, 2):
        _replay(server, tmp_path / f"w{workers}", workers, recycle=True, duration_s=3.0,
                seed=5)
        runs[workers] = pl.read_parquet(tmp_path / f"w{workers}" / "sessions.parquet")
    cols = ["lane", "play", "session_id", "start_turn", "marker_block"]
    first = {w: r.filter(pl.col("play") == 0).select(cols).sort("lane") for w, r in runs.items()}
    assert first[1].height == 4 and first[1].equals(first[2])
    assert first[1]["start_turn"].n_unique() > 1  # each lane draws its own start


def test_a_killed_worker_keeps_every_request_it_finished(server: str,
                                                          tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_replay(server, run_dir, "--duration", "6")
    shard = shard_journal_path(run_dir, 1)
    pid = worker_pid(shard)
    wait_requests(shard, 5)
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    # What the worker had journaled when it died (the file cannot grow after).
    _, finished = read_journal(shard)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    lost = summary["workers"]["lost"]
    assert summary["workers"]["workers_lost"] == 1
    assert lost[0]["worker"] == 1 and lost[0]["lanes"] == [1, 3]
    assert lost[0]["reason"] == "killed by SIGKILL"
    frame = pl.read_parquet(run_dir / "requests.parquet")
    kept = frame.filter(pl.col("lane").is_in([1, 3]))
    assert sorted(kept["request_id"]) == sorted(r["request_id"] for r in finished)
    # The other worker went on after the loss, to the end of --duration.
    survivors = frame.filter(pl.col("lane").is_in([0, 2]))
    assert survivors["sent_ns"].max() / 1e9 > lost[0]["at_s"] + 1.0
    assert "worker 1 lost: killed by SIGKILL" in err
    # The loss makes the run invalid, and its requests still add up.
    assert any("worker 1 (lanes [1, 3]) was lost" in r for r in summary["validity"]["reasons"])
    assert summary["requests_sent"] >= summary["requests_completed"] + summary["requests_failed"]
    # Headless progress lines aggregate every worker: counts and the P90 of their union.
    assert re.search(r"requests \d+/\? done, .* P90 interactivity \d+ tok/s", err), err


def test_on_worker_loss_stop_ends_the_run(server: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_replay(server, run_dir, "--duration", "60", "--on-worker-loss", "stop")
    shard = shard_journal_path(run_dir, 0)
    pid = worker_pid(shard)
    wait_requests(shard, 3)
    os.kill(pid, signal.SIGKILL)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"].startswith("worker 0 lost (killed by SIGKILL")
    assert summary["workers"]["workers_lost"] == 1


def test_ctrl_c_stops_every_worker_and_keeps_what_finished(server: str,
                                                            tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_replay(server, run_dir, "--duration", "60")
    pids = [worker_pid(shard_journal_path(run_dir, k)) for k in (0, 1)]
    wait_requests(shard_journal_path(run_dir, 1), 3)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    for pid in pids:  # no worker outlives the run
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"]
    assert pl.read_parquet(run_dir / "requests.parquet").height >= 3
    assert not shard_journals(run_dir)


@pytest.mark.parametrize(("args", "message"), [
    (["--workers", "0"], "--workers must be at least 1, got 0"),
    (["--workers", "many"], "--workers must be a count or 'auto'"),
    (["--workers", "2", "--aiperf-compatible"], "sequential draws from one pool"),
    (["--workers", "2", "--max-requests", "5"], "--max-requests counts over every lane"),
    (["--workers", "2", "--session-order", "pool"], "--session-order pool"),
    (["--workers", "2", "--cpus", "100000"], "--cpus '100000': CPUs 100000 are not"),
])
def test_bad_worker_options_are_one_line_and_exit_2(args: list[str], message: str,
                                                     tmp_path: Path) -> None:
    result = run_cli("replay", str(demo_trace_path()), "--target", "http://127.0.0.1:9",
                     "-o", str(tmp_path / "run"), *args)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / JOURNAL_NAME).exists()


def test_auto_picks_a_worker_per_250_users_within_the_cores() -> None:
    assert auto_workers(4, cpus=16) == 1
    assert auto_workers(251, cpus=16) == 2
    assert auto_workers(2000, cpus=16) == 8
    assert auto_workers(2000, cpus=4) == 3  # a core is left to the driver
    assert auto_workers(2000, cpus=1) == 1
    assert parse_workers("auto") is None and parse_workers("3") == 3
    with pytest.raises(ReplayError):
        parse_cpus("3-x")
    assert parse_cpus(f"{min(os.sched_getaffinity(0))}") == [min(os.sched_getaffinity(0))]


def _lines(path: Path, objs: list[dict[str, object]], torn: bytes = b"") -> None:
    path.write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in objs) + torn)


def test_merge_keeps_whole_lines_drops_torn_ones_and_never_merges_twice(
        tmp_path: Path) -> None:
    _lines(tmp_path / JOURNAL_NAME, [{"type": "run"}])
    _lines(shard_journal_path(tmp_path, 0), [{"type": "request", "request_id": "a"}])
    _lines(shard_journal_path(tmp_path, 1), [{"type": "request", "request_id": "b"}],
           torn=b'{"type":"request","requ')
    assert merge_shards(tmp_path) == 2
    _, rows = read_journal(tmp_path / JOURNAL_NAME)
    assert [r["request_id"] for r in rows] == ["a", "b"]
    assert not shard_journals(tmp_path)
    # A merge whose shard files were left behind (cut after the rename) is not redone.
    _lines(shard_journal_path(tmp_path, 1), [{"type": "request", "request_id": "b"}])
    assert merge_shards(tmp_path) == 0
    assert [r["request_id"] for r in read_journal(tmp_path / JOURNAL_NAME)[1]] == ["a", "b"]
    assert not shard_journals(tmp_path)


def test_merge_waits_for_a_local_worker_still_writing(tmp_path: Path) -> None:
    _lines(tmp_path / JOURNAL_NAME, [{"type": "run"}])
    _lines(shard_journal_path(tmp_path, 0), [
        {"type": "event", "kind": "worker", "t_ns": 0, "worker": 0, "pid": os.getpid()}])
    with pytest.raises(ReplayError, match=f"worker process {os.getpid()} still writes"):
        merge_shards(tmp_path)
    assert shard_journals(tmp_path)  # nothing merged, nothing lost


def test_open_loop_with_more_sessions_than_users_over_workers(server: str,
                                                             tmp_path: Path) -> None:
    """Open loop: a lane per session, whatever --users says (it once indexed by users)."""
    trace = _shared_prefix_trace()
    opts = ReplayOptions(users=1, open_loop=True, cache_salt=4)
    for workers in (1, 2):
        run_replay(trace, tmp_path / f"w{workers}", target_url=server, options=opts,
                   workers=workers, progress="none", report=False, say=lambda line: None)
        frame = pl.read_parquet(tmp_path / f"w{workers}" / "requests.parquet")
        assert frame.height == trace.num_requests and frame["ok"].all()
        assert sorted(frame["lane"].unique()) == [0, 1, 2, 3]


def test_merged_diagnostics_take_the_worst_worker() -> None:
    merged = merge_diagnostics({
        0: {"stamp_error_p99_s": 1e-4, "cpu_cores": 0.3, "kernel_stamps": True,
            "saturation_reasons": []},
        1: {"stamp_error_p99_s": 5e-3, "cpu_cores": 0.9, "kernel_stamps": True,
            "saturation_reasons": ["client saturated"]}})
    assert merged["stamp_error_p99_s"] == 5e-3 and merged["cpu_cores"] == 0.9
    assert merged["saturation_reasons"] == ["worker 1: client saturated"]
    assert set(merged["workers"]) == {"0", "1"}


def _shared_prefix_trace() -> Trace:
    """Four sessions opening with one shared 256-token system block, arriving 0.3 s apart
    (open loop), two turns each."""
    sessions = []
    for k in range(4):
        system, own = Block(id=1, tokens=256), Block(id=100 + k, tokens=64)
        first = Request(id=f"s{k}-t0", session_id=f"s{k}", blocks=(system, own),
                        output_tokens=8, arrival_s=0.3 * k)
        second = Request(id=f"s{k}-t1", session_id=f"s{k}",
                         blocks=(system, own, Block(id=200 + k, tokens=64)), output_tokens=8,
                         depends_on=(first.id,), pause_s=0.05)
        sessions.append(Session(id=f"s{k}", requests=(first, second)))
    return Trace(name="shared-prefix", sessions=tuple(sessions), block_size=64)


def test_theoretical_hits_are_counted_over_every_worker(server: str, tmp_path: Path) -> None:
    """Sessions sharing a system prefix: per worker, each worker's first use of it would
    count as a miss; the driver recounts over every worker's requests. The recount of a
    one-process journal changes nothing: it counts as the engine counts."""
    from agentload.replay.fleet.recount import recount_theoretical

    trace = _shared_prefix_trace()
    frames = {}
    for workers in (1, 2):
        opts = ReplayOptions(users=4, open_loop=True, cache_salt=3)
        run_dir = tmp_path / f"w{workers}"
        run_replay(trace, run_dir, target_url=server, options=opts, workers=workers,
                   progress="none", report=False, say=lambda line: None)
        again = recount_theoretical(run_dir / JOURNAL_NAME, trace, opts, trace.block_size)
        assert again == 0  # the engine's own counts (w1), or the driver's recount (w2)
        frames[workers] = pl.read_parquet(run_dir / "requests.parquet").sort("request_id")
    run = json.loads((tmp_path / "w2" / "run.json").read_text())
    assert "(1 requests changed)" in run["workers"]["theoretical_cache"]  # s1's first turn
    # Sessions 1-3 start after session 0's prompt was computed: its 256 system tokens hit.
    hits = dict(zip(frames[2]["request_id"], frames[2]["theoretical_cached_tokens"],
                    strict=True))
    assert hits["s0-t0"] == 0 and hits["s1-t0"] == hits["s2-t0"] == hits["s3-t0"] == 256
    assert frames[1]["theoretical_cached_tokens"].equals(
        frames[2]["theoretical_cached_tokens"])


def test_report_merges_and_recounts_a_run_whose_driver_was_killed(server: str,
                                                                   tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_replay(server, run_dir, "--duration", "60")
    pids = [worker_pid(shard_journal_path(run_dir, k)) for k in (0, 1)]
    wait_requests(shard_journal_path(run_dir, 1), 3)
    proc.kill()  # the driver only: its workers see the pipe close and wind down
    proc.wait(timeout=30)
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "workers outlived their driver"
        time.sleep(0.2)
    journaled = sum(len(read_journal(p)[1]) for p in shard_journals(run_dir))
    result = run_cli("report", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "merged the worker journals; theoretical prefix hits recounted" in result.stdout
    assert not shard_journals(run_dir)
    assert pl.read_parquet(run_dir / "requests.parquet").height == journaled


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and b"zombie" not in Path(
        f"/proc/{pid}/status").read_bytes().lower()


def test_the_dashboard_shows_the_worst_workers_client_health(tmp_path: Path) -> None:
    """Each worker journals its own client figures; played back (live or after the
    merge) the board shows each figure's worst worker and every worker's reasons."""
    from agentload.replay.live import JournalPlayback

    def client(worker: int, p99: float, reasons: list[str]) -> dict[str, object]:
        return {"type": "event", "kind": "client", "t_ns": 1_000_000_000 + worker,
                "worker": worker, "final": False, "kernel_stamps": True,
                "stamp_error_p99_s": p99, "events_per_read": 1.0,
                "multi_event_read_share": 0.0, "loop_lag_p99_s": 0.001, "cpu_cores": 0.2,
                "saturation_reasons": reasons}

    _lines(tmp_path / JOURNAL_NAME, [
        {"type": "run"}, client(0, 2e-5, []), client(1, 4e-3, ["client behind"]),
        {"type": "event", "kind": "replay_end", "t_ns": 2_000_000_000}])
    playback = JournalPlayback(tmp_path, speed=1000.0)
    playback.advance(3e9)
    health = playback.board.client
    playback.close()
    assert health is not None
    assert health.stamp_error_p99_s == 4e-3 and health.kernel_stamps
    assert health.reasons == ("worker 1: client behind",)

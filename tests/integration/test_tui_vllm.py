"""The dashboard over a real replay against real vLLM (the embedded CPU server).

``run_replay`` runs in a thread with an in-process viewer, exactly as the CLI runs it
with the dashboard process, and the app (driven by Pilot) pulls the engine's
published snapshots: the numbers must move while it runs and end where the run's own
summary ends; ``q`` then ``y`` must stop the run and still finalize it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentload.replay import ReplayOptions, RunResult, run_replay
from agentload.replay.live import CODE_STATES, BoardSource, LiveBoard
from agentload.traces import demo_trace_path
from agentload.tui.app import ConfirmStop, DashboardApp

pytestmark = pytest.mark.vllm


class InProcessViewer:
    """A Viewer that hands the engine's board to the test (the dashboard process's twin)."""

    def __init__(self) -> None:
        self.attached = threading.Event()
        self.board: LiveBoard | None = None
        self.stop: Callable[[str], None] | None = None
        self.note: str | None = None
        self.closed = False

    def attach(self, board: LiveBoard, stop: Callable[[str], None]) -> None:
        self.board, self.stop = board, stop
        self.attached.set()

    def finish(self, note: str) -> None:
        self.note = note

    def close(self) -> None:
        self.closed = True


def start_replay(tmp_path: Path, url: str, viewer: InProcessViewer, salt: int,
                 **options: Any) -> tuple[threading.Thread, list[RunResult]]:
    results: list[RunResult] = []

    def target() -> None:
        results.append(run_replay(
            demo_trace_path(), tmp_path / "run", target_url=url,
            options=ReplayOptions(cache_salt=salt, **options), progress="dashboard",
            viewer=viewer, report=False, say=lambda _: None))

    thread = threading.Thread(target=target, name="replay", daemon=True)
    thread.start()
    assert viewer.attached.wait(120), "the replay never started"
    return thread, results


async def test_dashboard_numbers_move_with_a_real_replay(embedded_server: str,
                                                         tmp_path: Path) -> None:
    viewer = InProcessViewer()
    thread, results = start_replay(tmp_path, embedded_server, viewer, 3101, users=4,
                                   time_scale=0.2, max_requests=24)
    assert viewer.board is not None
    app = DashboardApp(BoardSource(viewer.board))
    seen: list[tuple[int, float | None, float]] = []
    states: set[str] = set()
    strip_states: set[str] = set()
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(1200):  # at most five minutes
            await pilot.pause(0.25)
            snap = app.snapshot
            if snap is None:
                continue
            seen.append((snap.totals.requests_done,
                         snap.headline("request").p90_interactivity_tok_s, snap.elapsed_s))
            states |= {lane.state for lane in snap.lanes}
            strip_states |= {CODE_STATES[c] for strip in snap.strips for c in strip}
            if snap.finished and viewer.note is not None:
                break
        final = app.snapshot
        assert final is not None and final.finished
        await pilot.press("q")  # a finished run: leaves without asking
        assert app._exit
    thread.join(timeout=60)
    summary = results[0].summary
    done = [d for d, _, _ in seen]
    assert done == sorted(done) and done[0] < done[-1] == summary["requests_completed"] == 24
    assert len({d for d in done}) >= 3, "the count should move in several steps"
    assert [t for _, _, t in seen] == sorted(t for _, _, t in seen)
    # What the lanes did: the strips keep each second's busiest state (a sample every
    # 0.25 s missed every ~0.1 s decode of the tiny model once, on a loaded CI machine),
    # and the samples catch the states that last, pauses and prefills behind a queue.
    assert "decoding" in strip_states, (strip_states, states)
    assert {"pausing", "prefilling"} & (states | strip_states)
    assert states <= set(CODE_STATES)
    head = final.headline("request")
    for key in ("p90_interactivity_tok_s", "ttft_p90_s", "decode_throughput_tok_s",
                "output_throughput_tok_s"):
        assert getattr(head, key) == pytest.approx(summary[key], rel=1e-6), key
    assert final.server is not None and final.server.ok
    assert final.series_by_key("kv_usage").last() is not None  # type: ignore[union-attr]
    assert "run written to" in (viewer.note or "")


async def test_quitting_the_dashboard_stops_and_finalizes_the_run(embedded_server: str,
                                                                  tmp_path: Path) -> None:
    viewer = InProcessViewer()
    thread, results = start_replay(tmp_path, embedded_server, viewer, 3102, users=2,
                                   time_scale=1.0)
    assert viewer.board is not None
    app = DashboardApp(BoardSource(viewer.board))
    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(600):
            await pilot.pause(0.25)
            if app.snapshot is not None and app.snapshot.totals.requests_done >= 3:
                break
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmStop)
        await pilot.press("y")
        for _ in range(600):  # requests in flight finish, then the run ends
            await pilot.pause(0.25)
            if app._exit:
                break
        assert app._exit, "the app leaves once the stopped run has finished"
    thread.join(timeout=120)
    summary = results[0].summary
    assert summary["stop_reason"] == "stopped from the dashboard"
    assert not summary["interrupted"]
    assert 3 <= summary["requests_completed"] < 49  # the demo trace has 49
    assert (tmp_path / "run" / "summary.json").is_file()
    assert (tmp_path / "run" / "requests.parquet").is_file()

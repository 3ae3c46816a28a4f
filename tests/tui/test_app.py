"""Pilot-driven tests of the dashboard: every panel, key and state, on a scripted source.

The source is a synthetic 40-user run played back on a clock the test moves by hand,
so every snapshot (and so every assertion) is reproducible.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from agentload.replay.client.diagnostics import saturation_reasons
from agentload.replay.live import Header, LiveBoard, LiveSnapshot
from agentload.tui import format as f
from agentload.tui.app import ConfirmStop, DashboardApp, InfoScreen
from agentload.tui.remote import DashboardProcess, RemoteSource
from agentload.tui.synthetic import ScriptedSource, write_synthetic_run
from agentload.tui.widgets import (
    Charts,
    ClientBar,
    EventLog,
    HeaderBar,
    Headline,
    LanesStrip,
    UsersTable,
    client_line,
    lane_cells,
    spark_rows,
)

SIZE = (120, 36)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = write_synthetic_run(tmp_path_factory.mktemp("dash") / "run", users=40,
                              duration_s=240, seed=11, error_rate=0.02, gpus=4)
    return run.run_dir


@pytest.fixture
def source(run_dir: Path) -> Iterator[ScriptedSource]:
    src = ScriptedSource(run_dir)
    yield src
    src.close()


@pytest.fixture
def live_source(run_dir: Path) -> Iterator[ScriptedSource]:
    src = ScriptedSource(run_dir, live=True)
    yield src
    src.close()


def text_of(widget: object) -> str:
    """The plain text a Static-based panel shows."""
    content = widget.render()  # type: ignore[attr-defined]
    return str(getattr(content, "plain", content))


async def test_every_panel_shows_the_snapshot(source: ScriptedSource) -> None:
    app = DashboardApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        snap = app.snapshot
        assert snap is not None
        header = text_of(app.query_one(HeaderBar))
        for part in ("synthetic-arm", "synthetic-40u", "4 GPUs", "40 users", "PLAYBACK",
                     f.clock(snap.elapsed_s) + " elapsed", "weighting request"):
            assert part in header, part
        headline = text_of(app.query_one(Headline))
        head = snap.headline("request")
        assert f.rate(head.p90_interactivity_tok_s, "t/s") in headline
        assert f.seconds(head.ttft_p90_s) in headline
        assert "valid" in headline or "invalid" in headline
        charts = text_of(app.query_one(Charts))
        for label in ("inter. P50", "inter. P90", "TTFT P90", "in flight", "srv queue",
                      "KV usage", "prefix hit"):
            assert label in charts
        table = app.query_one(UsersTable)
        assert table.row_count == 40
        assert table.row_cells(0) == lane_cells(snap.lanes[0])
        strip = app.query_one(LanesStrip)
        assert strip.virtual_size.height == 40
        assert len(strip.render_line(0).text) == strip.size.width
        log = app.query_one(EventLog)
        assert len(log.line_texts()) >= 1  # recycles at least, errors at 2 %
        assert log.render_line(0).text.strip()


async def test_numbers_change_and_the_table_is_diff_updated(source: ScriptedSource) -> None:
    app = DashboardApp(source, refresh_hz=20)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        first = app.snapshot
        assert first is not None
        table = app.query_one(UsersTable)
        table.focus()
        await pilot.press("down", "down", "down")
        assert table.cursor_row == 3
        updates = table.cell_updates
        source.advance(20.0)
        await pilot.pause(0.2)
        later = app.snapshot
        assert later is not None and later.elapsed_s > first.elapsed_s + 19
        assert later.totals.requests_done > first.totals.requests_done
        # Only changed cells were written, rows were never cleared: the cursor stayed.
        written = table.cell_updates - updates
        assert 0 < written < table.row_count * len(table.COLUMNS)
        assert table.cursor_row == 3 and table.row_count == 40
        assert table.row_cells(5) == lane_cells(later.lanes[5])
        # Rows are re-rendered only when they changed and are on screen.
        rendered = table.rows_rendered
        app.draw(later)
        await pilot.pause()
        assert table.rows_rendered == rendered
        # A pull without a new snapshot draws nothing.
        applied = app.applied
        shown = app.snapshot
        app.source.snapshot = lambda: shown  # type: ignore[method-assign]
        app.tick()
        assert app.applied == applied


async def test_pause_freezes_the_display(source: ScriptedSource) -> None:
    app = DashboardApp(source, refresh_hz=20)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("p")
        assert app.paused and source.held == [True]
        frozen = app.snapshot
        assert "DISPLAY PAUSED" in text_of(app.query_one(HeaderBar))
        source.advance(30.0)
        await pilot.pause(0.2)
        assert app.snapshot is frozen
        await pilot.press("space")
        assert not app.paused and source.held == [True, False]
        source.advance(5.0)
        await pilot.pause(0.2)
        assert app.snapshot is not frozen
        assert "DISPLAY PAUSED" not in text_of(app.query_one(HeaderBar))


async def test_zoom_keys_maximize_each_panel(source: ScriptedSource) -> None:
    app = DashboardApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        for key, panel in (("1", "charts"), ("2", "users"), ("3", "lanes"), ("4", "events")):
            await pilot.press(key)
            assert app.screen.maximized is app.query_one(f"#{panel}")
            await pilot.press("escape")
            assert app.screen.maximized is None
        await pilot.press("2")
        await pilot.press("2")  # the same key again zooms back out
        assert app.screen.maximized is None


async def test_weighting_key_cycles_request_user_session(source: ScriptedSource) -> None:
    app = DashboardApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        snap = app.snapshot
        assert snap is not None
        seen = []
        for expected in ("user", "session", "request"):
            await pilot.press("w")
            assert app.weighting == expected
            headline = text_of(app.query_one(Headline))
            assert f"{expected}-weighted" in headline
            assert f"weighting {expected}" in text_of(app.query_one(HeaderBar))
            value = f.rate(app.snapshot.headline(expected).p90_interactivity_tok_s,  # type: ignore[union-attr]
                           "t/s")
            assert value in headline
            seen.append(value)
        assert snap.headline("user") != snap.headline("request")


async def test_help_and_definitions(source: ScriptedSource) -> None:
    app = DashboardApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("question_mark")
        assert isinstance(app.screen, InfoScreen) and app.screen.id == "help"
        assert "zoom a panel" in text_of(app.screen.query_one(".info-text"))
        await pilot.press("escape")
        assert not isinstance(app.screen, InfoScreen)
        await pilot.press("d")
        assert app.screen.id == "definitions"
        text = text_of(app.screen.query_one(".info-text"))
        for term in ("P90 interactivity", "1 / P90(ITL_i)", "E2E-normalized", "user",
                     "session", "prefix hits", "sum(OSL_i - 1)"):
            assert term in text, term
        await pilot.press("d")
        assert app.screen.id != "definitions"


async def test_q_leaves_a_playback_at_once(source: ScriptedSource) -> None:
    app = DashboardApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("q")
        assert app._exit


async def test_q_on_a_live_run_asks_then_stops_it(live_source: ScriptedSource) -> None:
    app = DashboardApp(live_source, refresh_hz=20)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert "LIVE" in text_of(app.query_one(HeaderBar))
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmStop)
        await pilot.press("n")  # keep running
        assert not isinstance(app.screen, ConfirmStop) and not app._exit
        assert live_source.stop_requests == 0
        await pilot.press("ctrl+c")  # the same question
        assert isinstance(app.screen, ConfirmStop)
        await pilot.press("y")
        assert live_source.stop_requests == 1 and app.stopping and not app._exit
        assert "STOPPING" in text_of(app.query_one(HeaderBar))
        # The run finishes its requests in flight and is finalized; then the app leaves.
        live_source.finish()
        live_source.advance(1.0)
        await pilot.pause(0.3)
        assert app._exit


async def test_q_again_while_stopping_leaves_now(live_source: ScriptedSource) -> None:
    app = DashboardApp(live_source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("q", "y")
        assert app.stopping and not app._exit
        await pilot.press("q")
        assert app._exit


async def test_q_on_a_finished_live_run_does_not_ask(live_source: ScriptedSource) -> None:
    live_source.finish()
    app = DashboardApp(live_source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert "FINISHED" in text_of(app.query_one(HeaderBar))
        await pilot.press("q")
        assert app._exit and live_source.stop_requests == 0


async def test_before_the_first_snapshot(source: ScriptedSource) -> None:
    source.empty = True
    app = DashboardApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.3)
        assert app.snapshot is None and source.pulls >= 1
        assert "waiting for the first second" in text_of(app.query_one(Charts))
        await pilot.press("w", "p", "p", "1", "escape")  # keys work on an empty screen
        source.empty = False
        await pilot.pause(0.4)
        assert app.snapshot is not None


async def test_event_log_says_when_events_were_skipped() -> None:
    board = LiveBoard(Header("a", "t", 1, 1, 10, None))
    for i in range(300):  # more than a snapshot carries
        board.event(i * 10**6, "error", f"failure {i}", "error")
    snap = board.publish(10**9)

    class One:
        live = False

        def snapshot(self) -> LiveSnapshot:
            return snap

        def request_stop(self) -> None: ...

        def hold(self, paused: bool) -> None: ...

    app = DashboardApp(One())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        log = app.query_one(EventLog)
        lines = log.line_texts()
        assert "100 earlier events not shown" in lines[0]
        assert "failure 299" in lines[-1]
        # It follows the newest event: the last line on screen is the newest.
        assert log.scroll_offset.y == len(lines) - log.size.height


async def test_refresh_rate_follows_refresh_hz(source: ScriptedSource) -> None:
    app = DashboardApp(source, refresh_hz=4)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.1)
        start = app.pulls
        t = time.monotonic()
        await pilot.pause(3.0)
        rate = (app.pulls - start) / (time.monotonic() - t)
        assert 3.0 <= rate <= 4.7  # 4 Hz, give or take a tick at the window's edges


def test_remote_feed_sends_snapshots_and_forwards_stop() -> None:
    """The replay-side feed thread and the child's source, over a real socket pair."""
    board = LiveBoard(Header("a", "t", 1, 2, 10, None))
    board.publish(10**9)
    parent, child = socket.socketpair()
    viewer = DashboardProcess()
    viewer._conn = Connection(parent.detach())
    stops: list[str] = []
    thread = threading.Thread(target=viewer._serve, args=(board, stops.append), daemon=True)
    thread.start()
    remote = RemoteSource(Connection(child.detach()))
    deadline = time.monotonic() + 5
    while remote.snapshot() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    first = remote.snapshot()
    assert first is not None and first.seq == board.latest.seq  # type: ignore[union-attr]
    board.publish(2 * 10**9)
    while remote.snapshot().seq == first.seq and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.02)
    assert remote.snapshot().seq == board.latest.seq  # type: ignore[union-attr]
    viewer._note = "report: x.html"
    while remote.snapshot().note is None and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.02)
    assert remote.snapshot().note == "report: x.html"  # type: ignore[union-attr]
    remote.request_stop()
    while not stops and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stops == ["stopped from the dashboard"]
    remote.bye()
    thread.join(timeout=5)
    assert not thread.is_alive()
    viewer._conn.close()
    while not remote.gone and time.monotonic() < deadline:
        time.sleep(0.02)
    assert remote.gone


def test_spark_rows_and_formats() -> None:
    rows = spark_rows([0.0, 5.0, 10.0, float("nan")], 2, 0.0, 10.0)
    assert rows == [" ▁█ ".replace("▁", " "), "▁██ "] or rows[1].startswith("▁")
    assert rows[0][2] == "█" and rows[1][3] == " "
    assert f.rate(None) == f.NONE and f.rate(12345.0) == "12.3k" and f.rate(3.14) == "3.1"
    assert f.seconds(0.0123) == "12 ms" and f.seconds(1.5) == "1.50 s"
    assert f.clock(3725) == "1:02:05" and f.clock(65) == "1:05"
    assert f.percent(0.5) == "50.0%"


async def test_users_table_sorts_worst_first(source: ScriptedSource) -> None:
    app = DashboardApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        table = app.query_one(UsersTable)
        table.focus()
        await pilot.press("s")
        assert table.sort == "worst P90"
        snap = app.snapshot
        assert snap is not None
        p90 = {v.lane: v.p90_interactivity_tok_s for v in snap.lanes}
        shown = [p90[lane] for lane in table._order if p90[lane] is not None]
        assert shown == sorted(shown)
        assert "sorted by worst P90" in str(table.border_subtitle)
        await pilot.press("s", "s")
        assert table.sort == "lane" and table._order == sorted(table._order)
        await pilot.press("end")
        assert table.cursor_row == 39 and table.scroll_offset.y > 0
        await pilot.press("home")
        assert table.cursor_row == 0 and table.scroll_offset.y == 0


def test_client_line_renders_the_boards_figures() -> None:
    figures = {"kernel_stamps": True, "stamp_error_p99_s": 0.00042, "events_per_read": 1.25,
               "multi_event_read_share": 0.125, "loop_lag_p99_s": 0.0731,
               "cpu_cores": 0.47}
    figures["saturation_reasons"] = saturation_reasons(figures)
    board = LiveBoard(Header("x", "t", 1, 2, 10, None))
    board.client_sample(1_000_000_000, figures)
    c = board.publish(1_000_000_000).client
    assert c is not None
    line = client_line(c).plain
    # The values the board holds, verdict first, then its two reasons (12.5 % > 10 %
    # multi-event reads, 73.1 ms > 50 ms loop lag).
    assert line.startswith(" client  INVALID ")
    for part in ("stamp error p99 ≈420 µs", "events/read 1.25", "(12.5% multi)",
                 "loop lag p99 ≈73 ms", "CPU 47%"):
        assert part in line, part
    assert line.endswith("; ".join(c.reasons)) and len(c.reasons) == 2
    # The final figures (summary.json's) carry no ≈; a run without kernel stamps says so.
    board.client_sample(2_000_000_000, {**figures, "kernel_stamps": False,
                                        "saturation_reasons": []}, final=True)
    final = client_line(board.publish(2_000_000_000).client).plain
    assert " valid " in final and "INVALID" not in final and "≈" not in final
    assert "stamp error p99 n/a (no kernel stamps)" in final and "loop lag p99 73 ms" in final
    assert "none yet" in client_line(None).plain


async def test_a_saturated_client_shows_invalid_with_its_reason(tmp_path: Path) -> None:
    run = write_synthetic_run(tmp_path / "run", users=6, duration_s=60, seed=4,
                              client_saturated_at_s=30)
    src = ScriptedSource(run.run_dir, start_s=20.0)
    app = DashboardApp(src)
    try:
        async with app.run_test(size=(220, 36)) as pilot:
            await pilot.pause()
            bar = text_of(app.query_one(ClientBar))
            assert " valid " in bar and "INVALID" not in bar
            src.advance(15.0)
            await pilot.pause(0.4)
            snap = app.snapshot
            assert snap is not None and snap.client is not None
            bar = text_of(app.query_one(ClientBar))
            assert "INVALID" in bar
            assert "client event loop lagged: p99" in bar and "(> 50 ms)" in bar
            # The run's verdict follows (as summary.json's validity does), reason once.
            assert snap.totals.verdict == "invalid"
            assert set(snap.client.reasons) <= set(snap.totals.reasons)
            headline = text_of(app.query_one(Headline))
            assert "invalid" in headline and "client saturated (client line)" in headline
            assert "loop lagged" not in headline
            assert bar == client_line(snap.client).plain
            # The event log says when it turned.
            assert any("client INVALID" in t for t in app.query_one(EventLog).line_texts())
    finally:
        src.close()

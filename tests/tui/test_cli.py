"""The dashboard from the command line: ``agentload replay`` on a terminal opens it (in its
own process), without a terminal prints progress lines, and ``agentload dashboard`` plays a
run directory back. The server is the small local SSE server of test_tui_live.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentload.replay import cli as replay_cli
from agentload.replay import live
from agentload.traces import demo_trace_path
from agentload.tui.remote import DashboardProcess
from agentload.tui.synthetic import write_synthetic_run
from tests.support import ROOT, app_on_thread, run_cli
from tests.tui.test_live import sse_app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[str]:
    """The fake SSE server on its own thread and loop, for subprocess clients."""
    with app_on_thread(sse_app(ttft_s=0.01, itl_s=0.002)) as url:
        yield url


@pytest.fixture(scope="module")
def server(fake_server: str) -> str:
    return fake_server


def in_pty(argv: list[str], until: Path, size: tuple[int, int] = (100, 30),
           timeout_s: float = 120.0) -> tuple[int, bytes]:
    """Run ``argv`` on a pseudo-terminal; once ``until`` exists, press q; return (rc, output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT,
                            env={**os.environ, "TERM": "xterm-256color"}, close_fds=True,
                            start_new_session=True)
    os.close(slave)
    out = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            out.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not until.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.5)  # the dashboard shows the finished run and where it went
        if proc.poll() is None:
            os.write(master, b"q")
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
        os.close(master)
    return rc, bytes(out)


def test_replay_on_a_terminal_opens_the_dashboard(server: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    rc, out = in_pty([sys.executable, "-m", "agentload", "replay", str(demo_trace_path()),
                      "--target", server, "--users", "4", "--time-scale", "0.5",
                      "--no-report", "-o", str(run)], until=run / "summary.json")
    text = out.decode(errors="replace")
    assert rc == 0, text[-2000:]
    # The dashboard drew (alternate screen, its header and panels), then gave the
    # terminal back, and the summary was printed after it.
    assert "\x1b[?1049h" in text and "\x1b[?1049l" in text
    for part in ("agentload", "LIVE", "FINISHED", "time series", "session lanes", "events"):
        assert part in text, part
    tail = text[text.rindex("\x1b[?1049l"):]
    assert "run written to" in tail and "P90 interactivity" in tail
    assert (run / "summary.json").is_file()


def test_a_replay_over_workers_draws_the_same_dashboard(server: str, tmp_path: Path) -> None:
    """--workers 2: the driver's board, fed from the workers' journals, on the dashboard."""
    run = tmp_path / "run"
    rc, out = in_pty([sys.executable, "-m", "agentload", "replay", str(demo_trace_path()),
                      "--target", server, "--users", "4", "--time-scale", "0.5",
                      "--workers", "2", "--no-report", "-o", str(run)],
                     until=run / "summary.json")
    text = out.decode(errors="replace")
    assert rc == 0, text[-2000:]
    for part in ("LIVE", "FINISHED", "time series", "session lanes", "run written to"):
        assert part in text, part
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"]["count"] == 2 and summary["requests_completed"] > 20


def test_replay_without_a_terminal_prints_progress_lines(server: str, tmp_path: Path
                                                         ) -> None:
    result = run_cli("replay", str(demo_trace_path()), "--target", server, "--users", "2",
                     "--time-scale", "0.05", "--no-report", "-o", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert "\x1b[" not in result.stdout + result.stderr  # no dashboard, no status line
    assert "run written to" in result.stdout


def test_progress_mode_picks_the_dashboard_only_on_a_terminal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live._snapshot, "_dashboard", DashboardProcess)

    class Tty:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    monkeypatch.setattr(sys, "stdout", Tty(True))
    monkeypatch.setattr(sys, "stdin", Tty(True))
    assert replay_cli._progress_mode(None) == "dashboard"
    assert replay_cli._progress_mode(False) == "dashboard"
    assert replay_cli._progress_mode(True) == "headless"
    assert replay_cli._progress_mode(None, dashboard=False) == "live"
    monkeypatch.setattr(sys, "stdin", Tty(False))  # keys need a terminal too
    assert replay_cli._progress_mode(None) == "live"
    monkeypatch.setattr(sys, "stdout", Tty(False))
    assert replay_cli._progress_mode(None) == "headless"
    monkeypatch.setattr(live._snapshot, "_dashboard", None)
    monkeypatch.setattr(sys, "stdout", Tty(True))
    monkeypatch.setattr(sys, "stdin", Tty(True))
    assert replay_cli._progress_mode(None) == "live"


def test_dashboard_command_plays_a_run_back(tmp_path: Path) -> None:
    run = write_synthetic_run(tmp_path / "run", users=8, duration_s=20, seed=4).run_dir
    stats = tmp_path / "stats.json"
    rc, out = in_pty([sys.executable, "-m", "agentload", "dashboard", str(run), "--speed",
                      "20", "--stats", str(stats)], until=tmp_path / "never", timeout_s=4)
    text = out.decode(errors="replace")
    assert rc == 0, text[-2000:]
    assert "PLAYBACK" in text and "synthetic-8u" in text
    assert stats.is_file()


def test_dashboard_command_errors_are_one_line(tmp_path: Path) -> None:
    result = run_cli("dashboard", str(tmp_path))
    assert result.returncode == 2
    assert "holds no run journal" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("dashboard", str(tmp_path), "--speed", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "Invalid value for '--speed'" in result.stderr

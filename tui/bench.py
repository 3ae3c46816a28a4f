"""``agentload bench dashboard``: what the dashboard costs over a 1,000-user run.

It writes a synthetic journal of a ``--users``-lane run (no server needed), then
plays it back with the real ``agentload dashboard`` in a pseudo-terminal of
``--size`` (its output drained, as a terminal would), starting ``--start`` seconds
in, at ``--speed`` x. After a warm-up it measures, over ``--seconds``:

- refresh rate: snapshot pulls per second (the app's timer, stamped in the app);
- CPU: the dashboard process's user + system time / wall time (``/proc/PID/stat``),
  in % of one core: everything it does (journal parsing, the board, rendering);
- bytes written to the terminal per second.

The pass bar of issue 6 is >= 4 Hz at < 10 % of a core.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from agentload.tui.synthetic import write_synthetic_run


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks / os.sysconf("SC_CLK_TCK")


def measure_playback(run_dir: Path, size: tuple[int, int] = (200, 60), speed: float = 1.0,
                     start_s: float = 300.0, warmup_s: float = 6.0, seconds: float = 20.0,
                     refresh_hz: float = 4.0) -> dict[str, Any]:
    """Run ``agentload dashboard`` on ``run_dir`` in a pty and measure it (see module doc)."""
    cols, rows = size
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    stats_path = Path(tempfile.mkdtemp(prefix="agentload-dash-")) / "stats.json"
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": str(rows)}
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentload", "dashboard", str(run_dir), "--speed", str(speed),
         "--start", str(start_s), "--refresh", str(refresh_hz), "--stats", str(stats_path)],
        stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
        start_new_session=True)
    os.close(slave)
    written = [0]
    window: dict[str, float] = {}

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            written[0] += len(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        time.sleep(warmup_s)
        if proc.poll() is not None:
            raise RuntimeError(f"the dashboard exited early (status {proc.returncode})")
        window["t0"], window["cpu0"], window["bytes0"] = (time.monotonic(), _cpu_s(proc.pid),
                                                          written[0])
        time.sleep(seconds)
        window["t1"], window["cpu1"], window["bytes1"] = (time.monotonic(), _cpu_s(proc.pid),
                                                          written[0])
        os.write(master, b"q")
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    stats = json.loads(stats_path.read_text())
    pulls = [t for t in stats["pull_times"] if window["t0"] <= t <= window["t1"]]
    wall = window["t1"] - window["t0"]
    return {
        "size": f"{cols}x{rows}", "speed": speed, "start_s": start_s, "seconds": wall,
        "startup_s": window["t0"] - started,
        "refresh_hz": len(pulls) / wall,
        "cpu_core_pct": 100 * (window["cpu1"] - window["cpu0"]) / wall,
        "terminal_kb_s": (window["bytes1"] - window["bytes0"]) / wall / 1024,
        "draws": stats["applied"], "draw_ms_mean": (1e3 * stats["apply_s"] / stats["applied"]
                                                    if stats["applied"] else None),
    }


def dashboard_bench(
    users: Annotated[int, typer.Option("--users", min=1, help="Lanes of the synthetic run.")
                     ] = 1000,
    duration: Annotated[float, typer.Option("--duration", min=30.0,
                                            help="Seconds of the synthetic run.")] = 600.0,
    speed: Annotated[str, typer.Option("--speed", help="Playback speeds, comma-separated.")
                     ] = "1,10",
    size: Annotated[str, typer.Option("--size", help="Terminal sizes COLSxROWS, "
                                      "comma-separated.")] = "200x60,100x30",
    seconds: Annotated[float, typer.Option("--seconds", min=2.0,
                                           help="Measured seconds per row.")] = 20.0,
    start: Annotated[float, typer.Option("--start", min=0.0,
                                         help="Start the playback this far in.")] = 300.0,
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", help="Use (or write) the synthetic run here instead of a temp dir.")
    ] = None,
) -> None:
    """Refresh rate and CPU of the dashboard playing back a recorded 1,000-user run."""
    with tempfile.TemporaryDirectory(prefix="agentload-bench-dash-") as tmp:
        target = run_dir or Path(tmp) / "run"
        t = time.perf_counter()
        if not (target / "journal.jsonl").is_file():
            run = write_synthetic_run(target, users=users, duration_s=duration)
            typer.echo(f"synthetic run: {run.users} users, {run.duration_s:.0f} s, "
                       f"{run.requests} requests ({run.failed} failed), {run.lines} journal "
                       f"lines, {(target / 'journal.jsonl').stat().st_size / 1e6:.1f} MB, "
                       f"written in {time.perf_counter() - t:.1f} s")
        typer.echo(f"{'size':>8} {'speed':>6} {'Hz':>6} {'CPU %core':>10} {'draw ms':>8} "
                   f"{'term kB/s':>10} {'startup s':>10}  verdict")
        for sz in (s.strip() for s in size.split(",") if s.strip()):
            cols, rows = (int(x) for x in sz.lower().split("x"))
            for sp in (float(x) for x in speed.split(",") if x.strip()):
                r = measure_playback(target, (cols, rows), sp, start, seconds=seconds)
                ok = r["refresh_hz"] >= 4.0 * 0.95 and r["cpu_core_pct"] < 10.0
                typer.echo(f"{r['size']:>8} {sp:>6g} {r['refresh_hz']:>6.2f} "
                           f"{r['cpu_core_pct']:>10.1f} {r['draw_ms_mean'] or 0:>8.1f} "
                           f"{r['terminal_kb_s']:>10.1f} {r['startup_s']:>10.1f}  "
                           f"{'ok (>= 4 Hz, < 10 %)' if ok else 'MISSES the bar'}")

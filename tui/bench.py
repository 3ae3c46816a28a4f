"""``agentload bench dashboard``: what the dashboard costs over a 1,000-user run.

It writes a synthetic journal of a ``--users``-lane run (no server needed), then
plays it back with the real ``agentload dashboard`` in a pseudo-terminal of
``--size`` (its output drained, as a terminal would), starting ``--start`` seconds
in, at ``--speed`` x. After a warm-up it measures, over ``--seconds``:

- refresh rate: snapshot pulls per second (the app's timer, stamped in the app);
- CPU: the dashboard process's user + system time / wall time (``/proc/PID/stat``),
  in % of one core: everything it does (journal parsing, the board, rendering);
- bytes written to the terminal per second, and how long it took to start and catch
  up to ``--start`` (until its first draw; the window is measured after that).

The pass bar of issue 6 is >= 4 Hz at < 10 % of a core.

With ``--replay-target URL`` it also replays the same bounded workload against that
server ``--repeats`` times with the dashboard (``agentload replay`` in a pty, so the
dashboard process really draws) and as many times ``--headless``, alternating, and
prints each run's timing metrics and the two groups' means and spreads: the
dashboard must not move the numbers by more than they move from run to run.
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

from agentload.traces import demo_trace_path
from agentload.tui.synthetic import write_synthetic_run


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks / os.sysconf("SC_CLK_TCK")


def measure_playback(run_dir: Path, size: tuple[int, int] = (200, 60), speed: float = 1.0,
                     start_s: float = 300.0, warmup_s: float = 2.0, seconds: float = 20.0,
                     refresh_hz: float = 4.0) -> dict[str, Any]:
    """Run ``agentload dashboard`` on ``run_dir`` in a pty and measure it (see module doc)."""
    cols, rows = size
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    stats_path = Path(tempfile.mkdtemp(prefix="agentload-dash-")) / "stats.json"
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": str(rows)}
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "agentload", "dashboard", str(run_dir), "--speed", str(speed),
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
        # Measure once the playback has caught up to --start and drawn (its first draw
        # writes a .ready file), plus a settling pause.
        ready = stats_path.with_suffix(".ready")
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the dashboard exited early (status {proc.returncode})")
            time.sleep(0.1)
        caught_up = time.monotonic()
        time.sleep(warmup_s)
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
        "startup_s": caught_up - started,
        "refresh_hz": len(pulls) / wall,
        "cpu_core_pct": 100 * (window["cpu1"] - window["cpu0"]) / wall,
        "terminal_kb_s": (window["bytes1"] - window["bytes0"]) / wall / 1024,
        "draws": stats["applied"], "draw_ms_mean": (1e3 * stats["apply_s"] / stats["applied"]
                                                    if stats["applied"] else None),
    }


REPLAY_KEYS: tuple[tuple[str, str, float], ...] = (
    ("p90_interactivity_tok_s", "P90 inter tok/s", 1.0),
    ("ttft_p90_s", "TTFT P90 ms", 1e3),
    ("itl_p50_s", "ITL P50 ms", 1e3),
    ("schedule_lag_p99_s", "lag P99 ms", 1e3),
    ("pause_error_p99_s", "pause err P99 ms", 1e3),
)


def _replay_once(target: str, out: Path, dashboard: bool, args: list[str],
                 timeout_s: float = 600.0) -> dict[str, Any]:
    """One ``agentload replay`` run; with the dashboard it runs in an 100x30 pty."""
    argv = [sys.executable, "-P", "-m", "agentload", "replay", str(demo_trace_path()),
            "--target", target, "-o", str(out), "--no-report", *args]
    if not dashboard:
        subprocess.run([*argv, "--headless"], check=True, capture_output=True,
                       timeout=timeout_s)
    else:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave,
                                env={**os.environ, "TERM": "xterm-256color"},
                                close_fds=True, start_new_session=True)
        os.close(slave)
        threading.Thread(target=_drain, args=(master,), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        try:
            while not (out / "summary.json").is_file():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"replay with the dashboard ended early ({out})")
                time.sleep(0.5)
            time.sleep(1.0)
            os.write(master, b"q")  # the finished dashboard waits for its user
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(master)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 65536):
                return
        except OSError:
            return


def replay_overhead(target: str, repeats: int, args: list[str]) -> None:
    """Print timing metrics of replays with and without the dashboard, alternating."""
    import statistics

    rows: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    typer.echo(f"replays against {target} ({' '.join(args)}), {repeats} with the dashboard "
               f"and {repeats} headless, alternating; load average "
               f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    typer.echo(f"{'run':>14}" + "".join(f"{label:>18}" for _, label, _ in REPLAY_KEYS))
    with tempfile.TemporaryDirectory(prefix="agentload-bench-replay-") as tmp:
        for i in range(repeats):
            for dashboard in (True, False):
                name = f"{'dashboard' if dashboard else 'headless'} {i + 1}"
                s = _replay_once(target, Path(tmp) / name.replace(" ", "-"), dashboard, args)
                rows[dashboard].append(s)
                typer.echo(f"{name:>14}" + "".join(
                    f"{(s.get(k) or 0) * scale:>18.2f}" for k, _, scale in REPLAY_KEYS))
    for dashboard in (True, False):
        group = rows[dashboard]
        cells = []
        for k, _, scale in REPLAY_KEYS:
            values = [(r.get(k) or 0.0) * scale for r in group]
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):>9.2f} ±{sd:>7.2f}")
        typer.echo(f"{'mean ± sd ' + ('dash' if dashboard else 'headless'):>14}"
                   + "".join(f"{c:>18}" for c in cells))
    typer.echo(f"{'diff / spread':>14}" + "".join(
        f"{_diff_over_spread(rows, k, scale):>18}" for k, _, scale in REPLAY_KEYS))


def _diff_over_spread(rows: dict[bool, list[dict[str, Any]]], key: str, scale: float) -> str:
    """|mean(dashboard) - mean(headless)| / the larger run-to-run range of the two."""
    a = [(r.get(key) or 0.0) * scale for r in rows[True]]
    b = [(r.get(key) or 0.0) * scale for r in rows[False]]
    spread = max(max(a) - min(a), max(b) - min(b))
    diff = abs(sum(a) / len(a) - sum(b) / len(b))
    return f"{diff / spread:.2f}" if spread > 0 else "n/a"


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
    replay_target: Annotated[str | None, typer.Option(
        "--replay-target", help="Also compare replays with and without the dashboard "
        "against this server (e.g. one started with agentload serve --embedded).")] = None,
    repeats: Annotated[int, typer.Option("--repeats", min=2,
                                         help="Replays per group with --replay-target.")] = 3,
    replay_args: Annotated[str, typer.Option(
        "--replay-args", help="Options of each compared replay.")
    ] = "--users 4 --recycle --max-requests 48 --seed 1",
    skip_playback: Annotated[bool, typer.Option(
        "--skip-playback", help="Only the replay comparison.")] = False,
) -> None:
    """Refresh rate and CPU of the dashboard playing back a recorded 1,000-user run
    (and, with --replay-target, replay timings with and without it)."""
    if not skip_playback:
        _playback_rows(users, duration, speed, size, seconds, start, run_dir)
    if replay_target is not None:
        replay_overhead(replay_target, repeats, replay_args.split())


def _playback_rows(users: int, duration: float, speed: str, size: str, seconds: float,
                   start: float, run_dir: Path | None) -> None:
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
                   f"{'term kB/s':>10} {'1st draw s':>10}  verdict")
        for sz in (s.strip() for s in size.split(",") if s.strip()):
            cols, rows = (int(x) for x in sz.lower().split("x"))
            for sp in (float(x) for x in speed.split(",") if x.strip()):
                r = measure_playback(target, (cols, rows), sp, start, seconds=seconds)
                ok = r["refresh_hz"] >= 4.0 * 0.95 and r["cpu_core_pct"] < 10.0
                typer.echo(f"{r['size']:>8} {sp:>6g} {r['refresh_hz']:>6.2f} "
                           f"{r['cpu_core_pct']:>10.1f} {r['draw_ms_mean'] or 0:>8.1f} "
                           f"{r['terminal_kb_s']:>10.1f} {r['startup_s']:>10.1f}  "
                           f"{'ok (>= 4 Hz, < 10 %)' if ok else 'MISSES the bar'}")

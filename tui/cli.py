"""The dashboard room's commands: ``agentload dashboard RUN_DIR`` and its registration.

:func:`register` tells the replay room that a dashboard exists (the top-level CLI calls
it), so ``agentload replay`` and ``agentload demo`` open it on a terminal. Textual is
imported only when a dashboard is actually shown.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Annotated

import typer

from agentload.replay import live


def available() -> bool:
    """Whether Textual is installed (the dashboard's one extra dependency)."""
    return importlib.util.find_spec("textual") is not None


def register() -> None:
    """Make replays open the dashboard (in its own process) when shown on a terminal."""
    if available():
        from agentload.tui.remote import DashboardProcess

        live.set_dashboard(DashboardProcess)


def dashboard(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (with journal.jsonl), "
                                            "finished, killed or still running.")],
    speed: Annotated[float, typer.Option("--speed", min=0.001,
                                         help="Playback speed (2 = twice as fast).")] = 1.0,
    refresh: Annotated[float, typer.Option("--refresh", min=0.5, max=20.0,
                                           help="Display refreshes per second.")] = 4.0,
    start: Annotated[float, typer.Option("--start", min=0.0,
                                         help="Start this many seconds into the run.")] = 0.0,
    stats: Annotated[Path | None, typer.Option("--stats", hidden=True,
                                               help="Write refresh statistics here on exit "
                                               "(agentload bench dashboard).")] = None,
) -> None:
    """Play back a recorded run on the dashboard, at --speed times real time.

    The same screens as a live run. A run that is still being written is followed as
    its journal grows. Keys: p pause, 1-4 zoom, w weighting, d definitions, ? help, q quit.

    Example: agentload dashboard runs/demo --speed 10
    """
    if not available():
        from agentload.replay.errors import ReplayError

        raise ReplayError("the dashboard needs Textual: pip install 'textual==8.2.8'")
    from agentload.tui.app import DashboardApp

    source = live.JournalPlayback(run_dir, speed=speed, start_s=start)
    app = DashboardApp(source, refresh_hz=refresh)
    if stats is not None:
        ready = stats.with_suffix(".ready")

        def mark_ready() -> None:
            ready.write_text("ready")  # the benchmark measures from here

        app.on_first_draw = mark_ready
    try:
        app.run()
    finally:
        source.close()
        if stats is not None:
            stats.write_text(json.dumps(app.stats()))

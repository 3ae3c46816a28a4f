"""agentload.tui: the Textual dashboard, live and over a recorded run.

- ``DashboardApp(source)`` (``agentload.tui.app``) draws any snapshot source: the
  replay engine's :class:`~agentload.replay.live.LiveBoard`, a
  :class:`~agentload.replay.live.JournalPlayback` of a run directory, or a fake.
- ``DashboardProcess`` (``agentload.tui.remote``) runs it beside a live replay, in its
  own process, as the replay's viewer; ``register()`` makes ``agentload replay`` /
  ``demo`` open it on a terminal.
- ``agentload dashboard RUN_DIR [--speed X]`` plays a recorded run back
  (``agentload.tui.cli``); ``agentload bench dashboard`` measures its cost
  (``agentload.tui.bench``).

Importing this package does not import Textual; the app modules do.
"""

from __future__ import annotations

from agentload.tui.cli import available, register

__all__ = ["available", "register"]

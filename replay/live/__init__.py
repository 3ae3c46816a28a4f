"""Live state of a replay, published as immutable snapshots for the dashboard.

The engine feeds a :class:`LiveBoard` from its own loop (``begin_play``,
``transition``, ``finished``, ``event``, ``server_sample``: each a few dict and list
operations, never a wait) and calls :meth:`LiveBoard.publish` about four times a
second; that builds one frozen :class:`LiveSnapshot` and stores it in
``board.latest``. A viewer on another thread or process only ever reads ``latest``
(one reference read), so nothing a viewer does can delay a timestamp. The same board,
fed from a run directory's journal instead of the engine, plays a recorded run back
(:class:`JournalPlayback`), finished or not.

Numbers follow ``replay/results/metrics.py`` (request-weighted, linear interpolation) and are
computed over the measured, successful requests finished so far:

- P90 interactivity = 1 / P90(ITL_i); E2E-normalized = 1 / P90(E2EL_i / OSL_i);
- TTFT P90; decode tok/s = sum(OSL_i - 1) / time with >= 1 request decoding;
- output tok/s = sum(OSL_i) / (last token - first send); per GPU adds ISL.

The *user* and *session* weightings give each user (session) the same total weight,
spread over its requests (:func:`weighted_quantile`, midpoint rule); *request*
weighting is numpy's linear percentile, exactly the report's. Rolling series
use 1 s bins; percentiles in them cover the requests finished in the last 10 s.

This module belongs to the engine side: it imports nothing from ``agentload.tui``.
The dashboard registers itself with :func:`set_dashboard` (the top-level CLI does),
and ``run_replay(progress="dashboard")`` opens it through the :class:`Viewer`
protocol.

The package is cut by job: ``_snapshot`` (the published records and the viewer
protocol), ``_board`` (the board and its in-process source), ``_playback`` (a run
directory played back). Other rooms import from here only.
"""

from __future__ import annotations

from agentload.replay.live._board import (
    BoardSource,
    LiveBoard,
    _Intervals,  # noqa: F401  (tests)
    weighted_quantile,
)
from agentload.replay.live._playback import (
    JournalPlayback,
    header_from_run,
)
from agentload.replay.live._snapshot import (
    BIN_S,
    CLIENT_KEYS,
    CODE_STATES,
    EVENTS_KEPT,
    HEADLINE_EVERY_S,
    HISTORY_BINS,
    SERIES,
    SERIES_DEFINITIONS,
    STATE_CODES,
    STRIP_CELLS,
    WEIGHTINGS,
    WINDOW_BINS,
    ClientHealth,
    Event,
    Header,
    Headline,
    LaneState,
    LaneView,
    LiveSnapshot,
    RequestState,
    Series,
    ServerGauges,
    SnapshotSource,
    Totals,
    Viewer,
    Weighting,
    client_figures,
    client_health,
    dashboard_factory,
    open_viewer,
    set_dashboard,
)

__all__ = [
    "BIN_S",
    "CLIENT_KEYS",
    "CODE_STATES",
    "EVENTS_KEPT",
    "HEADLINE_EVERY_S",
    "HISTORY_BINS",
    "SERIES",
    "SERIES_DEFINITIONS",
    "STATE_CODES",
    "STRIP_CELLS",
    "WEIGHTINGS",
    "WINDOW_BINS",
    "BoardSource",
    "ClientHealth",
    "Event",
    "Header",
    "Headline",
    "JournalPlayback",
    "LaneState",
    "LaneView",
    "LiveBoard",
    "LiveSnapshot",
    "RequestState",
    "Series",
    "ServerGauges",
    "SnapshotSource",
    "Totals",
    "Viewer",
    "Weighting",
    "client_figures",
    "client_health",
    "dashboard_factory",
    "header_from_run",
    "open_viewer",
    "set_dashboard",
    "weighted_quantile",
]

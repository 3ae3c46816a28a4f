"""The dashboard app: pulls snapshots from a source on a timer and draws every panel.

``DashboardApp(source)`` works with any :class:`~agentload.replay.live.SnapshotSource`:
the engine's board (live, in this process or over a pipe from the replay process), a
journal playback, or a fake in tests. It pulls at ``refresh_hz`` (4 by default) and
only when the snapshot is new; one pull assigns one immutable snapshot to every
panel inside ``batch_update``, so nothing is drawn half-updated.

Keys: ``p``/space pause the display, ``1``-``4`` zoom a panel (``escape`` back),
``w`` cycles the weighting (request / user / session), ``d`` shows the definitions,
``?`` the help, ``q`` quits (on a live run it asks first, then stops the run, which
finishes its requests in flight and is finalized).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import Footer, Static

from agentload.replay.client.diagnostics import (
    MAX_CLIENT_CPU,
    MAX_LOOP_LAG_P99_S,
    MAX_MULTI_EVENT_READS,
    MAX_STAMP_ERROR_P99_S,
    PROBE_S,
)
from agentload.replay.live import (
    SERIES,
    SERIES_DEFINITIONS,
    WEIGHTINGS,
    LiveSnapshot,
    SnapshotSource,
    Weighting,
)
from agentload.replay.results.metrics import DEFINITIONS
from agentload.tui.widgets import (
    Charts,
    ClientBar,
    EventLog,
    HeaderBar,
    Headline,
    LanesStrip,
    UsersTable,
)

DASHBOARD_CSS = """
Screen {
    layout: vertical;
}

HeaderBar {
    dock: top;
    height: 2;
    background: $panel;
    text-wrap: nowrap;
    text-overflow: ellipsis;
}

Headline {
    height: 3;
    text-wrap: nowrap;
    text-overflow: clip;
    border-bottom: none;
}

ClientBar {
    height: 1;
    text-wrap: nowrap;
    text-overflow: ellipsis;
}

#grid {
    layout: grid;
    grid-size: 2 2;
    grid-columns: 2fr 3fr;
    grid-rows: 1fr 1fr;
    height: 1fr;
}

#charts, #users, #lanes, #events {
    border: round $primary-darken-2;
    border-title-color: $accent;
    border-subtitle-color: $text-muted;
    height: 1fr;
    width: 1fr;
}

#users, #lanes, #events {
    scrollbar-size-vertical: 1;
}

#lanes, #events {
    overflow-x: hidden;
}

#charts:focus, #users:focus, #lanes:focus, #events:focus {
    border: round $accent;
}

Charts {
    padding: 0 1;
}

.info-box {
    width: 100;
    max-width: 95%;
    height: auto;
    max-height: 95%;
    border: thick $accent;
    background: $surface;
    padding: 1 2;
}

.confirm-box {
    width: 70;
    border: thick $warning;
}

InfoScreen, ConfirmStop {
    align: center middle;
}
"""
"""The layout: header, headline, a 2 x 2 grid of panels, footer (inline, so the
package needs no data files)."""

PANELS: dict[str, str] = {"1": "charts", "2": "users", "3": "lanes", "4": "events"}
"""Zoom keys and the panel ids they maximize."""

WEIGHTING_DEFINITIONS: dict[Weighting, str] = {
    "request": "every measured request counts once (the report's convention)",
    "user": "each user's requests together weigh as much as any other user's "
            "(weight 1/n_user); each value sits mid-way in its weight",
    "session": "each played session's requests together weigh the same "
               "(weight 1/n_session); each value sits mid-way in its weight",
}

HELP = """\
[b]agentload dashboard[/b]

  [b]p[/b] / [b]space[/b]  pause / resume the display (a live run goes on)
  [b]1[/b] … [b]4[/b]      zoom a panel: 1 time series, 2 users, 3 lanes, 4 events
  [b]escape[/b]     back from a zoomed panel
  [b]w[/b]          switch the weighting: request → user → session
  [b]d[/b]          definitions of every number on screen
  [b]?[/b]          this help
  [b]q[/b]          quit (a live run: asks, then stops it; it is finalized, not lost)

Headline numbers cover the measured, successful requests so far;
series are rolling (1 s bins, percentiles over the last 10 s).
Lane states: decoding (tokens streaming), prefilling (sent, no token yet),
on subagents (the main agent waits for its subagents), pausing (think or
tool time before the next turn), waiting (dependencies not done), idle.

[dim]escape, q or ? closes this[/dim]"""


def definitions_text() -> str:
    keys = ("p90_interactivity_tok_s", "e2e_norm_p90_interactivity_tok_s", "ttft_p90_s",
            "decode_throughput_tok_s", "output_throughput_tok_s", "throughput_per_gpu_tok_s")
    names = ("P90 interactivity", "E2E-normalized P90", "TTFT P90", "decode tok/s",
             "output tok/s", "throughput/GPU")
    lines = ["[b]Definitions[/b]  (per request: TTFT = first token - sent; "
             "ITL = (E2EL - TTFT) / (OSL - 1))", ""]
    lines += [f"  [b]{n:<19}[/b] {DEFINITIONS[k]}" for n, k in zip(names, keys, strict=True)]
    lines += ["  [b]P50 interactivity  [/b] 1 / P50(ITL_i)",
              "  [b]errors             [/b] measured requests that failed, by kind",
              "  [b]validity           [/b] the report's verdict so far: error rate <= 10 %, "
              ">= 99 % exact OSL",
              "  [b]client             [/b] agentload's own health over the run so far "
              "(summary.json → client): Python-minus-kernel stamp error p99, token events "
              "per socket read (share with several), event-loop lag p99 (oversleep of a "
              f"{PROBE_S * 1e3:g} ms sleep), CPU of one core; INVALID, with the reason, when "
              f"the client was saturated (CPU > {MAX_CLIENT_CPU:.0%}, > "
              f"{MAX_MULTI_EVENT_READS:.0%} multi-event reads, lag p99 > "
              f"{MAX_LOOP_LAG_P99_S * 1e3:g} ms, stamp error p99 > "
              f"{MAX_STAMP_ERROR_P99_S * 1e3:g} ms); ≈ marks a live estimate, "
              "unmarked figures are summary.json's",
              "", "[b]Weighting[/b] (key w)"]
    lines += [f"  [b]{w:<8}[/b] {WEIGHTING_DEFINITIONS[w]}" for w in WEIGHTINGS]
    lines += ["", "[b]Rolling series[/b]"]
    lines += [f"  [b]{label:<18}[/b] {SERIES_DEFINITIONS[key]}" for key, label, _ in SERIES]
    lines += ["", "[dim]escape, q or d closes this[/dim]"]
    return "\n".join(lines)


class InfoScreen(ModalScreen[None]):
    """A modal text page (help, definitions)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,question_mark,d", "dismiss_page", "Close", show=False)]

    def __init__(self, text: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._text = text

    def compose(self) -> ComposeResult:
        yield VerticalScroll(Static(self._text, classes="info-text"), classes="info-box")

    def action_dismiss_page(self) -> None:
        self.dismiss(None)


class ConfirmStop(ModalScreen[bool]):
    """Asked before ``q`` stops a live run."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Stop the run"),
        Binding("n,escape,q", "answer(False)", "Keep running")]

    def compose(self) -> ComposeResult:
        yield Vertical(Static(
            "[b]Stop the replay?[/b]\n\nNothing more is sent; requests in flight finish, "
            "then the run is finalized (summary, Parquet tables, report): nothing "
            "recorded is lost.\n\n  [b]y[/b] stop the run    [b]n[/b] keep it running",
            classes="info-text"), classes="info-box confirm-box")

    def action_answer(self, stop: bool) -> None:
        self.dismiss(stop)


class DashboardApp(App[None]):
    """The live / playback dashboard over one snapshot source."""

    CSS = DASHBOARD_CSS
    TITLE = "agentload"
    ENABLE_COMMAND_PALETTE = False
    ALLOW_IN_MAXIMIZED_VIEW = "HeaderBar, Footer"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit_dashboard", "Quit", id="quit"),
        Binding("ctrl+c", "quit_dashboard", "Quit", show=False, priority=True,
                id="quit_ctrl_c"),
        Binding("p,space", "toggle_pause", "Pause", id="pause"),
        Binding("1", "zoom('1')", "Zoom", key_display="1-4", id="zoom"),
        Binding("2", "zoom('2')", show=False), Binding("3", "zoom('3')", show=False),
        Binding("4", "zoom('4')", show=False),
        Binding("escape", "unzoom", show=False),
        Binding("w", "cycle_weighting", "Weighting", id="weighting"),
        Binding("d", "definitions", "Definitions", id="definitions"),
        Binding("question_mark", "help", "Help", key_display="?", id="help"),
    ]

    def __init__(self, source: SnapshotSource, refresh_hz: float = 4.0) -> None:
        super().__init__()
        self.source = source
        self.refresh_hz = refresh_hz
        self.snapshot: LiveSnapshot | None = None
        """The snapshot on screen."""
        self.paused = False
        self.weighting: Weighting = "request"
        self.stopping = False
        """A live run was asked to stop; the app leaves once it has finished."""
        self.pulls = 0
        """Timer ticks that pulled a snapshot (pulls per second = the refresh rate)."""
        self.applied = 0
        """Snapshots drawn (a pull that returns the same snapshot draws nothing)."""
        self.apply_s = 0.0
        """Seconds spent drawing snapshots into the panels."""
        self.pull_times: list[float] = []
        """``time.monotonic()`` of every pull (the benchmark counts them per second)."""
        self.first_draw_at: float | None = None
        """``time.monotonic()`` of the first draw (a playback has caught up by then)."""
        self.on_first_draw: Callable[[], None] | None = None
        self.exit_when_gone = False
        """Leave when the source says its replay process is gone (the child process)."""
        self._timer: Timer | None = None

    def compose(self) -> ComposeResult:
        # Held, not queried: a pull then costs no DOM query, and a late one during
        # shutdown draws into detached widgets instead of failing.
        self.header_bar = HeaderBar(id="header")
        self.headline = Headline(id="headline")
        self.client_bar = ClientBar(id="client")
        self.charts = Charts(id="charts")
        self.charts.border_title = "1 time series · 1 s bins"
        self.users = UsersTable(id="users")
        self.users.border_title = "2 users"
        self.lanes = LanesStrip(id="lanes")
        self.lanes.border_title = "3 session lanes · 1 cell = 1 s"
        self.lanes.border_subtitle = LanesStrip.legend().plain
        self.events = EventLog(id="events")
        self.events.border_title = "4 events"
        yield self.header_bar
        yield self.headline
        yield self.client_bar
        with Grid(id="grid"):
            yield self.charts
            yield self.users
            yield self.lanes
            yield self.events
        yield Footer()

    def on_mount(self) -> None:
        self._timer = self.set_interval(1.0 / self.refresh_hz, self.tick, name="pull")
        self.tick()
        # Panels lay out their text by their width; a first draw can come before layout.
        self.call_after_refresh(self._redraw)

    def on_resize(self) -> None:
        self.call_after_refresh(self._redraw)

    def _redraw(self) -> None:
        if self.snapshot is not None:
            self.draw()

    # -- pulling -------------------------------------------------------------------

    def tick(self) -> None:
        """Pull the newest snapshot and draw it if it is new (the timer's callback)."""
        if self.exit_when_gone and getattr(self.source, "gone", False):
            self.exit()
            return
        if self.paused or self._exit:
            return
        self.pulls += 1
        self.pull_times.append(time.monotonic())
        snap = self.source.snapshot()
        if snap is None or (self.snapshot is not None and snap.seq == self.snapshot.seq
                            and snap.note == self.snapshot.note):
            return
        self.draw(snap)
        if self.stopping and snap.finished:
            self.exit()

    def draw(self, snap: LiveSnapshot | None = None) -> None:
        """Draw ``snap`` (default: the one on screen again, e.g. after a key)."""
        snap = snap or self.snapshot
        if snap is None:
            return
        started = time.perf_counter()
        self.snapshot = snap
        with self.batch_update():
            self.header_bar.show(snap, self.weighting, self.paused, self.stopping)
            self.headline.show(snap, self.weighting)
            self.client_bar.show(snap)
            self.charts.show(snap)
            self.users.show(snap)
            self.lanes.show(snap)
            self.events.show(snap)
        self.applied += 1
        self.apply_s += time.perf_counter() - started
        if self.first_draw_at is None:
            self.first_draw_at = time.monotonic()
            if self.on_first_draw is not None:
                self.on_first_draw()

    # -- actions -------------------------------------------------------------------

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.source.hold(self.paused)
        self.draw()

    def action_zoom(self, key: str) -> None:
        panel = self.query_one(f"#{PANELS[key]}")
        if self.screen.maximized is panel:
            self.screen.minimize()
        else:
            self.screen.maximize(panel, container=False)
            panel.focus()

    def action_unzoom(self) -> None:
        self.screen.minimize()

    def action_cycle_weighting(self) -> None:
        i = WEIGHTINGS.index(self.weighting)
        self.weighting = WEIGHTINGS[(i + 1) % len(WEIGHTINGS)]
        self.draw()

    def action_help(self) -> None:
        self.push_screen(InfoScreen(HELP, id="help"))

    def action_definitions(self) -> None:
        self.push_screen(InfoScreen(definitions_text(), id="definitions"))

    def action_quit_dashboard(self) -> None:
        finished = self.snapshot is not None and self.snapshot.finished
        if not self.source.live or finished or self.stopping:
            self.exit()
            return

        def answered(stop: bool | None) -> None:
            if stop:
                self.stopping = True
                self.source.request_stop()
                self.notify("Stopping: requests in flight finish, then the run is "
                            "finalized. q again leaves now.", timeout=6)
                self.draw()

        self.push_screen(ConfirmStop(id="confirm"), answered)

    def stats(self) -> dict[str, object]:
        """What the benchmark reads: pulls, draws and drawing time."""
        return {"pulls": self.pulls, "applied": self.applied, "apply_s": self.apply_s,
                "pull_times": self.pull_times}

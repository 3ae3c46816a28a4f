"""The dashboard's panels. Each is dumb: ``show(snapshot, weighting)`` draws it.

Widgets only read :class:`~agentload.replay.live.LiveSnapshot`s (immutable), so a
panel can never see a half-updated aggregate. The per-user table is diff-updated
(only changed cells are written; rows are never cleared), the lanes strip and the
time series render only what is on screen.
"""

from __future__ import annotations

import math
import time
from typing import ClassVar, Literal

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget

from agentload.replay.live import (
    CODE_STATES,
    STATE_CODES,
    ClientHealth,
    Event,
    LaneView,
    LiveSnapshot,
    Series,
    ServerGauges,
    Weighting,
)
from agentload.tui import format as f

STATE_STYLES: dict[str, str] = {
    "idle": "dim", "waiting": "blue", "pausing": "grey62", "subagents": "magenta",
    "prefilling": "yellow", "decoding": "green",
}
"""Colour of each lane state (table cell and strip cell)."""
STATE_GLYPHS: dict[str, str] = {
    "idle": " ", "waiting": "░", "pausing": "·", "subagents": "▒", "prefilling": "▓",
    "decoding": "█",
}
STATE_LABELS: dict[str, str] = {
    "idle": "idle", "waiting": "waiting", "pausing": "pausing",
    "subagents": "on subagents", "prefilling": "prefilling", "decoding": "decoding",
}
SPARK = " ▁▂▃▄▅▆▇█"


class TextPanel(Widget):
    """A fixed-height text panel that repaints only when its text changed (never a
    layout pass: ``Static.update`` would re-lay the whole screen on every draw)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._text = Text()
        self._key: tuple[str, str] | None = None

    def set_text(self, text: Text) -> None:
        key = (text.plain, repr(text.spans))
        if key != self._key:
            self._key = key
            self._text = text
            self.refresh()

    def render(self) -> Text:
        return self._text


class HeaderBar(TextPanel):
    """Arm, trace, GPU count, users, elapsed / remaining, progress and display state."""

    _shown: tuple[LiveSnapshot, Weighting, bool, bool] | None = None

    def on_resize(self) -> None:
        # The labels depend on the width: a draw before the first layout (width 0) must
        # be redone once the bar knows its size, or a still snapshot keeps the wrong one.
        if self._shown is not None:
            self.show(*self._shown)

    def show(self, snap: LiveSnapshot, weighting: Weighting, paused: bool,
             stopping: bool) -> None:
        self._shown = (snap, weighting, paused, stopping)
        h = snap.header
        mode = "PLAYBACK" if h.mode == "playback" else "LIVE"
        if snap.finished:
            mode = "FINISHED"
        elif stopping:
            mode = "STOPPING"
        wide = self.size.width >= 120 or not self.size.width
        top = Text(no_wrap=True, overflow="ellipsis")
        top.append(" agentload ", "bold reverse")
        top.append(" ")
        top.append(mode, "bold green" if mode in ("LIVE", "FINISHED") else "bold yellow")
        top.append(f" │ {'arm ' if wide else ''}")
        top.append(h.label, "bold")
        top.append(f" │ {'trace ' if wide else ''}{h.trace} │ {h.gpus} GPU"
                   f"{'s' if h.gpus != 1 else ''} │ {h.users} users │ ")
        top.append(f"{f.clock(snap.elapsed_s)} elapsed", "bold")
        top.append(f" │ {f.clock(snap.remaining_s)} left")
        if paused:
            top.append(" │ ")
            top.append("DISPLAY PAUSED", "bold reverse yellow")
        t = snap.totals
        done = t.requests_done + t.requests_failed
        total = h.requests_total
        bottom = Text(no_wrap=True, overflow="ellipsis")
        bottom.append(f" requests {done}/{total or '?'} ")
        if snap.finished and snap.note:
            # Where the run went is what matters now; it replaces the progress bar.
            bottom.append("│ ")
            bottom.append(snap.note, "italic")
            bottom.append(" │ q leaves", "bold")
        else:
            # Progress by requests, or by time when the run is bounded by --duration only.
            frac = (done / total if total else snap.elapsed_s / h.duration_s
                    if h.duration_s else None)
            width = 20
            filled = round(width * min(1.0, frac)) if frac is not None else 0
            bottom.append("━" * min(width, filled), "green")
            bottom.append("━" * max(0, width - filled), "grey30")
            pct = f" {100 * min(1.0, frac):3.0f}%" if frac is not None else ""
            if not total and frac is not None:
                pct += " of the time"
            bottom.append(f"{pct} │ in flight {t.in_flight} │ active {t.users_active}/"
                          f"{h.users} │ weighting ")
            bottom.append(weighting, "bold cyan")
            if snap.note:
                bottom.append(f" │ {snap.note}", "italic")
            elif snap.stop_reason:
                bottom.append(f" │ {snap.stop_reason}", "italic")
        self.set_text(Text("\n", no_wrap=True, overflow="ellipsis").join([top, bottom]))


class Headline(TextPanel):
    """The run's headline numbers (definitions: the ``d`` key)."""

    LABELS: ClassVar[tuple[str, ...]] = (
        "P90 inter.", "E2E P90", "TTFT P90", "decode", "output", "per GPU",
        "errors", "validity", "P50 inter.")

    def show(self, snap: LiveSnapshot, weighting: Weighting) -> None:
        hl = snap.headline(weighting)
        t = snap.totals
        verdict_style = {"valid": "bold green", "invalid": "bold red"}.get(t.verdict, "dim")
        values: list[tuple[str, str]] = [
            (f.rate(hl.p90_interactivity_tok_s, "t/s"), "bold"),
            (f.rate(hl.e2e_norm_p90_interactivity_tok_s, "t/s"), "bold"),
            (f.seconds(hl.ttft_p90_s), "bold"),
            (f.rate(hl.decode_throughput_tok_s, "t/s"), "bold"),
            (f.rate(hl.output_throughput_tok_s, "t/s"), "bold"),
            (f.rate(hl.throughput_per_gpu_tok_s, "t/s"), "bold"),
            (str(t.requests_failed), "bold red" if t.requests_failed else "bold"),
            (t.verdict, verdict_style),
            (f.rate(hl.p50_interactivity_tok_s, "t/s"), "bold"),
        ]
        cols = max(1, self.size.width // 12) if self.size.width else len(values)
        cols = min(cols, len(values))
        width = max(8, (self.size.width or 12 * cols) // cols)
        labels = Text(no_wrap=True, overflow="crop")
        row = Text(no_wrap=True, overflow="crop")
        for label, (value, style) in list(zip(self.LABELS, values, strict=True))[:cols]:
            labels.append(f" {label:<{width - 1}.{width - 1}}", "dim")
            row.append(f" {value:<{width - 1}.{width - 1}}", style)
        extra = Text(no_wrap=True, overflow="ellipsis")
        extra.append(f" {weighting}-weighted · t/s = tokens/s (inter.: per user) · ", "dim")
        extra.append(f"{t.requests_done} ok, {t.requests_failed} failed")
        if t.errors_by_kind:
            extra.append(" (" + ", ".join(f"{k} {n}" for k, n in t.errors_by_kind) + ")",
                         "red")
        if t.osl_exact_fraction is not None:
            extra.append(f" · exact OSL {f.percent(t.osl_exact_fraction)}")
        spec = spec_text(snap.server)
        if spec:
            extra.append(f" · {spec}")
        if t.slo_text:
            extra.append(f" · {t.slo_text}")
        # The client's own reasons are on the client line below; not twice.
        client = set(snap.client.reasons) if snap.client is not None else set()
        reasons = [r for r in t.reasons if r not in client]
        if len(reasons) < len(t.reasons):
            reasons.append("client saturated (client line)")
        if reasons:
            extra.append(" · " + "; ".join(reasons), "red")
        extra.append("  [d] definitions", "dim")
        self.set_text(Text("\n", no_wrap=True, overflow="crop").join([labels, row, extra]))


def spec_text(server: ServerGauges | None) -> str:
    """Speculative decoding as the server counts it, or "" when it drafted nothing."""
    if server is None or server.spec_acceptance is None:
        return ""
    length = (f", mean length {server.spec_mean_length:.2f}"
              if server.spec_mean_length is not None else "")
    return f"spec. acceptance {f.percent(server.spec_acceptance)}{length}"


def client_line(c: ClientHealth | None) -> Text:
    """The client's self-diagnostics in one line: verdict first, then its figures.

    Live figures are estimates over the run so far (``≈``); the final ones are
    summary.json's. An invalid verdict carries its reasons (the thresholds are in
    ``replay/client/diagnostics.py``).
    """
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append(" client ", "dim")
    if c is None:
        line.append("self-diagnostics: none yet", "dim")
        return line
    if c.reasons:
        line.append(" INVALID ", "bold reverse red")
    else:
        line.append(" valid ", "bold reverse green")
    approx = "" if c.final else "≈"
    stamp = (f"{approx}{f.fine_seconds(c.stamp_error_p99_s)}" if c.kernel_stamps
             else "n/a (no kernel stamps)")
    line.append(f" stamp error p99 {stamp} │ events/read "
                f"{f.NONE if c.events_per_read is None else f'{c.events_per_read:.2f}'}")
    if c.multi_event_read_share is not None:
        line.append(f" ({f.percent(c.multi_event_read_share)} multi)")
    line.append(f" │ loop lag p99 {approx}{f.fine_seconds(c.loop_lag_p99_s)} │ CPU "
                f"{f.NONE if c.cpu_cores is None else f'{c.cpu_cores * 100:.0f}%'}")
    if c.reasons:
        line.append(" │ " + "; ".join(c.reasons), "red")
    return line


class ClientBar(TextPanel):
    """One line: is the client keeping up? (``replay/client/diagnostics.py``'s verdict)."""

    def show(self, snap: LiveSnapshot) -> None:
        self.set_text(client_line(snap.client))


def spark_rows(values: list[float], rows: int, lo: float, hi: float) -> list[str]:
    """``values`` as a block chart ``rows`` high (top row first); NaN is blank."""
    span = hi - lo
    levels = rows * 8
    heights = []
    for v in values:
        if math.isnan(v):
            heights.append(-1)
        elif span <= 0:
            heights.append(levels // 2 if v else 0)
        else:
            heights.append(max(1, round((v - lo) / span * levels)) if v > lo else 0)
    out = []
    for r in range(rows - 1, -1, -1):
        base = r * 8
        line = []
        for h in heights:
            if h < 0:
                line.append(" ")
            elif h == 0 and r == 0:
                line.append("▁")  # a finite minimum keeps a baseline (blank = no data)
            else:
                line.append(SPARK[max(0, min(8, h - base))])
        out.append("".join(line))
    return out


class Charts(Widget):
    """Rolling time series: one block chart per series, as tall as the panel allows."""

    ALLOW_MAXIMIZE = True

    COLORS: ClassVar[dict[str, str]] = {
        "interactivity_p50": "green", "interactivity_p90": "bright_green",
        "ttft_p90": "yellow", "in_flight": "cyan", "queue": "magenta", "kv_usage": "blue",
        "prefix_hit": "bright_cyan"}
    LABEL_W = 11
    VALUE_W = 9
    SHORT: ClassVar[dict[str, str]] = {
        "interactivity_p50": "inter. P50", "interactivity_p90": "inter. P90",
        "ttft_p90": "TTFT P90", "in_flight": "in flight", "queue": "srv queue",
        "kv_usage": "KV usage", "prefix_hit": "prefix hit"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._series: tuple[Series, ...] = ()
        self._key: tuple[float, int] | None = None

    def show(self, snap: LiveSnapshot) -> None:
        first = snap.series[0] if snap.series else None
        key = (first.t0_s, len(first.values)) if first else None
        if key != self._key or not self._series:
            self._key = key
            self._series = snap.series
            self.refresh()

    def render(self) -> Text:
        series = self._series
        width, height = self.size.width, self.size.height
        if not series or width <= 0:
            return Text("waiting for the first second of data…", style="dim")
        chart_w = max(4, width - self.LABEL_W - self.VALUE_W)
        per = max(1, height // len(series))
        lines: list[Text] = []
        for s in series:
            if len(lines) + per > height and lines:
                break
            values = list(s.values[-chart_w:])
            values = [math.nan] * (chart_w - len(values)) + values
            finite = [v for v in values if not math.isnan(v)]
            hi = max(finite) if finite else 1.0
            # Counts and shares start at zero; latencies and rates are autoscaled (the
            # scale is printed) so a 10 % change is visible.
            lo = 0.0 if s.unit in ("req", "%") or not finite else min(finite)
            if s.unit in ("req", "%") or hi - lo <= 0:
                lo = 0.0
            else:
                lo -= (hi - lo) * 0.15
                lo = max(0.0, lo)
            if s.unit == "%":
                hi = max(hi, 100.0) if s.key == "kv_usage" else max(hi, 1.0)
            rows = spark_rows(values, per, lo, hi)
            color = self.COLORS.get(s.key, "white")
            for i, chart in enumerate(rows):
                line = Text(no_wrap=True, overflow="crop")
                if i == 0:
                    label = self.SHORT.get(s.key, s.label)
                    line.append(f"{label:<{self.LABEL_W}.{self.LABEL_W}}")
                elif i == 1 and per >= 2:
                    line.append(f"{'max ' + f.series_value(hi, s.unit):>{self.LABEL_W - 1}} ",
                                "dim")
                elif i == per - 1 and per >= 3:
                    line.append(f"{'min ' + f.series_value(lo, s.unit):>{self.LABEL_W - 1}} ",
                                "dim")
                else:
                    line.append(" " * self.LABEL_W)
                line.append(chart, color)
                if i == 0:
                    line.append(f"{f.series_value(s.last(), s.unit):>{self.VALUE_W}}", "bold")
                lines.append(line)
        return Text("\n").join(lines)


def lane_cells(v: LaneView) -> tuple[str, ...]:
    """The per-user table's cells of one lane, formatted."""
    if v.session is None:
        turn = ""
    elif v.warmup:
        turn = "warmup"
    else:
        turn = f"{v.turn}/{v.turns}"
    state = STATE_LABELS[v.state]
    if v.state == "subagents":
        state = f"subagents x{v.subagents}"
    return (str(v.lane), v.session or "", turn, state, f.seconds(v.last_itl_s),
            f.rate(v.p90_interactivity_tok_s), str(v.requests), str(v.errors))


SortKey = Literal["lane", "worst P90", "state"]
SORTS: tuple[SortKey, ...] = ("lane", "worst P90", "state")


class UsersTable(ScrollView, can_focus=True):
    """One row per user lane, updated in place: a row is re-rendered only when its
    lane's view changed, and only if it is on screen (line API, nothing is cleared,
    so the cursor and the scroll position never jump)."""

    DEFAULT_CSS = "UsersTable { overflow-x: hidden; }"
    ALLOW_MAXIMIZE = True
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "cursor(-1)", show=False), Binding("down", "cursor(1)", show=False),
        Binding("pageup", "page(-1)", show=False), Binding("pagedown", "page(1)", show=False),
        Binding("home", "cursor(-1000000000)", show=False),
        Binding("end", "cursor(1000000000)", show=False),
        Binding("s", "sort", "Sort users", id="sort")]
    COLUMNS: ClassVar[tuple[tuple[str, str, int], ...]] = (
        ("lane", "lane", 4), ("session", "session", 8), ("turn", "turn", 5),
        ("state", "state", 13), ("itl", "ITL", 6), ("p90", "P90", 6),
        ("reqs", "reqs", 4), ("err", "err", 3))

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._views: dict[int, LaneView] = {}
        self._cells: dict[int, tuple[str, ...]] = {}
        self._order: list[int] = []
        self._position: dict[int, int] = {}
        self._rendered: dict[int, tuple[int, bool, Strip]] = {}  # lane -> (width, cursor, strip)
        self.cursor_row = 0
        """Index (in display order) of the highlighted row."""
        self.sort: SortKey = "lane"
        self.cell_updates = 0
        """Cells that changed since mount (the diff update's work, for tests and the bench)."""
        self.rows_rendered = 0
        """Row strips built since mount (only changed rows on screen are rebuilt)."""
        self._header_style = Style(bold=True, underline=True)
        self._cursor_style = Style(reverse=True)
        self._styles = {state: Style.parse(style) for state, style in STATE_STYLES.items()}
        self._red = Style.parse("red")

    @property
    def row_count(self) -> int:
        return len(self._order)

    def row_cells(self, lane: int) -> tuple[str, ...]:
        """The cells a lane's row shows."""
        return self._cells[lane]

    def show(self, snap: LiveSnapshot) -> None:
        changed: list[int] = []
        for view in snap.lanes:
            if self._views.get(view.lane) is view:
                continue  # the board reuses a lane's view object while it is unchanged
            self._views[view.lane] = view
            cells = lane_cells(view)
            old = self._cells.get(view.lane)
            if old == cells:
                continue
            self.cell_updates += len(cells) if old is None else sum(
                a != b for a, b in zip(cells, old, strict=True))
            self._cells[view.lane] = cells
            self._rendered.pop(view.lane, None)
            changed.append(view.lane)
        if not changed:
            return
        if self._reorder():
            self.refresh()
            return
        top = int(self.scroll_offset.y)
        bottom = top + self.size.height
        for lane in changed:
            line = self._position[lane] + 1  # line 0 is the header
            if top < line <= bottom:
                self.refresh_line(line)

    def _sort_key(self, lane: int) -> tuple[float, int]:
        view = self._views[lane]
        if self.sort == "worst P90":
            p90 = view.p90_interactivity_tok_s
            return (p90 if p90 is not None else float("inf"), lane)
        if self.sort == "state":
            return (-STATE_CODES[view.state], lane)
        return (0.0, lane)

    def _reorder(self) -> bool:
        order = sorted(self._views, key=self._sort_key)
        if order == self._order:
            return False
        self._order = order
        self._position = {lane: i for i, lane in enumerate(order)}
        self.virtual_size = Size(0, len(order) + 1)
        self._rendered.clear()
        return True

    def action_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        self.border_subtitle = f"sorted by {self.sort} · s to change"
        self._reorder()
        self.refresh()

    def action_cursor(self, delta: int) -> None:
        self._move_cursor(self.cursor_row + delta)

    def action_page(self, direction: int) -> None:
        self._move_cursor(self.cursor_row + direction * max(1, self.size.height - 2))

    def _move_cursor(self, row: int) -> None:
        old = self.cursor_row
        self.cursor_row = max(0, min(row, len(self._order) - 1))
        visible = max(1, self.size.height - 1)
        top = int(self.scroll_offset.y)
        if self.cursor_row < top:
            self.scroll_to(y=self.cursor_row, animate=False)
        elif self.cursor_row >= top + visible:
            self.scroll_to(y=self.cursor_row - visible + 1, animate=False)
        for row_index in (old, self.cursor_row):
            if row_index < len(self._order):
                self._rendered.pop(self._order[row_index], None)
                self.refresh_line(row_index + 1)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if y == 0:
            return self._header(width)
        index = int(self.scroll_offset.y) + y - 1
        if index >= len(self._order) or width <= 0:
            return Strip.blank(width, self.rich_style)
        lane = self._order[index]
        cursor = index == self.cursor_row and self.has_focus
        cached = self._rendered.get(lane)
        if cached is not None and cached[0] == width and cached[1] == cursor:
            return cached[2]
        strip = self._row(lane, width, cursor)
        self._rendered[lane] = (width, cursor, strip)
        self.rows_rendered += 1
        return strip

    def _header(self, width: int) -> Strip:
        text = "".join(f"{label:<{w + 1}.{w}}" for _, label, w in self.COLUMNS)
        return Strip([Segment(text, self._header_style)]).adjust_cell_length(width)

    def _row(self, lane: int, width: int, cursor: bool) -> Strip:
        cells = self._cells[lane]
        state = self._views[lane].state
        segments = []
        for i, ((_, _, w), value) in enumerate(zip(self.COLUMNS, cells, strict=True)):
            style = None
            if i == 3:
                style = self._styles.get(state)
            elif i == 7 and value != "0":
                style = self._red
            segments.append(Segment(f"{value:<{w + 1}.{w}}", style))
        strip = Strip(segments).adjust_cell_length(width)
        return strip.apply_style(self._cursor_style) if cursor else strip

    def on_focus(self) -> None:
        self._invalidate_cursor()

    def on_blur(self) -> None:
        self._invalidate_cursor()

    def _invalidate_cursor(self) -> None:
        if self.cursor_row < len(self._order):
            self._rendered.pop(self._order[self.cursor_row], None)
            self.refresh_line(self.cursor_row + 1)


class LanesStrip(ScrollView):
    """Each lane's recent seconds as a strip of coloured cells (newest on the right).

    Rendered with the line API: only the visible lanes are drawn, and a lane's strip is
    re-built only when its history changed.
    """

    DEFAULT_CSS = "LanesStrip { height: 1fr; overflow-x: hidden; }"
    LABEL_W = 6

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._strips: tuple[bytes, ...] = ()
        self._lanes: tuple[LaneView, ...] = ()
        self._cache: dict[int, tuple[bytes, int, Strip]] = {}
        self._styles = {code: Style.parse(STATE_STYLES[state])
                        for state, code in STATE_CODES.items()}

    def show(self, snap: LiveSnapshot) -> None:
        if snap.strips == self._strips:  # identical bytes objects between bins: cheap
            return
        self._strips = snap.strips
        self._lanes = snap.lanes
        if self.virtual_size.height != len(snap.strips):
            self.virtual_size = Size(0, len(snap.strips))
        self.refresh()

    def render_line(self, y: int) -> Strip:
        index = int(self.scroll_offset.y) + y
        width = self.size.width
        if index >= len(self._strips) or width <= 0:
            return Strip.blank(width, self.rich_style)
        data = self._strips[index]
        cached = self._cache.get(index)
        if cached is not None and cached[0] is data and cached[1] == width:
            return cached[2]
        cells = max(0, width - self.LABEL_W)
        tail = data[-cells:] if cells else b""
        tail = bytes(cells - len(tail)) + tail
        lane = self._lanes[index].lane if index < len(self._lanes) else index
        segments = [Segment(f"{lane:>{self.LABEL_W - 1}} ", Style(dim=True))]
        run_code, run_len = -1, 0
        for code in tail:
            if code == run_code:
                run_len += 1
                continue
            if run_len:
                segments.append(Segment(STATE_GLYPHS[CODE_STATES[run_code]] * run_len,
                                        self._styles[run_code]))
            run_code, run_len = code, 1
        if run_len:
            segments.append(Segment(STATE_GLYPHS[CODE_STATES[run_code]] * run_len,
                                    self._styles[run_code]))
        strip = Strip(segments, width).crop(0, width)
        self._cache[index] = (data, width, strip)
        return strip

    @staticmethod
    def legend() -> Text:
        short = {"decoding": "decode", "prefilling": "prefill", "subagents": "subs",
                 "pausing": "pause"}
        text = Text()
        for state, label in short.items():
            text.append(STATE_GLYPHS[state], STATE_STYLES[state])
            text.append(f"{label} ")
        return text


class EventLog(ScrollView, can_focus=True):
    """Errors, recycles, warmup end, stops and server restarts, newest at the bottom.

    Line API, like the lanes strip: new events repaint only their lines. The scrollable
    height grows in chunks (a layout pass every ``CHUNK`` events, not on every event),
    and the view follows the newest event unless the user scrolled up. New events are
    taken at most once a second.
    """

    DEFAULT_CSS = "EventLog { overflow-x: hidden; }"
    ALLOW_MAXIMIZE = True
    FLUSH_EVERY_S = 1.0
    CHUNK = 200
    KEEP = 2000
    STYLES: ClassVar[dict[str, str]] = {"error": "red", "warn": "yellow", "info": ""}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._events: list[Event] = []
        self._last_seq = 0
        self._skipped: dict[int, int] = {}  # index -> events not shown before it
        self._flushed_at = -1e9
        self._cache: dict[int, tuple[int, Strip]] = {}
        self._dim = Style(dim=True)
        self._styles = {k: Style.parse(v) if v else Style() for k, v in self.STYLES.items()}
        self._kind_style = Style.parse("cyan")

    def line_texts(self) -> list[str]:
        """The log's lines as plain text (oldest first)."""
        return [self._plain(i) for i in range(len(self._events))]

    def _plain(self, i: int) -> str:
        e = self._events[i]
        skipped = self._skipped.get(i)
        head = f"… {skipped} earlier events not shown · " if skipped else ""
        return f"{head}{f.clock(e.t_s):>7} {e.kind:<8} {e.text}"

    def show(self, snap: LiveSnapshot, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not snap.events or snap.events[-1].seq <= self._last_seq:
            return
        if now - self._flushed_at < self.FLUSH_EVERY_S and not snap.finished:
            return
        self._flushed_at = now
        fresh = [e for e in snap.events if e.seq > self._last_seq]
        following = self.scroll_offset.y >= self._follow_y() - 1
        if fresh[0].seq > self._last_seq + 1:
            self._skipped[len(self._events)] = fresh[0].seq - self._last_seq - 1
        first_new = len(self._events)
        self._events.extend(fresh)
        self._last_seq = fresh[-1].seq
        if len(self._events) > self.KEEP:
            drop = len(self._events) - self.KEEP + self.CHUNK
            self._events = self._events[drop:]
            self._skipped = {i - drop: n for i, n in self._skipped.items() if i >= drop}
            self._cache.clear()
            first_new = 0
        height = -(-max(len(self._events), 1) // self.CHUNK) * self.CHUNK
        grew = self.virtual_size.height != height
        if grew:
            self.virtual_size = Size(0, height)
        if following and grew:  # the new height takes effect after the layout pass
            self.call_after_refresh(self._follow)
        elif following:
            self._follow()
        self.refresh_lines(first_new, len(self._events) - first_new)

    def _follow(self) -> None:
        self.scroll_to(y=self._follow_y(), animate=False)

    def _follow_y(self) -> int:
        return max(0, len(self._events) - self.size.height)

    def render_line(self, y: int) -> Strip:
        index = int(self.scroll_offset.y) + y
        width = self.size.width
        if index >= len(self._events) or width <= 0:
            return Strip.blank(width, self.rich_style)
        cached = self._cache.get(index)
        if cached is not None and cached[0] == width:
            return cached[1]
        e = self._events[index]
        style = self._styles.get(e.level, Style())
        segments = []
        skipped = self._skipped.get(index)
        if skipped:
            segments.append(Segment(f"… {skipped} earlier events not shown · ",
                                    Style(dim=True, italic=True)))
        segments += [Segment(f"{f.clock(e.t_s):>7} ", self._dim),
                     Segment(f"{e.kind:<8} ", style if e.level != "info" else self._kind_style),
                     Segment(e.text, style)]
        strip = Strip(segments).crop(0, width).adjust_cell_length(width)
        self._cache[index] = (width, strip)
        return strip

"""The dashboard's panels. Each is dumb: ``show(snapshot, weighting)`` draws it.

Widgets only read :class:`~agentload.replay.live.LiveSnapshot`s (immutable), so a
panel can never see a half-updated aggregate. The per-user table is diff-updated
(only changed cells are written; rows are never cleared), the lanes strip and the
time series render only what is on screen.
"""

from __future__ import annotations

import math
from typing import ClassVar

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import DataTable, RichLog, Static

from agentload.replay.live import (
    CODE_STATES,
    STATE_CODES,
    LaneView,
    LiveSnapshot,
    Series,
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


class HeaderBar(Static):
    """Arm, trace, GPU count, users, elapsed / remaining, progress and display state."""

    def show(self, snap: LiveSnapshot, weighting: Weighting, paused: bool,
             stopping: bool) -> None:
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
        width = 20
        filled = round(width * done / total) if total else 0
        bottom.append("━" * min(width, filled), "green")
        bottom.append("━" * max(0, width - filled), "grey30")
        pct = f" {100 * done / total:3.0f}%" if total else ""
        bottom.append(f"{pct} │ in flight {t.in_flight} │ active {t.users_active}/"
                      f"{h.users} │ weighting ")
        bottom.append(weighting, "bold cyan")
        if snap.note:
            bottom.append(f" │ {snap.note}", "italic")
        elif snap.stop_reason:
            bottom.append(f" │ {snap.stop_reason}", "italic")
        self.update(Text("\n", no_wrap=True, overflow="ellipsis").join([top, bottom]))


class Headline(Static):
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
        if t.reasons:
            extra.append(" · " + "; ".join(t.reasons), "red")
        extra.append("  [d] definitions", "dim")
        self.update(Text("\n", no_wrap=True, overflow="crop").join([labels, row, extra]))


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

    def show(self, snap: LiveSnapshot) -> None:
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


class UsersTable(DataTable[str | Text]):
    """One row per user lane, updated cell by cell (never cleared, so no flicker)."""

    COLUMNS: ClassVar[tuple[tuple[str, str, int], ...]] = (
        ("lane", "lane", 4), ("session", "session", 8), ("turn", "turn", 5),
        ("state", "state", 13), ("itl", "ITL", 6), ("p90", "P90", 6),
        ("reqs", "reqs", 4), ("err", "err", 3))

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=False, cell_padding=0)
        self._views: dict[int, LaneView] = {}
        self._cells: dict[int, tuple[str, ...]] = {}
        self.cell_updates = 0
        """Cells written since mount (the diff update's cost, for tests and the bench)."""

    def on_mount(self) -> None:
        for key, label, width in self.COLUMNS:
            self.add_column(label, key=key, width=width + 1)  # one space between columns

    @staticmethod
    def _cell(col: int, value: str, state: str) -> str | Text:
        if col == 3:
            return Text(value, style=STATE_STYLES.get(state, ""))
        if col == 7 and value != "0":
            return Text(value, style="red")
        return value

    def show(self, snap: LiveSnapshot) -> None:
        keys = [k for k, _, _ in self.COLUMNS]
        for view in snap.lanes:
            if self._views.get(view.lane) is view:
                continue  # the board reuses a lane's view object while it is unchanged
            self._views[view.lane] = view
            cells = lane_cells(view)
            old = self._cells.get(view.lane)
            row_key = str(view.lane)
            if old is None:
                self.add_row(*(self._cell(i, c, view.state) for i, c in enumerate(cells)),
                             key=row_key)
                self.cell_updates += len(cells)
            else:
                for i, (new, was) in enumerate(zip(cells, old, strict=True)):
                    if new != was:
                        self.update_cell(row_key, keys[i], self._cell(i, new, view.state))
                        self.cell_updates += 1
            self._cells[view.lane] = cells


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
        self._strips = snap.strips
        self._lanes = snap.lanes
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


class EventLog(RichLog):
    """Errors, recycles, warmup end, stops and server restarts, newest at the bottom."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, max_lines=2000, wrap=False, markup=False, auto_scroll=True)
        self._last_seq = 0

    def show(self, snap: LiveSnapshot) -> None:
        fresh = [e for e in snap.events if e.seq > self._last_seq]
        if not fresh:
            return
        if fresh[0].seq > self._last_seq + 1:
            self.write(Text(f"… {fresh[0].seq - self._last_seq - 1} earlier events not "
                            "shown", style="dim italic"))
        for e in fresh:
            style = {"error": "red", "warn": "yellow"}.get(e.level, "")
            line = Text(no_wrap=True)
            line.append(f"{f.clock(e.t_s):>7} ", "dim")
            line.append(f"{e.kind:<8} ", style or "cyan")
            line.append(e.text, style)
            self.write(line)
        self._last_seq = fresh[-1].seq

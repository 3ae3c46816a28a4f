"""The live board's published records: snapshot dataclasses, the series it keeps,
the client figures it shows, and the viewer protocol and registry."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from agentload.replay.live._board import LiveBoard

CLIENT_KEYS = ("kernel_stamps", "stamp_error_p99_s", "events_per_read",
               "multi_event_read_share", "loop_lag_p99_s", "cpu_cores")
"""The client self-diagnostics the dashboard shows (``replay/client/diagnostics.py`` names)."""

Weighting = Literal["request", "user", "session"]
WEIGHTINGS: tuple[Weighting, ...] = ("request", "user", "session")
LaneState = Literal["idle", "waiting", "pausing", "subagents", "prefilling", "decoding"]
RequestState = Literal["waiting", "pausing", "prefilling", "decoding", "done"]

# Strip codes: what a lane did in one second (the busiest thing it did), oldest first.
STATE_CODES: dict[LaneState, int] = {"idle": 0, "waiting": 1, "pausing": 2, "subagents": 3,
                                     "prefilling": 4, "decoding": 5}
CODE_STATES: tuple[LaneState, ...] = ("idle", "waiting", "pausing", "subagents",
                                      "prefilling", "decoding")
_REQ_CODES: dict[str, int] = {"waiting": 0, "pausing": 1, "prefilling": 2, "decoding": 3}

BIN_S = 1.0
"""Width of one time-series bin and one strip cell, seconds."""
WINDOW_BINS = 10
"""Percentiles in the rolling series cover the last this many bins."""
HISTORY_BINS = 600
"""Bins kept in each series (ten minutes at 1 s)."""
STRIP_CELLS = 240
"""Seconds of each lane's history kept for the lanes strip."""
EVENTS_KEPT = 200
"""Events carried in each snapshot (the newest)."""
HEADLINE_EVERY_S = 1.0
"""The headline percentiles are recomputed at most this often (they cover the run)."""

SERIES: tuple[tuple[str, str, str], ...] = (
    ("interactivity_p50", "interactivity P50", "tok/s"),
    ("interactivity_p90", "interactivity P90", "tok/s"),
    ("ttft_p90", "TTFT P90", "s"),
    ("in_flight", "in flight", "req"),
    ("queue", "server queue", "req"),
    ("kv_usage", "KV usage", "%"),
    ("prefix_hit", "prefix hits", "%"),
)
"""(key, label, unit) of every rolling series, in display order."""

SERIES_DEFINITIONS: dict[str, str] = {
    "interactivity_p50": "1 / P50(ITL_i) over requests finished in the last 10 s",
    "interactivity_p90": "1 / P90(ITL_i) over requests finished in the last 10 s",
    "ttft_p90": "P90(TTFT_i) over requests finished in the last 10 s, seconds",
    "in_flight": "requests sent and not finished, at the end of each second",
    "queue": "vllm:num_requests_waiting (server queue), sampled every second",
    "kv_usage": "vllm:kv_cache_usage_perc x 100, sampled every second",
    "prefix_hit": "delta prefix_cache_hits / delta prefix_cache_queries over the last 10 s",
}


# --------------------------------------------------------------------------- snapshot


@dataclass(frozen=True, slots=True)
class Header:
    """What is being run: shown in the dashboard's title bar."""

    label: str
    trace: str
    gpus: int
    users: int
    requests_total: int
    duration_s: float | None
    mode: Literal["live", "playback"] = "live"
    run_dir: str | None = None
    recycle: bool = False
    """Lanes recycle through sessions (--recycle); else each plays its share once."""
    slo: tuple[tuple[str, float], ...] = ()
    """The run's ``--slo`` bounds (name, seconds), in the order given; () for none."""


@dataclass(frozen=True, slots=True)
class Headline:
    """The run's headline numbers under one weighting (None: no data yet)."""

    weighting: Weighting
    p50_interactivity_tok_s: float | None = None
    p90_interactivity_tok_s: float | None = None
    e2e_norm_p90_interactivity_tok_s: float | None = None
    ttft_p90_s: float | None = None
    decode_throughput_tok_s: float | None = None
    output_throughput_tok_s: float | None = None
    throughput_per_gpu_tok_s: float | None = None


@dataclass(frozen=True, slots=True)
class Totals:
    requests_done: int = 0
    requests_failed: int = 0
    warmup_done: int = 0
    in_flight: int = 0
    users_active: int = 0
    errors_by_kind: tuple[tuple[str, int], ...] = ()
    osl_exact_fraction: float | None = None
    verdict: str = "no data"
    reasons: tuple[str, ...] = ()
    slo_text: str | None = None
    """Who met the ``--slo`` so far, as the console says it (``slo.slo_line``)."""


@dataclass(frozen=True, slots=True)
class LaneView:
    """One user lane, as the per-user table shows it."""

    lane: int
    session: str | None = None
    play: int = 0
    turn: int = 0
    turns: int = 0
    state: LaneState = "idle"
    warmup: bool = False
    in_flight: int = 0
    subagents: int = 0
    last_itl_s: float | None = None
    p90_interactivity_tok_s: float | None = None
    requests: int = 0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class Series:
    """A rolling series: ``values[i]`` covers [t0_s + i*step_s, t0_s + (i+1)*step_s)."""

    key: str
    label: str
    unit: str
    t0_s: float
    step_s: float
    values: tuple[float, ...]  # nan: no data in that bin

    def last(self) -> float | None:
        for v in reversed(self.values):
            if not math.isnan(v):
                return v
        return None


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    t_s: float
    kind: str
    text: str
    level: Literal["info", "warn", "error"] = "info"


@dataclass(frozen=True, slots=True)
class ServerGauges:
    """The server's latest Prometheus sample (None values: not exported)."""

    t_s: float
    ok: bool
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    prefix_hit_rate: float | None = None
    spec_acceptance: float | None = None
    """Accepted / drafted speculative tokens over the run so far (None: no drafts)."""
    spec_mean_length: float | None = None
    """1 + accepted / drafts: tokens each verification step yields on average."""


@dataclass(frozen=True, slots=True)
class ClientHealth:
    """The client's self-diagnostics over the run so far (``summary.json`` → ``client``).

    Live figures are the probe's once-a-second estimates (histogram percentiles); the
    ``final`` ones are summary.json's exact values. ``reasons`` empty: the client kept
    up; else the run is invalid for those reasons.
    """

    t_s: float
    final: bool = False
    kernel_stamps: bool = False
    stamp_error_p99_s: float | None = None
    events_per_read: float | None = None
    multi_event_read_share: float | None = None
    loop_lag_p99_s: float | None = None
    cpu_cores: float | None = None
    reasons: tuple[str, ...] = ()

    @property
    def verdict(self) -> str:
        return "invalid" if self.reasons else "valid"


def client_figures(d: dict[str, Any]) -> dict[str, Any]:
    """The dashboard's share of a diagnostics summary: ``CLIENT_KEYS`` and the reasons."""
    out = {k: d.get(k) for k in CLIENT_KEYS}
    out["saturation_reasons"] = list(d.get("saturation_reasons") or ())
    return out


def client_health(t_s: float, d: dict[str, Any], final: bool = False) -> ClientHealth:
    def num(key: str) -> float | None:
        v = d.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    return ClientHealth(t_s, final, bool(d.get("kernel_stamps")),
                        num("stamp_error_p99_s"), num("events_per_read"),
                        num("multi_event_read_share"), num("loop_lag_p99_s"),
                        num("cpu_cores"), tuple(str(r) for r in
                                                d.get("saturation_reasons") or ()))


@dataclass(frozen=True, slots=True)
class LiveSnapshot:
    """The whole run at one instant. Immutable: safe to hand to any thread or process."""

    seq: int
    header: Header
    elapsed_s: float
    remaining_s: float | None
    finished: bool
    stop_reason: str | None
    headlines: tuple[Headline, ...]
    totals: Totals
    series: tuple[Series, ...]
    lanes: tuple[LaneView, ...]
    strips: tuple[bytes, ...]  # per lane, STATE_CODES per second, oldest first
    events: tuple[Event, ...]
    server: ServerGauges | None
    note: str | None = None  # e.g. where the report was written, once finalized
    client: ClientHealth | None = None  # the client's self-diagnostics (None: not yet)

    def headline(self, weighting: Weighting) -> Headline:
        for h in self.headlines:
            if h.weighting == weighting:
                return h
        return Headline(weighting)

    def series_by_key(self, key: str) -> Series | None:
        return next((s for s in self.series if s.key == key), None)


class SnapshotSource(Protocol):
    """What the dashboard reads: the engine's board, a journal playback, or a fake."""

    @property
    def live(self) -> bool:
        """True for a running replay (quitting asks first, then stops and finalizes it)."""
        ...

    def snapshot(self) -> LiveSnapshot | None:
        """The newest snapshot (None before the first); never blocks for long."""
        ...

    def request_stop(self) -> None:
        """Ask the run to stop sending; it finishes what is in flight and is finalized."""
        ...

    def hold(self, paused: bool) -> None:
        """The display is paused (a playback clock stops; a live run goes on)."""
        ...


class Viewer(Protocol):
    """A live display of a replay (the dashboard), driven by ``run_replay``."""

    def attach(self, board: LiveBoard, stop: Callable[[str], None]) -> None:
        """The replay starts; ``stop(reason)`` may be called from any thread."""
        ...

    def finish(self, note: str) -> None:
        """The run is finalized (``note`` says where); returns once the viewer closed."""
        ...

    def close(self) -> None:
        """Tear the viewer down at once (errors, interrupts); idempotent."""
        ...


_dashboard: Callable[[], Viewer] | None = None


def set_dashboard(factory: Callable[[], Viewer] | None) -> None:
    """Register the dashboard (``agentload.tui`` does) so replays can open it."""
    global _dashboard
    _dashboard = factory


def dashboard_factory() -> Callable[[], Viewer] | None:
    return _dashboard


def open_viewer(progress: str, viewer: Viewer | None, board: LiveBoard) -> Viewer | None:
    """Attach ``viewer`` (or, for ``progress="dashboard"``, the registered dashboard).

    None when no viewer is wanted or none is registered (the caller then falls back to
    a status line).
    """
    if viewer is None and progress == "dashboard" and _dashboard is not None:
        viewer = _dashboard()
    if viewer is not None:
        viewer.attach(board, board.request_stop)
    return viewer



"""Live state of a replay, published as immutable snapshots for the dashboard.

The engine feeds a :class:`LiveBoard` from its own loop (``begin_play``,
``transition``, ``finished``, ``event``, ``server_sample``: each a few dict and list
operations, never a wait) and calls :meth:`LiveBoard.publish` about four times a
second; that builds one frozen :class:`LiveSnapshot` and stores it in
``board.latest``. A viewer on another thread or process only ever reads ``latest``
(one reference read), so nothing a viewer does can delay a timestamp. The same board,
fed from a run directory's journal instead of the engine, plays a recorded run back
(:class:`JournalPlayback`), finished or not.

Numbers follow ``replay/metrics.py`` (request-weighted, linear interpolation) and are
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
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import orjson

from agentload.replay.journal import JOURNAL_NAME, RequestRecord
from agentload.replay.metrics import validity
from agentload.replay.prometheus import SPEC_COUNTERS, spec_acceptance

CLIENT_KEYS = ("kernel_stamps", "stamp_error_p99_s", "events_per_read",
               "multi_event_read_share", "loop_lag_p99_s", "cpu_cores")
"""The client self-diagnostics the dashboard shows (``replay/diagnostics.py`` names)."""

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


# --------------------------------------------------------------------------- helpers


class _Floats:
    """A growable float64 array (amortized appends, zero-copy views)."""

    __slots__ = ("_a", "n")

    def __init__(self) -> None:
        self._a = np.empty(1024, dtype=np.float64)
        self.n = 0

    def append(self, x: float) -> None:
        if self.n == len(self._a):
            self._a = np.concatenate([self._a, np.empty(len(self._a), dtype=np.float64)])
        self._a[self.n] = x
        self.n += 1

    def view(self) -> np.ndarray:
        return self._a[: self.n]


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float | None:
    """Quantile ``q`` of ``values`` under ``weights`` (NaN values left out).

    Each sorted value sits at the middle of its weight, (S_i - w_i / 2) / S_n, and the
    quantile is interpolated linearly between those positions (clamped at the ends),
    so a user whose requests are few but slow weighs as much as one with many fast
    ones. (Request weighting uses numpy's linear percentile instead, the report's.)
    """
    keep = ~np.isnan(values)
    v, w = values[keep], weights[keep]
    if len(v) == 0:
        return None
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    cum = np.cumsum(w)
    return float(np.interp(q, (cum - w / 2) / cum[-1], v))


def _quantiles(values: np.ndarray, groups: dict[str, np.ndarray],
               ) -> dict[str, Callable[[float], float | None]]:
    """Quantile functions of ``values`` per weighting, from one sort.

    "request": numpy's linear percentile (metrics.py's definition); each of ``groups``
    (user, session): :func:`weighted_quantile` with every group weighing the same.
    """
    valid = ~np.isnan(values)
    v = values[valid]
    order = np.argsort(v, kind="stable")
    v = v[order]
    n = len(v)

    def linear(q: float) -> float | None:
        if n == 0:
            return None
        pos = q * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))

    out: dict[str, Callable[[float], float | None]] = {"request": linear}
    for name, g in groups.items():
        gv = g[valid]
        counts = np.bincount(gv, minlength=int(gv.max()) + 1 if len(gv) else 1)
        w = (1.0 / np.maximum(counts, 1)[gv])[order]
        cum = np.cumsum(w)
        positions = (cum - w / 2) / cum[-1] if n else cum

        def weighted(q: float, positions: np.ndarray = positions) -> float | None:
            return float(np.interp(q, positions, v)) if n else None

        out[name] = weighted
    return out


def _inverse(x: float | None) -> float | None:
    return None if x is None or x <= 0 else 1.0 / x


class _Intervals:
    """Union length of [start, end] intervals, kept as disjoint sorted runs."""

    __slots__ = ("ends", "starts", "total")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.total = 0

    def add(self, start: int, end: int) -> None:
        if end < start:
            return
        i = bisect.bisect_left(self.ends, start)  # first run that ends at/after start
        j = bisect.bisect_right(self.starts, end)  # runs before j start at/before end
        if i < j:
            start = min(start, self.starts[i])
            end = max(end, self.ends[j - 1])
            self.total -= sum(self.ends[k] - self.starts[k] for k in range(i, j))
        self.starts[i:j] = [start]
        self.ends[i:j] = [end]
        self.total += end - start


class _Lane:
    """Mutable per-lane state, owned by the board (engine thread only)."""

    __slots__ = ("bin_code", "counts", "errors", "itl", "last_itl_s", "main_sent",
                 "p90", "p90_stale", "play", "reqs", "requests", "session", "start_turn",
                 "strip", "strip_cache", "turns", "view", "warmup_left")

    def __init__(self) -> None:
        self.session: str | None = None
        self.play = 0
        self.start_turn = 0
        self.turns = 0
        self.main_sent = 0
        self.warmup_left = 0
        self.reqs: dict[str, tuple[bool, int]] = {}  # request id -> (is main, state code)
        self.counts = [[0, 0, 0, 0], [0, 0, 0, 0]]  # [is main][state code]
        self.itl: list[float] = []
        self.last_itl_s: float | None = None
        self.p90: float | None = None
        self.p90_stale = False
        self.requests = 0
        self.errors = 0
        self.bin_code = 0
        self.strip: deque[int] = deque(maxlen=STRIP_CELLS)
        self.strip_cache: bytes | None = None
        self.view: LaneView | None = None

    def strip_bytes(self) -> bytes:
        """The strip as bytes, rebuilt only after a bin closed (same object until then)."""
        if self.strip_cache is None:
            self.strip_cache = bytes(self.strip)
        return self.strip_cache

    def state(self) -> LaneState:
        main, sub = self.counts[1], self.counts[0]
        if main[3] or (not any(main) and sub[3]):
            return "decoding"
        if main[2] or (not any(main) and sub[2]):
            return "prefilling"
        if main[0] and any(sub):
            return "subagents"
        if main[1] or sub[1]:
            return "pausing"
        if main[0] or sub[0]:
            return "waiting"
        return "idle"


# --------------------------------------------------------------------------- the board


class LiveBoard:
    """Aggregates a replay as it happens and publishes :class:`LiveSnapshot`s.

    Every method takes times as ns since the run's start (the journal's clock) and is
    meant to be called from one thread (the engine's loop, or a playback); ``latest``
    may be read from anywhere.
    """

    def __init__(self, header: Header) -> None:
        self.header = header
        self.latest: LiveSnapshot | None = None
        self.note: str | None = None
        self.stop_requested: str | None = None
        """Set from any thread by :meth:`request_stop`; the engine's loop acts on it."""
        self._seq = 0
        self._lanes: dict[int, _Lane] = {}
        self._order: list[int] = []
        self._dirty: set[int] = set()
        self._views: tuple[LaneView, ...] | None = None
        self._active = 0  # lanes with a request pending
        self._in_flight = 0  # requests prefilling or decoding
        for i in range(header.users):
            self._lane(i)
        self._finished = False
        self._stop_reason: str | None = None
        self._now_ns = 0
        # Measured, successful requests: one entry each.
        self._itl = _Floats()
        self._ttft = _Floats()
        self._e2e_tok = _Floats()
        self._lane_of = _Floats()
        self._session_of = _Floats()
        self._session_ids: dict[str, int] = {}
        self._decoding = _Intervals()
        self._osl_sum = self._isl_sum = self._decode_tokens = 0
        self._osl_exact = 0
        self._first_sent: int | None = None
        self._last_token: int | None = None
        self._done = self._failed = self._warmup_done = 0
        self._errors: dict[str, int] = {}
        self._new_since_headline = False
        self._headline_at_ns = -(10**18)
        self._headlines: tuple[Headline, ...] = tuple(Headline(w) for w in WEIGHTINGS)
        self._totals = Totals()
        self._warming: set[int] = set()
        self._warmup_seen = False
        # Rolling series.
        self._bin = 0  # index of the open bin
        self._bin_itl: list[float] = []
        self._bin_ttft: list[float] = []
        self._recent: deque[tuple[list[float], list[float]]] = deque(maxlen=WINDOW_BINS)
        self._series: dict[str, deque[float]] = {k: deque(maxlen=HISTORY_BINS)
                                                 for k, _, _ in SERIES}
        self._server: ServerGauges | None = None
        # The speculative counters at the first scrape: acceptance is over the run.
        self._spec_first: dict[str, float] | None = None
        self._server_ok: bool | None = None
        self._server_prev: dict[str, float] | None = None
        self._server_hist: deque[tuple[int, float, float]] = deque(maxlen=WINDOW_BINS + 1)
        self._client: ClientHealth | None = None
        self._events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self._strips: tuple[bytes, ...] | None = None
        self._event_seq = 0

    # -- feeding -----------------------------------------------------------------

    def _lane(self, lane: int) -> _Lane:
        state = self._lanes.get(lane)
        if state is None:
            state = self._lanes[lane] = _Lane()
            if self._order and lane < self._order[-1]:
                self._order = sorted(self._lanes)
            else:
                self._order.append(lane)
            self._dirty.add(lane)
        return state

    def request_stop(self, reason: str) -> None:
        """Ask the replay to stop sending (thread-safe: one attribute write)."""
        if self.stop_requested is None:
            self.stop_requested = reason

    def say(self, line: str) -> None:
        """A message for the user (e.g. "server died"), logged as an event."""
        self.event(self._now_ns, "note", line, "warn")

    def event(self, t_ns: int, kind: str, text: str,
              level: Literal["info", "warn", "error"] = "info") -> None:
        """Add a line to the event log."""
        self._event_seq += 1
        self._events.append(Event(self._event_seq, t_ns / 1e9, kind, text, level))

    def begin_play(self, t_ns: int, lane: int, play: int, session_id: str, start_turn: int,
                   main_turns: int, warmup_requests: int = 0) -> None:
        """Lane ``lane`` starts play ``play`` of a session (recycles after the first)."""
        s = self._lane(lane)
        s.session, s.play, s.start_turn, s.turns = session_id, play, start_turn, main_turns
        s.main_sent = 0
        s.warmup_left = warmup_requests
        self._dirty.add(lane)
        if warmup_requests:
            self._warming.add(lane)
            self._warmup_seen = True
        if play and self.header.recycle:
            self.event(t_ns, "recycle", f"lane {lane} recycles into session {session_id} "
                       f"(play {play})")
        elif play:
            self.event(t_ns, "session", f"lane {lane} starts session {session_id} "
                       f"(its session {play + 1})")

    def transition(self, t_ns: int, lane: int, request_id: str, agent_kind: str,
                   state: RequestState, phase: str = "measure") -> None:
        """A request of ``lane`` enters ``state`` ("done" removes it)."""
        self._roll(t_ns)
        s = self._lane(lane)
        was_active = bool(s.reqs)
        old = s.reqs.pop(request_id, None)
        if old is not None:
            s.counts[old[0]][old[1]] -= 1
            self._in_flight -= old[1] >= 2
        is_main = agent_kind == "main"
        if state != "done":
            code = _REQ_CODES[state]
            s.reqs[request_id] = (is_main, code)
            s.counts[is_main][code] += 1
            self._in_flight += code >= 2
            if state == "prefilling":
                if is_main and phase == "measure":
                    s.main_sent += 1
                if phase == "measure" and lane in self._warming:
                    self._warming.discard(lane)
                    s.warmup_left = 0
                    if not self._warming:
                        self.event(t_ns, "warmup", "warmup ended: every lane is measuring")
        self._active += bool(s.reqs) - was_active
        code = STATE_CODES[s.state()]
        s.bin_code = max(s.bin_code, code)
        self._dirty.add(lane)

    def finished(self, rec: RequestRecord) -> None:
        """A request finished (the record the journal holds)."""
        self._roll(rec.done_ns)
        s = self._lane(rec.lane)
        self._dirty.add(rec.lane)
        itl: float | None = None
        if (rec.ok and rec.first_token_ns is not None and rec.last_token_ns is not None
                and rec.osl is not None and rec.osl >= 2):
            itl = (rec.last_token_ns - rec.first_token_ns) / 1e9 / (rec.osl - 1)
            s.last_itl_s = itl
        if rec.phase != "measure":
            self._warmup_done += rec.ok
            return
        s.requests += 1
        if not rec.ok:
            s.errors += 1
            self._failed += 1
            kind = rec.error_kind or "error"
            self._errors[kind] = self._errors.get(kind, 0) + 1
            self.event(rec.done_ns, "error", f"lane {rec.lane} {rec.request_id}: "
                       f"{rec.error or kind}", "error")
            self._new_since_headline = True
            return
        assert rec.first_token_ns is not None and rec.last_token_ns is not None
        self._done += 1
        osl = rec.osl or 0
        isl = rec.isl if rec.isl is not None else rec.isl_requested
        self._osl_sum += osl
        self._isl_sum += isl
        self._osl_exact += osl == rec.osl_requested
        ttft = (rec.first_token_ns - rec.sent_ns) / 1e9
        self._ttft.append(ttft)
        self._itl.append(math.nan if itl is None else itl)
        self._e2e_tok.append((rec.last_token_ns - rec.sent_ns) / 1e9 / osl if osl else math.nan)
        self._lane_of.append(rec.lane)
        sid = self._session_ids.setdefault(f"{rec.lane}/{rec.play}/{rec.session_id}",
                                           len(self._session_ids))
        self._session_of.append(sid)
        if osl >= 2:
            self._decoding.add(rec.first_token_ns, rec.last_token_ns)
            self._decode_tokens += osl - 1
        self._first_sent = rec.sent_ns if self._first_sent is None else min(
            self._first_sent, rec.sent_ns)
        self._last_token = rec.last_token_ns if self._last_token is None else max(
            self._last_token, rec.last_token_ns)
        if itl is not None:
            s.itl.append(itl)
            s.p90_stale = True
            self._bin_itl.append(itl)
        self._bin_ttft.append(ttft)
        self._new_since_headline = True

    def server_sample(self, t_ns: int, values: dict[str, float] | None) -> None:
        """One scrape of the server's metrics (None: the scrape failed)."""
        self._roll(t_ns)
        if values is None:
            if self._server_ok is not False:
                self.event(t_ns, "server", "server metrics unavailable", "warn")
            self._server_ok = False
            self._server = (replace(self._server, ok=False, t_s=t_ns / 1e9)
                            if self._server else ServerGauges(t_ns / 1e9, False))
            return
        if self._server_ok is False:
            self.event(t_ns, "server", "server metrics back")
        self._server_ok = True
        prev = self._server_prev
        counters = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
        if prev is not None and any(values.get(c, 0.0) < prev.get(c, 0.0) for c in counters):
            self.event(t_ns, "server", "server restarted (its counters went back)", "warn")
            self._server_hist.clear()
        self._server_prev = values
        hits = values.get("vllm:prefix_cache_hits_total")
        queries = values.get("vllm:prefix_cache_queries_total")
        rate = None
        if hits is not None and queries is not None:
            self._server_hist.append((t_ns, hits, queries))
            _, h0, q0 = self._server_hist[0]
            if queries - q0 > 0:
                rate = (hits - h0) / (queries - q0)
        kv = values.get("vllm:kv_cache_usage_perc")
        if self._spec_first is None and all(n in values for n in SPEC_COUNTERS):
            self._spec_first = {n: values[n] for n in SPEC_COUNTERS}
        spec = None
        if self._spec_first is not None and all(n in values for n in SPEC_COUNTERS):
            spec = spec_acceptance({n: values[n] - self._spec_first[n] for n in SPEC_COUNTERS})
        self._server = ServerGauges(
            t_ns / 1e9, True, running=values.get("vllm:num_requests_running"),
            waiting=values.get("vllm:num_requests_waiting"), kv_usage=kv,
            prefix_hit_rate=rate,
            spec_acceptance=spec["acceptance_rate"] if spec else None,
            spec_mean_length=spec.get("mean_acceptance_length") if spec else None)

    @property
    def client(self) -> ClientHealth | None:
        """The client's latest self-diagnostics (None before the first)."""
        return self._client

    def client_sample(self, t_ns: int, figures: dict[str, Any], final: bool = False) -> None:
        """The client's self-diagnostics so far (``final``: summary.json's own figures).

        A verdict that changes is logged, with its reasons, in the event log.
        """
        self._roll(t_ns)
        was = self._client
        now = client_health(t_ns / 1e9, figures, final)
        if now.reasons and (was is None or not was.reasons):
            self.event(t_ns, "client", "client INVALID: " + "; ".join(now.reasons), "error")
        elif was is not None and was.reasons and not now.reasons:
            self.event(t_ns, "client", "client keeps up again (valid)")
        if was is None or was.reasons != now.reasons:
            self._new_since_headline = True  # the run's verdict follows the client's
        self._client = now

    def finish(self, t_ns: int, stop_reason: str | None = None) -> None:
        """The replay ended (nothing more will be sent or received)."""
        self._roll(t_ns)
        self._finished = True
        self._stop_reason = stop_reason
        self.event(t_ns, "end", f"replay ended: {stop_reason or 'finished'}")
        self._headline_at_ns = -(10**18)

    def stopping(self, t_ns: int, reason: str) -> None:
        self.event(t_ns, "stop", f"stopping: {reason} (requests in flight finish)", "warn")

    # -- time ----------------------------------------------------------------------

    def _roll(self, t_ns: int) -> None:
        """Close every bin that ended by ``t_ns``."""
        if t_ns > self._now_ns:
            self._now_ns = t_ns
        target = int(self._now_ns / 1e9 / BIN_S)
        if target <= self._bin:
            return
        # A long gap (a playback seek) closes at most a history's worth of bins.
        if target - self._bin > HISTORY_BINS:
            self._bin = target - HISTORY_BINS
        while self._bin < target:
            self._close_bin()
            self._bin += 1

    def _close_bin(self) -> None:
        self._recent.append((self._bin_itl, self._bin_ttft))
        self._bin_itl, self._bin_ttft = [], []
        itl = [x for b in self._recent for x in b[0]]
        ttft = [x for b in self._recent for x in b[1]]
        nan = math.nan
        if itl:
            p50, p90 = np.percentile(itl, [50, 90])
            self._series["interactivity_p50"].append(1 / p50 if p50 > 0 else nan)
            self._series["interactivity_p90"].append(1 / p90 if p90 > 0 else nan)
        else:
            self._series["interactivity_p50"].append(nan)
            self._series["interactivity_p90"].append(nan)
        self._series["ttft_p90"].append(float(np.percentile(ttft, 90)) if ttft else nan)
        self._series["in_flight"].append(float(self._in_flight))
        srv = self._server if self._server is not None and self._server.ok else None

        def val(x: float | None, scale: float = 1.0) -> float:
            return nan if x is None else x * scale

        self._series["queue"].append(val(srv.waiting) if srv else nan)
        self._series["kv_usage"].append(val(srv.kv_usage, 100.0) if srv else nan)
        self._series["prefix_hit"].append(val(srv.prefix_hit_rate, 100.0) if srv else nan)
        for s in self._lanes.values():
            now = STATE_CODES[s.state()]
            s.strip.append(max(s.bin_code, now))
            s.strip_cache = None
            s.bin_code = now
        self._strips = None

    # -- publishing ---------------------------------------------------------------------

    def _compute_headlines(self) -> None:
        itl, ttft, e2e = self._itl.view(), self._ttft.view(), self._e2e_tok.view()
        window = ((self._last_token - self._first_sent) / 1e9
                  if self._first_sent is not None and self._last_token is not None else 0.0)
        decode_s = self._decoding.total / 1e9
        rates = {
            "decode_throughput_tok_s": self._decode_tokens / decode_s if decode_s > 0 else None,
            "output_throughput_tok_s": self._osl_sum / window if window > 0 else None,
            "throughput_per_gpu_tok_s": ((self._isl_sum + self._osl_sum) / window
                                         / max(1, self.header.gpus) if window > 0 else None),
        }
        groups = {"user": self._lane_of.view().astype(np.int64),
                  "session": self._session_of.view().astype(np.int64)}
        quantiles = {name: _quantiles(x, groups) for name, x in
                     (("itl", itl), ("ttft", ttft), ("e2e", e2e))}
        heads = []
        for w in WEIGHTINGS:
            q_itl, q_ttft, q_e2e = (quantiles[k][w] for k in ("itl", "ttft", "e2e"))
            heads.append(Headline(
                w, p50_interactivity_tok_s=_inverse(q_itl(0.5)),
                p90_interactivity_tok_s=_inverse(q_itl(0.9)),
                e2e_norm_p90_interactivity_tok_s=_inverse(q_e2e(0.9)),
                ttft_p90_s=q_ttft(0.9), **rates))
        self._headlines = tuple(heads)
        exact = self._osl_exact / self._done if self._done else None
        # A saturated client makes the run invalid, as in summary.json (metrics.validity).
        client = {"saturation_reasons": list(self._client.reasons)} if self._client else {}
        verdict = validity({"requests_completed": self._done,
                            "requests_failed": self._failed, "osl_exact_fraction": exact,
                            "client": client})
        self._totals = Totals(
            requests_done=self._done, requests_failed=self._failed,
            warmup_done=self._warmup_done,
            errors_by_kind=tuple(sorted(self._errors.items())), osl_exact_fraction=exact,
            verdict=verdict["verdict"] if self._done + self._failed else "no data",
            reasons=tuple(verdict["reasons"]))

    def _lane_view(self, lane: int, s: _Lane) -> LaneView:
        if s.p90_stale:
            s.p90 = _inverse(float(np.percentile(s.itl, 90))) if s.itl else None
            s.p90_stale = False
        in_flight = s.counts[0][2] + s.counts[0][3] + s.counts[1][2] + s.counts[1][3]
        subagents = sum(s.counts[0])
        turn = min(s.start_turn + s.main_sent, s.turns) if s.session is not None else 0
        return LaneView(lane=lane, session=s.session, play=s.play, turn=turn, turns=s.turns,
                        state=s.state(), warmup=s.warmup_left > 0, in_flight=in_flight,
                        subagents=subagents, last_itl_s=s.last_itl_s,
                        p90_interactivity_tok_s=s.p90, requests=s.requests, errors=s.errors)

    def publish(self, now_ns: int) -> LiveSnapshot:
        """Build the snapshot for ``now_ns`` (ns since the start) and store it in ``latest``.

        Cheap by design: lanes that did not change reuse their previous (immutable)
        view, and the run-wide percentiles are recomputed at most once a second.
        """
        self._roll(now_ns)
        now_ns = self._now_ns
        if self._new_since_headline and (
                now_ns - self._headline_at_ns >= HEADLINE_EVERY_S * 1e9 or self._finished):
            self._compute_headlines()
            self._new_since_headline = False
            self._headline_at_ns = now_ns
        if self._dirty or self._views is None:
            for lane in self._dirty:
                s = self._lanes[lane]
                s.view = self._lane_view(lane, s)
            self._dirty.clear()
            self._views = tuple(self._lanes[lane].view for lane in self._order)  # type: ignore[misc]
        if self._strips is None or len(self._strips) != len(self._lanes):
            self._strips = tuple(self._lanes[lane].strip_bytes() for lane in self._order)
        strips = self._strips
        totals = replace(self._totals, in_flight=self._in_flight, users_active=self._active)
        t0 = (self._bin - len(self._series["in_flight"])) * BIN_S
        series = tuple(Series(k, label, unit, t0, BIN_S, tuple(self._series[k]))
                       for k, label, unit in SERIES)
        elapsed = now_ns / 1e9
        self._seq += 1
        snap = LiveSnapshot(
            seq=self._seq, header=self.header, elapsed_s=elapsed,
            remaining_s=None if self._finished else self._remaining(elapsed),
            finished=self._finished, stop_reason=self._stop_reason,
            headlines=self._headlines, totals=totals, series=series, lanes=self._views,
            strips=strips, events=tuple(self._events), server=self._server, note=self.note,
            client=self._client)
        self.latest = snap
        return snap

    def _remaining(self, elapsed: float) -> float | None:
        total = self.header.requests_total
        finished = self._done + self._failed
        eta = None
        if total and 0 < finished < total:
            eta = elapsed * (total - finished) / finished
        if self.header.duration_s is not None:
            left = max(0.0, self.header.duration_s - elapsed)
            eta = left if eta is None else min(eta, left)
        return eta


def _group_weights(groups: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Weights giving each group total weight 1 over its non-NaN ``values``."""
    valid = ~np.isnan(values)
    if not len(groups):
        return np.ones(0)
    counts = np.bincount(groups[valid], minlength=int(groups.max()) + 1).astype(np.float64)
    counts[counts == 0] = 1.0
    weights: np.ndarray = 1.0 / counts[groups]
    return weights


# --------------------------------------------------------------------------- in-process source


@dataclass
class BoardSource:
    """A :class:`SnapshotSource` over a board in this process (the engine's own)."""

    board: LiveBoard
    live: bool = True

    def snapshot(self) -> LiveSnapshot | None:
        return self.board.latest

    def request_stop(self) -> None:
        self.board.request_stop("stopped from the dashboard")

    def hold(self, paused: bool) -> None:
        pass


# --------------------------------------------------------------------------- playback


def header_from_run(meta: dict[str, Any], run_dir: Path | None = None,
                    mode: Literal["live", "playback"] = "playback") -> Header:
    """The header of a run from its ``run.json`` (or the journal's run line)."""
    target = meta.get("target") or {}
    options = meta.get("options") or {}
    trace = meta.get("trace") or {}
    users = int(options.get("users") or 1)
    total = int(trace.get("requests") or 0)
    if options.get("recycle"):
        total = int(options.get("max_requests") or 0)
    elif options.get("max_requests"):
        total = min(total, int(options["max_requests"]))
    return Header(label=str(target.get("label") or target.get("base_url") or "?"),
                  trace=str(trace.get("name") or trace.get("path") or "?"),
                  gpus=int(target.get("gpus") or 1), users=users, requests_total=total,
                  duration_s=options.get("duration_s"), mode=mode,
                  run_dir=None if run_dir is None else str(run_dir),
                  recycle=bool(options.get("recycle")))


_Item = tuple[int, int, str, Any]  # (t_ns, order, kind, payload)


def _item_key(item: _Item) -> tuple[int, int]:
    return item[0], item[1]
_RECORD_FIELDS = frozenset(RequestRecord.__dataclass_fields__)


class JournalPlayback:
    """Plays a run directory's journal through a :class:`LiveBoard` at ``speed`` x.

    Request lines carry every time the board needs (dependencies done, sent, first
    and last token, done), so lane states are rebuilt exactly; events and server
    samples come back at their own times. A journal that is still growing (a run in
    progress, or one that was killed) is read on as lines arrive, and the clock never
    runs past the last line while the run has not ended.
    """

    live = False

    def __init__(self, run_dir: Path, speed: float = 1.0, clock: Callable[[], float]
                 = time.monotonic, start_s: float = 0.0) -> None:
        run_dir = Path(run_dir)
        self.path = run_dir / JOURNAL_NAME
        if not self.path.is_file():
            from agentload.replay.errors import ReplayError

            raise ReplayError(f"{run_dir} holds no run journal ({JOURNAL_NAME})")
        if speed <= 0:
            from agentload.replay.errors import ReplayError

            raise ReplayError(f"--speed must be positive, got {speed:g}")
        self.run_dir = run_dir
        self.speed = speed
        self._clock = clock
        self._fh = open(self.path, "rb")  # noqa: SIM115 - read for the playback's lifetime
        self._partial = b""
        # Pending timeline items, sorted by time from ``_pos`` on; lines read later are
        # merged in with one sort (Timsort: near-linear on the mostly-sorted list).
        self._items: list[_Item] = []
        self._pos = 0
        self._new: list[_Item] = []
        self._order = 0
        self._plays: dict[tuple[int, int], int] = {}
        self._max_t = 0
        self._ended = False
        self._virtual_ns = start_s * 1e9
        self._wall = clock()
        self._paused = False
        run_json = run_dir / "run.json"
        meta: dict[str, Any] = {}
        if run_json.is_file():
            try:
                meta = orjson.loads(run_json.read_bytes())
            except orjson.JSONDecodeError:
                meta = {}
        self._meta = meta
        self._read()
        self.board = LiveBoard(header_from_run(self._meta, run_dir))

    def close(self) -> None:
        self._fh.close()

    def _push(self, t: int, kind: str, payload: Any) -> None:
        self._order += 1
        self._new.append((t, self._order, kind, payload))
        if t > self._max_t:
            self._max_t = t

    def _read(self) -> None:
        data = self._partial + self._fh.read()
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line.startswith((b'{"type":"chunks"', b'{"type":"gpu"')):
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            self._line(obj)
        if self._new:
            items = self._items[self._pos:] + self._new
            items.sort(key=_item_key)
            self._items, self._pos, self._new = items, 0, []

    def _pending(self) -> bool:
        return self._pos < len(self._items)

    def _line(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "run":
            if not self._meta:
                self._meta = obj
        elif kind == "request":
            rec = RequestRecord(**{k: v for k, v in obj.items() if k in _RECORD_FIELDS})
            start = self._plays.get((rec.lane, rec.play), rec.intended_ns)
            who = (rec.lane, rec.request_id, rec.agent_kind, rec.phase)
            if rec.ready_ns is not None:
                self._push(min(start, rec.ready_ns), "state", (*who, "waiting"))
                self._push(rec.ready_ns, "state", (*who, "pausing"))
            else:
                self._push(min(start, rec.sent_ns), "state", (*who, "pausing"))
            self._push(rec.sent_ns, "state", (*who, "prefilling"))
            if rec.first_token_ns is not None:
                self._push(rec.first_token_ns, "state", (*who, "decoding"))
            self._push(rec.done_ns, "done", rec)
        elif kind == "server_metrics":
            values = {k: v for k, v in obj.items() if k not in ("type", "t_ns")}
            self._push(int(obj["t_ns"]), "server", values)
        elif kind == "event":
            t = int(obj.get("t_ns", 0))
            ev = obj.get("kind")
            if ev == "play":
                self._plays[(obj["lane"], obj["play"])] = t
                self._push(t, "play", obj)
            elif ev in ("stop", "backoff"):
                self._push(t, ev, obj)
            elif ev == "replay_end":
                self._ended = True
                self._push(t, "end", obj)
            elif ev == "client":
                self._push(t, "client", obj)

    def _apply(self, kind: str, p: Any, t: int) -> None:
        b = self.board
        if kind == "state":
            lane, rid, agent, phase, state = p
            b.transition(t, lane, rid, agent, state, phase)
        elif kind == "done":
            b.transition(t, p.lane, p.request_id, p.agent_kind, "done", p.phase)
            b.finished(p)
        elif kind == "server":
            b.server_sample(t, p)
        elif kind == "play":
            b.begin_play(t, p["lane"], p["play"], str(p.get("session_id")),
                         int(p.get("start_turn") or 0), int(p.get("main_turns") or 0),
                         int(p.get("warmup_requests") or 0))
        elif kind == "stop":
            b.stopping(t, str(p.get("reason")))
        elif kind == "backoff":
            b.event(t, "backoff", f"lane {p.get('lane')} backs off {p.get('s')} s: "
                    f"{p.get('reason')}", "warn")
        elif kind == "client":
            b.client_sample(t, p, bool(p.get("final")))
        elif kind == "end":
            b.finish(t, p.get("stop_reason"))
            if b.client is None:
                self._client_from_summary(t)

    def _client_from_summary(self, t_ns: int) -> None:
        """A journal from before client lines: summary.json's figures, at the end."""
        path = self.run_dir / "summary.json"
        try:
            client = orjson.loads(path.read_bytes()).get("client")
        except (OSError, orjson.JSONDecodeError, AttributeError):
            return
        if isinstance(client, dict) and client:
            self.board.client_sample(t_ns, client, final=True)

    def advance(self, t_ns: float) -> None:
        """Apply everything that happened up to ``t_ns``."""
        self._read()
        limit = t_ns if self._ended else min(t_ns, self._max_t)
        items, pos, end = self._items, self._pos, len(self._items)
        while pos < end and items[pos][0] <= limit:
            t, _, kind, payload = items[pos]
            pos += 1
            self._apply(kind, payload, t)
        self._pos = pos
        if pos > 100_000 and pos * 2 > end:  # drop what was applied, now and then
            self._items, self._pos = items[pos:], 0
        self._virtual_ns = max(self._virtual_ns, limit)

    def clock_ns(self) -> float:
        now = self._clock()
        if not self._paused:
            self._virtual_ns += (now - self._wall) * 1e9 * self.speed
        self._wall = now
        return self._virtual_ns

    def snapshot(self) -> LiveSnapshot | None:
        t = self.clock_ns()
        self.advance(t)
        if self.board._finished and not self._pending():
            self.board.note = "end of the recorded run"
        elif not self._ended and not self._pending() and t >= self._max_t:
            self.board.note = "end of the journal so far (the run has not ended)"
        else:
            self.board.note = None
        return self.board.publish(int(self._virtual_ns))

    def request_stop(self) -> None:
        pass

    def hold(self, paused: bool) -> None:
        self.clock_ns()
        self._paused = paused

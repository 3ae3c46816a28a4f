"""The live board: fed by the engine (or a journal), it publishes immutable snapshots."""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from agentload.replay.journal import RequestRecord
from agentload.replay.live._snapshot import (
    _REQ_CODES,
    BIN_S,
    EVENTS_KEPT,
    HEADLINE_EVERY_S,
    HISTORY_BINS,
    SERIES,
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
    Totals,
    client_health,
)
from agentload.replay.results.metrics import validity
from agentload.replay.serve.prometheus import SPEC_COUNTERS, spec_acceptance

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
        self._osl_of = _Floats()
        self._session_ids: dict[str, int] = {}
        # Failed measured requests' (lane, session): a user or session with one misses
        # the SLO (replay/results/slo.py's rule).
        self._failed_groups: list[tuple[int, int]] = []
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
            self._failed_groups.append((rec.lane, self._session_id(rec)))
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
        self._session_of.append(self._session_id(rec))
        self._osl_of.append(osl)
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

    def _session_id(self, rec: RequestRecord) -> int:
        return self._session_ids.setdefault(f"{rec.lane}/{rec.play}/{rec.session_id}",
                                            len(self._session_ids))

    # -- publishing ---------------------------------------------------------------------

    def _slo_text(self, window_s: float) -> str | None:
        """``--slo`` attainment over the requests finished so far, by the summary's own
        rules (``slo.slo_summary``), so the dashboard and summary.json agree at the end."""
        if not self.header.slo:
            return None
        import polars as pl

        from agentload.replay.results.slo import slo_line, slo_summary

        failed = self._failed_groups
        # numpy columns, not lists: this runs once a second over every finished request.
        nf = len(failed)
        nan = np.full(nf, np.nan)
        osl = self._osl_of.view()
        frame = pl.DataFrame({
            "ok": np.concatenate([np.ones(self._done, dtype=bool), np.zeros(nf, dtype=bool)]),
            "osl": np.concatenate([osl.astype(np.int64), np.zeros(nf, dtype=np.int64)]),
            "ttft_s": np.concatenate([self._ttft.view(), nan]),
            "itl_s": np.concatenate([self._itl.view(), nan]),
            "e2el_s": np.concatenate([self._e2e_tok.view() * osl, nan]),
            "lane": np.concatenate([self._lane_of.view().astype(np.int64),
                                    np.array([g[0] for g in failed], dtype=np.int64)]),
            "session_id": np.concatenate([self._session_of.view().astype(np.int64),
                                          np.array([g[1] for g in failed], dtype=np.int64)]),
        }, nan_to_null=True).with_columns(play=pl.lit(0))
        return slo_line(slo_summary(frame, dict(self.header.slo), window_s or None))

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
            reasons=tuple(verdict["reasons"]), slo_text=self._slo_text(window))

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



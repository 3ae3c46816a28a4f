"""The replay engine: N user lanes play trace sessions against a target, closed loop.

Lane ``i`` of ``N`` plays sessions ``i, i+N, i+2N, ...`` one after another. Inside a
session every request waits for the requests it depends on, then for its pause (think
or tool time, times ``time_scale``), then streams; subagent chains therefore run beside
their parent inside the parent's lane, and in-flight requests may exceed N. Each
finished request is written to the journal at once. The engine keeps a few live
counters and hands out immutable ``ProgressSnapshot``s for progress lines and the
dashboard; nothing a viewer does runs on the request path.

Each request also records how many of its prompt tokens a perfect, infinite prefix
cache would hold when it is sent: the leading blocks that some request sent before it
(in this run, in actual send order) already carried. Summed over the run, that is the
theoretical prefix-cache hit rate the server's own counters are checked against.

Switches that reproduce AIPerf's traffic (``--aiperf-compatible``): ``idle_cap_s``
pulls pending sends forward only while nothing at all is in flight (``pacing.py``);
``cache_bust="after-shared-prefix"`` puts each play's marker block after the prompt's
leading blocks that other sessions share (the system/tool prefix) instead of at its
head, so that prefix stays cached across sessions; ``grace_s`` cuts what is still in
flight that long after ``--duration`` and journals it with phase ``cut``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import httpx
import numpy as np
import orjson

from agentload.replay.client.diagnostics import ClientDiagnostics
from agentload.replay.client.sse import StreamResult, stream_completion
from agentload.replay.engine.cache_model import PrefixCacheModel, server_block_keys
from agentload.replay.engine.pacing import IdleCap, Shift
from agentload.replay.engine.plan import (
    PRIME_SUFFIX,
    WARM_BARRIER,
    PlannedRequest,
    Play,
    aiperf_start_s,
    chat_segments,
    declared_prefix_blocks,
    main_turns,
    marker_block,
    marker_positions,
    plan_play,
    plan_play_at,
    shared_block_ids,
)
from agentload.replay.engine.prompts import DEFAULT_TOKEN_ID_RANGE, TextPrompts, TokenPrompts
from agentload.replay.journal import Journal, RequestRecord
from agentload.replay.live import Header, LiveBoard, client_figures
from agentload.replay.results.metrics import MAX_ERROR_RATE
from agentload.traces import Block, Request, Session, Trace
from agentload.traces.headers import SESSION_HEADER


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go. ``api_key`` is sent as a bearer token and never recorded."""

    base_url: str
    model: str
    gpus: int = 1
    device: str = "gpu"
    label: str = "target"
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE
    kv_block_size: int | None = None
    api_key: str | None = field(default=None, repr=False)

    def public(self) -> dict[str, Any]:
        """The target as it may appear in run metadata (no secrets)."""
        return {"base_url": self.base_url, "model": self.model, "gpus": self.gpus,
                "device": self.device, "label": self.label,
                "token_id_range": list(self.token_id_range),
                "kv_block_size": self.kv_block_size}


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How to replay; recorded whole in ``run.json``."""

    users: int = 4
    duration_s: float | None = None
    max_requests: int | None = None
    time_scale: float = 1.0
    cache_salt: int = 0
    request_timeout_s: float = 600.0
    stall_timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    max_connections: int | None = None
    output_mode: Literal["canned", "actual"] = "canned"
    open_loop: bool = False
    api: Literal["completions", "chat"] = "completions"
    words_per_token: float = 1.0
    # Each built-in chat word's token count on the target (exact chat prompt lengths).
    chat_word_tokens: tuple[int, ...] | None = None
    recycle: bool = False
    seed: int = 0
    start_range: tuple[float, float] = (0.25, 0.75)
    warmup_turns: int = 1
    salt_tokens: int = 16
    # "pinned": lane i plays sessions i, i + N, ...; "pool": every lane takes the next
    # session from one seeded shuffle of them all, whichever lane is free; "sequential":
    # the same, in trace order, wrapping (AIPerf's SequentialSampler for WEKA traces).
    session_order: Literal["pinned", "pool", "sequential"] = "pinned"
    # Where a lane's first recycled play starts: "turn" (a main turn drawn from
    # start_range, primed and warmed by warmup_turns) or "time" (AIPerf's: an instant
    # drawn as AIPerf draws it from start_range of the session's recorded span, every
    # agent live then primed with its last request before it; ``plan.plan_play_at``).
    start_at: Literal["turn", "time"] = "turn"
    preset: str | None = None  # the methodology that set these (``--preset``), if any
    # "stamped": agentload's transport with kernel receive stamps (http:// targets);
    # "aiohttp": httpx-aiohttp (also used for https:// targets).
    transport: Literal["stamped", "aiohttp"] = "stamped"
    # AIPerf's system idle cap (s): pending sends are pulled forward only while nothing is
    # in flight on any lane (``pacing.py``); None: no such cap.
    idle_cap_s: float | None = None
    # Where a play's cache-bust marker goes: "head" (recycled plays only, at the head of
    # every prompt) or "after-shared-prefix" (every play, after the leading blocks other
    # sessions share, as AIPerf puts its "[rid:...]" marker after the system/tool prefix).
    cache_bust: Literal["head", "after-shared-prefix"] = "head"
    # With duration_s: seconds requests in flight at the deadline may still take before
    # they are cut (journaled with phase "cut"); None: each may take request_timeout_s.
    grace_s: float | None = None
    # AIPerf's request shape: chat requests carry max_completion_tokens (not max_tokens).
    aiperf_compatible: bool = False

    def connection_limit(self) -> int:
        return self.max_connections or max(16, 4 * self.users)


@dataclass(frozen=True, slots=True)
class ProgressSnapshot:
    """The run at one instant, safe to hand to another thread."""

    elapsed_s: float
    requests_total: int
    requests_done: int
    requests_failed: int
    requests_skipped: int
    in_flight: int
    users_active: int
    users: int
    p90_interactivity_tok_s: float | None
    ttft_p90_s: float | None
    eta_s: float | None
    finished: bool
    invalid_reasons: tuple[str, ...] = ()
    """Why the run would be judged invalid if it ended now (empty while it is valid)."""


@dataclass(frozen=True, slots=True)
class EngineOutcome:
    sent: int
    completed: int
    failed: int
    skipped: int
    stop_reason: str
    duration_s: float
    cut: int = 0
    """Requests still in flight at ``--duration`` + ``--grace``, cut (none measured)."""
    cut_reason: str | None = None
    idle_cap_shifts: int = 0
    """Times the idle cap pulled the pending sends forward, and by how much in all."""
    idle_cap_shifted_s: float = 0.0


def unshardable(options: ReplayOptions) -> str | None:
    """Why ``options`` cannot be split over worker processes (None: they can).

    Each of these couples every lane to one shared state in one event loop: a session
    pool or sequence drawn from by whichever lane is free, AIPerf's system idle cap and
    warm-up barrier, and a request budget counted over all lanes.
    """
    if options.session_order != "pinned":
        return (f"--session-order {options.session_order} draws from one pool shared by "
                "every lane; with --workers use --session-order pinned")
    if options.idle_cap_s is not None:
        return "the idle cap (--aiperf-compatible) watches every lane at once; use --workers 1"
    if options.recycle and options.start_at == "time":
        return ("--start-at time waits for every lane's warm-up together; use --workers 1 "
                "or --start-at turn")
    if options.max_requests is not None:
        return "--max-requests counts over every lane; with --workers bound the run by --duration"
    return None


# How long after the system goes idle the idle cap is checked (``IdleCap.defer``).
SETTLE_S = 0.005

# The reason a cut request is journaled with (error_kind "grace").
CUT_KIND = "grace"


class Planner:
    """What each lane plays: its ``index``-th play of ``session``, with the marker and
    start turn the options give. Deterministic per (lane, index, session), so a worker
    process, or the driver recounting a ``--workers`` run, plans exactly what one
    process would."""

    def __init__(self, trace: Trace, options: ReplayOptions) -> None:
        self.options = options
        # Per session: where each request's marker goes (after the shared prefix).
        self._shared_ids = (shared_block_ids(trace) if options.cache_bust
                            == "after-shared-prefix" else frozenset[int]())
        self._marker_at: dict[str, dict[str, int]] = {}
        self._declared_prefix = declared_prefix_blocks(trace)

    def plan(self, lane: int, index: int, session: Session) -> Play:
        after_shared = self.options.cache_bust == "after-shared-prefix"
        marker = (marker_block(lane, index, self.options.salt_tokens)
                  if self.options.recycle or after_shared else None)
        marker_at = self.marker_positions(session) if after_shared else None
        if not self.options.recycle:
            return plan_play(session, lane, index, marker=marker, marker_at=marker_at)
        start = 0
        if index == 0 and self.options.start_at == "time":
            at_s = aiperf_start_s(self.options.seed, session, lane, self.options.start_range)
            if at_s is not None:
                return plan_play_at(session, lane, index, start_s=at_s, marker=marker,
                                    marker_at=marker_at, barrier=WARM_BARRIER)
        if index == 0:
            # Each lane draws from its own seeded stream, so a lane's plan does not depend
            # on which other lanes share its process (``replay --workers``).
            lo, hi = self.options.start_range
            rng = random.Random(f"start-{self.options.seed}-{lane}")
            start = int(rng.uniform(lo, hi) * main_turns(session))
        return plan_play(session, lane, index, start_turn=start,
                         warmup_turns=self.options.warmup_turns, marker=marker,
                         marker_at=marker_at)

    def marker_positions(self, session: Session) -> dict[str, int]:
        found = self._marker_at.get(session.id)
        if found is None:
            found = self._marker_at[session.id] = marker_positions(
                session, self._shared_ids, self._declared_prefix.get(session.id))
        return found


class ReplayEngine:
    """Plays ``trace`` against ``target`` with ``options.users`` lanes; ``await run()``."""

    def __init__(
        self,
        trace: Trace,
        target: Target,
        options: ReplayOptions,
        journal: Journal,
        client: httpx.AsyncClient,
        slo: Mapping[str, float] | None = None,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        """``slo``: the ``--slo`` bounds (s), which the dashboard's SLO line follows.

        ``shard`` (k, W): play only lanes ``i`` with ``i % W == k`` (``replay --workers``);
        the lanes, their plans and their request ids are those of a one-process run.
        """
        if options.users < 1:
            raise ValueError("users must be at least 1")
        index, count = shard
        if not 0 <= index < count:
            raise ValueError(f"shard {index} of {count} does not exist")
        if count > 1 and (problem := unshardable(options)) is not None:
            raise ValueError(problem)
        self.shard = shard
        self.trace = trace
        self.target = target
        self.options = options
        self.journal = journal
        self.client = client
        self.prompts = TokenPrompts(options.cache_salt, *target.token_id_range)
        self.texts = TextPrompts(options.cache_salt, options.words_per_token,
                                 options.chat_word_tokens)
        path = "/v1/chat/completions" if options.api == "chat" else "/v1/completions"
        self._url = target.base_url.rstrip("/") + path
        self._auth = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        # Theoretical hits are counted at the server's KV block size when it is known.
        self.cache_model = PrefixCacheModel(target.kv_block_size or trace.block_size)
        self._t0_ns = 0
        self._started = asyncio.Event()
        self._deadline_ns: int | None = None
        self._deadline: asyncio.TimerHandle | None = None
        # AIPerf's warm-up (``start_at="time"`` with recycling): resolved when every
        # priming request of the lanes' first plays is done; None otherwise.
        self._warm_done: asyncio.Future[int] | None = None
        self._warm_left = 0
        self._warm_primed = 0
        self._sent = self._completed = self._failed = self._skipped = 0
        self._warmup_sent = 0
        self._cut = 0
        self._refusals: dict[int, int] = {}
        self._in_flight = 0
        self._lanes_active = 0
        self._finished = False
        self._stop_reason: str | None = None
        # Set when nothing more may be sent (deadline, stop, max requests): sleeping lanes
        # wake at once instead of sleeping out a pause longer than the run.
        self._closed: asyncio.Event | None = None
        self._past_deadline = False
        self._client_reasons: tuple[str, ...] = ()
        self._itl_s: list[float] = []
        # The client's own health (stamp error, events per read, loop lag) for summary.json.
        self.diagnostics = ClientDiagnostics()
        self._ttft_s: list[float] = []
        self.pacer = IdleCap(options.idle_cap_s, self._idle_shift, self._after_follow_ups)
        self.planner = Planner(trace, options)
        # Per session, under --aiperf-compatible: each request's chat messages.
        self._sessions = {s.id: s for s in trace.sessions}
        self._segments: dict[str, Mapping[str, tuple[tuple[str, int], ...]]] = {}
        # With recycling the run is bounded by time or a request count, not by the trace.
        planned_total = ((options.max_requests or 0) if options.recycle
                         else self._shard_requests())
        self.total_requests = min(planned_total, options.max_requests or planned_total)
        # The dashboard's view of the run: fed below, published by run.py (never awaited).
        self.live = LiveBoard(Header(target.label, trace.name, target.gpus,
                                     len(trace.sessions) if options.open_loop else options.users,
                                     self.total_requests, options.duration_s,
                                     recycle=options.recycle,
                                     slo=tuple((slo or {}).items())))
        # The client's figures once a second (and summary.json's at the end): journaled,
        # so a playback shows them too, and on the dashboard.
        self.diagnostics.on_figures = self._client_figures

    async def wait_started(self) -> None:
        """Return once the run's clock has started (``now_ns`` counts from then)."""
        await self._started.wait()

    @property
    def requests_sent(self) -> int:
        """Measured requests sent so far."""
        return self._sent

    def now_ns(self) -> int:
        """Nanoseconds since the run started."""
        return time.perf_counter_ns() - self._t0_ns

    def _client_figures(self, figures: dict[str, Any], final: bool) -> None:
        t_ns = self.now_ns()
        compact = client_figures(figures)
        self._client_reasons = tuple(figures.get("saturation_reasons") or ())
        # A worker of a --workers run names itself: the dashboard shows the worst worker.
        worker = {"worker": self.shard[0]} if self.shard[1] > 1 else {}
        self.journal.write_event("client", t_ns, final=final, **worker, **compact)
        self.live.client_sample(t_ns, compact, final)

    def _after_follow_ups(self, check: Callable[[], None]) -> None:
        """Run ``check`` once what a finished request releases (its dependants, the lane's
        next play) has queued its send: a few loop turns, well inside ``SETTLE_S``."""
        asyncio.get_running_loop().call_later(SETTLE_S, check)

    def _idle_shift(self, shift: Shift) -> None:
        self.journal.write_event("idle_cap", self.now_ns(), idle_since_ns=shift.idle_since_ns,
                                 fire_ns=shift.fire_ns, shift_ns=shift.shift_ns,
                                 timers=shift.timers)

    def _shard_requests(self) -> int:
        """Requests of the sessions this shard's lanes play once each (no recycling)."""
        index, count = self.shard
        if count == 1:
            return self.trace.num_requests
        lanes = len(self.trace.sessions) if self.options.open_loop else self.options.users
        return sum(len(s.requests) for i, s in enumerate(self.trace.sessions)
                   if (i % lanes) % count == index)

    async def run(self, start_at_ns: int | None = None) -> EngineOutcome:
        """Play the run; ``start_at_ns`` (``perf_counter_ns``): start then, not now, so
        that every shard of a ``--workers`` run shares one time origin."""
        if start_at_ns is not None:
            await asyncio.sleep(max(0.0, (start_at_ns - time.perf_counter_ns()) / 1e9))
            while time.perf_counter_ns() < start_at_ns:
                await asyncio.sleep(0)
        self._t0_ns = start_at_ns if start_at_ns is not None else time.perf_counter_ns()
        self._started.set()
        self.pacer.start(0)
        self._closed = asyncio.Event()
        if self._stop_reason is not None:
            self._closed.set()
        if self.options.recycle and self.options.start_at == "time":
            self._warm_done = asyncio.get_running_loop().create_future()
        if self.options.duration_s is not None and self._warm_done is None:
            self._start_clock()
        # A worker's journal starts and ends a shard, never the run (the driver's does).
        worker = self.shard[1] > 1
        self.journal.write_event("worker_start" if worker else "replay_start", 0,
                                 users=self.options.users,
                                 recycle=self.options.recycle, shard=list(self.shard))
        sessions = list(self.trace.sessions)
        if self.options.open_loop:
            # Every session is its own user, started at its first request's arrival.
            lanes: list[Iterator[Session]] = [iter([s]) for s in sessions]
        elif self.options.session_order in ("pool", "sequential"):
            pool = (self._sequential(sessions) if self.options.session_order
                    == "sequential" else self._pool(sessions))
            lanes = [pool] * self.options.users  # one iterator: a free lane takes the next
        elif self.options.recycle:
            lanes = [self._recycled(i, sessions) for i in range(self.options.users)]
        else:
            lanes = [iter(sessions[i:: self.options.users]) for i in range(self.options.users)]
        firsts: list[Play | None] = [None] * len(lanes)  # open loop: a lane per session
        if self._warm_done is not None:
            # AIPerf's phases: every lane's first play is planned now, in lane order (its
            # sampler's draws); the warm-up (their priming requests) runs first, and the
            # measured requests and the --duration clock start once all of it is done.
            for i, lane_sessions in enumerate(lanes):
                session = next(lane_sessions, None)
                if session is not None:
                    firsts[i] = self._plan(i, 0, session)
            self._warm_left = sum(p.requests[k].prime for p in firsts if p is not None
                                  for k in range(len(p.requests)))
            if not self._warm_left:
                self._warmed()
        index, count = self.shard
        try:
            await asyncio.gather(*(self._lane(i, lane, firsts[i])
                                   for i, lane in enumerate(lanes) if i % count == index))
        finally:
            self._finished = True
            if self._deadline is not None:
                self._deadline.cancel()
        stop_reason = self._why_stopped()
        self.live.finish(self.now_ns(), stop_reason)
        cut_reason = None
        if self._cut:
            cut_reason = (f"in flight {self.options.grace_s:g} s after --duration "
                          f"{self.options.duration_s:g} s (--grace)")
        outcome = EngineOutcome(self._sent, self._completed, self._failed, self._skipped,
                                stop_reason, self.now_ns() / 1e9, self._cut, cut_reason,
                                self.pacer.shifts, self.pacer.shifted_ns / 1e9)
        self.journal.write_event("worker_end" if self.shard[1] > 1 else "replay_end",
                                 self.now_ns(), stop_reason=stop_reason)
        return outcome

    def _start_clock(self) -> None:
        """Start ``--duration`` now: nothing is sent once it has run out."""
        assert self._closed is not None and self.options.duration_s is not None
        self._deadline_ns = self.now_ns() + int(self.options.duration_s * 1e9)
        self._deadline = asyncio.get_running_loop().call_later(self.options.duration_s,
                                                               self._closed.set)

    def _warmed(self) -> None:
        """The warm-up of the first plays is done: measured requests may go (they wait on
        ``WARM_BARRIER``) and ``--duration`` starts counting (AIPerf's profiling phase)."""
        assert self._warm_done is not None
        now = self.now_ns()
        self.journal.write_event("warmup_done", now, primes=self._warm_primed)
        if self.options.duration_s is not None:
            self._start_clock()
        if not self._warm_done.done():
            self._warm_done.set_result(now)

    def _pool(self, sessions: list[Session]) -> Iterator[Session]:
        """One seeded shuffle of the sessions, drawn from by every lane: once each, or
        (with recycling) a fresh shuffle each time the pool runs dry."""
        rng = random.Random(f"pool-{self.options.seed}")
        while True:
            order = list(sessions)
            rng.shuffle(order)
            yield from order
            if not self.options.recycle:
                return

    def _sequential(self, sessions: list[Session]) -> Iterator[Session]:
        """The sessions in trace order, drawn from by every lane: once each, or (with
        recycling) round and round (AIPerf's SequentialSampler: the first N draws are
        lanes 0..N-1's first plays, then each finished lane takes the next)."""
        while True:
            yield from sessions
            if not self.options.recycle:
                return

    def _recycled(self, lane: int, sessions: list[Session]) -> Iterator[Session]:
        """Lane ``lane``'s sessions for ever: lane, lane + N, ... wrapping round the trace."""
        users = self.options.users
        for k in itertools.count():
            yield sessions[(lane + k * users) % len(sessions)]

    def _plan(self, lane: int, index: int, session: Session) -> Play:
        return self.planner.plan(lane, index, session)

    def _chat_segments(self, req: Request) -> tuple[tuple[str, int], ...] | None:
        """AIPerf's chat messages for ``req`` (``plan.chat_segments``), under
        ``--aiperf-compatible`` with canned outputs; None: one user message."""
        if not self.options.aiperf_compatible or self.options.output_mode != "canned":
            return None
        session = self._sessions.get(req.session_id)
        if session is None:
            return None
        found = self._segments.get(session.id)
        if found is None:
            found = self._segments[session.id] = chat_segments(
                session, self._marker_positions(session), self.trace.block_size)
        return found.get(req.id.removesuffix(PRIME_SUFFIX))

    def _marker_positions(self, session: Session) -> dict[str, int]:
        return self.planner.marker_positions(session)

    async def _lane(self, lane: int, sessions: Iterator[Session],
                    first: Play | None = None) -> None:
        plays: Iterator[Session | Play] = (itertools.chain([first], sessions)
                                           if first is not None else sessions)
        for index, next_play in enumerate(plays):
            session = next_play.session if isinstance(next_play, Play) else next_play
            if self._dispatch_closed(self.now_ns()):
                if not self.options.recycle:
                    self._skipped += len(session.requests)
                    continue
                return
            play = (next_play if isinstance(next_play, Play)
                    else self._plan(lane, index, session))
            if index:
                self.journal.write_event("recycle", self.now_ns(), lane=lane, play=index,
                                         session=session.id)
            self.journal.write_event(
                "play", self.now_ns(), lane=lane, play=index, session_id=session.id,
                start_turn=play.start_turn, main_turns=main_turns(session),
                requests=play.measured, warmup_requests=len(play.requests) - play.measured,
                marker_block=play.marker.id if play.marker else None)
            self.live.begin_play(self.now_ns(), lane, index, session.id, play.start_turn,
                                 main_turns(session), len(play.requests) - play.measured)
            self._lanes_active += 1
            try:
                await self._play(play)
            finally:
                self._lanes_active -= 1

    async def _play(self, play: Play) -> None:
        loop = asyncio.get_running_loop()
        done: dict[str, asyncio.Future[int]] = {p.request.id: loop.create_future()
                                                for p in play.requests}
        if self._warm_done is not None:
            done[WARM_BARRIER] = self._warm_done
        scale = self.options.time_scale
        threads = _Threads(play) if self.options.output_mode == "actual" else None
        # Arrivals are not-before times: from the run's start in open loop, from the
        # session's first arrival in closed loop (where the lane decides when it starts).
        arrivals = [p.request.arrival_s for p in play.requests
                    if p.request.arrival_s is not None]
        origin_ns = 0 if self.options.open_loop else self.now_ns()
        first_arrival = 0.0 if self.options.open_loop or not arrivals else min(arrivals)

        async def step(turn: int, planned: PlannedRequest) -> None:
            req = planned.request
            live = self.live
            try:
                ready_at: int | None = None
                if planned.depends_on:
                    live.transition(self.now_ns(), play.lane, req.id, req.agent_kind,
                                    "waiting", planned.phase)
                    ready_at = max([await done[d] for d in planned.depends_on])
                live.transition(self.now_ns(), play.lane, req.id, req.agent_kind, "pausing",
                                planned.phase)
                ready = self.now_ns() if ready_at is None else ready_at
                intended = ready + int(req.pause_s * scale * 1e9)
                if req.arrival_s is not None:
                    not_before = origin_ns + int((req.arrival_s - first_arrival) * scale * 1e9)
                    intended = max(intended, not_before)
                if threads is not None:
                    # The model's actual earlier outputs replace the trace's answer blocks.
                    planned = threads.apply(planned)
                    req = planned.request
                # Build the payload during the pause, so the send itself is on time.
                payload = self._payload(req)
                if self.pacer.cap_ns is not None and self._closed is not None:
                    # Every pending send is a timer the idle cap may pull forward, even
                    # one due past the deadline (it may come before it once pulled).
                    intended = await self.pacer.wait(intended, self.now_ns, self._closed)
                elif not self._dispatch_closed(intended):
                    await self._nap((intended - self.now_ns()) / 1e9)
                if self._dispatch_closed(intended):
                    if planned.phase == "measure":
                        self._skipped += 1
                    return
                await self._send(play, turn, planned, intended, ready_at, payload, threads)
            finally:
                live.transition(self.now_ns(), play.lane, req.id, req.agent_kind, "done",
                                planned.phase)
                if not done[req.id].done():
                    done[req.id].set_result(self.now_ns())
                if planned.prime and self._warm_left > 0:
                    self._warm_left -= 1
                    self._warm_primed += 1
                    if not self._warm_left:
                        self._warmed()

        await asyncio.gather(*(step(t, p) for t, p in enumerate(play.requests)))

    def _why_stopped(self) -> str:
        if self._stop_reason is not None:
            return self._stop_reason
        if self._deadline_ns is not None and (self._past_deadline
                                              or self.now_ns() >= self._deadline_ns):
            return "duration reached"
        if self.options.max_requests is not None and self._sent >= self.options.max_requests:
            return "max requests reached"
        return "trace finished"

    async def _nap(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if the run closes (nothing more will be sent) first."""
        if seconds <= 0 or self._closed is None or self._closed.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closed.wait(), timeout=seconds)

    def stop(self, reason: str) -> None:
        """Send nothing more (requests in flight still finish); ``reason`` is recorded."""
        if self._stop_reason is None:
            self._stop_reason = reason
            if self._closed is not None:
                self._closed.set()
            self.journal.write_event("stop", self.now_ns(), reason=reason)
            self.live.stopping(self.now_ns(), reason)

    def _dispatch_closed(self, intended_ns: int) -> bool:
        if self._stop_reason is not None:
            return True
        if self._deadline_ns is not None and intended_ns >= self._deadline_ns:
            self._past_deadline = True  # a request fell past the end: the duration cut it
            return True
        return self.options.max_requests is not None and self._sent >= self.options.max_requests

    def _payload(self, req: Request) -> bytes:
        extra: dict[str, Any] = {"return_token_ids": True} if (
            self.options.output_mode == "actual") else {}
        if self.options.api == "chat":
            # Chat endpoints take text only: deterministic words per block, one user turn.
            segments = self._chat_segments(req)
            prompt: dict[str, Any] = {"messages": (
                self.texts.messages(req.blocks) if segments is None
                else self.texts.messages_in(req.blocks, segments))}
        else:
            prompt = {"prompt": self.prompts.prompt(req.blocks)}
        # AIPerf's chat requests name the output bound max_completion_tokens and leave
        # the temperature to the server.
        aiperf = self.options.aiperf_compatible
        bound = "max_completion_tokens" if aiperf and self.options.api == "chat" else "max_tokens"
        if not aiperf:
            extra["temperature"] = 0.0
        return orjson.dumps({
            "model": self.target.model,
            **prompt,
            bound: req.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        })

    async def _send(self, play: Play, turn: int, planned: PlannedRequest, intended_ns: int,
                    ready_ns: int | None, payload: bytes,
                    threads: _Threads | None = None) -> None:
        req = planned.request
        # The prompt joins the model cache when its first token comes back (prefill done).
        theoretical, keys = self.cache_model.send(req.blocks, cache_now=False)
        if planned.phase == "measure":
            self._sent += 1
            if (self.options.max_requests is not None and self._closed is not None
                    and self._sent >= self.options.max_requests):
                self._closed.set()  # the last one: lanes waiting to send wake now
        else:
            self._warmup_sent += 1
        self._in_flight += 1
        self.pacer.sending()
        live = self.live
        # With --grace, what is still in flight at the deadline + grace is cut there.
        timeout_s = self.options.request_timeout_s
        may_cut = False
        if self._deadline_ns is not None and self.options.grace_s is not None:
            left_s = (self._deadline_ns - self.now_ns()) / 1e9 + self.options.grace_s
            if left_s < timeout_s:
                timeout_s, may_cut = max(left_s, 1e-3), True

        def first_token() -> None:
            self.cache_model.cache(keys)
            live.transition(self.now_ns(), play.lane, req.id, req.agent_kind, "decoding",
                            planned.phase)

        live.transition(self.now_ns(), play.lane, req.id, req.agent_kind, "prefilling",
                        planned.phase)
        try:
            # The session header lets a recording proxy or a router group a user's turns.
            headers = {**self._auth, SESSION_HEADER: req.session_id}
            res = await stream_completion(
                self.client, self._url, payload, headers=headers,
                total_timeout_s=timeout_s,
                on_first_token=first_token,
                collect_token_ids=threads is not None,
                collect_text=threads is not None and self.options.api == "chat")
        finally:
            self._in_flight -= 1
            self.pacer.finished(self.now_ns())
        self.diagnostics.observe(res)
        answer: Block | None = None
        if threads is not None and res.ok and self.options.api == "chat":
            # Chat prompts are text: the answer goes back as the assistant's own words.
            if res.output_text is not None:
                answer = self.texts.literal("".join(res.output_text),
                                            res.completion_tokens or req.output_tokens)
        elif threads is not None and res.ok and res.output_ids:
            answer = self.prompts.literal(res.output_ids)
        if threads is not None and answer is not None:
            threads.answered(req, answer)
            # The server keeps the KV of what it generated, so prompt + answer is cached.
            self.cache_model.cache(server_block_keys((*req.blocks, answer),
                                                     self.cache_model.block_size))
        if res.error_kind in ("refused", "connect_timeout"):
            # The server is not taking connections: this lane backs off (1, 2, 4 ... 8 s)
            # before its dependants go, instead of hammering a restarting server.
            backoff = min(8.0, 2.0 ** self._refusals.get(play.lane, 0))
            self._refusals[play.lane] = self._refusals.get(play.lane, 0) + 1
            self.journal.write_event("backoff", self.now_ns(), lane=play.lane, s=backoff,
                                     reason=res.error)
            live.event(self.now_ns(), "backoff", f"lane {play.lane} backs off {backoff:g} s: "
                       f"{res.error}", "warn")
            await self._nap(backoff)
        else:
            self._refusals.pop(play.lane, None)
        rec = self._record(play, turn, planned, intended_ns, ready_ns, res, theoretical)
        if may_cut and res.error_kind == "timeout":
            # Cut by the end of the run, not failed: journaled apart, never measured.
            rec = replace(rec, phase="cut", error_kind=CUT_KIND,
                          error=f"cut {self.options.grace_s:g} s after the --duration "
                                "deadline (--grace)")
            self._cut += 1
        elif planned.phase == "warmup":
            pass
        elif rec.ok:
            self._completed += 1
            self._observe(rec)
        else:
            self._failed += 1
        self.journal.write_request(rec, [t - self._t0_ns for t in res.chunk_ns],
                                   res.chunk_tokens)
        live.finished(rec)

    def _record(self, play: Play, turn: int, planned: PlannedRequest, intended_ns: int,
                ready_ns: int | None, res: StreamResult, theoretical: int) -> RequestRecord:
        req = planned.request
        t0 = self._t0_ns

        def rel(ns: int | None) -> int | None:
            return None if ns is None else ns - t0

        osl, source = res.completion_tokens, "server"
        if osl is None and res.ok:
            osl, source = res.client_tokens, "client"
        return RequestRecord(
            request_id=req.id, session_id=req.session_id, lane=play.lane,
            agent_kind=req.agent_kind, turn=turn, phase=planned.phase, intended_ns=intended_ns,
            sent_ns=res.sent_ns - t0,
            first_token_ns=rel(res.first_token_ns), last_token_ns=rel(res.last_token_ns),
            done_ns=(res.done_ns or res.sent_ns) - t0, isl_requested=req.input_tokens,
            osl_requested=req.output_tokens, isl=res.prompt_tokens, osl=osl, osl_source=source,
            cached_tokens=res.cached_tokens, theoretical_cached_tokens=theoretical,
            chunks=res.chunks, ok=res.ok, status=res.status, error=res.error,
            error_kind=res.error_kind,
            ready_ns=ready_ns, play=play.index,
        )

    def _observe(self, rec: RequestRecord) -> None:
        assert rec.first_token_ns is not None and rec.last_token_ns is not None
        self._ttft_s.append((rec.first_token_ns - rec.sent_ns) / 1e9)
        if rec.osl is not None and rec.osl >= 2:
            self._itl_s.append((rec.last_token_ns - rec.first_token_ns) / 1e9 / (rec.osl - 1))

    def snapshot(self) -> ProgressSnapshot:
        elapsed = self.now_ns() / 1e9 if self._t0_ns else 0.0
        finished = self._completed + self._failed + self._skipped
        eta = None
        if 0 < finished < self.total_requests:
            eta = elapsed * (self.total_requests - finished) / finished
        if self._deadline_ns is not None:
            remaining = max(0.0, self._deadline_ns / 1e9 - elapsed)
            eta = remaining if eta is None else min(eta, remaining)
        itl = np.percentile(self._itl_s, 90) if self._itl_s else None
        ttft = float(np.percentile(self._ttft_s, 90)) if self._ttft_s else None
        return ProgressSnapshot(
            elapsed_s=elapsed, requests_total=self.total_requests,
            requests_done=self._completed, requests_failed=self._failed,
            requests_skipped=self._skipped, in_flight=self._in_flight,
            users_active=self._lanes_active, users=self.options.users,
            p90_interactivity_tok_s=(1.0 / float(itl)) if itl else None,
            ttft_p90_s=ttft, eta_s=eta, finished=self._finished,
            invalid_reasons=self._invalid_now(),
        )

    def _invalid_now(self) -> tuple[str, ...]:
        """The verdict's reasons that can be judged mid-run: errors and the client's health."""
        reasons = list(self._client_reasons)
        ended = self._completed + self._failed
        if ended and self._failed / ended > MAX_ERROR_RATE:
            reasons.insert(0, f"error rate {self._failed / ended:.1%} > {MAX_ERROR_RATE:.0%}")
        return tuple(reasons)


def build_http_client(options: ReplayOptions, base_url: str | None = None) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` sized for ``options``.

    httpx's own connection pool degrades badly past a few hundred concurrent streams, so
    it is never used: for ``http://`` targets agentload's stamped transport (plain asyncio
    sockets, an O(1) pool, kernel receive stamps on every read; ``netstamp.py``), else
    (or with ``transport="aiohttp"``) the ``httpx-aiohttp`` transport.
    """
    from httpx_aiohttp import AiohttpTransport

    from agentload.replay.client.netstamp import StampedTransport

    # The read timeout bounds the gap between chunks (a stall); the engine bounds the total.
    timeout = httpx.Timeout(options.stall_timeout_s, connect=options.connect_timeout_s)
    if options.transport == "stamped" and not (base_url or "").startswith("https:"):
        return httpx.AsyncClient(transport=StampedTransport(options.connect_timeout_s),
                                 timeout=timeout, trust_env=False)
    limits = httpx.Limits(max_connections=options.connection_limit(),
                          max_keepalive_connections=options.connection_limit())
    return httpx.AsyncClient(transport=AiohttpTransport(limits=limits), limits=limits,
                             timeout=timeout, trust_env=False)


class _Threads:
    """Actual outputs of one play, threaded into the prompts that follow them.

    A trace carries each answer as the blocks that follow its request's prompt in the
    next turn (as many as cover its output length). When the model's own tokens come
    back, those blocks are replaced, in every later prompt of the play, by one literal
    block holding exactly the generated ids, so the server sees (and can reuse from its
    cache) the context a real agent would send.
    """

    def __init__(self, play: Play) -> None:
        self.dependants: dict[str, list[Request]] = {}
        for planned in play.requests:
            for dep in planned.depends_on:
                self.dependants.setdefault(dep, []).append(planned.request)
        self.subs: dict[int, tuple[tuple[int, ...], Block]] = {}

    def answered(self, req: Request, answer: Block) -> None:
        n = len(req.blocks)
        for child in self.dependants.get(req.id, ()):
            blocks = self._substituted(child.blocks)
            if blocks[:n] != req.blocks or len(blocks) <= n:
                continue
            run, covered = [], 0
            for block in blocks[n:]:
                if covered >= req.output_tokens:
                    break
                run.append(block.id)
                covered += block.tokens
            self.subs[run[0]] = (tuple(run), answer)
            return

    def apply(self, planned: PlannedRequest) -> PlannedRequest:
        blocks = self._substituted(planned.request.blocks)
        if blocks == planned.request.blocks:
            return planned
        return replace(planned, request=replace(planned.request, blocks=blocks))

    def _substituted(self, blocks: tuple[Block, ...]) -> tuple[Block, ...]:
        if not self.subs:
            return blocks
        out: list[Block] = []
        i = 0
        while i < len(blocks):
            sub = self.subs.get(blocks[i].id)
            if sub is not None and tuple(b.id for b in blocks[i:i + len(sub[0])]) == sub[0]:
                out.append(sub[1])
                i += len(sub[0])
            else:
                out.append(blocks[i])
                i += 1
        return tuple(out)

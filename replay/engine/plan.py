"""Plays: what one lane sends for one session, with its start point, warmup and salt.

A *play* is one pass of a lane through one session's DAG. In trace mode every session
is played once, from its first request. With recycling (``--recycle``, the steady
state AgentX measures), a lane plays sessions one after another for the whole run,
and its first play starts part-way in (a seeded point, 25-75 % of the main turns by
default) so that the run opens with contexts of every depth rather than with every
user at turn one. Such a play is preceded by a warmup: one ``max_tokens=1`` request
with the first warmup turn's prompt (so the server's prefix cache holds the context a
real agent would have built), then ``warmup_turns`` main turns played normally. Warmup
requests are journaled with phase ``warmup`` and left out of every metric.

Recycled plays of one session must not hit each other's cache, so each play puts its
own marker block at the head of every prompt: the same marker in warmup and
measurement, a fresh one on every recycle. Marker ids are negative, so they never
meet a trace's block ids.

With ``--cache-bust after-shared-prefix`` (AIPerf's placement) every play gets a
marker, and it goes after the *shared prefix* instead of at the head. Where the source
declares a system/tool prefix (WEKA's "tool_tokens" + "system_tokens", kept as whole
blocks in the trace's ``prefix_blocks`` meta) that prefix is it, as AIPerf renders
those blocks as the system message and marks the first user message: for the main
agent, and for any other agent whose first request starts with the same blocks. A
session without a declaration uses the leading blocks that also occur in another
session of the trace (a common system prompt and tool definitions; WEKA files with
``hash_id_scope: global`` share them). An agent's position is fixed by its first
request in the session, so every later prompt of the agent, which extends the first,
carries the marker at the same place and keeps the play's own context cacheable; with
no prefix the marker lands at the head. The marker is ``salt_tokens`` (16) tokens
long, counted in the request's requested ISL like any block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import orjson

from agentload.traces import Block, Request, Session, Trace
from agentload.traces.formats.weka import PREFIX_BLOCKS_META

Phase = Literal["warmup", "measure"]
# A priming request's id: its request's, with this after it.
PRIME_SUFFIX = "#prime"


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """A request as a play sends it; ``prime`` ones ask for one token only."""

    request: Request
    phase: Phase
    depends_on: tuple[str, ...]
    prime: bool = False


@dataclass(frozen=True, slots=True)
class Play:
    lane: int
    index: int
    session: Session
    start_turn: int
    marker: Block | None
    requests: tuple[PlannedRequest, ...]

    @property
    def measured(self) -> int:
        return sum(r.phase == "measure" for r in self.requests)


def marker_block(lane: int, index: int, tokens: int) -> Block:
    """The salt block of play ``index`` of ``lane``: unique, and never a trace block id."""
    return Block(id=-(1 + lane * 1_000_003 + index), tokens=tokens)


def shared_block_ids(trace: Trace) -> frozenset[int]:
    """The block ids that occur in more than one session of ``trace``."""
    seen: dict[int, str] = {}
    shared: set[int] = set()
    for session in trace.sessions:
        for req in session.requests:
            for block in req.blocks:
                first = seen.setdefault(block.id, session.id)
                if first != session.id:
                    shared.add(block.id)
    return frozenset(shared)


def marker_positions(session: Session, shared: frozenset[int],
                     declared: int | None = None) -> dict[str, int]:
    """Request id -> how many leading blocks come before the play's marker.

    With ``declared`` (the source's system/tool prefix in leading blocks of the
    session's first request), the first request's ``declared`` blocks are the prefix
    of every agent whose first request starts with them, and other agents have none.
    Otherwise an agent's prefix is the run of leading ``shared`` blocks of its first
    request. A later request of the agent that does not start with its agent's prefix
    takes the part it does start with.
    """
    prefix: dict[str, tuple[Block, ...]] = {}
    base = session.requests[0].blocks[:declared] if declared else ()
    out: dict[str, int] = {}
    for req in session.requests:
        mine = prefix.get(req.agent_id)
        if mine is None:
            if declared is not None:
                mine = base if req.blocks[:len(base)] == base else ()
            else:
                mine = req.blocks[:_leading_run(req.blocks, shared)]
            prefix[req.agent_id] = mine
        n = 0
        for have, want in zip(req.blocks, mine, strict=False):
            if have != want:
                break
            n += 1
        out[req.id] = n
    return out


def _leading_run(blocks: tuple[Block, ...], shared: frozenset[int]) -> int:
    n = 0
    for block in blocks:
        if block.id not in shared:
            break
        n += 1
    return n


def plan_play(session: Session, lane: int, index: int, *, start_turn: int = 0,
              warmup_turns: int = 1, marker: Block | None = None,
              marker_at: Mapping[str, int] | None = None) -> Play:
    """The requests of one play of ``session`` starting at main turn ``start_turn``.

    Requests listed before main turn ``start_turn`` are dropped (their dependants
    treat them as done when the play starts), except the ``warmup_turns`` main turns
    just before it, which are played as warmup after a one-token priming request. A
    mid-session start is primed even with no warmup turns. ``marker`` goes into every
    prompt after ``marker_at[request id]`` leading blocks (at the head without it).
    """
    at = marker_at or {}
    reqs = session.requests
    main_positions = [i for i, r in enumerate(reqs) if r.agent_kind == "main"]
    start_turn = max(0, min(start_turn, len(main_positions) - 1)) if main_positions else 0
    cut = main_positions[start_turn] if main_positions and start_turn else 0
    warm = main_positions[max(0, start_turn - warmup_turns):start_turn] if start_turn else []
    kept = set(warm) | set(range(cut, len(reqs)))
    kept_ids = {reqs[i].id for i in kept}
    planned: list[PlannedRequest] = []
    if start_turn:
        # Prime with the first warmup turn's prompt; with no warmup turns, with the turn
        # just before the start: the context the agent had built by then.
        first = _salted(reqs[warm[0] if warm else main_positions[start_turn - 1]], marker, at)
        planned.append(PlannedRequest(replace(first, id=first.id + PRIME_SUFFIX, output_tokens=1,
                                              depends_on=(), pause_s=0.0),
                                      "warmup", (), prime=True))
    previous_warm: str | None = planned[0].request.id if planned else None
    for i in sorted(kept):
        req = _salted(reqs[i], marker, at)
        deps = tuple(d for d in req.depends_on if d in kept_ids)
        if i in warm:
            # Warmup turns run back to back after the priming request.
            deps = (previous_warm,) if previous_warm else ()
            planned.append(PlannedRequest(replace(req, pause_s=0.0), "warmup", deps))
            previous_warm = req.id
            continue
        if i == cut and previous_warm is not None:
            deps = (*deps, previous_warm) if previous_warm not in deps else deps
        planned.append(PlannedRequest(req, "measure", deps))
    return Play(lane, index, session, start_turn, marker, tuple(planned))


def _salted(req: Request, marker: Block | None, at: Mapping[str, int]) -> Request:
    if marker is None:
        return req
    k = at.get(req.id, 0)
    return replace(req, blocks=(*req.blocks[:k], marker, *req.blocks[k:]))


def main_turns(session: Session) -> int:
    return sum(r.agent_kind == "main" for r in session.requests)


def declared_prefix_blocks(trace: Trace) -> dict[str, int]:
    """Session id -> its declared system/tool prefix in blocks (WEKA's, in the trace's
    ``prefix_blocks`` meta); empty when the source declared none."""
    raw = trace.meta.get(PREFIX_BLOCKS_META)
    if not raw:
        return {}
    try:
        found = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(found, dict):
        return {}
    return {str(k): int(v) for k, v in found.items() if isinstance(v, int) and v >= 0}


def aiperf_start_s(seed: int, session: Session, lane: int,
                   start_range: tuple[float, float] = (0.0, 1.0)) -> float | None:
    """AIPerf's sample instant t* (s of recorded time) for ``lane``'s first play of
    ``session``, or None when a request has no recorded ``t``.

    AIPerf 0.13.0 (``timing/trajectory_source.py``, ``_build_timestamped_trajectory``
    and ``_seed_for_trace_lane``): numpy's ``default_rng`` seeded with the first 8 bytes
    (big-endian) of sha256("{seed}:{trace id}:{lane}"), one ``uniform(lo, hi)`` over
    ``start_range`` of the span between the session's first and last recorded request
    (subagents included), in milliseconds. The same numpy call here gives the same
    float, so the same seed gives AIPerf's start points exactly.
    """
    import hashlib

    import numpy as np

    stamps = [r.recorded.t for r in session.requests
              if r.recorded is not None and r.recorded.t is not None]
    if not stamps or len(stamps) != len(session.requests):
        return None
    first, last = min(stamps) * 1e3, max(stamps) * 1e3
    span = last - first
    lo, hi = first + start_range[0] * span, first + start_range[1] * span
    hi = max(hi, lo)
    digest = hashlib.sha256(f"{seed}:{session.id}:{lane}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "big"))
    t_star_ms = float(lo if hi == lo else rng.uniform(lo, hi))
    return t_star_ms / 1e3


# The dependency a measured request of a time-cut play names to wait for the whole run's
# warm-up (every lane's priming requests), as AIPerf's profiling phase waits for its
# warm-up phase; the engine resolves it. Without a barrier the play's own primes are
# waited for.
WARM_BARRIER = "#warmup"


def plan_play_at(session: Session, lane: int, index: int, *, start_s: float,
                 marker: Block | None = None, marker_at: Mapping[str, int] | None = None,
                 barrier: str | None = None) -> Play:
    """The requests of one play of ``session`` cut at recorded instant ``start_s``:
    AIPerf's wall-clock snapshot (``TrajectorySource._snapshot_for``).

    Every request recorded at or after ``start_s`` is measured; earlier ones are
    dropped (their dependants treat them as done). Each agent (main chain or
    subagent) with a measured request and an earlier one is primed first with its
    last request before ``start_s``, for one output token (AIPerf's warm-up: turn
    ``next_turn_index - 1`` with its full prefix, ``max_tokens`` 1). A measured request
    none of whose dependencies is measured waits for ``barrier`` (else every priming
    request of the play) and then ``t - start_s`` (AIPerf's ``next_dispatch_offset_ms``,
    from the start of its profiling phase); the others wait for their dependencies and
    pause as usual.
    ``start_turn`` of the play is the main chain's first measured turn.
    """
    at = marker_at or {}
    reqs = session.requests

    def t_of(req: Request) -> float:
        return req.recorded.t if req.recorded is not None and req.recorded.t is not None \
            else 0.0

    kept = [i for i, r in enumerate(reqs) if t_of(r) >= start_s]
    kept_ids = {reqs[i].id for i in kept}
    streams = {reqs[i].agent_id for i in kept}
    primes: list[PlannedRequest] = []
    for agent in sorted(streams, key=lambda a: min(i for i in kept if reqs[i].agent_id == a)):
        before = [r for r in reqs if r.agent_id == agent and r.id not in kept_ids]
        if not before:
            continue
        first = _salted(before[-1], marker, at)
        primes.append(PlannedRequest(replace(first, id=first.id + PRIME_SUFFIX, output_tokens=1,
                                             depends_on=(), pause_s=0.0),
                                     "warmup", (), prime=True))
    prime_ids = (barrier,) if barrier else tuple(p.request.id for p in primes)
    planned: list[PlannedRequest] = list(primes)
    for i in kept:
        req = _salted(reqs[i], marker, at)
        deps = tuple(d for d in req.depends_on if d in kept_ids)
        if not deps:
            offset = max(0.0, t_of(reqs[i]) - start_s)
            req = replace(req, pause_s=offset)
            deps = prime_ids
        planned.append(PlannedRequest(req, "measure", deps))
    mains = [r for r in reqs if r.agent_kind == "main"]
    start_turn = next((n for n, r in enumerate(mains) if r.id in kept_ids), len(mains))
    return Play(lane, index, session, start_turn, marker, tuple(planned))


Role = Literal["system", "user", "assistant"]


def chat_segments(session: Session, prefix: Mapping[str, int], block_size: int
                  ) -> dict[str, tuple[tuple[Role, int], ...]]:
    """Request id -> its prompt as chat messages: (role, blocks) in order, AIPerf's way.

    AIPerf 0.13.0 rebuilds a WEKA conversation turn by turn
    (``dataset/loader/weka_synth_buf.py``, ``ConversationReconstructor``): an agent's
    first prompt is a system message (its tool/system prefix, here ``prefix[id]``
    leading blocks) and a user message; each later prompt keeps the earlier messages up
    to the blocks it shares with the agent's previous prompt, then adds an assistant
    message of ceil(previous output / block size) new blocks and a user message with the
    rest, ending on a user message. The server counts a template wrapper per message,
    so the message count moves the server-counted ISL; the blocks and their text are the
    same either way.
    """
    out: dict[str, tuple[tuple[Role, int], ...]] = {}
    last: dict[str, tuple[tuple[Block, ...], list[tuple[Role, int]], int]] = {}
    for req in session.requests:
        blocks = req.blocks
        prev = last.get(req.agent_id)
        segs: list[tuple[Role, int]]
        if prev is None:
            k = min(prefix.get(req.id, 0), len(blocks))
            segs = [("system", k)] if k else []
            if len(blocks) > k:
                segs.append(("user", len(blocks) - k))
        else:
            before, prev_segs, prev_out = prev
            lcp = 0
            for have, had in zip(blocks, before, strict=False):
                if have != had:
                    break
                lcp += 1
            segs = []
            left = lcp
            for role, n in prev_segs:
                if left <= 0:
                    break
                segs.append((role, min(n, left)))
                left -= n
            new = len(blocks) - lcp
            if new > 0:
                tail = blocks[-1].tokens < block_size
                hashed = new - tail
                asst = (min(-(-prev_out // block_size), hashed)
                        if any(r == "user" for r, _ in segs) else 0)
                if asst and asst == hashed and not tail:
                    asst -= 1  # a request ends on a user message
                if asst > 0:
                    segs.append(("assistant", asst))
                segs.append(("user", new - max(asst, 0)))
        out[req.id] = tuple(segs)
        last[req.agent_id] = (blocks, segs, req.output_tokens)
    return out

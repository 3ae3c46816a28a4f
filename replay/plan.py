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
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from agentload.traces import Block, Request, Session

Phase = Literal["warmup", "measure"]


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


def plan_play(session: Session, lane: int, index: int, *, start_turn: int = 0,
              warmup_turns: int = 1, marker: Block | None = None) -> Play:
    """The requests of one play of ``session`` starting at main turn ``start_turn``.

    Requests listed before main turn ``start_turn`` are dropped (their dependants
    treat them as done when the play starts), except the ``warmup_turns`` main turns
    just before it, which are played as warmup after a one-token priming request. A
    mid-session start is primed even with no warmup turns.
    """
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
        first = _salted(reqs[warm[0] if warm else main_positions[start_turn - 1]], marker)
        planned.append(PlannedRequest(replace(first, id=f"{first.id}#prime", output_tokens=1,
                                              depends_on=(), pause_s=0.0),
                                      "warmup", (), prime=True))
    previous_warm: str | None = planned[0].request.id if planned else None
    for i in sorted(kept):
        req = _salted(reqs[i], marker)
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


def _salted(req: Request, marker: Block | None) -> Request:
    return req if marker is None else replace(req, blocks=(marker, *req.blocks))


def main_turns(session: Session) -> int:
    return sum(r.agent_kind == "main" for r in session.requests)

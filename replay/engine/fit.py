"""Fit a trace to a target: scale token lengths, cap context, choose and cap pauses.

Real agent traces run to 100k+ token contexts and pauses of many minutes; the embedded
tiny model takes 16k tokens. ``fit_trace`` shrinks a trace without changing its
structure: every block keeps its id and is scaled by the same factor everywhere (so
equal ids still mean equal content and every reuse stays a reuse), output lengths
scale alike, and a prompt that still exceeds the context keeps its leading blocks (the
shared part) and loses its tail. What was changed is counted, so ``run.json`` can say.

Pauses follow one of two rules (``--pauses``). ``trace`` keeps each request's
``pause_s`` as its importer set it (WEKA: the recorded ``think_time`` where there is
one, else the recorded end-to-start gap), counted from the end of the request's last
dependency in the replay. ``end-to-start`` is AIPerf's: every pause is recomputed from
the recording as ``max(0, t_k - (t_d + api_time_d))``, ``d`` the dependency that ended
last in the recording (a missing ``api_time`` counts as 0), and a request with no
dependency goes as soon as its play starts. Requests without a recorded ``t`` keep
their pause and are counted. ``--pause-cap`` then caps whatever the rule gave.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

from agentload.replay.errors import ReplayError
from agentload.traces import Block, Request, Session, Trace


@dataclass(frozen=True, slots=True)
class FitOptions:
    """``scale_tokens`` multiplies every length; ``max_context`` bounds ISL + OSL."""

    scale_tokens: float = 1.0
    max_context: int | None = None
    pause_cap_s: float | None = None
    pause_rule: PauseRule = "trace"


PauseRule = Literal["trace", "end-to-start"]
PAUSE_RULES: tuple[PauseRule, ...] = ("trace", "end-to-start")


@dataclass(frozen=True, slots=True)
class FitReport:
    """What ``fit_trace`` changed; recorded in ``run.json``."""

    scale_tokens: float
    max_context: int | None
    pause_cap_s: float | None
    requests_truncated: int
    outputs_capped: int
    pauses_capped: int
    input_tokens_before: int
    input_tokens_after: int
    pause_rule: PauseRule = "trace"
    pauses_from_recording: int = 0
    """Pauses recomputed from recorded ``t`` / ``api_time`` (``end-to-start``)."""
    pauses_without_recording: int = 0
    """Requests ``end-to-start`` could not recompute (no recorded ``t``): pause kept."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def fit_trace(trace: Trace, options: FitOptions) -> tuple[Trace, FitReport]:
    """The trace scaled by ``scale_tokens``, then capped to ``max_context`` and pauses."""
    if not options.scale_tokens > 0:
        raise ReplayError(f"--scale-tokens must be positive, got {options.scale_tokens}")
    if options.max_context is not None and options.max_context < 2:
        raise ReplayError(f"--max-context must be at least 2 tokens, got {options.max_context}")
    if options.pause_cap_s is not None and options.pause_cap_s < 0:
        raise ReplayError(f"--pause-cap must be >= 0 s, got {options.pause_cap_s}")
    if options.pause_rule not in PAUSE_RULES:
        raise ReplayError(f"--pauses must be one of {', '.join(PAUSE_RULES)}, "
                          f"got {options.pause_rule!r}")
    before = sum(r.input_tokens for r in trace.requests())
    truncated = capped_out = capped_pause = recomputed = kept = 0
    # Truncated blocks are new content (a different length); give each (id, length) its
    # own id above every existing one, the same one wherever it recurs.
    next_id = max((b.id for r in trace.requests() for b in r.blocks), default=0) + 1
    cut_ids: dict[tuple[int, int], int] = {}
    sessions = []
    for session in trace.sessions:
        requests = []
        by_id = {r.id: r for r in session.requests}
        for req in session.requests:
            blocks = tuple(_scaled(b, options.scale_tokens) for b in req.blocks)
            out = max(1, round(req.output_tokens * options.scale_tokens))
            if options.max_context is not None:
                if out > options.max_context // 2:
                    out, capped_out = options.max_context // 2, capped_out + 1
                room = options.max_context - out
                if sum(b.tokens for b in blocks) > room:
                    blocks, next_id = _truncate(blocks, room, cut_ids, next_id)
                    truncated += 1
            pause = req.pause_s
            if options.pause_rule == "end-to-start":
                gap = end_to_start_pause(req, by_id)
                if gap is None:
                    kept += 1
                else:
                    pause, recomputed = gap, recomputed + 1
            if options.pause_cap_s is not None and pause > options.pause_cap_s:
                pause, capped_pause = options.pause_cap_s, capped_pause + 1
            requests.append(replace(req, blocks=blocks, output_tokens=out, pause_s=pause))
        sessions.append(Session(id=session.id, requests=tuple(requests)))
    fitted = replace(trace, sessions=tuple(sessions))
    after = sum(r.input_tokens for r in fitted.requests())
    return fitted, FitReport(options.scale_tokens, options.max_context, options.pause_cap_s,
                             truncated, capped_out, capped_pause, before, after,
                             options.pause_rule, recomputed, kept)


def end_to_start_pause(req: Request, session: dict[str, Request]) -> float | None:
    """AIPerf's pause before ``req``, in seconds, or None without a recorded ``t``.

    ``max(0, t_k - (t_d + api_time_d))`` for the dependency ``d`` that ended last in the
    recording (``api_time`` missing counts as 0; a dependency without a recorded ``t``
    makes the pause unknown); 0 for a request with no dependency, and 0 for a request
    that depends on another agent's: a subagent's first request goes at its spawn and a
    join turn when its last subagent returns (AIPerf's ``timing/branch_orchestrator.py``
    dispatches FORK children at once and "agentx fires such joins immediately").
    """
    mine = req.recorded
    if mine is None or mine.t is None:
        return None
    if not req.depends_on:
        return 0.0
    if any((dep := session.get(d)) is not None and dep.agent_id != req.agent_id
           for d in req.depends_on):
        return 0.0
    ends = []
    for dep_id in req.depends_on:
        dep = session.get(dep_id)
        timing = dep.recorded if dep is not None else None
        if timing is None or timing.t is None:
            return None
        ends.append(timing.t + (timing.api_time or 0.0))
    return max(0.0, mine.t - max(ends))


def _scaled(block: Block, factor: float) -> Block:
    return block if factor == 1.0 else Block(block.id, max(1, round(block.tokens * factor)))


def _truncate(blocks: tuple[Block, ...], room: int, cut_ids: dict[tuple[int, int], int],
              next_id: int) -> tuple[tuple[Block, ...], int]:
    kept: list[Block] = []
    used = 0
    for block in blocks:
        if used + block.tokens <= room:
            kept.append(block)
            used += block.tokens
            continue
        left = room - used
        if left > 0:
            key = (block.id, left)
            if key not in cut_ids:
                cut_ids[key], next_id = next_id, next_id + 1
            kept.append(Block(cut_ids[key], left))
        break
    return tuple(kept), next_id


def check_fits(trace: Trace, max_model_len: int | None) -> None:
    """Refuse, before anything is sent, a trace whose requests the server cannot take."""
    if max_model_len is None:
        return
    too_long = [r for r in trace.requests() if _length(r) > max_model_len]
    if too_long:
        worst = max(too_long, key=_length)
        suggestion = max_model_len / _length(worst)
        raise ReplayError(
            f"{len(too_long)} of {trace.num_requests} requests need more than the server's "
            f"max_model_len {max_model_len} (the longest, {worst.id!r}, needs "
            f"{_length(worst):,} tokens); shrink the trace with --scale-tokens "
            f"{suggestion:.2g} or cap it with --max-context {max_model_len}")


def _length(req: Request) -> int:
    return req.input_tokens + req.output_tokens

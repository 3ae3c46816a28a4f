"""Fit a trace to a target: scale token lengths, cap context, cap pauses.

Real agent traces run to 100k+ token contexts and pauses of many minutes; the embedded
tiny model takes 16k tokens. ``fit_trace`` shrinks a trace without changing its
structure: every block keeps its id and is scaled by the same factor everywhere (so
equal ids still mean equal content and every reuse stays a reuse), output lengths
scale alike, and a prompt that still exceeds the context keeps its leading blocks (the
shared part) and loses its tail. What was changed is counted, so ``run.json`` can say.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from agentload.replay.errors import ReplayError
from agentload.traces import Block, Request, Session, Trace


@dataclass(frozen=True, slots=True)
class FitOptions:
    """``scale_tokens`` multiplies every length; ``max_context`` bounds ISL + OSL."""

    scale_tokens: float = 1.0
    max_context: int | None = None
    pause_cap_s: float | None = None


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
    before = sum(r.input_tokens for r in trace.requests())
    truncated = capped_out = capped_pause = 0
    # Truncated blocks are new content (a different length); give each (id, length) its
    # own id above every existing one, the same one wherever it recurs.
    next_id = max((b.id for r in trace.requests() for b in r.blocks), default=0) + 1
    cut_ids: dict[tuple[int, int], int] = {}
    sessions = []
    for session in trace.sessions:
        requests = []
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
            if options.pause_cap_s is not None and pause > options.pause_cap_s:
                pause, capped_pause = options.pause_cap_s, capped_pause + 1
            requests.append(replace(req, blocks=blocks, output_tokens=out, pause_s=pause))
        sessions.append(Session(id=session.id, requests=tuple(requests)))
    fitted = replace(trace, sessions=tuple(sessions))
    after = sum(r.input_tokens for r in fitted.requests())
    return fitted, FitReport(options.scale_tokens, options.max_context, options.pause_cap_s,
                             truncated, capped_out, capped_pause, before, after)


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

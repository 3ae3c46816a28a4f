"""What the export writers share: the format record, re-blocking, timings, milliseconds.

A foreign format describes prompts as fixed-size hash blocks, while agentload's blocks
have any length (a scaled trace's are a few tokens each). ``PrefixBlocks`` cuts each
prompt into the format's blocks and names each by the prefix it ends, so two prompts
get the same id for a block exactly when they agree on every token up to its end: the
prefix sharing a prefix cache sees survives the change of block size.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentload.traces.formats._common import Notes
from agentload.traces.model import Block, Session, Trace


@dataclass(frozen=True, slots=True)
class ExportFormat:
    """A format agentload writes: its name, what it keeps and drops, and its writer.

    ``write(trace, path, notes)`` writes a file (or, with ``directory``, fills the
    empty directory ``path``) and counts what it had to approximate in ``notes``.
    """

    name: str
    summary: str
    mapping: str
    directory: bool
    write: Callable[[Trace, Path, Notes], None]


class PrefixBlocks:
    """Cuts prompts into ``size``-token blocks whose ids name the prefix they end.

    A block's id is fixed by the id of the block before it and by which tokens of
    which agentload blocks it holds, so equal ids mean equal prompts up to that block's
    end. Ids count up from 1 in first-seen order; one instance is one id namespace.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._ids: dict[Hashable, int] = {}

    def ids(self, blocks: Sequence[Block], *, partial: bool) -> list[int]:
        """Ids of the prompt's full blocks, and of its partial last one with ``partial``."""
        out: list[int] = []
        prev = 0
        pieces: list[tuple[int, int, int]] = []  # (agentload block id, from, tokens)
        filled = 0
        for block in blocks:
            start = 0
            while start < block.tokens:
                take = min(block.tokens - start, self.size - filled)
                pieces.append((block.id, start, take))
                start += take
                filled += take
                if filled == self.size:
                    prev = self._id((prev, tuple(pieces)))
                    out.append(prev)
                    pieces, filled = [], 0
        if partial and pieces:
            out.append(self._id((prev, tuple(pieces))))
        return out

    def _id(self, key: Hashable) -> int:
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids) + 1
        return found


def ms(seconds: float) -> int | float:
    """Seconds as milliseconds, to the microsecond; whole numbers as ints."""
    value = round(seconds * 1000.0, 3)
    return int(value) if value.is_integer() else value




@dataclass(frozen=True, slots=True)
class Span:
    """When a request starts and ends on a session's timeline, in seconds from its start."""

    start: float
    end: float


def timeline(session: Session) -> dict[str, Span]:
    """Each request's span when the session plays as replay plays it, in seconds.

    A request starts ``pause_s`` after the last of its dependencies ends, and no earlier
    than its arrival (counted from the session's first arrival, as a closed-loop replay
    counts it). It lasts its recorded ``api_time``; without one it lasts 0 s, so the gap
    to the next request is exactly that request's pause.
    """
    arrivals = [r.arrival_s for r in session.requests if r.arrival_s is not None]
    first_arrival = min(arrivals, default=0.0)
    spans: dict[str, Span] = {}
    for req in session.requests:
        ready = max((spans[d].end for d in req.depends_on), default=0.0)
        start = ready + req.pause_s
        if req.arrival_s is not None:
            start = max(start, req.arrival_s - first_arrival)
        api = req.recorded.api_time if req.recorded is not None else None
        spans[req.id] = Span(start, start + (api or 0.0))
    return spans

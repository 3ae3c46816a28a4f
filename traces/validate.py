"""``agentload traces validate``: every problem in a trace, not just the first.

Per session (the checks reading uses, so a clean report means the file loads): bad
fields, duplicate request ids, dangling dependencies, cycles, dependencies listed late,
negative pauses, zero outputs. Across the trace: duplicate session ids, a block id used
with different token counts (equal ids must mean equal content), blocks longer than
the trace's block size, and (a warning) partial blocks in the middle of a prompt, past
which no prefix cache can match. Foreign formats are imported first; an importer stops
at its first error, which is then the one problem reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentload.traces.checks import Problem
from agentload.traces.errors import TraceError
from agentload.traces.files import is_parquet
from agentload.traces.formats import AUTO, NATIVE, ImportOptions, detect_format, import_trace
from agentload.traces.model import Session
from agentload.traces.native import session_problems_by_line
from agentload.traces.parquet import parquet_session_problems

MAX_LISTED_PER_CHECK = 20  # beyond this many of one kind, say how many more


@dataclass(frozen=True, slots=True)
class Validation:
    """The outcome: what was read and everything wrong with it."""

    path: str
    format: str
    sessions: int
    requests: int
    problems: tuple[Problem, ...]
    notes: tuple[str, ...] = ()

    @property
    def errors(self) -> int:
        return sum(p.severity == "error" for p in self.problems)

    @property
    def warnings(self) -> int:
        return sum(p.severity == "warning" for p in self.problems)


def validate_path(src: str | Path, fmt: str = AUTO,
                  options: ImportOptions | None = None) -> Validation:
    """Check a native trace file, or import a foreign one and check the result."""
    path = Path(src)
    if fmt == AUTO:
        fmt = detect_format(path)
    if fmt != NATIVE:
        try:
            result = import_trace(fmt, path, options)
        except TraceError as exc:
            return Validation(str(path), fmt, 0, 0, (Problem(str(exc)),))
        imported: list[tuple[int | None, Session]] = [(None, s) for s in result.trace.sessions]
        return Validation(str(path), fmt, len(imported), result.trace.num_requests,
                          tuple(trace_problems(imported, result.trace.block_size)),
                          result.notes)
    try:
        if is_parquet(path):
            header, rows = parquet_session_problems(path)
            lined: Iterable[tuple[int | None, Session | None, list[Problem]]] = (
                (None, s, p) for s, p in rows)
        else:
            header_any, lines = session_problems_by_line(path)
            header = {k: str(v) for k, v in header_any.items()}
            lined = lines
    except TraceError as exc:
        return Validation(str(path), NATIVE, 0, 0, (Problem(str(exc)),))
    problems: list[Problem] = []
    located: list[tuple[int | None, Session]] = []
    for line, session, found in lined:
        problems.extend(p.at_line(line) for p in found)
        if session is not None:
            located.append((line, session))
    block_size = int(header.get("block_size", 64))
    problems.extend(trace_problems(located, block_size))
    return Validation(str(path), NATIVE, len(located),
                      sum(len(s.requests) for _, s in located), tuple(problems))


def trace_problems(sessions: Sequence[tuple[int | None, Session]],
                   block_size: int) -> Iterator[Problem]:
    """Problems that only show across sessions: ids, block lengths, partial blocks."""
    first_line: dict[str, int | None] = {}
    block_len: dict[int, tuple[int, str, str]] = {}
    counts = {"conflict": 0, "long": 0, "partial": 0}
    for line, session in sessions:
        if session.id in first_line:
            where = first_line[session.id]
            yield Problem(f"session id appears twice (also at line {where})"
                          if where else "session id appears twice", session.id, line=line,
                          field="session")
        first_line.setdefault(session.id, line)
        for req in session.requests:
            last = len(req.blocks) - 1
            for j, block in enumerate(req.blocks):
                seen = block_len.setdefault(block.id, (block.tokens, session.id, req.id))
                if seen[0] != block.tokens and _under_limit(counts, "conflict"):
                    yield Problem(f"block id {block.id} has {block.tokens} tokens here but "
                                  f"{seen[0]} in session {seen[1]!r} request {seen[2]!r} "
                                  "(equal ids must mean equal content)",
                                  session.id, req.id, f"blocks[{j}]", line)
                if block.tokens > block_size and _under_limit(counts, "long"):
                    yield Problem(f"block {block.id} holds {block.tokens} tokens, more than "
                                  f"the trace's block_size {block_size}",
                                  session.id, req.id, f"blocks[{j}]", line)
                elif (j < last and block.tokens < block_size
                      and _under_limit(counts, "partial")):
                    yield Problem(f"block {block.id} is partial ({block.tokens} of "
                                  f"{block_size} tokens) but not last; a prefix cache cannot "
                                  "match past it", session.id, req.id, f"blocks[{j}]", line,
                                  "warning")
    for kind, n in counts.items():
        if n > MAX_LISTED_PER_CHECK:
            label = {"conflict": "block id conflicts", "long": "over-long blocks",
                     "partial": "mid-prompt partial blocks"}[kind]
            yield Problem(f"... and {n - MAX_LISTED_PER_CHECK} more {label}",
                          severity="warning" if kind == "partial" else "error")


def _under_limit(counts: dict[str, int], kind: str) -> bool:
    counts[kind] += 1
    return counts[kind] <= MAX_LISTED_PER_CHECK

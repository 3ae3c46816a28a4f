"""Dynamo "agentic Mooncake" rows: requests with explicit dependencies and tool waits.

v1 rows carry ``request_id``, ``session_id``, ``wait_for``, ``delay``, ``tool_wait_ms``;
typed v2 files start with a header (``schema``, ``version``, ``block_size``) and give
``dependencies`` with a trigger and relation. ``MAPPING`` is what ``--help`` shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentload.traces.checks import structure_problems
from agentload.traces.errors import TraceError
from agentload.traces.formats._common import (
    BlockIds,
    FieldReader,
    ImportOptions,
    ImportResult,
    Notes,
    TraceFormat,
    json_lines,
    length_row_blocks,
)
from agentload.traces.model import AgentKind, RecordedTiming, Request, Session, Trace

DEFAULT_BLOCK_SIZE = 512

MAPPING = """\
Rows are grouped into sessions by "session_id" (a row without one is its own session)
and keep their "request_id". A row waits for every request in "wait_for" (v1) or in
its completion-triggered "dependencies" (v2), then pauses "delay" + "tool_wait_ms"
(ms; v2: the dependency's "delay_ms"). A dispatch-triggered v2 dependency (start
"delay_ms" after the other request was sent) is rewritten exactly as that request's
own dependencies and pause plus the delay. Rows with no dependencies arrive open loop
at "timestamp" or "not_before_ms" (ms, offset so the earliest is 0). A "spawn"
relation marks the child chain as subagent requests. Dependencies must stay inside
the session. "hash_ids" are 512-token blocks unless the v2 header or --block-size
says otherwise; the last may be partial. Kept: lengths, "model", timestamps. Dropped:
"branches", "prefix_reset", "tool_events" (their span is already "tool_wait_ms"),
"output_token_ids", "priority", "strict_priority", "policy_class", "play_id"."""


@dataclass(slots=True)
class _Row:
    lineno: int
    reader: FieldReader
    rid: str
    sid: str
    waits: list[str]
    pause_s: float
    dispatch: list[tuple[str, float]]
    spawned: bool


def load_dynamo(paths: list[Path], options: ImportOptions) -> ImportResult:
    """Import Dynamo agentic trace rows (one file or a directory) as one trace."""
    ids = BlockIds()
    notes = Notes()
    sessions: list[Session] = []
    block_size = options.block_size
    seen_ids: dict[str, str] = {}
    for path in paths:
        lines = list(json_lines(path))
        if lines and isinstance(lines[0][1], dict) and "schema" in lines[0][1]:
            header = FieldReader(f"{path}:{lines[0][0]}", lines[0][1])
            if block_size is None and header.has("block_size"):
                block_size = header.count("block_size")
            lines = lines[1:]
        size = block_size or DEFAULT_BLOCK_SIZE
        rows = [_parse_row(path, lineno, obj) for lineno, obj in lines]
        for row in rows:
            where = f"{path}:{row.lineno}"
            if row.rid in seen_ids:
                raise TraceError(f"{where} field request_id: {row.rid!r} is also at "
                                 f"{seen_ids[row.rid]}")
            seen_ids[row.rid] = where
        stamps = [r.reader.seconds("timestamp", 1e-3) for r in rows]
        nb = [r.reader.seconds("not_before_ms", 1e-3) for r in rows]
        origin = min((s for s in [*stamps, *nb] if s is not None), default=0.0)
        by_session: dict[str, list[_Row]] = {}
        for row in rows:
            by_session.setdefault(row.sid, []).append(row)
        for sid, members in by_session.items():
            sessions.append(_session(path, sid, members, dict(zip(
                (r.rid for r in rows), zip(stamps, nb, strict=True), strict=True)),
                origin, ids, size, notes))
        block_size = size
    if not sessions:
        raise TraceError(f"{paths[0]}: no rows")
    name = options.name or (paths[0].parent.name if len(paths) > 1 else paths[0].stem)
    return ImportResult(Trace(name=name, sessions=tuple(sessions),
                              block_size=block_size or DEFAULT_BLOCK_SIZE, source="dynamo"),
                        notes.lines())


def _parse_row(path: Path, lineno: int, obj: Any) -> _Row:
    reader = FieldReader(f"{path}:{lineno}", obj)
    rid = reader.text("request_id")
    if rid is None:
        raise reader.fail("request_id", "is missing")
    sid = reader.text("session_id") or rid
    waits = reader.strings("wait_for")
    pause = (reader.seconds("delay", 1e-3) or 0.0) + (reader.seconds("tool_wait_ms", 1e-3)
                                                     or 0.0)
    dispatch: list[tuple[str, float]] = []
    spawned = False
    deps = reader.row.get("dependencies")
    if deps is not None:
        if not isinstance(deps, list):
            raise reader.fail("dependencies", "must be a list of {request_id, trigger, ...}")
        for k, dep in enumerate(deps):
            d = FieldReader(f"{path}:{lineno} dependencies[{k}]", dep)
            other = d.text("request_id")
            if other is None:
                raise d.fail("request_id", "is missing")
            trigger = d.text("trigger") or "completion"
            delay = d.seconds("delay_ms", 1e-3) or 0.0
            if trigger == "completion":
                waits.append(other)
                pause = max(pause, delay)
            elif trigger == "dispatch":
                dispatch.append((other, delay))
            else:
                raise d.fail("trigger", f"must be completion or dispatch, got {trigger!r}")
            spawned = spawned or d.text("relation") == "spawn"
    return _Row(lineno, reader, rid, sid, waits, pause, dispatch, spawned)


def _session(path: Path, sid: str, rows: list[_Row],
             stamps: dict[str, tuple[float | None, float | None]], origin: float,
             ids: BlockIds, block_size: int, notes: Notes) -> Session:
    by_id = {r.rid: r for r in rows}
    for row in rows:
        for other in [*row.waits, *(o for o, _ in row.dispatch)]:
            if other not in by_id:
                raise row.reader.fail("wait_for", f"request {other!r} is not in session "
                                                  f"{sid!r} (dependencies must stay inside "
                                                  "a session)")
    _rewrite_dispatch(rows, by_id)
    ordered = _dependency_order(path, sid, rows)
    subagent: set[str] = set()
    requests = []
    for row in ordered:
        kind: AgentKind = "main"
        # A spawned chain stays subagent until a request also waits on the main chain.
        if row.spawned or (row.waits and all(w in subagent for w in row.waits)):
            kind = "subagent"
        if kind == "subagent":
            subagent.add(row.rid)
        stamp, not_before = stamps[row.rid]
        arrival = None
        if not row.waits:
            start = not_before if not_before is not None else stamp
            if start is None:
                raise row.reader.fail("timestamp", "is missing on a request without "
                                                   "dependencies (ms since the trace began)")
            arrival = start - origin
        blocks, out = length_row_blocks(row.reader, ids, str(path), block_size, notes,
                                        note_missing_hashes=False)
        requests.append(Request(
            id=row.rid, session_id=sid, blocks=tuple(blocks), output_tokens=out,
            depends_on=tuple(dict.fromkeys(row.waits)), pause_s=row.pause_s,
            agent_id="subagent" if kind == "subagent" else "main", agent_kind=kind,
            model=row.reader.text("model"), arrival_s=arrival,
            recorded=RecordedTiming(t=None if stamp is None else stamp - origin),
        ))
    return Session(id=sid, requests=tuple(requests))


def _rewrite_dispatch(rows: list[_Row], by_id: dict[str, _Row]) -> None:
    """Turn "start d after X was sent" into X's own dependencies and pause, plus d."""
    for row in rows:
        seen: set[str] = set()
        while row.dispatch:
            other, delay = row.dispatch.pop()
            if other in seen:
                continue
            seen.add(other)
            base = by_id[other]
            row.waits.extend(base.waits)
            row.dispatch.extend(base.dispatch)
            row.pause_s = max(row.pause_s, base.pause_s + delay)


def _dependency_order(path: Path, sid: str, rows: list[_Row]) -> list[_Row]:
    """Rows with their dependencies first, otherwise in file order; cycles are errors."""
    placed: set[str] = set()
    ordered: list[_Row] = []
    remaining = list(rows)
    while remaining:
        ready = [r for r in remaining if all(w in placed for w in r.waits)]
        if not ready:
            left = {r.rid for r in remaining}
            nodes = [_Node(r.rid, tuple(w for w in r.waits if w in left)) for r in remaining]
            cycles = [p for p in structure_problems(sid, nodes) if "cycle" in p.message]
            culprit = next((r for r in remaining if cycles and r.rid == cycles[0].request),
                           remaining[0])
            detail = cycles[0].message if cycles else "dependencies never complete"
            raise TraceError(f"{path}:{culprit.lineno}: session {sid!r} request "
                             f"{culprit.rid!r} field wait_for: {detail}")
        for row in ready:
            placed.add(row.rid)
            ordered.append(row)
        remaining = [r for r in remaining if r.rid not in placed]
    return ordered


@dataclass(frozen=True, slots=True)
class _Node:
    id: str
    depends_on: tuple[str, ...]


DYNAMO = TraceFormat(
    name="dynamo",
    summary="Dynamo agentic Mooncake rows (request_id, session_id, wait_for, delay, "
            "tool_wait_ms; typed v2 dependencies)",
    mapping=MAPPING,
    suffixes=(".jsonl",),
    load=load_dynamo,
)

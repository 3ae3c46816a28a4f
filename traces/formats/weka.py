"""WEKA / kv-cache-tester / SemiAnalysis cc-traces (the AgentX traces): one JSON object a session.

A file is one recorded coding-agent conversation: ``requests`` in time order, where an
entry of ``type: "subagent"`` holds a nested conversation of its own (which may nest
further). ``MAPPING`` says exactly what maps to what and what is dropped; it is also
what ``agentload traces import weka --help`` shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from agentload.traces.errors import TraceError
from agentload.traces.formats._common import (
    BlockIds,
    FieldReader,
    ImportOptions,
    ImportResult,
    Notes,
    TraceFormat,
    hashed_blocks,
    load_json,
)
from agentload.traces.model import AgentKind, RecordedTiming, Request, Session, Trace

MAPPING = """\
Each file is one session (its "id"); a directory imports every *.json in it. Main
requests form the session's main chain. A "subagent" entry becomes a chain of kind
subagent that depends on the main request before it (its spawn) and joins the first
later request of its parent sent after the subagent finished ("t" + "duration_ms",
within 1 s); nested subagents nest the same way. A subagent request's "t" counts from
the spawn when it is earlier than the spawn's "t", else from the conversation's start,
as AIPerf reads it (older files stamp from the spawn, current captures from the
start). Pauses: "think_time" for a request
whose only dependency is the previous request of its chain, otherwise "t" minus the
latest dependency's end ("t" + "api_time"). "hash_ids" are 64-token blocks (the
file's "block_size"); hash ids are namespaced per file unless "hash_id_scope" is
"global", and the unhashed tail of each prompt ("in" minus the hashed tokens) is a
block of its own that nothing shares. Kept: "in", "out", "model", recorded "t",
"api_time" and "ttft"; "tool_tokens" + "system_tokens" as the session's system/tool
prefix in whole blocks (trace meta "prefix_blocks"). Dropped: "type" s/n (replays
always stream), "input_types", "output_types", "stop", subagent "subagent_type",
"status", "tool_use_count", "total_tokens", "_analysis", "totals"."""

# The trace meta key of each session's declared system/tool prefix, in leading blocks of
# its first request: "tool_tokens" + "system_tokens" rounded up to whole blocks and
# clamped to the hashed blocks (AIPerf's system message; ``--cache-bust
# after-shared-prefix`` puts the play's marker after it). A JSON object, session -> n.
PREFIX_BLOCKS_META = "prefix_blocks"

# Main-chain "t" values are whole seconds in published traces, so a subagent that ended
# up to a second after a parent request's stamp may still have been waited for.
JOIN_TOLERANCE_S = 1.0
# A subagent request's "t" this far before its spawn is relative to the spawn (AIPerf's
# rule, so both read a file alike).
RELATIVE_EPS_S = 1e-6


@dataclass(frozen=True, slots=True)
class _Done:
    """A request already emitted: its id and when it ended in the recording (s)."""

    rid: str
    end: float


class _SessionBuilder:
    def __init__(self, sid: str, path: Path, block_size: int, ids: BlockIds,
                 namespace: object, notes: Notes) -> None:
        self.sid = sid
        self.path = path
        self.block_size = block_size
        self.ids = ids
        self.namespace = namespace
        self.notes = notes
        self.requests: list[Request] = []
        self.agent_ids: set[str] = set()

    def chain(self, entries: Any, where: str, base_t: float, agent: str, kind: AgentKind,
              prefix: str, spawn: _Done | None, model: str | None) -> _Done | None:
        """Emit one agent's requests; return the last one (None if it has none)."""
        if not isinstance(entries, list):
            raise TraceError(f"{self.path}: {where}: must be a list of requests")
        prev: _Done | None = spawn
        prev_in_chain = False
        pending: list[_Done] = []  # subagents that have not joined yet
        n = 0
        for i, entry in enumerate(entries):
            here = f"{where}[{i}]"
            row = FieldReader(f"{self.path}: {here}", entry)
            kind_of_entry = row.text("type") or "s"
            if kind_of_entry == "subagent":
                joined = self._subagent(row, here, base_t, agent, prefix, prev, model, i)
                if joined is not None:
                    pending.append(joined)
                continue
            if kind_of_entry not in ("s", "n"):
                raise row.fail("type", f"unknown request type {kind_of_entry!r} "
                                       "(expected s, n or subagent)")
            t = row.seconds("t")
            if t is None:
                raise row.fail("t", "is missing (seconds since the conversation began)")
            # A subagent's requests may stamp "t" from its spawn (older files) or
            # from the conversation's start (current captures); like AIPerf, a "t"
            # before the spawn is read as relative to it.
            t_abs = base_t + t if t + RELATIVE_EPS_S < base_t else t
            joins = [p for p in pending if p.end <= t_abs + JOIN_TOLERANCE_S]
            pending = [p for p in pending if p not in joins]
            deps = ([prev.rid] if prev else []) + [j.rid for j in joins]
            think = row.seconds("think_time")
            if prev is None:
                pause = t_abs  # a root request starts this long after the session began
            elif prev_in_chain and not joins and think is not None:
                pause = think
            else:
                pause = max(0.0, t_abs - max([prev.end, *(j.end for j in joins)]))
            rid = f"{prefix}/{n}"
            n += 1
            self.requests.append(self._request(row, rid, t_abs, tuple(deps), pause, agent,
                                               kind, model))
            api_time = row.seconds("api_time")
            if api_time is None:
                self.notes.add("{n} requests had no api_time; pauses after them count from "
                               "their start (or use the next request's think_time)")
            prev = _Done(rid, t_abs + (api_time or 0.0))
            prev_in_chain = True
        if pending:
            self.notes.add("{n} subagents finished after their parent's last request and "
                           "join nothing", len(pending))
        return prev if prev_in_chain else None

    def _subagent(self, row: FieldReader, where: str, base_t: float, parent_agent: str,
                  prefix: str, spawn: _Done | None, model: str | None,
                  index: int) -> _Done | None:
        t = row.seconds("t")
        if t is None:
            raise row.fail("t", "is missing (when the subagent started)")
        agent = row.text("agent_id") or f"{parent_agent}.sa{index}"
        if agent in self.agent_ids:
            agent = f"{parent_agent}.{agent}"
        self.agent_ids.add(agent)
        models = row.row.get("models")
        sub_model = models[0] if isinstance(models, list) and models else model
        start = base_t + t
        last = self.chain(row.row.get("requests"), f"{where}.requests", start,
                          agent, "subagent", f"{prefix}/sa:{agent}", spawn,
                          sub_model if isinstance(sub_model, str) else model)
        if last is None:
            self.notes.add("{n} subagent entries had no requests")
            return None
        duration = row.seconds("duration_ms", 1e-3)
        return _Done(last.rid, start + duration if duration is not None else last.end)

    def _request(self, row: FieldReader, rid: str, t_abs: float, deps: tuple[str, ...],
                 pause: float, agent: str, kind: AgentKind, model: str | None) -> Request:
        isl = row.count("in")
        if isl < 1:
            raise row.fail("in", "must be at least 1 input token")
        out = row.count("out")
        if out < 1:
            self.notes.add("{n} requests recorded 0 output tokens; they ask for 1")
            out = 1
        blocks = hashed_blocks(self.ids, self.namespace, row.ids("hash_ids") or [], isl,
                               self.block_size, row, partial_last=False)
        return Request(
            id=rid, session_id=self.sid, blocks=tuple(blocks), output_tokens=out,
            depends_on=deps, pause_s=pause, agent_id=agent, agent_kind=kind,
            model=row.text("model") or model,
            recorded=RecordedTiming(t=t_abs, api_time=row.seconds("api_time"),
                                    ttft=row.seconds("ttft")),
        )


def load_weka(paths: list[Path], options: ImportOptions) -> ImportResult:
    """Import WEKA-format files (one session each) as one trace."""
    ids = BlockIds()
    notes = Notes()
    sessions: list[Session] = []
    seen: dict[str, Path] = {}
    block_size: int | None = None
    prefix_blocks: dict[str, int] = {}
    for path in paths:
        top = FieldReader(str(path), load_json(path))
        if not isinstance(top.row.get("requests"), list):
            raise top.fail("requests", "is missing; is this a WEKA / cc-traces session file?")
        sid = top.text("id") or path.stem
        if sid in seen:
            raise top.fail("id", f"session {sid!r} is also in {seen[sid]}")
        seen[sid] = path
        size = top.count("block_size", 64)
        if size < 1:
            raise top.fail("block_size", "must be at least 1")
        if block_size is not None and size != block_size:
            raise top.fail("block_size", f"is {size}, but earlier files use {block_size}")
        block_size = size
        scope = top.text("hash_id_scope") or "local"
        namespace: object = "global" if scope == "global" else str(path)
        models = top.row.get("models")
        model = models[0] if isinstance(models, list) and models and isinstance(
            models[0], str) else None
        builder = _SessionBuilder(sid, path, size, ids, namespace, notes)
        builder.chain(top.row["requests"], "requests", 0.0, "main", "main", sid, None, model)
        if not builder.requests:
            notes.add("{n} files had no requests and were skipped")
            continue
        sessions.append(Session(id=sid, requests=tuple(builder.requests)))
        declared = _prefix_blocks(top, size)
        if declared is not None:
            prefix_blocks[sid] = declared
    name = options.name or (paths[0].parent.name if len(paths) > 1 else paths[0].stem)
    meta = {PREFIX_BLOCKS_META: orjson.dumps(prefix_blocks).decode()} if prefix_blocks else {}
    trace = Trace(name=name, sessions=tuple(sessions), block_size=block_size or 64,
                  source="weka", meta=meta)
    return ImportResult(trace, notes.lines())


def _prefix_blocks(top: FieldReader, size: int) -> int | None:
    """The file's declared system/tool prefix in leading blocks of its first request
    (None when the file declares neither "tool_tokens" nor "system_tokens")."""
    if not (top.has("tool_tokens") or top.has("system_tokens")):
        return None
    declared = top.count("tool_tokens", 0) + top.count("system_tokens", 0)
    first = next((r for r in top.row["requests"] if isinstance(r, dict)
                  and (r.get("type") or "s") != "subagent"), None)
    if first is None or not declared:
        return 0
    row = FieldReader(f"{top.where}: requests[0]", first)
    hashed = min(len(row.ids("hash_ids") or []), row.count("in") // size)
    return min(math.ceil(declared / size), hashed)


WEKA = TraceFormat(
    name="weka",
    summary="WEKA / kv-cache-tester / SemiAnalysis cc-traces (AgentX): a JSON file a session",
    mapping=MAPPING,
    suffixes=(".json",),
    load=load_weka,
)

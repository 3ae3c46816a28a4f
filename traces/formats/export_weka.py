"""WEKA / kv-cache-tester files from a trace: one JSON file a session, as AIPerf reads them.

The inverse of ``formats/weka.py``, written to the schema AIPerf 0.13.0 validates
strictly (``aiperf/dataset/loader/weka_trace_models.py``, extra fields forbidden): only
the fields below are written. A session's main chain is its request list; every other
chain becomes a ``"subagent"`` entry right after the main request that spawned it, with
a ``duration_ms`` that makes the importer (and AIPerf) join it to the main request that
waited for it, and to nothing earlier. Times come from replaying the session's pauses
(``_export.timeline``), so a re-import gives back the same pauses. ``MAPPING`` is what
``agentload traces export --help`` shows.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import orjson

from agentload.traces.formats._common import Notes
from agentload.traces.formats._export import ExportFormat, PrefixBlocks, Span, timeline
from agentload.traces.formats.weka import JOIN_TOLERANCE_S
from agentload.traces.model import Request, Session, Trace

BLOCK_SIZE = 64
UNKNOWN_MODEL = "unknown"
"""Written as "model" for requests whose source named none (the schema requires one)."""
# How far past the latest main request a subagent that must not join it is made to end.
_PAST_S = 0.002

MAPPING = """\
A folder of <session>.json files, one a session ("id" is the session id), with
"block_size" 64 and "hash_id_scope" "local". Each request is a streaming ("s") entry
with "t" (seconds from the session's start, from replaying its pauses), "model", "in",
"out", "hash_ids" (one per full 64-token block, named by the prefix they end, so equal
prefixes share ids), "think_time" (its pause), and the recorded "api_time" and "ttft"
when there are any. Main requests form the list; each other chain (subagent or aux) is
a "subagent" entry after the main request that spawned it, its requests stamped from
the session's start, with a "duration_ms" that joins it to the main request that waited
for it (or to none). WEKA cannot hold: prefixes shared across sessions (hash ids are
local to a file), a prompt's last partial block (re-imported as unshared), arrival times
(every file starts at 0), subagents nested in subagents (moved under the main chain:
AIPerf's schema nests one level), dependencies other than chains, spawns and joins, the
aux kind (aux chains become subagents with "subagent_type" "aux"), message content."""


def write_weka(trace: Trace, folder: Path, notes: Notes) -> None:
    """Write one ``<session id>.json`` a session into the empty directory ``folder``."""
    names: set[str] = set()
    for session in trace.sessions:
        doc = _SessionWriter(session, notes).doc()
        (folder / _file_name(session.id, names)).write_bytes(orjson.dumps(doc))
    if any(r.arrival_s is not None for r in trace.requests()):
        notes.say("arrival times are not kept: every WEKA file starts at t = 0")


class _SessionWriter:
    def __init__(self, session: Session, notes: Notes) -> None:
        self.session = session
        self.notes = notes
        self.spans: dict[str, Span] = timeline(session)
        self.blocks = PrefixBlocks(BLOCK_SIZE)  # one namespace a file ("local" scope)
        self.models: list[str] = []

    def doc(self) -> dict[str, Any]:
        reqs = self.session.requests
        main_agent = next((r.agent_id for r in reqs if r.agent_kind == "main"),
                          reqs[0].agent_id)
        chains: dict[str, list[Request]] = {}
        for req in reqs:
            chains.setdefault(req.agent_id, []).append(req)
        main = chains.pop(main_agent)
        after: dict[int | None, list[tuple[float, dict[str, Any]]]] = {}
        expected: dict[str, set[str]] = {r.id: ({main[k - 1].id} if k else set())
                                         for k, r in enumerate(main)}
        for agent, chain in chains.items():
            anchor, join, entry = self._subagent(agent, chain, main)
            after.setdefault(anchor, []).append((entry["t"], entry))
            expected[chain[0].id] = {main[anchor].id} if anchor is not None else set()
            expected.update({r.id: {chain[k - 1].id} for k, r in enumerate(chain) if k})
            if join is not None:
                expected[main[join].id].add(chain[-1].id)
        changed = sum(set(r.depends_on) != expected[r.id] for r in reqs)
        if changed:
            self.notes.add("{n} requests depend on more, or other, requests than WEKA can "
                           "say (a chain per agent, spawned after a main request, joined "
                           "by time); a re-import differs there", changed)
        requests = [e for _, e in sorted(after.get(None, []), key=lambda x: x[0])]
        for k, req in enumerate(main):
            requests.append(self._request(req))
            requests.extend(e for _, e in sorted(after.get(k, []), key=lambda x: x[0]))
        if None in after:
            self.notes.add("{n} subagents start before any main request; AIPerf drops "
                           "them", len(after[None]))
        return {"id": self.session.id, "models": self.models or [UNKNOWN_MODEL],
                "block_size": BLOCK_SIZE, "hash_id_scope": "local", "requests": requests}

    def _subagent(self, agent: str, chain: list[Request], main: list[Request]
                  ) -> tuple[int | None, int | None, dict[str, Any]]:
        """The main request it follows, the one that joins it, and its entry."""
        first, last = chain[0], chain[-1]
        start = round(self.spans[first.id].start, 6)
        main_at = {r.id: k for k, r in enumerate(main)}
        spawn = max((d for d in first.depends_on if d in self.spans),
                    key=lambda d: self.spans[d].end, default=None)
        anchor: int | None
        if spawn is not None and spawn in main_at:
            anchor = main_at[spawn]
        else:
            if spawn is not None:
                self.notes.add("{n} subagents spawned by a subagent were moved under the "
                               "main chain")
            anchor = max((k for k, r in enumerate(main) if self.spans[r.id].start <= start),
                         default=None)
        later = range(anchor + 1 if anchor is not None else 0, len(main))
        join = next((k for k in later if last.id in main[k].depends_on), None)
        passed = [self.spans[main[k].id].start for k in later if join is None or k < join]
        end = self.spans[last.id].end
        duration = math.floor((end - start) * 1000 + 1e-6)
        # The importer joins a subagent to the first later main request sent no more than
        # 1 s before it ended; one that main requests passed by must end after them.
        must_pass = max(passed, default=-math.inf) + JOIN_TOLERANCE_S
        if end <= must_pass:
            fits = join is None or must_pass + _PAST_S <= self.spans[main[join].id].start
            if fits:
                duration = math.ceil((must_pass + _PAST_S - start) * 1000)
            else:
                self.notes.add("{n} subagents end too close to a main request they did not "
                               "wait for; a re-import joins them earlier")
        kinds = {r.agent_kind for r in chain}
        if "aux" in kinds:
            self.notes.add("{n} aux requests (nobody waits for them) become subagent "
                           "requests", sum(r.agent_kind == "aux" for r in chain))
        requests = [self._request(r) for r in chain]
        entry = {"t": start, "type": "subagent", "agent_id": agent,
                 "subagent_type": "aux" if kinds == {"aux"} else "unknown",
                 "duration_ms": max(0, duration), "status": "completed",
                 "requests": requests, "models": _distinct(r["model"] for r in requests)}
        return anchor, join, entry

    def _request(self, req: Request) -> dict[str, Any]:
        if req.model is None:
            self.notes.add("{n} requests name no model; written as \"" + UNKNOWN_MODEL + "\"")
        model = req.model or UNKNOWN_MODEL
        if model not in self.models:
            self.models.append(model)
        doc: dict[str, Any] = {
            "t": round(self.spans[req.id].start, 6), "type": "s", "model": model,
            "in": req.input_tokens, "out": req.output_tokens,
            "hash_ids": self.blocks.ids(req.blocks, partial=False),
        }
        recorded = req.recorded
        if recorded is not None and recorded.api_time is not None:
            doc["api_time"] = recorded.api_time
        doc["think_time"] = round(req.pause_s, 6)
        if recorded is not None and recorded.ttft is not None:
            doc["ttft"] = recorded.ttft
        return doc


def _distinct(items: Any) -> list[str]:
    return list(dict.fromkeys(items))


def _file_name(session_id: str, taken: set[str]) -> str:
    """A file name for the session: its id with unsafe characters replaced, unique."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", session_id).lstrip(".") or "session"
    name, n = f"{stem}.json", 1
    while name in taken:
        n += 1
        name = f"{stem}-{n}.json"
    taken.add(name)
    return name


WEKA_FILES = ExportFormat(
    name="weka",
    summary="WEKA / kv-cache-tester / AgentX: a folder of JSON files, one a session",
    mapping=MAPPING,
    directory=True,
    write=write_weka,
)

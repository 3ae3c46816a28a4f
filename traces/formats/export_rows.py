"""Length-only rows from a trace: Mooncake JSONL, and AIPerf's multi_turn sessions.

Both formats describe a request by its input and output length; neither can say that
two requests of a session run side by side, so a session's requests are written as one
chain in the trace's order. Mooncake rows (the inverse of ``formats/mooncake.py``)
carry 512-token ``hash_ids``; multi_turn turns carry no prompt content at all.

AIPerf 0.13.0's ``multi_turn`` loader (``aiperf/dataset/loader/models.py``:
``MultiTurn`` of ``SingleTurn``) has no ``input_length`` field: a turn must carry text
(or another modality), so AIPerf refuses these rows as written and an ``input_length``
would be ignored as an unknown extra. ``output_length``, ``delay`` and ``timestamp``
(ms; a turn may not set both) are its fields. The rows follow the shape asked for in
issue 24; for AIPerf with exact token counts and prefix sharing, export ``mooncake``
(AIPerf's ``mooncake_trace`` reads ``session_id`` and ``delay``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from agentload.traces.formats._common import Notes
from agentload.traces.formats._export import ExportFormat, PrefixBlocks, ms
from agentload.traces.formats.mooncake import DEFAULT_BLOCK_SIZE
from agentload.traces.model import Request, Session, Trace

MOONCAKE_MAPPING = """\
One JSON row a request: "input_length", "output_length" and "hash_ids" (one per
512-token block, the last one partial, named by the prefix they end, so equal prefixes
share ids across the whole file). A one-request session is a plain row with its
"timestamp" (ms, its arrival; 0 for closed-loop traces). A longer session is rows with
its "session_id" (AIPerf's extension), one after another: the first with its
"timestamp", each later one with its pause as "delay" (ms), or only its "timestamp"
when it is an open-loop arrival with no pause. Mooncake cannot hold: requests of a
session running side by side (subagents are written in line, in the trace's order),
agent kinds, models, recorded timings other than arrivals, message content."""

AIPERF_MAPPING = """\
AIPerf's multi_turn JSONL: one session a line, {"session_id", "turns": [{"input_length",
"output_length", "delay"}]}, "delay" being the pause before the turn (ms), or
"timestamp" (ms) in place of it for a turn that arrives open loop without a pause.
Cannot hold: prompt content and prefix sharing (no hash ids), requests running side by
side (subagents are written in line), agent kinds, models, recorded timings. Note:
AIPerf 0.13.0's multi_turn loader wants text in every turn and has no "input_length"
field, so it refuses these rows; for AIPerf use the mooncake export (its mooncake_trace
loader reads session_id and delay)."""


def write_mooncake(trace: Trace, path: Path, notes: Notes) -> None:
    """Write every request as a Mooncake row, sessions one after another, to ``path``."""
    blocks = PrefixBlocks(DEFAULT_BLOCK_SIZE)  # one namespace: the importer's, per file
    lines: list[bytes] = []
    for session in _by_arrival(trace, notes):
        alone = len(session.requests) == 1
        for k, req in enumerate(session.requests):
            row: dict[str, Any] = {} if alone else {"session_id": session.id}
            row |= _timing(req, k, notes, both=True)
            row |= {"input_length": req.input_tokens, "output_length": req.output_tokens,
                    "hash_ids": blocks.ids(req.blocks, partial=True)}
            lines.append(orjson.dumps(row))
    path.write_bytes(b"\n".join(lines) + b"\n")


def write_aiperf_jsonl(trace: Trace, path: Path, notes: Notes) -> None:
    """Write each session as one multi_turn line to ``path``."""
    lines = []
    for session in _by_arrival(trace, notes):
        turns = [_timing(req, k, notes, both=False)
                 | {"input_length": req.input_tokens, "output_length": req.output_tokens}
                 for k, req in enumerate(session.requests)]
        lines.append(orjson.dumps({"session_id": session.id, "turns": turns}))
    path.write_bytes(b"\n".join(lines) + b"\n")


def _by_arrival(trace: Trace, notes: Notes) -> list[Session]:
    """Sessions by their first arrival (closed-loop ones at 0), counting side-by-side ones."""
    for session in trace.sessions:
        chain = all(r.depends_on == ((session.requests[k - 1].id,) if k else ())
                    for k, r in enumerate(session.requests))
        if not chain:
            notes.add("{n} sessions are not one chain of requests (subagents, aux calls); "
                      "their requests are written one after another in the trace's order")
    return sorted(trace.sessions, key=lambda s: s.requests[0].arrival_s or 0.0)


def _timing(req: Request, k: int, notes: Notes, *, both: bool) -> dict[str, int | float]:
    """A row's "timestamp" and/or "delay" (ms); ``both`` lets a first row carry the two.

    A session's first row has a timestamp (Mooncake needs one: a closed-loop session's
    is 0) and, where the format allows both, its pause as a delay. A later row arrives
    by timestamp when it is an open-loop arrival with no pause, else waits its pause.
    """
    if k == 0:
        stamp = {"timestamp": ms(req.arrival_s or 0.0)}
        if req.pause_s > 0 and both:
            return stamp | {"delay": ms(req.pause_s)}
        if req.pause_s > 0 and req.arrival_s is None:
            return {"delay": ms(req.pause_s)}
        if req.pause_s > 0:
            notes.add("{n} first turns have both an arrival and a pause; the pause is "
                      "dropped (a turn may not set both)")
        return stamp
    if req.arrival_s is not None and req.pause_s == 0:
        return {"timestamp": ms(req.arrival_s)}
    if req.arrival_s is not None:
        notes.add("{n} later requests had an arrival time and a pause; only the pause "
                  "is kept")
    return {"delay": ms(req.pause_s)}


MOONCAKE_ROWS = ExportFormat(
    name="mooncake",
    summary="Mooncake FAST'25 rows (with AIPerf's session_id / delay): one JSONL file",
    mapping=MOONCAKE_MAPPING,
    directory=False,
    write=write_mooncake,
)

AIPERF_JSONL = ExportFormat(
    name="aiperf-jsonl",
    summary="AIPerf multi_turn sessions (input/output lengths and delays): one JSONL file",
    mapping=AIPERF_MAPPING,
    directory=False,
    write=write_aiperf_jsonl,
)

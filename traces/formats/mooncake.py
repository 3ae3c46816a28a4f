"""Mooncake (FAST'25) request rows, with AIPerf's optional session extension.

One JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids`` of 512-token blocks. ``MAPPING`` is what ``--help`` shows.
"""

from __future__ import annotations

from pathlib import Path

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
from agentload.traces.model import RecordedTiming, Request, Session, Trace

DEFAULT_BLOCK_SIZE = 512

MAPPING = """\
Each row without a "session_id" is a session of one request that arrives, open loop,
at "timestamp" ms (arrival_s, offset so the earliest row is at 0). Rows sharing a
"session_id" (AIPerf's extension) form a closed-loop chain in file order: the first
arrives at its timestamp, each later one waits for the previous and then "delay" or
"delay_ms" (ms) as its pause, or, with only a timestamp, is sent no earlier than it.
"hash_ids" are 512-token blocks (--block-size to change): the last one may be partial,
and a partial block only matches the same hash with the same length; a row without
"hash_ids" gets blocks nothing shares. Hash ids are namespaced per file; a directory
imports every *.jsonl in it. Kept: "input_length", "output_length", timestamps (as
recorded t). Dropped: "tools", "payload", extra per-request inputs. Rows with
"messages" or "text_input" are refused: import those with openai-messages."""


def load_mooncake(paths: list[Path], options: ImportOptions) -> ImportResult:
    """Import Mooncake rows (one file or a directory of them) as one trace."""
    block_size = options.block_size or DEFAULT_BLOCK_SIZE
    ids = BlockIds()
    notes = Notes()
    sessions: list[Session] = []
    for path in paths:
        prefix = f"{path.stem}:" if len(paths) > 1 else ""
        rows = [(lineno, FieldReader(f"{path}:{lineno}", obj))
                for lineno, obj in json_lines(path)]
        stamps = [r.seconds("timestamp", 1e-3) for _, r in rows]
        origin = min((s for s in stamps if s is not None), default=0.0)
        if origin:
            notes.add("{n} files' timestamps were offset so their first row arrives at 0")
        chains: dict[str, list[Request]] = {}
        for (lineno, row), stamp in zip(rows, stamps, strict=True):
            for refused in ("messages", "text_input"):
                if row.has(refused):
                    raise row.fail(refused, "holds content; import such rows with "
                                            "`agentload traces import openai-messages`")
            given = row.text("session_id")
            sid = prefix + (given if given is not None else f"r{lineno:06d}")
            chain = chains.setdefault(sid, [])
            arrival = None if stamp is None else stamp - origin
            delay = row.seconds("delay", 1e-3)
            if delay is None:
                delay = row.seconds("delay_ms", 1e-3)
            if not chain and arrival is None:
                raise row.fail("timestamp", "is missing on the first row of a session "
                                            "(ms since the trace began)")
            if chain and delay is not None:
                arrival = None  # a later turn waits for the previous one, then the delay
            blocks, out = length_row_blocks(row, ids, str(path), block_size, notes)
            rid = f"{sid}/{len(chain)}"
            chain.append(Request(
                id=rid, session_id=sid, blocks=tuple(blocks), output_tokens=out,
                depends_on=(chain[-1].id,) if chain else (), pause_s=delay or 0.0,
                arrival_s=arrival, recorded=RecordedTiming(t=arrival),
            ))
        sessions.extend(Session(id=sid, requests=tuple(reqs)) for sid, reqs in chains.items())
    if not sessions:
        raise TraceError(f"{paths[0]}: no rows")
    name = options.name or (paths[0].parent.name if len(paths) > 1 else paths[0].stem)
    return ImportResult(Trace(name=name, sessions=tuple(sessions), block_size=block_size,
                              source="mooncake"), notes.lines())


MOONCAKE = TraceFormat(
    name="mooncake",
    summary="Mooncake FAST'25 rows (timestamp, input/output length, 512-token hash_ids)",
    mapping=MAPPING,
    suffixes=(".jsonl",),
    load=load_mooncake,
)

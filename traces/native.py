"""agentload's native trace file: JSONL, a header line then one session a line.

```
{"agentload_trace": 1, "name": "demo", "block_size": 64, "source": "synth"}
{"session": "s0", "requests": [{"id": "s0/0", "blocks": [[1, 64], [2, 64]], "out": 80},
                              {"id": "s0/1", "deps": ["s0/0"], "pause_s": 2.5, ...}]}
```

Request keys: ``id``, ``blocks`` ([block id, tokens] pairs), ``out`` (output tokens),
optional ``deps``, ``pause_s``, ``agent``, ``kind`` (main / subagent / aux), ``model``
and ``recorded`` ({t, api_time, ttft}). Sessions stream one line at a time in both
directions, so a trace larger than memory can still be read and written. Every error
names the line, the session and the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from agentload.traces.errors import TraceError
from agentload.traces.model import (
    AGENT_KINDS,
    Block,
    RecordedTiming,
    Request,
    Session,
    Trace,
)

FORMAT_VERSION = 1


def read_trace(path: str | Path) -> Trace:
    """Read a whole native JSONL trace into memory."""
    header, sessions = _open(Path(path))
    return Trace(
        name=str(header.get("name") or Path(path).stem),
        sessions=tuple(sessions),
        block_size=int(header.get("block_size", 64)),
        source=str(header.get("source", "agentload")),
    )


def iter_sessions(path: str | Path) -> Iterator[Session]:
    """Stream the sessions of a native JSONL trace, one line at a time."""
    _, sessions = _open(Path(path))
    return sessions


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as native JSONL (header line, then one session a line)."""
    write_sessions(trace.sessions, path, name=trace.name, block_size=trace.block_size,
                   source=trace.source)


def session_to_dict(session: Session) -> dict[str, Any]:
    return {"session": session.id, "requests": [_request_to_dict(r) for r in session.requests]}


def _request_to_dict(req: Request) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": req.id,
        "blocks": [[b.id, b.tokens] for b in req.blocks],
        "out": req.output_tokens,
    }
    if req.depends_on:
        row["deps"] = list(req.depends_on)
    if req.pause_s:
        row["pause_s"] = req.pause_s
    if req.agent_id != "main":
        row["agent"] = req.agent_id
    if req.agent_kind != "main":
        row["kind"] = req.agent_kind
    if req.model is not None:
        row["model"] = req.model
    if req.recorded is not None:
        rec = {k: v for k, v in (("t", req.recorded.t), ("api_time", req.recorded.api_time),
                                 ("ttft", req.recorded.ttft)) if v is not None}
        row["recorded"] = rec
    return row


def _open(path: Path) -> tuple[dict[str, Any], Iterator[Session]]:
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    handle = open(path, "rb")  # noqa: SIM115 - closed by the session generator
    first = handle.readline()
    try:
        header = orjson.loads(first) if first.strip() else None
    except orjson.JSONDecodeError as exc:
        handle.close()
        raise TraceError(f"{path}:1: not JSON ({exc})") from None
    if not isinstance(header, dict) or "agentload_trace" not in header:
        handle.close()
        raise TraceError(
            f"{path}:1: not an agentload trace (the first line must be a header with "
            "\"agentload_trace\"); import other formats with `agentload traces import`"
        )
    if header["agentload_trace"] != FORMAT_VERSION:
        handle.close()
        raise TraceError(f"{path}:1: unsupported agentload_trace version "
                         f"{header['agentload_trace']!r} (this agentload reads {FORMAT_VERSION})")
    return header, _sessions(path, handle)


def _sessions(path: Path, handle: Any) -> Iterator[Session]:
    with handle:
        for lineno, line in enumerate(handle, start=2):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not JSON ({exc})") from None
            try:
                yield _session_from_dict(obj)
            except TraceError as exc:
                raise TraceError(f"{path}:{lineno}: {exc}") from None


def _session_from_dict(obj: Any) -> Session:
    if not isinstance(obj, dict) or not isinstance(obj.get("session"), str):
        raise TraceError("a session line needs a string \"session\" id")
    sid = obj["session"]
    rows = obj.get("requests")
    if not isinstance(rows, list) or not rows:
        raise TraceError(f"session {sid!r}: \"requests\" must be a non-empty list")
    return Session(id=sid, requests=tuple(_request_from_dict(sid, i, r)
                                          for i, r in enumerate(rows)))


def _request_from_dict(sid: str, index: int, row: Any) -> Request:
    where = f"session {sid!r} request #{index}"
    if not isinstance(row, dict):
        raise TraceError(f"{where}: must be an object")
    rid = row.get("id")
    if not isinstance(rid, str):
        raise TraceError(f"{where}: \"id\" must be a string")
    where = f"session {sid!r} request {rid!r}"
    blocks = _blocks(where, row.get("blocks"))
    out = row.get("out")
    if not isinstance(out, int) or isinstance(out, bool):
        raise TraceError(f"{where}: \"out\" must be an integer token count")
    kind = row.get("kind", "main")
    if kind not in AGENT_KINDS:
        raise TraceError(f"{where}: \"kind\" must be one of {', '.join(AGENT_KINDS)}")
    deps = row.get("deps", [])
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise TraceError(f"{where}: \"deps\" must be a list of request ids")
    pause = row.get("pause_s", 0.0)
    if not isinstance(pause, int | float) or isinstance(pause, bool):
        raise TraceError(f"{where}: \"pause_s\" must be a number of seconds")
    rec = row.get("recorded")
    recorded = None
    if rec is not None:
        if not isinstance(rec, dict):
            raise TraceError(f"{where}: \"recorded\" must be an object")
        recorded = RecordedTiming(t=rec.get("t"), api_time=rec.get("api_time"),
                                  ttft=rec.get("ttft"))
    return Request(
        id=rid, session_id=sid, blocks=blocks, output_tokens=out, depends_on=tuple(deps),
        pause_s=float(pause), agent_id=str(row.get("agent", "main")), agent_kind=kind,
        model=row.get("model"), recorded=recorded,
    )


def _blocks(where: str, raw: Any) -> tuple[Block, ...]:
    if not isinstance(raw, list) or not raw:
        raise TraceError(f"{where}: \"blocks\" must be a non-empty list of [id, tokens]")
    blocks = []
    for j, pair in enumerate(raw):
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
            raise TraceError(f"{where}: blocks[{j}] must be [block id, token count] integers")
        if pair[1] < 1:
            raise TraceError(f"{where}: blocks[{j}] has {pair[1]} tokens (at least 1)")
        blocks.append(Block(id=pair[0], tokens=pair[1]))
    return tuple(blocks)


def write_sessions(sessions: Iterable[Session], path: str | Path, name: str,
                   block_size: int = 64, source: str = "agentload") -> None:
    """Stream ``sessions`` to a native JSONL file without holding them all."""
    with open(path, "wb") as out:
        header = {"agentload_trace": FORMAT_VERSION, "name": name,
                  "block_size": block_size, "source": source}
        out.write(orjson.dumps(header) + b"\n")
        for session in sessions:
            out.write(orjson.dumps(session_to_dict(session)) + b"\n")

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

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from agentload.traces.checks import Problem, first_error, is_count, is_seconds, structure_problems
from agentload.traces.errors import TraceError
from agentload.traces.model import (
    AGENT_KINDS,
    Block,
    Message,
    RecordedTiming,
    Request,
    Session,
    Trace,
    session_problems,
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
        meta=_meta(header.get("meta")),
    )


def _meta(raw: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def iter_sessions(path: str | Path) -> Iterator[Session]:
    """Stream the sessions of a native JSONL trace, one line at a time."""
    _, sessions = _open(Path(path))
    return sessions


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as native JSONL (header line, then one session a line)."""
    write_sessions(trace.sessions, path, name=trace.name, block_size=trace.block_size,
                   source=trace.source, meta=trace.meta)


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
    if req.arrival_s is not None:
        row["arrival_s"] = req.arrival_s
    if req.messages is not None:
        row["messages"] = [{"role": m.role, "content": m.content} for m in req.messages]
    return row


def _open(path: Path) -> tuple[dict[str, Any], Iterator[Session]]:
    header, handle = _open_handle(path)
    return header, _sessions(path, handle)


def _open_handle(path: Path) -> tuple[dict[str, Any], Any]:
    """The parsed header line and the open file, positioned at the first session."""
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
    return header, handle


def session_problems_by_line(path: str | Path) -> tuple[dict[str, Any],
                                                        Iterator[tuple[int, Session | None,
                                                                       list[Problem]]]]:
    """The header, then (line, parsed session or None, every problem) for each line.

    Header problems raise ``TraceError``; ``agentload traces validate`` uses this to
    list all problems instead of stopping at the first.
    """
    header, handle = _open_handle(Path(path))
    return header, _closing_lines(handle)


def _closing_lines(handle: Any) -> Iterator[tuple[int, Session | None, list[Problem]]]:
    with handle:
        yield from _session_lines(handle)


def _sessions(path: Path, handle: Any) -> Iterator[Session]:
    with handle:
        for lineno, obj, problems in _session_lines(handle):
            error = first_error(problems)
            if error is not None:
                raise TraceError(error.at_line(lineno).describe(str(path)))
            assert obj is not None
            yield obj


def _session_lines(handle: Any) -> Iterator[tuple[int, Session | None, list[Problem]]]:
    """Each non-empty line after the header: its number, the session, its problems."""
    for lineno, line in enumerate(handle, start=2):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            yield lineno, None, [Problem(f"not JSON ({exc})")]
            continue
        problems: list[Problem] = []
        session = session_from_dict(obj, problems)
        yield lineno, session, problems


def session_from_dict(obj: Any, problems: list[Problem]) -> Session | None:
    """Parse one session object, appending every problem found; None if any is an error."""
    if not isinstance(obj, dict) or not isinstance(obj.get("session"), str):
        problems.append(Problem('a session line needs a string "session" id', field="session"))
        return None
    sid = obj["session"]
    rows = obj.get("requests")
    if not isinstance(rows, list) or not rows:
        problems.append(Problem('"requests" must be a non-empty list', sid, field="requests"))
        return None
    requests = [request_from_dict(sid, i, r, problems) for i, r in enumerate(rows)]
    parsed = [r for r in requests if r is not None]
    if len(parsed) != len(requests):
        # Still check the structure of what parsed, so one run lists more problems.
        problems.extend(structure_problems(sid, parsed))
        return None
    session_errors = session_problems(sid, parsed)
    problems.extend(session_errors)
    if first_error(session_errors) is not None:
        return None
    return Session(id=sid, requests=tuple(parsed))


def request_from_dict(sid: str, index: int, row: Any, problems: list[Problem]) -> Request | None:
    """Parse one request object of session ``sid``; every bad field becomes a Problem."""
    if not isinstance(row, dict):
        problems.append(Problem(f"request #{index} must be an object", sid))
        return None
    rid = row.get("id")
    if not isinstance(rid, str):
        problems.append(Problem(f'request #{index} needs a string "id"', sid, field="id"))
        return None
    before = len(problems)

    def bad(name: str, message: str) -> None:
        problems.append(Problem(message, sid, rid, name))

    blocks = _blocks(row.get("blocks"), bad)
    out = row.get("out")
    if not is_count(out):
        bad("out", "must be an integer token count")
    kind = row.get("kind", "main")
    if kind not in AGENT_KINDS:
        bad("kind", f"must be one of {', '.join(AGENT_KINDS)}, got {kind!r}")
    deps = row.get("deps", [])
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        bad("deps", "must be a list of request ids")
    pause = row.get("pause_s", 0.0)
    if not (isinstance(pause, int | float) and not isinstance(pause, bool)):
        bad("pause_s", "must be a number of seconds")
    arrival = row.get("arrival_s")
    if arrival is not None and not (isinstance(arrival, int | float)
                                    and not isinstance(arrival, bool)):
        bad("arrival_s", "must be a number of seconds")
    for name in ("agent", "model"):
        if name in row and not isinstance(row[name], str):
            bad(name, "must be a string")
    recorded = _recorded(row.get("recorded"), bad)
    messages = _messages(row.get("messages"), bad)
    if len(problems) > before:
        return None
    return Request(
        id=rid, session_id=sid, blocks=blocks, output_tokens=out or 0, depends_on=tuple(deps),
        pause_s=float(pause), agent_id=row.get("agent", "main"), agent_kind=kind,
        model=row.get("model"), recorded=recorded,
        arrival_s=None if arrival is None else float(arrival), messages=messages,
    )


def _blocks(raw: Any, bad: Callable[[str, str], None]) -> tuple[Block, ...]:
    if not isinstance(raw, list) or not raw:
        bad("blocks", "must be a non-empty list of [block id, token count]")
        return ()
    blocks = []
    for j, pair in enumerate(raw):
        if not isinstance(pair, list) or len(pair) != 2 or not all(is_count(x) for x in pair):
            bad(f"blocks[{j}]", "must be [block id, token count] integers")
        elif pair[1] < 1:
            bad(f"blocks[{j}]", f"has {pair[1]} tokens (at least 1)")
        else:
            blocks.append(Block(id=pair[0], tokens=pair[1]))
    return tuple(blocks)


def _recorded(raw: Any, bad: Callable[[str, str], None]) -> RecordedTiming | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        bad("recorded", "must be an object of {t, api_time, ttft}")
        return None
    for key, value in raw.items():
        if key not in ("t", "api_time", "ttft"):
            bad(f"recorded.{key}", "is not a recorded timing (t, api_time, ttft)")
        elif value is not None and not is_seconds(value):
            bad(f"recorded.{key}", f"must be finite and >= 0 s, got {value!r}")
    return RecordedTiming(t=raw.get("t"), api_time=raw.get("api_time"), ttft=raw.get("ttft"))


def _messages(raw: Any, bad: Callable[[str, str], None]) -> tuple[Message, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        bad("messages", "must be a list of {role, content}")
        return None
    messages = []
    for j, m in enumerate(raw):
        if (not isinstance(m, dict) or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)):
            bad(f"messages[{j}]", "must be {\"role\": str, \"content\": str}")
        else:
            messages.append(Message(role=m["role"], content=m["content"]))
    return tuple(messages)


def write_sessions(sessions: Iterable[Session], path: str | Path, name: str,
                   block_size: int = 64, source: str = "agentload",
                   meta: dict[str, str] | None = None) -> None:
    """Stream ``sessions`` to a native JSONL file without holding them all."""
    with open(path, "wb") as out:
        header: dict[str, Any] = {"agentload_trace": FORMAT_VERSION, "name": name,
                                  "block_size": block_size, "source": source}
        if meta:
            header["meta"] = meta
        out.write(orjson.dumps(header) + b"\n")
        for session in sessions:
            out.write(orjson.dumps(session_to_dict(session)) + b"\n")

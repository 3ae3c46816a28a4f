"""agentload's native Parquet trace: one request a row, the trace header in file metadata.

Columns: ``session``, ``id``, ``blocks`` (list of {id, tokens}), ``out``, ``deps``,
``pause_s``, ``agent``, ``kind``, ``model``, ``recorded`` (whether the source recorded
timing) with ``t``, ``api_time`` and ``ttft``, ``arrival_s`` and ``messages`` (list of
{role, content}, null unless kept). Rows are in session order and, inside a session,
in the order the JSONL form lists them, so the two forms convert into each other
without loss. The header (``agentload_trace``, ``name``, ``block_size``, ``source``)
is Parquet key-value metadata. The table is a natural input for polars queries over
many traces (``pl.scan_parquet``).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl

from agentload.traces.checks import Problem, first_error
from agentload.traces.errors import TraceError
from agentload.traces.model import Session, Trace
from agentload.traces.native import FORMAT_VERSION, session_from_dict

SCHEMA: dict[str, Any] = {
    "session": pl.String,
    "id": pl.String,
    "blocks": pl.List(pl.Struct({"id": pl.Int64, "tokens": pl.Int64})),
    "out": pl.Int64,
    "deps": pl.List(pl.String),
    "pause_s": pl.Float64,
    "agent": pl.String,
    "kind": pl.String,
    "model": pl.String,
    "recorded": pl.Boolean,
    "t": pl.Float64,
    "api_time": pl.Float64,
    "ttft": pl.Float64,
    "arrival_s": pl.Float64,
    "messages": pl.List(pl.Struct({"role": pl.String, "content": pl.String})),
}


def write_parquet_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as one request a row (see the module docstring for columns)."""
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA}
    for req in trace.requests():
        rec = req.recorded
        row: dict[str, Any] = {
            "session": req.session_id, "id": req.id,
            "blocks": [{"id": b.id, "tokens": b.tokens} for b in req.blocks],
            "out": req.output_tokens, "deps": list(req.depends_on), "pause_s": req.pause_s,
            "agent": req.agent_id, "kind": req.agent_kind, "model": req.model,
            "recorded": rec is not None,
            "t": rec.t if rec else None, "api_time": rec.api_time if rec else None,
            "ttft": rec.ttft if rec else None, "arrival_s": req.arrival_s,
            "messages": (None if req.messages is None else
                         [{"role": m.role, "content": m.content} for m in req.messages]),
        }
        for name, value in row.items():
            columns[name].append(value)
    frame = pl.DataFrame(columns, schema=SCHEMA)
    frame.write_parquet(path, metadata={
        "agentload_trace": str(FORMAT_VERSION), "name": trace.name,
        "block_size": str(trace.block_size), "source": trace.source,
        **{f"meta.{k}": v for k, v in trace.meta.items()},
    })


def read_parquet_trace(path: str | Path) -> Trace:
    """Read a native Parquet trace; the first problem is raised naming session and field."""
    path = Path(path)
    header, sessions = _open(path)
    built = []
    for session, problems in sessions:
        error = first_error(problems)
        if error is not None:
            raise TraceError(error.describe(str(path)))
        assert session is not None
        built.append(session)
    return Trace(name=header.get("name") or path.stem, sessions=tuple(built),
                 block_size=int(header.get("block_size", 64)),
                 source=header.get("source", "agentload"),
                 meta={k[5:]: v for k, v in header.items() if k.startswith("meta.")})


def parquet_session_problems(path: str | Path) -> tuple[dict[str, str],
                                                        Iterator[tuple[Session | None,
                                                                       list[Problem]]]]:
    """The header and, per session, the parsed session (or None) and all its problems."""
    return _open(Path(path))


def _open(path: Path) -> tuple[dict[str, str], Iterator[tuple[Session | None, list[Problem]]]]:
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    try:
        # One read of the bytes, then both parses from memory: reading the path twice
        # can see two versions of a file that a recorder is atomically replacing.
        data = path.read_bytes()
        header = pl.read_parquet_metadata(io.BytesIO(data))
        frame = pl.read_parquet(io.BytesIO(data))
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise TraceError(f"{path}: not a readable Parquet file ({exc})") from None
    if header.get("agentload_trace") != str(FORMAT_VERSION):
        raise TraceError(f"{path}: not an agentload Parquet trace (no agentload_trace="
                         f"{FORMAT_VERSION} in its metadata)")
    missing = [c for c in ("session", "id", "blocks", "out") if c not in frame.columns]
    if missing:
        raise TraceError(f"{path}: missing column(s) {', '.join(missing)}")
    return header, _sessions(frame)


def _sessions(frame: pl.DataFrame) -> Iterator[tuple[Session | None, list[Problem]]]:
    current: str | None = None
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for row in frame.iter_rows(named=True):
        if row["session"] != current:
            if current is not None:
                yield _session(current, rows)
            current = row["session"]
            if current in seen:
                yield None, [Problem("rows of this session are not contiguous", current)]
            seen.add(str(current))
            rows = []
        rows.append(row)
    if current is not None:
        yield _session(current, rows)


def _session(sid: str, rows: list[dict[str, Any]]) -> tuple[Session | None, list[Problem]]:
    # Reuse the JSONL parser on the same dict shape, so both forms check the same things.
    problems: list[Problem] = []
    obj = {"session": sid, "requests": [_as_jsonl_request(r) for r in rows]}
    return session_from_dict(obj, problems), problems


def _as_jsonl_request(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": row["id"],
        "blocks": [[b["id"], b["tokens"]] for b in row["blocks"] or []],
        "out": row["out"],
    }
    for key in ("deps", "pause_s", "agent", "kind", "model", "arrival_s", "messages"):
        value = row.get(key)
        if value is not None:
            out[key] = value
    if row.get("recorded"):
        out["recorded"] = {k: row.get(k) for k in ("t", "api_time", "ttft")}
    return out


"""The run journal: an append-only JSONL file written as each request finishes.

Every finished request (and every run event) is one line, flushed at once, so a run
killed at any moment (Ctrl-C, server death, ``kill -9``) keeps every request that had
completed; ``read_journal`` skips a torn last line. ``finalize`` turns the journal
into ``requests.parquet``, the table every metric and report is computed from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import orjson
import polars as pl

JOURNAL_NAME = "journal.jsonl"
REQUESTS_NAME = "requests.parquet"

Phase = Literal["warmup", "measure", "cut"]  # cut: in flight past --duration + --grace


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request. Times are ns since the run's start (``perf_counter_ns``)."""

    request_id: str
    session_id: str
    lane: int
    agent_kind: str
    turn: int
    phase: Phase
    intended_ns: int
    sent_ns: int
    first_token_ns: int | None
    last_token_ns: int | None
    done_ns: int
    isl_requested: int
    osl_requested: int
    isl: int | None
    osl: int | None
    osl_source: str
    cached_tokens: int | None
    theoretical_cached_tokens: int
    chunks: int
    ok: bool
    status: int | None
    error: str | None
    # When the request's dependencies were done (None for a request without any): the
    # measured pause is sent - ready, the intended one intended - ready.
    ready_ns: int | None = None
    # Which of its lane's plays the request belongs to (recycled lanes replay sessions).
    play: int = 0
    error_kind: str | None = None


REQUEST_SCHEMA: dict[str, pl.DataType] = {
    "request_id": pl.String(), "session_id": pl.String(), "lane": pl.Int32(),
    "agent_kind": pl.String(), "turn": pl.Int32(), "phase": pl.String(),
    "intended_ns": pl.Int64(), "sent_ns": pl.Int64(), "first_token_ns": pl.Int64(),
    "last_token_ns": pl.Int64(), "done_ns": pl.Int64(), "isl_requested": pl.Int64(),
    "osl_requested": pl.Int64(), "isl": pl.Int64(), "osl": pl.Int64(),
    "osl_source": pl.String(), "cached_tokens": pl.Int64(),
    "theoretical_cached_tokens": pl.Int64(), "chunks": pl.Int64(), "ok": pl.Boolean(),
    "status": pl.Int32(), "error": pl.String(), "ready_ns": pl.Int64(),
    "play": pl.Int32(), "error_kind": pl.String(),
}
assert set(REQUEST_SCHEMA) == {f.name for f in dataclasses.fields(RequestRecord)}


class Journal:
    """Append-only writer; every ``write_*`` reaches the file before it returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: IO[bytes] = open(path, "ab")  # noqa: SIM115 - lives as long as the journal

    def _write(self, obj: dict[str, Any]) -> None:
        self._fh.write(orjson.dumps(obj) + b"\n")
        self._fh.flush()

    def write_run(self, meta: dict[str, Any]) -> None:
        self._write({"type": "run", **meta})

    def write_request(self, rec: RequestRecord, chunk_ns: list[int] | None = None,
                      chunk_tokens: list[int] | None = None) -> None:
        """One finished request, and (on the next line) when each of its chunks arrived."""
        self._write({"type": "request", **dataclasses.asdict(rec)})
        if chunk_ns:
            self._write({"type": "chunks", "request_id": rec.request_id, "lane": rec.lane,
                         "play": rec.play, "t_ns": chunk_ns, "tokens": chunk_tokens})

    def write_server_metrics(self, t_ns: int, values: dict[str, float]) -> None:
        self._write({"type": "server_metrics", "t_ns": t_ns, **values})

    def write_gpu(self, t_ns: int, rows: list[dict[str, float | int]]) -> None:
        for row in rows:
            self._write({"type": "gpu", "t_ns": t_ns, **row})

    def write_event(self, kind: str, t_ns: int, **fields: Any) -> None:
        self._write({"type": "event", "kind": kind, "t_ns": t_ns, **fields})

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_journal(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(run/event lines, request lines) of a journal; a torn final line is ignored."""
    meta: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    with open(path, "rb") as fh:
        for line in fh:
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a line cut short by kill -9; everything before it is intact
            if obj.get("type") == "request":
                obj.pop("type")
                requests.append(obj)
            else:
                meta.append(obj)
    return meta, requests


SHARD_GLOB = "journal.shard-*.jsonl"
MERGED_EVENT = "shards_merged"


def shard_journal_path(run_dir: Path, index: int) -> Path:
    """Where worker ``index`` of a ``--workers`` run appends its own journal."""
    return Path(run_dir) / f"journal.shard-{index}.jsonl"


def shard_journals(run_dir: Path) -> list[Path]:
    """The worker journals of a run directory not yet merged, in worker order."""
    def index(path: Path) -> int:
        return int(path.name.split("-")[-1].split(".")[0])

    return sorted(Path(run_dir).glob(SHARD_GLOB), key=index)


def merge_shards(run_dir: Path) -> int:
    """Fold the worker journals into ``journal.jsonl``; the number of lines moved.

    Each shard's lines are appended whole (a torn last line dropped), then the shard
    files go. The merged journal is written beside the old one and renamed over it, with
    a ``shards_merged`` event naming the files, so a merge cut short is never applied
    twice: files a journal already names as merged are only deleted. A worker process of
    this host still writing its journal (a driver killed mid-run) is waited for, never
    merged under it.
    """
    from agentload.replay.errors import ReplayError

    run_dir = Path(run_dir)
    shards = shard_journals(run_dir)
    if not shards:
        return 0
    for path in shards:
        if (pid := _live_local_worker(path)) is not None:
            raise ReplayError(f"worker process {pid} still writes {path.name}; let it end "
                              "(or kill it) before building the reports")
    main = run_dir / JOURNAL_NAME
    data = main.read_bytes()  # read once: for what was merged before, then copied
    merged: set[str] = set()
    for line in data.splitlines():
        if MERGED_EVENT.encode() in line and line.startswith(b'{"type":"event"'):
            with contextlib.suppress(orjson.JSONDecodeError):
                merged.update(orjson.loads(line).get("files") or ())
    done = [p for p in shards if p.name in merged]
    for path in done:
        path.unlink(missing_ok=True)
    shards = [p for p in shards if p.name not in merged]
    if not shards:
        return 0
    moved = 0
    tmp = main.with_name(main.name + ".merging")
    with open(tmp, "wb") as out:
        out.write(data if not data or data.endswith(b"\n") else data.rsplit(b"\n", 1)[0] + b"\n")
        for path in shards:
            with open(path, "rb") as fh:
                for line in fh:
                    if line.endswith(b"\n"):  # a line without its newline was torn
                        out.write(line)
                        moved += 1
        out.write(orjson.dumps({"type": "event", "kind": MERGED_EVENT, "t_ns": 0,
                                "files": [p.name for p in shards], "lines": moved}) + b"\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, main)
    _fsync_dir(run_dir)  # the rename is durable before the shards go
    for path in shards:
        path.unlink(missing_ok=True)
    return moved


def _live_local_worker(path: Path) -> int | None:
    """The pid of the local worker process writing ``path``, if it is still alive (Ray
    actors' lines name their host and are streamed by the driver: never waited for)."""
    with open(path, "rb") as fh:
        first = fh.readline()
    try:
        head = orjson.loads(first)
    except orjson.JSONDecodeError:
        return None
    pid = head.get("pid") if head.get("kind") == "worker" and "host" not in head else None
    if not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    # A recycled pid that is not ours would be a python process too; good enough here.
    return pid if _is_python(pid) else None


def _is_python(pid: int) -> bool:
    try:
        return b"python" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: assume the worker


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def request_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """The journal's request lines as a typed frame, sorted by send time."""
    frame = pl.DataFrame(rows, schema=REQUEST_SCHEMA) if rows else pl.DataFrame(
        schema=REQUEST_SCHEMA)
    return frame.sort("sent_ns")


CHUNKS_NAME = "chunks.parquet"
SESSIONS_NAME = "sessions.parquet"
SERVER_METRICS_NAME = "server_metrics.parquet"
GPU_METRICS_NAME = "gpu_metrics.parquet"
SERVER_METRICS_TEXT = "server_metrics_end.txt"
"""The server's whole ``/metrics`` text at the end of the run (every series, not only
those agentload tracks)."""
CHUNK_SCHEMA: dict[str, pl.DataType] = {
    "request_id": pl.String(), "lane": pl.Int32(), "play": pl.Int32(), "index": pl.Int32(),
    "t_ns": pl.Int64(), "tokens": pl.Int32(),
}
PLAY_SCHEMA: dict[str, pl.DataType] = {
    "lane": pl.Int32(), "play": pl.Int32(), "session_id": pl.String(),
    "start_turn": pl.Int32(), "main_turns": pl.Int32(), "requests": pl.Int32(),
    "warmup_requests": pl.Int32(), "marker_block": pl.Int64(), "t_ns": pl.Int64(),
}


def finalize(run_dir: Path) -> pl.DataFrame:
    """Write the run's tables from the journal; return the requests frame.

    ``requests.parquet`` (one row a request), ``chunks.parquet`` (one row a streamed
    chunk: when it arrived, how many tokens), ``sessions.parquet`` (one row a play:
    lane, session, start turn, salt) and ``server_metrics.parquet`` (the server's
    Prometheus values sampled every second, with per-interval deltas of counters).
    """
    meta, rows = read_journal(run_dir / JOURNAL_NAME)
    frame = request_frame(rows)
    frame.write_parquet(run_dir / REQUESTS_NAME)
    chunk_rows: dict[str, list[Any]] = {k: [] for k in CHUNK_SCHEMA}
    for m in meta:
        if m.get("type") == "chunks":
            n = len(m["t_ns"])
            chunk_rows["request_id"] += [m["request_id"]] * n
            chunk_rows["lane"] += [m["lane"]] * n
            chunk_rows["play"] += [m.get("play", 0)] * n
            chunk_rows["index"] += list(range(n))
            chunk_rows["t_ns"] += m["t_ns"]
            chunk_rows["tokens"] += m.get("tokens") or [1] * n
    pl.DataFrame(chunk_rows, schema=CHUNK_SCHEMA).write_parquet(run_dir / CHUNKS_NAME)
    plays = [{k: m.get(k) for k in PLAY_SCHEMA} for m in meta
             if m.get("type") == "event" and m.get("kind") == "play"]
    pl.DataFrame(plays, schema=PLAY_SCHEMA).write_parquet(run_dir / SESSIONS_NAME)
    server_metrics_frame(meta).write_parquet(run_dir / SERVER_METRICS_NAME)
    gpu = [{k: v for k, v in m.items() if k != "type"} for m in meta if m.get("type") == "gpu"]
    if gpu:
        pl.DataFrame(gpu).write_parquet(run_dir / GPU_METRICS_NAME)
    return frame


def server_metrics_frame(meta: list[dict[str, Any]]) -> pl.DataFrame:
    """Samples of the server's metrics, with ``d_<counter>`` per-interval deltas."""
    samples = [{k: v for k, v in m.items() if k != "type"} for m in meta
               if m.get("type") == "server_metrics"]
    if not samples:
        return pl.DataFrame(schema={"t_ns": pl.Int64()})
    frame = pl.DataFrame(samples).sort("t_ns")
    counters = [c for c in frame.columns if c.endswith("_total")]
    return frame.with_columns(pl.col(c).diff().alias("d_" + c.split(":", 1)[-1])
                              for c in counters)

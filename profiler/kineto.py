"""PyTorch profiler (Kineto) Chrome-trace JSON -> :class:`~agentload.profiler.model.Profile`.

Facts this relies on (checked on torch 2.11 / CUPTI 13 traces from an H200):

- ``ts``/``dur`` are µs with three decimals, so ``round(ts * 1000)`` is exact ns.
- GPU events (``kernel``, ``gpu_memcpy``, ``gpu_memset``) carry ``pid`` = device index and
  ``tid`` = stream; their ``args.correlation`` equals the launching ``cuda_runtime`` (or
  ``cuda_driver``) event's, which sits on the real OS pid/tid.
- ``user_annotation`` events are ``record_function`` ranges on CPU threads: they nest per
  thread like NVTX push/pop ranges. With ``with_stack=True`` (vLLM's profiler default),
  ``python_function`` events named ``nn.Module: <Class>_<k>`` are module forwards on the
  same threads; they are read as ranges too. ``gpu_user_annotation`` is Kineto's projection of
  the same ranges onto the GPU and is not used (attribution goes through the launch).
- Kernels of a CUDA-graph replay all carry the ``cudaGraphLaunch``'s correlation and, in
  builds up to at least torch 2.11, no graph node id; newer Kineto may add
  ``graph node id``, which is read when present.

The document is streamed (:mod:`agentload.profiler.jsonstream`): ``traceEvents`` is read
in chunks of a few MB and parsed in batches, each batch's events go through one Python
pass into column lists, and those become polars frames per batch, so memory stays
bounded by a batch plus the compact frames rather than the whole document as objects.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from agentload.profiler.errors import ProfileError
from agentload.profiler.jsonstream import JSONStreamError, Readable, StreamResult, stream_array
from agentload.profiler.model import (
    DEVICES_SCHEMA,
    LAUNCHES_SCHEMA,
    OPS_SCHEMA,
    PROCESSES_SCHEMA,
    RANGES_SCHEMA,
    STRINGS_SCHEMA,
    THREADS_SCHEMA,
    Profile,
    conform,
)

GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
RANGE_CATS = {"user_annotation"}
#: ``python_function`` events kept as ranges: module forwards (``with_stack=True``), the
#: only layer structure an eager model shows the PyTorch profiler (vLLM's layerwise
#: tracing is NVTX, which Kineto does not record). Other Python frames are dropped.
MODULE_PREFIX = "nn.Module: "
#: Top-level keys read besides ``traceEvents``.
KEEP_KEYS = frozenset({"deviceProperties"})
#: Events per batch when a parsed document is passed in (``load_kineto(path, doc)``).
DOC_BATCH = 50_000

_OPS_COLS = {"kind": pl.String, "start": pl.Int64, "end": pl.Int64, "device": pl.Int64,
             "stream": pl.Int64, "correlation": pl.Int64, "name": pl.String,
             "graph_node": pl.Int64}
_LAUNCH_COLS = {"pid": pl.Int64, "tid": pl.Int64, "start": pl.Int64, "end": pl.Int64,
                "correlation": pl.Int64, "name": pl.String}
_RANGE_COLS = {"pid": pl.Int64, "tid": pl.Int64, "start": pl.Int64, "end": pl.Int64,
               "name": pl.String}


def read_json_document(path: Path) -> Any:
    """Parse ``path`` (plain or gzip JSON); any damage is one :class:`ProfileError`."""
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return orjson.loads(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise ProfileError(f"{path}: cannot read gzip data ({exc})") from None
    except orjson.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON, truncated or corrupt ({exc})") from None


def _ns(us: Any) -> int:
    return round(float(us) * 1000)


class _Columns:
    """The per-event pass: column lists for one batch, turned into frames per batch."""

    def __init__(self) -> None:
        self.op_frames: list[pl.DataFrame] = []
        self.launch_frames: list[pl.DataFrame] = []
        self.range_frames: list[pl.DataFrame] = []
        self.proc_names: dict[int, str] = {}
        self.thread_names: dict[tuple[int, int], str] = {}

    def add(self, events: Iterable[Any]) -> None:
        ops: dict[str, list[Any]] = {k: [] for k in _OPS_COLS}
        launches: dict[str, list[Any]] = {k: [] for k in _LAUNCH_COLS}
        ranges: dict[str, list[Any]] = {k: [] for k in _RANGE_COLS}
        proc_names, thread_names = self.proc_names, self.thread_names
        for ev in events:
            cat = ev.get("cat")
            ph = ev.get("ph")
            if ph == "X" and cat in GPU_CATS:
                args = ev.get("args") or {}
                start = _ns(ev["ts"])
                ops["kind"].append(GPU_CATS[cat])
                ops["start"].append(start)
                ops["end"].append(start + _ns(ev.get("dur", 0)))
                ops["device"].append(args.get("device", ev.get("pid")))
                ops["stream"].append(args.get("stream", ev.get("tid")))
                ops["correlation"].append(args.get("correlation"))
                ops["name"].append(str(ev.get("name", "")))
                ops["graph_node"].append(args.get("graph node id"))
            elif ph == "X" and cat in LAUNCH_CATS:
                args = ev.get("args") or {}
                start = _ns(ev["ts"])
                launches["pid"].append(int(ev["pid"]))
                launches["tid"].append(int(ev["tid"]))
                launches["start"].append(start)
                launches["end"].append(start + _ns(ev.get("dur", 0)))
                launches["correlation"].append(args.get("correlation"))
                launches["name"].append(str(ev.get("name", "")))
            elif ph == "X" and (cat in RANGE_CATS or (
                    cat == "python_function" and ev.get("name", "").startswith(MODULE_PREFIX))):
                start = _ns(ev["ts"])
                ranges["pid"].append(int(ev["pid"]))
                ranges["tid"].append(int(ev["tid"]))
                ranges["start"].append(start)
                ranges["end"].append(start + _ns(ev.get("dur", 0)))
                ranges["name"].append(str(ev.get("name", "")))
            elif ph == "M" and ev.get("name") == "process_name":
                proc_names[int(ev["pid"])] = str((ev.get("args") or {}).get("name", ""))
            elif ph == "M" and ev.get("name") == "thread_name":
                thread_names[(int(ev["pid"]), int(ev["tid"]))] = str(
                    (ev.get("args") or {}).get("name", ""))
        if ops["kind"]:
            self.op_frames.append(pl.DataFrame(ops, schema=_OPS_COLS))
        if launches["pid"]:
            self.launch_frames.append(pl.DataFrame(launches, schema=_LAUNCH_COLS))
        if ranges["pid"]:
            self.range_frames.append(pl.DataFrame(ranges, schema=_RANGE_COLS))


def _concat(frames: list[pl.DataFrame], schema: dict[str, Any]) -> pl.DataFrame:
    if not frames:
        return pl.DataFrame(schema=schema)
    return pl.concat(frames, rechunk=True)


def _stream_events(path: Path, cols: _Columns) -> tuple[bool, dict[str, Any]]:
    """Feed ``path``'s events to ``cols``; (whether the array was found, kept top keys).

    The bytes go through gzip when the file starts with its magic, as before.
    """
    result = StreamResult()
    try:
        with open(path, "rb") as raw:
            gz = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            stream: Readable = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
            for batch in stream_array(stream, "traceEvents", KEEP_KEYS, result):
                cols.add(batch)
                del batch
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ProfileError(f"{path}: cannot read gzip data, truncated or corrupt "
                           f"({exc})") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read ({exc})") from None
    except JSONStreamError as exc:
        raise ProfileError(f"{path}: not valid JSON, truncated or corrupt ({exc})") from None
    return result.found, result.extras


def _doc_batches(events: list[Any]) -> Iterator[list[Any]]:
    for i in range(0, len(events), DOC_BATCH):
        yield events[i:i + DOC_BATCH]


def load_kineto(path: Path, doc: Any | None = None) -> Profile:
    """Read a Kineto Chrome trace (``.json`` or ``.json.gz``), streaming its events.

    ``doc``, when given, is the already parsed document (``read_json_document``) and is
    used instead of reading ``path``.
    """
    cols = _Columns()
    no_trace = ProfileError(f"{path}: not a Chrome trace (no traceEvents list)")
    try:
        if doc is None:
            found, extras = _stream_events(path, cols)
            if not found:
                raise no_trace
            props = extras.get("deviceProperties")
        else:
            events = doc.get("traceEvents") if isinstance(doc, dict) else doc
            if not isinstance(events, list):
                raise no_trace
            for batch in _doc_batches(events):
                cols.add(batch)
            props = doc.get("deviceProperties") if isinstance(doc, dict) else None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError,
            pl.exceptions.PolarsError) as exc:
        raise ProfileError(f"{path}: malformed trace event ({type(exc).__name__}: {exc})") from None
    of = _concat(cols.op_frames, _OPS_COLS)
    lf = _concat(cols.launch_frames, _LAUNCH_COLS)
    rf = _concat(cols.range_frames, _RANGE_COLS)
    proc_names, thread_names = cols.proc_names, cols.thread_names
    del cols

    names = sorted(set(of["name"].unique().to_list()) | set(lf["name"].unique().to_list()))
    strings = pl.DataFrame({"id": range(len(names)), "value": names}, schema=STRINGS_SCHEMA)
    name_ids = {n: i for i, n in enumerate(names)}

    def proc_expr(pid: pl.Expr) -> pl.Expr:
        return pid.cast(pl.UInt64) * (1 << 24)

    def tid_expr(pid: pl.Expr, tid: pl.Expr) -> pl.Expr:
        return proc_expr(pid) + (tid.cast(pl.Int64) % (1 << 24)).cast(pl.UInt64)

    launch_frame = conform(lf.with_columns(
        proc=proc_expr(pl.col("pid")), tid=tid_expr(pl.col("pid"), pl.col("tid")),
        name_id=pl.col("name").replace_strict(name_ids, return_dtype=pl.Int64, default=None),
    ), LAUNCHES_SCHEMA)
    # A GPU event's pid is its device; its process is the one whose runtime call has the
    # same correlation id (unique within one process's trace).
    owner = launch_frame.select("correlation", "proc").unique("correlation", keep="first")
    default_proc = (launch_frame["proc"].mode().sort()[0] if launch_frame.height
                    else 0)
    of = of.join(owner, on="correlation", how="left", maintain_order="left").with_columns(
        proc=pl.col("proc").fill_null(pl.lit(default_proc, pl.UInt64)),
        name_id=pl.col("name").replace_strict(name_ids, return_dtype=pl.Int64, default=None))
    op_frame = conform(of, OPS_SCHEMA)
    range_frame = conform(rf.with_row_index("range_id").with_columns(
        proc=proc_expr(pl.col("pid")), tid=tid_expr(pl.col("pid"), pl.col("tid")),
        style=pl.lit("pushpop")), RANGES_SCHEMA)

    processes = pl.DataFrame(
        {"proc": [p * (1 << 24) for p in proc_names], "pid": list(proc_names),
         "name": list(proc_names.values())}, schema=PROCESSES_SCHEMA)
    threads = pl.DataFrame(
        {"tid": [p * (1 << 24) + t % (1 << 24) for p, t in thread_names],
         "name": list(thread_names.values())}, schema=THREADS_SCHEMA)
    devices = pl.DataFrame(
        [{"device": d.get("id"), "name": d.get("name")} for d in props or []
         if isinstance(d, dict)], schema=DEVICES_SCHEMA)
    node_tracing = bool(op_frame.height) and op_frame["graph_node"].is_not_null().any()
    return Profile(source="kineto", path=str(path), ops=op_frame, launches=launch_frame,
                   ranges=range_frame, strings=strings, processes=processes, threads=threads,
                   devices=devices, graph_node_tracing=node_tracing)

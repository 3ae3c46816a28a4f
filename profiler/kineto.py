"""PyTorch profiler (Kineto) Chrome-trace JSON -> :class:`~agentload.profiler.model.Profile`.

Facts this relies on (checked on torch 2.11 / CUPTI 13 traces from an H200):

- ``ts``/``dur`` are µs with three decimals, so ``round(ts * 1000)`` is exact ns.
- GPU events (``kernel``, ``gpu_memcpy``, ``gpu_memset``) carry ``pid`` = device index and
  ``tid`` = stream; their ``args.correlation`` equals the launching ``cuda_runtime`` (or
  ``cuda_driver``) event's, which sits on the real OS pid/tid.
- ``user_annotation`` events are ``record_function`` ranges on CPU threads: they nest per
  thread like NVTX push/pop ranges. ``gpu_user_annotation`` is Kineto's projection of
  the same ranges onto the GPU and is not used (attribution goes through the launch).
- Kernels of a CUDA-graph replay all carry the ``cudaGraphLaunch``'s correlation and, in
  builds up to at least torch 2.11, no graph node id; newer Kineto may add
  ``graph node id``, which is read when present.

The whole document is parsed at once (JSON has no chunk boundaries); the per-event
Python work is one pass that appends to column lists.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from agentload.profiler.errors import ProfileError
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


def load_kineto(path: Path, doc: Any | None = None) -> Profile:
    """Read a Kineto Chrome trace (``.json`` or ``.json.gz``)."""
    if doc is None:
        doc = read_json_document(path)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ProfileError(f"{path}: not a Chrome trace (no traceEvents list)")
    ops: dict[str, list[Any]] = {k: [] for k in ("kind", "start", "end", "device", "stream",
                                                 "correlation", "name", "graph_node")}
    launches: dict[str, list[Any]] = {k: [] for k in ("pid", "tid", "start", "end",
                                                      "correlation", "name")}
    ranges: dict[str, list[Any]] = {k: [] for k in ("pid", "tid", "start", "end", "name")}
    proc_names: dict[int, str] = {}
    thread_names: dict[tuple[int, int], str] = {}
    try:
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
            elif ph == "X" and cat in RANGE_CATS:
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
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProfileError(f"{path}: malformed trace event ({type(exc).__name__}: {exc})") from None

    names = sorted(set(ops["name"]) | set(launches["name"]))
    strings = pl.DataFrame({"id": range(len(names)), "value": names}, schema=STRINGS_SCHEMA)
    name_ids = {n: i for i, n in enumerate(names)}

    def proc_expr(pid: pl.Expr) -> pl.Expr:
        return pid.cast(pl.UInt64) * (1 << 24)

    def tid_expr(pid: pl.Expr, tid: pl.Expr) -> pl.Expr:
        return proc_expr(pid) + (tid.cast(pl.Int64) % (1 << 24)).cast(pl.UInt64)

    lf = pl.DataFrame(launches, schema={"pid": pl.Int64, "tid": pl.Int64, "start": pl.Int64,
                                        "end": pl.Int64, "correlation": pl.Int64,
                                        "name": pl.String})
    launch_frame = conform(lf.with_columns(
        proc=proc_expr(pl.col("pid")), tid=tid_expr(pl.col("pid"), pl.col("tid")),
        name_id=pl.col("name").replace_strict(name_ids, return_dtype=pl.Int64, default=None),
    ), LAUNCHES_SCHEMA)
    of = pl.DataFrame(ops, schema={"kind": pl.String, "start": pl.Int64, "end": pl.Int64,
                                   "device": pl.Int64, "stream": pl.Int64,
                                   "correlation": pl.Int64, "name": pl.String,
                                   "graph_node": pl.Int64})
    # A GPU event's pid is its device; its process is the one whose runtime call has the
    # same correlation id (unique within one process's trace).
    owner = launch_frame.select("correlation", "proc").unique("correlation", keep="first")
    default_proc = (launch_frame["proc"].mode().sort()[0] if launch_frame.height
                    else 0)
    of = of.join(owner, on="correlation", how="left").with_columns(
        proc=pl.col("proc").fill_null(pl.lit(default_proc, pl.UInt64)),
        name_id=pl.col("name").replace_strict(name_ids, return_dtype=pl.Int64, default=None))
    op_frame = conform(of, OPS_SCHEMA)
    rf = pl.DataFrame(ranges, schema={"pid": pl.Int64, "tid": pl.Int64, "start": pl.Int64,
                                      "end": pl.Int64, "name": pl.String})
    range_frame = conform(rf.with_row_index("range_id").with_columns(
        proc=proc_expr(pl.col("pid")), tid=tid_expr(pl.col("pid"), pl.col("tid")),
        style=pl.lit("pushpop")), RANGES_SCHEMA)

    processes = pl.DataFrame(
        {"proc": [p * (1 << 24) for p in proc_names], "pid": list(proc_names),
         "name": list(proc_names.values())}, schema=PROCESSES_SCHEMA)
    threads = pl.DataFrame(
        {"tid": [p * (1 << 24) + t % (1 << 24) for p, t in thread_names],
         "name": list(thread_names.values())}, schema=THREADS_SCHEMA)
    props = doc.get("deviceProperties") if isinstance(doc, dict) else None
    devices = pl.DataFrame(
        [{"device": d.get("id"), "name": d.get("name")} for d in props or []
         if isinstance(d, dict)], schema=DEVICES_SCHEMA)
    node_tracing = bool(op_frame.height) and op_frame["graph_node"].is_not_null().any()
    return Profile(source="kineto", path=str(path), ops=op_frame, launches=launch_frame,
                   ranges=range_frame, strings=strings, processes=processes, threads=threads,
                   devices=devices, graph_node_tracing=node_tracing)

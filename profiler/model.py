"""The profiler's tables: one normalized shape for Nsight Systems and Kineto profiles.

Every ingest path (Nsight SQLite, Nsight Parquet/Arrow directories, Kineto JSON) ends
in a :class:`Profile` of polars frames with the columns below, so attribution and the
reports never see a file format. Times are integer nanoseconds on the profile's own
timeline. ``proc`` is a process key laid out like Nsight's ``globalPid``
(``<hw:8><vm:8><pid:24><tid:24 = 0>``) and ``tid`` like its ``globalTid``; both are
``UInt64`` because the top bit may be set (SQLite hands them back as signed). Kernel
names stay integer ids into ``strings`` until after aggregation, which keeps a
10 M-kernel table at a few hundred MB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

PID_MASK = 0xFFFFFFFFFF000000
"""``globalTid & PID_MASK`` is the ``globalPid`` of the thread's process."""

OP_KINDS = ("kernel", "memcpy", "memset", "graph")
"""GPU op kinds; ``graph`` is a whole CUDA-graph execution whose kernels were not traced."""

OPS_SCHEMA: dict[str, pl.DataType] = {
    "proc": pl.UInt64(), "kind": pl.Enum(OP_KINDS), "start": pl.Int64(), "end": pl.Int64(),
    "device": pl.Int64(), "stream": pl.Int64(), "correlation": pl.Int64(),
    "name_id": pl.Int64(), "graph_node": pl.Int64(), "graph_id": pl.Int64(),
}
LAUNCHES_SCHEMA: dict[str, pl.DataType] = {
    "proc": pl.UInt64(), "tid": pl.UInt64(), "correlation": pl.Int64(),
    "start": pl.Int64(), "end": pl.Int64(), "name_id": pl.Int64(),
}
RANGE_STYLES = ("pushpop", "startend")
RANGES_SCHEMA: dict[str, pl.DataType] = {
    "proc": pl.UInt64(), "tid": pl.UInt64(), "start": pl.Int64(), "end": pl.Int64(),
    "name": pl.String(), "style": pl.Enum(RANGE_STYLES), "range_id": pl.Int64(),
    "domain": pl.String(), "category": pl.String(),
}
"""``domain``: the NVTX domain's name (``nvtxDomainCreate``); null for NVTX's default
domain, which ``torch.cuda.nvtx`` and vLLM use, and for ``record_function`` ranges.
``category``: the NVTX category's name (``nvtxNameCategory``), or its number where it
was never named; null for no category and for ``record_function`` ranges."""
STRINGS_SCHEMA: dict[str, pl.DataType] = {"id": pl.Int64(), "value": pl.String()}
GRAPH_NODES_SCHEMA: dict[str, pl.DataType] = {
    "proc": pl.UInt64(), "tid": pl.UInt64(), "start": pl.Int64(), "end": pl.Int64(),
    "node": pl.Int64(), "original": pl.Int64(),
}
PROCESSES_SCHEMA: dict[str, pl.DataType] = {
    "proc": pl.UInt64(), "pid": pl.Int64(), "name": pl.String()}
THREADS_SCHEMA: dict[str, pl.DataType] = {"tid": pl.UInt64(), "name": pl.String()}
DEVICES_SCHEMA: dict[str, pl.DataType] = {"device": pl.Int64(), "name": pl.String()}


def empty(schema: dict[str, pl.DataType]) -> pl.DataFrame:
    """A frame with no rows and ``schema``'s columns."""
    return pl.DataFrame(schema=schema)


def conform(frame: pl.DataFrame, schema: dict[str, pl.DataType]) -> pl.DataFrame:
    """``frame`` with exactly ``schema``'s columns, in order, cast; missing ones null."""
    cols = [(pl.col(name) if name in frame.columns else pl.lit(None)).cast(dtype).alias(name)
            for name, dtype in schema.items()]
    return frame.select(cols)


def keep_rows(frame: pl.DataFrame, keep: pl.Expr) -> pl.DataFrame:
    """``frame`` where ``keep`` holds (a null is not kept, as ``filter`` has it); the
    frame itself, not a copy of every column, when it holds on every row."""
    mask = frame.select(keep).to_series()
    return frame if not mask.null_count() and mask.all() else frame.filter(mask)


def as_int(value: object, default: int = 0) -> int:
    """A polars scalar (``Series.max()`` and friends) as an int; ``default`` when null."""
    return int(value) if isinstance(value, int | float) else default


def pid_of(proc: pl.Expr) -> pl.Expr:
    """The OS pid in a ``globalPid``/``globalTid`` (bits 24-47)."""
    return ((proc.cast(pl.UInt64) // (1 << 24)) % (1 << 24)).cast(pl.Int64)


def tid_of(tid: pl.Expr) -> pl.Expr:
    """The OS thread id in a ``globalTid`` (bits 0-23)."""
    return (tid.cast(pl.UInt64) % (1 << 24)).cast(pl.Int64)


@dataclass(frozen=True, slots=True)
class Profile:
    """One profile's events, normalized.

    ``ops``: GPU work (kernels, memcpy, memset, and opaque ``graph`` executions), each
    with its launch's ``correlation``. ``launches``: the CPU-side CUDA API calls (runtime
    and driver). ``ranges``: NVTX or ``record_function`` ranges on CPU threads, closed
    (an open range is clamped to the profile's end, and said so in ``notes``).
    ``graph_nodes``: CUDA-graph node creation events (capture time), with the node each
    was cloned from. ``notes``: what the ingest had to assume or drop; ``warnings``:
    what the profiler itself reported losing.
    """

    source: str
    path: str
    ops: pl.DataFrame
    launches: pl.DataFrame
    ranges: pl.DataFrame
    strings: pl.DataFrame
    graph_nodes: pl.DataFrame = field(default_factory=lambda: empty(GRAPH_NODES_SCHEMA))
    processes: pl.DataFrame = field(default_factory=lambda: empty(PROCESSES_SCHEMA))
    threads: pl.DataFrame = field(default_factory=lambda: empty(THREADS_SCHEMA))
    devices: pl.DataFrame = field(default_factory=lambda: empty(DEVICES_SCHEMA))
    notes: tuple[str, ...] = ()
    graph_node_tracing: bool = False
    warnings: tuple[str, ...] = ()
    """The recorder's own warnings (Nsight's ``DIAGNOSTIC_EVENT``: dropped events, buffer
    overflows): the profile may be missing events, so the user is told, not only noted."""
    """True when replayed graph kernels carry node ids (``--cuda-graph-trace=node``)."""

"""Synthetic Nsight Systems SQLite exports, written to the documented schema (3.30.x).

Used by the tests (small exports whose ground truth is known by construction) and by
``agentload bench profiler`` (10 M kernels). The tables and column names are those of
NVIDIA's SQLite schema reference; only the columns attribution reads, plus a few that
real exports always have, are filled. ``globalTid`` is laid out as
``<hw:8><vm:8><pid:24><tid:24>`` and ``globalPid`` is the same with the tid bits zero;
correlation ids restart in every process, as CUPTI's do.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT);
CREATE TABLE PROCESSES (globalPid INTEGER, pid INTEGER, name TEXT);
CREATE TABLE ThreadNames (nameId INTEGER, priority INTEGER, globalTid INTEGER);
CREATE TABLE TARGET_INFO_GPU (vmId INTEGER, id INTEGER, name TEXT, busLocation TEXT,
    uuid TEXT, smCount INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER,
    streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
    demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, mangledName INTEGER,
    launchType INTEGER, cacheConfig INTEGER, registersPerThread INTEGER,
    gridX INTEGER, gridY INTEGER, gridZ INTEGER, blockX INTEGER, blockY INTEGER,
    blockZ INTEGER, staticSharedMemory INTEGER, dynamicSharedMemory INTEGER,
    localMemoryPerThread INTEGER, localMemoryTotal INTEGER, gridId INTEGER,
    sharedMemoryExecuted INTEGER, graphNodeId INTEGER, sharedMemoryLimitConfig INTEGER,
    qmdBulkReleaseDone INTEGER, qmdPreexitDone INTEGER, qmdLastCtaDone INTEGER,
    graphId INTEGER, clusterX INTEGER, clusterY INTEGER, clusterZ INTEGER,
    clusterSchedulingPolicy INTEGER, maxPotentialClusterSize INTEGER,
    maxActiveClusters INTEGER, sharedMemoryRequestedPercentage INTEGER,
    tensorSizeMinusOneElements INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER,
    streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER, bytes INTEGER,
    copyKind INTEGER, graphNodeId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER,
    streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER, value INTEGER,
    bytes INTEGER, graphNodeId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL,
    eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER,
    nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL, callchainId INTEGER);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
    rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER,
    endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, uint64Value INTEGER,
    int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER,
    floatValue REAL, jsonTextId INTEGER, jsonText TEXT, binaryData TEXT,
    eventId INTEGER PRIMARY KEY);
CREATE TABLE CUDA_GRAPH_NODE_EVENTS (start INTEGER NOT NULL, end INTEGER,
    eventClass INTEGER NOT NULL, globalTid INTEGER, nameId INTEGER NOT NULL,
    graphNodeId INTEGER NOT NULL, originalGraphNodeId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_GRAPH_TRACE (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, greenContextId INTEGER,
    streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
    graphId INTEGER NOT NULL, graphExecId INTEGER NOT NULL);
"""

PUSHPOP = 59
STARTEND = 60
DOMAIN_CREATE = 75
CATEGORY_NAME = 33
LAUNCH_KERNEL = "cudaLaunchKernel_v7000"
GRAPH_LAUNCH = "cudaGraphLaunch_v10000"


def global_pid(pid: int, hw: int = 0, vm: int = 0) -> int:
    """``globalPid`` as nsys writes it, as a signed SQLite integer."""
    return to_signed((hw << 56) | (vm << 48) | (pid << 24))


def global_tid(pid: int, tid: int, hw: int = 0, vm: int = 0) -> int:
    """``globalTid``: the process's ``globalPid`` with the thread id in the low 24 bits."""
    return to_signed((hw << 56) | (vm << 48) | (pid << 24) | tid)


def to_signed(value: int) -> int:
    """A 64-bit unsigned id as SQLite stores it (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def proc_of(gtid: int) -> int:
    """The ``globalPid`` of a (signed) ``globalTid``."""
    return to_signed((gtid & 0xFFFFFFFFFFFFFFFF) & 0xFFFFFFFFFF000000)


@dataclass
class SyntheticExport:
    """A small export built call by call; :meth:`write` makes the SQLite file.

    Correlation ids are handed out per process, like CUPTI's, so two processes reuse
    the same ids and a join that ignores ``globalPid`` is wrong on purpose.
    """

    schema_version: str = "3.30.1"
    strings: dict[str, int] = field(default_factory=dict)
    rows: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    _corr: dict[int, int] = field(default_factory=dict)
    _event: int = 0

    def sid(self, value: str) -> int:
        """The StringIds id of ``value`` (added on first use)."""
        if value not in self.strings:
            self.strings[value] = len(self.strings) + 1
        return self.strings[value]

    def _add(self, table: str, row: tuple[Any, ...]) -> None:
        self.rows.setdefault(table, []).append(row)

    def process(self, pid: int, name: str, hw: int = 0) -> int:
        gpid = global_pid(pid, hw)
        self._add("PROCESSES", (gpid, pid, name))
        return gpid

    def thread(self, pid: int, tid: int, name: str = "", hw: int = 0) -> int:
        gtid = global_tid(pid, tid, hw)
        if name:
            self._add("ThreadNames", (self.sid(name), 0, gtid))
        return gtid

    def gpu(self, device: int, name: str = "NVIDIA H200") -> None:
        self._add("TARGET_INFO_GPU", (0, device, name, "0000:00:00.0", "GPU-0", 132))

    def push(self, gtid: int, start: int, end: int | None, text: str,
             registered: bool = False, domain: int = 0, category: int | None = None) -> int:
        """A push/pop range; ``registered`` puts the text in ``textId`` (nvtx package);
        ``domain``: a domain id from :meth:`domain` (0: NVTX's default domain);
        ``category``: a category id (named or not by :meth:`category`)."""
        return self._range(PUSHPOP, gtid, start, end, text, registered, None, domain,
                           category)

    def start_end(self, gtid: int, start: int, end: int, text: str,
                  end_tid: int | None = None, registered: bool = False,
                  domain: int = 0, category: int | None = None) -> int:
        """A start/end range; ``end_tid`` set when another thread ended it."""
        return self._range(STARTEND, gtid, start, end, text, registered, end_tid, domain,
                           category)

    def domain(self, gtid: int, domain_id: int, name: str, at: int = 0) -> None:
        """``nvtxDomainCreate``: an ``eventType`` 75 row naming ``domain_id`` in the
        thread's process."""
        self._event += 1
        self._add("NVTX_EVENTS", (at, None, DOMAIN_CREATE, None, name, gtid, None, None,
                                  domain_id, None, self._event))

    def category(self, gtid: int, category_id: int, name: str, domain: int | None = 0,
                 at: int = 0) -> None:
        """``nvtxNameCategory``: an ``eventType`` 33 row naming ``category_id`` in the
        thread's process and ``domain`` (None: as a default-domain call may record it)."""
        self._event += 1
        self._add("NVTX_EVENTS", (at, None, CATEGORY_NAME, None, name, gtid, None, None,
                                  domain, category_id, self._event))

    def _range(self, kind: int, gtid: int, start: int, end: int | None, text: str,
               registered: bool, end_tid: int | None, domain: int = 0,
               category: int | None = None) -> int:
        self._event += 1
        self._add("NVTX_EVENTS", (start, end, kind, None if kind == PUSHPOP else self._event,
                                  None if registered else text, gtid, end_tid,
                                  self.sid(text) if registered else None, domain,
                                  category, self._event))
        return self._event

    def next_corr(self, gtid: int) -> int:
        proc = proc_of(gtid)
        self._corr[proc] = self._corr.get(proc, 0) + 1
        return self._corr[proc]

    def launch(self, gtid: int, start: int, end: int, api: str = LAUNCH_KERNEL) -> int:
        """A runtime call; returns its correlation id."""
        corr = self.next_corr(gtid)
        self._add("CUPTI_ACTIVITY_KIND_RUNTIME", (start, end, 0, gtid, corr, self.sid(api), 0))
        return corr

    def kernel(self, gtid: int, corr: int, start: int, end: int, name: str, device: int = 0,
               stream: int = 7, graph_node: int | None = None,
               graph_id: int | None = None) -> None:
        short = name.split("<")[0].split("(")[0].replace("void ", "")
        self._add("CUPTI_ACTIVITY_KIND_KERNEL", (
            start, end, device, 1, None, stream, corr, proc_of(gtid), self.sid(name),
            self.sid(short), None, 0, 1, 1, 1, 128, 1, 1, graph_node, graph_id))

    def launch_kernel(self, gtid: int, api_start: int, gpu_start: int, name: str,
                      api_ns: int = 2_000, gpu_ns: int = 5_000, **kw: Any) -> int:
        """``launch`` then ``kernel`` in one call; returns the correlation id."""
        corr = self.launch(gtid, api_start, api_start + api_ns)
        self.kernel(gtid, corr, gpu_start, gpu_start + gpu_ns, name, **kw)
        return corr

    def memcpy(self, gtid: int, corr: int, start: int, end: int, stream: int = 7) -> None:
        self._add("CUPTI_ACTIVITY_KIND_MEMCPY",
                  (start, end, 0, 1, None, stream, corr, proc_of(gtid), 4096, 1, None))

    def memset(self, gtid: int, corr: int, start: int, end: int, stream: int = 7) -> None:
        self._add("CUPTI_ACTIVITY_KIND_MEMSET",
                  (start, end, 0, 1, None, stream, corr, proc_of(gtid), 0, 4096, None))

    def graph_node(self, gtid: int, start: int, end: int, node: int,
                   original: int | None = None) -> None:
        """A node creation event (77: during capture) or a clone at instantiation."""
        self._add("CUDA_GRAPH_NODE_EVENTS",
                  (start, end, 77, gtid, self.sid("kernel node"), node, original))

    def graph_exec(self, gtid: int, corr: int, start: int, end: int, graph_id: int,
                   device: int = 0, stream: int = 7) -> None:
        """A whole-graph execution (``--cuda-graph-trace=graph``)."""
        self._add("CUPTI_ACTIVITY_KIND_GRAPH_TRACE",
                  (start, end, device, 1, None, stream, corr, proc_of(gtid), graph_id, 1))

    def write(self, path: Path) -> Path:
        write_tables(path, self.rows, self.strings, self.schema_version)
        return path


INSERT_COLUMNS = {
    "PROCESSES": "globalPid, pid, name",
    "ThreadNames": "nameId, priority, globalTid",
    "TARGET_INFO_GPU": "vmId, id, name, busLocation, uuid, smCount",
    "NVTX_EVENTS": "start, end, eventType, rangeId, text, globalTid, endGlobalTid, textId, "
                   "domainId, category, eventId",
    "CUPTI_ACTIVITY_KIND_RUNTIME": "start, end, eventClass, globalTid, correlationId, nameId, "
                                   "returnValue",
    "CUPTI_ACTIVITY_KIND_KERNEL": "start, end, deviceId, contextId, greenContextId, streamId, "
                                  "correlationId, globalPid, demangledName, shortName, "
                                  "mangledName, launchType, gridX, gridY, gridZ, blockX, "
                                  "blockY, blockZ, graphNodeId, graphId",
    "CUPTI_ACTIVITY_KIND_MEMCPY": "start, end, deviceId, contextId, greenContextId, streamId, "
                                  "correlationId, globalPid, bytes, copyKind, graphNodeId",
    "CUPTI_ACTIVITY_KIND_MEMSET": "start, end, deviceId, contextId, greenContextId, streamId, "
                                  "correlationId, globalPid, value, bytes, graphNodeId",
    "CUDA_GRAPH_NODE_EVENTS": "start, end, eventClass, globalTid, nameId, graphNodeId, "
                              "originalGraphNodeId",
    "CUPTI_ACTIVITY_KIND_GRAPH_TRACE": "start, end, deviceId, contextId, greenContextId, "
                                       "streamId, correlationId, globalPid, graphId, "
                                       "graphExecId",
}


def write_tables(path: Path, rows: Mapping[str, Iterable[tuple[Any, ...]]],
                 strings: dict[str, int], schema_version: str = "3.30.1") -> None:
    """Create the schema in a new SQLite file and insert ``rows`` per table.

    Like nsys (without ``--lazy=false``), a table with no rows is not created.
    """
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA journal_mode=OFF")
        con.execute("PRAGMA synchronous=OFF")
        wanted = {"StringIds", "META_DATA_EXPORT", *rows}
        for stmt in SCHEMA.split(";"):
            stmt = stmt.strip()
            if stmt and stmt.split()[2] in wanted:
                con.execute(stmt)
        con.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_SCHEMA_VERSION', ?)",
                    (schema_version,))
        con.executemany("INSERT INTO StringIds VALUES (?, ?)",
                        [(i, s) for s, i in strings.items()])
        for table, table_rows in rows.items():
            cols = INSERT_COLUMNS[table]
            marks = ", ".join("?" * len(cols.split(",")))
            con.executemany(f"INSERT INTO {table} ({cols}) VALUES ({marks})", table_rows)
        con.commit()
    finally:
        con.close()


def write_dir_export(db: Path, out: Path, suffix: str = ".parquet") -> Path:
    """``db``'s tables as an nsys ``parquetdir`` (``suffix=".parquet"``) or ``arrowdir``
    (``".arrow"``) export: one file per table, ids as uint64 as those exports write them."""
    import polars as pl

    out.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(db)
    try:
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'"):
            frame = pl.read_database(f'SELECT * FROM "{table}"', con, infer_schema_length=None)
            for col in ("globalPid", "globalTid", "endGlobalTid"):
                if col in frame.columns:
                    frame = frame.with_columns(
                        pl.col(col).cast(pl.Int64).reinterpret(signed=False))
            if suffix == ".parquet":
                frame.write_parquet(out / f"{table}.parquet")
            else:
                frame.write_ipc(out / f"{table}{suffix}", compression="uncompressed")
    finally:
        con.close()
    return out

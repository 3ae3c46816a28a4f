"""Nsight Systems exports -> :class:`~agentload.profiler.model.Profile`.

Two containers, one schema (the exporter's, documented for schema 3.30.1 in NVIDIA's
Post-Collection Analysis Guide): ``nsys export --type sqlite`` files, and
``--type parquetdir`` / ``arrowdir`` directories holding one file per table. Tables are
created lazily by the exporter (an empty one is simply absent) and columns come and go
between schema versions, so every read asks which columns exist and fills the rest
with nulls. Rows are read in chunks, only the needed columns, and kernel names stay
integer ids into ``StringIds``.

Joins follow the shipped reports: kernel -> runtime call on ``correlationId`` *and*
``globalPid`` (correlation ids repeat across processes); NVTX names are
``COALESCE(text, StringIds[textId])``; pid and tid come from ``globalTid`` bits.

SQLite files are read straight from SQLite's file format (:mod:`.sqlitefile`: the
table's B-tree pages decoded in compiled loops, about 10x ADBC's driver), the three big
tables on two threads at once. What that reader does not fully understand goes to ADBC's
SQLite driver (C into Arrow, about 4x Python's ``sqlite3`` row fetch) and then to
Python's ``sqlite3``, the last word, which also reports what is wrong with a damaged
file or a value of the wrong type.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import numpy as np
import polars as pl

from agentload.profiler import sqlitefile
from agentload.profiler.errors import ProfileError
from agentload.profiler.model import (
    DEVICES_SCHEMA,
    GRAPH_NODES_SCHEMA,
    LAUNCHES_SCHEMA,
    OPS_SCHEMA,
    PID_MASK,
    PROCESSES_SCHEMA,
    RANGES_SCHEMA,
    STRINGS_SCHEMA,
    THREADS_SCHEMA,
    Profile,
    as_int,
    conform,
    empty,
    keep_rows,
    pid_of,
)

CHUNK_ROWS = 262_144
"""Rows fetched from SQLite at a time: bounds the Python objects alive at once."""

KERNEL = "CUPTI_ACTIVITY_KIND_KERNEL"
MEMCPY = "CUPTI_ACTIVITY_KIND_MEMCPY"
MEMSET = "CUPTI_ACTIVITY_KIND_MEMSET"
RUNTIME = "CUPTI_ACTIVITY_KIND_RUNTIME"
GRAPH_TRACE = "CUPTI_ACTIVITY_KIND_GRAPH_TRACE"
NVTX = "NVTX_EVENTS"
GRAPH_NODES = "CUDA_GRAPH_NODE_EVENTS"
KNOWN_TABLES = (KERNEL, MEMCPY, MEMSET, RUNTIME, GRAPH_TRACE, NVTX, GRAPH_NODES, "StringIds",
                "DIAGNOSTIC_EVENT",
                "TARGET_INFO_GPU", "PROCESSES", "ThreadNames", "META_DATA_EXPORT")
"""Any one of these marks a file as an Nsight export; a file with none of them is foreign."""

PUSHPOP = (59, 70)  # NvtxPushPopRange; 70 = the same from imported NVTXT files
STARTEND = (60, 71)  # NvtxStartEndRange; 71 likewise
DOMAIN_CREATE = 75  # NvtxDomainCreate: names a domain id within its process
CATEGORY_NAME = 33  # NvtxCategory: names a category id within its process and domain
NVTX_COLUMNS = ["start", "end", "eventType", "globalTid", "endGlobalTid", "text", "textId",
                "eventId", "rangeId", "domainId", "category"]
NVTX_KINDS = PUSHPOP + STARTEND + (DOMAIN_CREATE, CATEGORY_NAME)
NVTX_WHERE = f"WHERE eventType IN ({','.join(map(str, NVTX_KINDS))})"
WHERE_FILTERS = {"": None, NVTX_WHERE: pl.col("eventType").is_in(NVTX_KINDS)}
"""The WHERE clauses this module asks for, as the filters the native reader applies
after decoding (it reads whole tables); another clause goes to the SQLite driver."""
GPU_COLUMNS = ["start", "end", "deviceId", "streamId", "correlationId", "globalPid",
               "graphNodeId", "graphId"]
KERNEL_COLUMNS = [*GPU_COLUMNS, "demangledName", "shortName"]
RUNTIME_COLUMNS = ["start", "end", "globalTid", "correlationId", "nameId"]
SIGNED_IDS = ("globalPid", "globalTid", "endGlobalTid")
"""SQLite has only signed 64-bit ints: these come back negative when the HW id's top bit
is set, so they are reinterpreted (not cast) to UInt64 before any bit arithmetic."""


SQLITE_READER_ENV = "AGENTLOAD_SQLITE_READER"
"""``driver`` reads SQLite exports through ADBC / ``sqlite3`` only, not the native page
reader (a way out should the native reader ever misread an export; the benchmark
uses it to time the driver side by side)."""


def _native_reader_on() -> bool:
    return os.environ.get(SQLITE_READER_ENV, "native").strip().lower() != "driver"


class _Source(Protocol):
    """A container of exporter tables: SQLite file or per-table file directory."""

    path: Path

    def tables(self) -> set[str]: ...

    def columns(self, table: str) -> list[str]: ...

    def not_null(self, table: str) -> set[str]:
        """The columns the schema declares ``NOT NULL`` (where the container says)."""

    def read(self, table: str, columns: list[str], where: str = "") -> pl.DataFrame: ...

    def prefetch(self, reads: list[tuple[str, list[str], str]]) -> None:
        """Start reading these ``(table, columns, where)`` now (the next ``read`` of
        each returns the result); a hint a source may ignore."""


class _SqliteSource:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            # Read-only and immutable: never creates a journal next to a user's export.
            self.con = sqlite3.connect(_ro_uri(path), uri=True)
            names = self.con.execute(
                "SELECT name FROM sqlite_master WHERE type IN ('table','view')").fetchall()
        except sqlite3.Error as exc:
            raise ProfileError(f"{path}: not a readable SQLite file ({exc})") from None
        self._tables = {n for (n,) in names}
        self._cols: dict[str, list[str]] = {}
        self._not_null: dict[str, set[str]] = {}
        self._ready: dict[tuple[str, tuple[str, ...], str], pl.DataFrame] = {}
        self._no_fast: set[tuple[str, tuple[str, ...], str]] = set()
        self._layouts: dict[str, sqlitefile.TableLayout | None] = {}

    def tables(self) -> set[str]:
        return self._tables

    def columns(self, table: str) -> list[str]:
        if table not in self._cols:
            rows = self.con.execute(f'PRAGMA table_info("{table}")').fetchall()
            self._cols[table] = [r[1] for r in rows]
            self._not_null[table] = {r[1] for r in rows if r[3]}
        return self._cols[table]

    def not_null(self, table: str) -> set[str]:
        self.columns(table)
        return self._not_null[table]

    def prefetch(self, reads: list[tuple[str, list[str], str]]) -> None:
        wanted = [(t, c, w) for t, c, w in reads if t in self._tables]
        if len(wanted) < 2:
            return
        for t, _, _ in wanted:
            self.columns(t)  # on this thread: the sqlite3 connection stays on it
        for (t, c, w), frame in zip(wanted, self._read_native(wanted), strict=True):
            if frame is not None:
                self._ready[(t, tuple(c), w)] = frame
        rest = [r for r in wanted if (r[0], tuple(r[1]), r[2]) not in self._ready]
        with ThreadPoolExecutor(2, thread_name_prefix="agentload-sqlite") as pool:
            done = list(pool.map(lambda r: self._read_adbc(*r), rest))
        for (t, c, w), adbc in zip(rest, done, strict=True):
            if adbc is not None:
                self._ready[(t, tuple(c), w)] = adbc
            else:  # neither fast reader could: straight to sqlite3 next time
                self._no_fast.add((t, tuple(c), w))

    def _layout(self, table: str) -> sqlitefile.TableLayout | None:
        if table not in self._layouts:
            try:
                self._layouts[table] = sqlitefile.table_layout(self.con, table)
            except sqlite3.Error:
                self._layouts[table] = None
        return self._layouts[table]

    def _read_native(self, reads: list[tuple[str, list[str], str]]
                     ) -> list[pl.DataFrame | None]:
        """Each ``(table, columns, where)`` read by :mod:`.sqlitefile` (all at once, on two
        threads), its WHERE applied as a filter; None where that reader does not read it
        (switched off, no layout, a clause it has no filter for, or it declined)."""
        if not _native_reader_on():
            return [None] * len(reads)
        native = [i for i, (t, _, w) in enumerate(reads)
                  if self._layout(t) is not None and w in WHERE_FILTERS]
        frames = sqlitefile.read_tables(
            self.path, [(self._layouts[reads[i][0]], reads[i][1])  # type: ignore[misc]
                        for i in native], TEXT_COLUMNS)
        out: list[pl.DataFrame | None] = [None] * len(reads)
        for i, frame in zip(native, frames, strict=True):
            keep = WHERE_FILTERS[reads[i][2]]
            # (NVTX_EVENTS of ranges only, as usual, is returned as it is: no copy.)
            out[i] = frame if frame is None or keep is None else keep_rows(frame, keep)
        return out

    def _read_fast(self, table: str, columns: list[str], where: str) -> pl.DataFrame | None:
        """The native read (:mod:`.sqlitefile`), else ADBC's; None when neither can."""
        (frame,) = self._read_native([(table, columns, where)])
        return frame if frame is not None else self._read_adbc(table, columns, where)

    def read(self, table: str, columns: list[str], where: str = "") -> pl.DataFrame:
        ready = self._ready.pop((table, tuple(columns), where), None)
        if ready is not None:
            return ready
        fast = (None if (table, tuple(columns), where) in self._no_fast
                else self._read_fast(table, columns, where))
        if fast is not None:
            return fast
        have = set(self.columns(table))
        picked = [c for c in columns if c in have]
        ints = [c for c in picked if c not in TEXT_COLUMNS]
        if picked and ints == picked:
            return self._read_ints(table, picked, where)
        sql = f'SELECT {", ".join(picked)} FROM "{table}" {where}'
        try:
            cur = self.con.execute(sql)
            chunks = [pl.DataFrame(rows, schema=picked, orient="row", infer_schema_length=None)
                      for rows in _chunks(cur)]
        except sqlite3.Error as exc:
            raise ProfileError(f"{self.path}: cannot read {table} ({exc})") from None
        if not chunks:
            return pl.DataFrame(schema={c: _null_type(c) for c in picked})
        return _typed_nulls(pl.concat(chunks, how="vertical_relaxed"))

    def _read_ints(self, table: str, picked: list[str], where: str) -> pl.DataFrame:
        """Integer columns straight into numpy (no per-value Python ints kept): NULL is
        mapped to a sentinel inside SQLite so every chunk is one dense int64 array."""
        cols = ", ".join(_sentinel_for_null(c) for c in picked)
        parts: list[np.ndarray] = []
        try:
            for rows in _chunks(self.con.execute(f'SELECT {cols} FROM "{table}" {where}')):
                parts.append(np.array(rows, dtype=np.int64))
        except (sqlite3.Error, TypeError, ValueError, OverflowError) as exc:
            raise ProfileError(f"{self.path}: cannot read {table} ({exc})") from None
        data = (np.concatenate(parts) if parts
                else np.zeros((0, len(picked)), np.int64))
        frame = pl.DataFrame({c: data[:, i] for i, c in enumerate(picked)})
        return frame.with_columns(_null_for_sentinel(c) for c in picked)

    def _read_adbc(self, table: str, columns: list[str], where: str) -> pl.DataFrame | None:
        """The read through ADBC, or None (no driver, or it could not type a column:
        the caller falls back to ``sqlite3``). NULLs are mapped to a sentinel (ints)
        or flagged in a side column (text) inside SQLite, because the driver types a
        column from its first rows and a late non-NULL value would not fit."""
        dbapi = _adbc()
        have = set(self.columns(table))
        picked = [c for c in columns if c in have]
        if dbapi is None or not picked:
            return None
        select = []
        for c in picked:
            if c in TEXT_COLUMNS:
                select += [f'IFNULL("{c}", \'\') AS "{c}"', f'("{c}" IS NULL) AS "{c}{NULL_FLAG}"']
            else:
                select.append(f'{_sentinel_for_null(c)} AS "{c}"')
        sql = f'SELECT {", ".join(select)} FROM "{table}" {where}'
        try:
            with dbapi.connect(_ro_uri(self.path)) as con, con.cursor() as cur:
                cur.adbc_statement.set_options(**{"adbc.sqlite.query.batch_rows": str(CHUNK_ROWS)})
                cur.execute(sql)
                frame = pl.DataFrame(cur.fetch_arrow()).rechunk()
        except Exception:  # any driver failure: the sqlite3 path decides
            return None
        want_int = (pl.Int64, pl.Null)
        if any(frame[c].dtype not in (want_int if c not in TEXT_COLUMNS else (pl.String, pl.Null))
               for c in picked):
            return None  # a value the schema does not expect: sqlite3 reports it
        fixes = []
        for c in picked:
            if c in TEXT_COLUMNS:
                fixes.append(pl.when(pl.col(f"{c}{NULL_FLAG}") == 0)
                             .then(pl.col(c).cast(pl.String)).alias(c))
            else:
                fixes.append(_null_for_sentinel(c).cast(pl.Int64))
        return frame.select(fixes)

    def close(self) -> None:
        self.con.close()


def _ro_uri(path: Path) -> str:
    """A read-only, immutable SQLite URI: never creates a journal next to a user's export;
    the path quoted (a ``#`` or ``?`` in a file name would end the path)."""
    return f"file:{quote(str(path.resolve()))}?mode=ro&immutable=1"


def _adbc() -> Any:
    """ADBC's SQLite DB-API module, or None when it is not installed."""
    try:
        import adbc_driver_sqlite.dbapi as dbapi
    except ImportError:
        return None
    return dbapi


NULL_FLAG = "__agentload_null"
TEXT_COLUMNS = {"text", "name", "value", "jsonText"}
NULL_SENTINEL = -(1 << 63)


def _null_type(column: str) -> pl.DataType:
    return pl.String() if column in TEXT_COLUMNS else pl.Int64()


def _typed_nulls(frame: pl.DataFrame) -> pl.DataFrame:
    """A column that is NULL in every row comes back untyped (``sqlite3`` rows, or an
    export's all-null column): give it its schema type."""
    return frame.with_columns(pl.col(c).cast(_null_type(c)) for c in frame.columns
                              if frame[c].dtype == pl.Null)


def _sentinel_for_null(column: str) -> str:
    """SQL for an integer column with NULL as :data:`NULL_SENTINEL`, so every value is an
    integer (one dense int64 array; one type for a driver that types from first rows)."""
    return f'IFNULL("{column}", {NULL_SENTINEL})'


def _null_for_sentinel(column: str) -> pl.Expr:
    """Back from :func:`_sentinel_for_null`: the sentinel is NULL again."""
    return pl.when(pl.col(column) != NULL_SENTINEL).then(pl.col(column)).alias(column)


def _chunks(cur: sqlite3.Cursor) -> Iterator[list[tuple[object, ...]]]:
    while rows := cur.fetchmany(CHUNK_ROWS):
        yield rows


class _DirSource:
    """``nsys export --type parquetdir|arrowdir``: one ``<TABLE>.parquet`` (or Arrow) each."""

    SUFFIXES = (".parquet", ".arrow", ".arrows", ".feather", ".ipc")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._files: dict[str, Path] = {}
        for f in sorted(path.iterdir()):
            if f.suffix in self.SUFFIXES and f.stem not in self._files:
                self._files[f.stem] = f

    def _scan(self, table: str) -> pl.LazyFrame:
        f = self._files[table]
        try:
            if f.suffix == ".parquet":
                return pl.scan_parquet(f)
            if f.suffix == ".arrows":  # an Arrow IPC *stream*, which cannot be scanned
                return pl.read_ipc_stream(f).lazy()
            return pl.scan_ipc(f)
        except Exception as exc:
            raise ProfileError(f"{f}: cannot read ({exc})") from None

    def tables(self) -> set[str]:
        return set(self._files)

    def columns(self, table: str) -> list[str]:
        try:
            return list(self._scan(table).collect_schema().names())
        except ProfileError:
            raise
        except Exception as exc:
            raise ProfileError(f"{self._files[table]}: cannot read ({exc})") from None

    def not_null(self, table: str) -> set[str]:
        return set()  # Parquet and Arrow schemas say, but polars does not tell

    def prefetch(self, reads: list[tuple[str, list[str], str]]) -> None:
        """Nothing to do: polars reads each file on all cores already."""

    def read(self, table: str, columns: list[str], where: str = "") -> pl.DataFrame:
        have = set(self.columns(table))
        try:
            frame = self._scan(table).select([c for c in columns if c in have]).collect()
        except Exception as exc:
            raise ProfileError(f"{self._files[table]}: cannot read ({exc})") from None
        return _typed_nulls(frame)


def load_nsight(path: Path) -> Profile:
    """Read an Nsight Systems SQLite export, or a Parquet/Arrow directory export."""
    if path.is_dir():
        source: _Source = _DirSource(path)
        kind = "nsight-dir"
    else:
        source = _SqliteSource(path)
        kind = "nsight-sqlite"
    try:
        return _ingest(source, kind)
    finally:
        if isinstance(source, _SqliteSource):
            source.close()


def _unsigned(frame: pl.DataFrame) -> pl.DataFrame:
    fixes = [pl.col(c).cast(pl.Int64).reinterpret(signed=False)
             if frame[c].dtype.is_signed_integer() or frame[c].dtype == pl.Null
             else pl.col(c).cast(pl.UInt64)
             for c in SIGNED_IDS if c in frame.columns]
    return frame.with_columns(fixes) if fixes else frame


def _ingest(src: _Source, kind: str) -> Profile:
    tables = src.tables()
    if not tables & set(KNOWN_TABLES):
        raise ProfileError(f"{src.path}: not an Nsight Systems export (none of its tables, "
                           f"e.g. {KERNEL}, {NVTX}, StringIds, was found)")
    notes: list[str] = []
    version = _schema_version(src)
    if version and not version.startswith("3."):
        notes.append(f"export schema {version}: read as 3.x; columns may differ")

    def read(table: str, columns: list[str], where: str = "") -> pl.DataFrame | None:
        return _unsigned(src.read(table, columns, where)) if table in tables else None

    # A kernel's name is demangledName, else shortName; the schema declares the first
    # NOT NULL, and where the file says so the second is not read (a tenth of the
    # kernel table's decode, and the coalesce).
    kernel_cols = KERNEL_COLUMNS
    if KERNEL in tables and "demangledName" in src.not_null(KERNEL):
        kernel_cols = [c for c in KERNEL_COLUMNS if c != "shortName"]
    # The three big tables, read at once where the source can (SQLite: two threads).
    src.prefetch([(KERNEL, kernel_cols, ""), (RUNTIME, RUNTIME_COLUMNS, ""),
                  (NVTX, NVTX_COLUMNS, NVTX_WHERE)])
    parts: list[pl.DataFrame] = []
    for table, op_kind, cols in ((KERNEL, "kernel", kernel_cols),
                                 (MEMCPY, "memcpy", GPU_COLUMNS),
                                 (MEMSET, "memset", GPU_COLUMNS)):
        frame = read(table, cols)
        if frame is None:
            continue
        name = (pl.coalesce(pl.col("demangledName"), pl.col("shortName"))
                if "demangledName" in frame.columns and "shortName" in frame.columns
                else pl.col("demangledName") if "demangledName" in frame.columns
                else pl.col("shortName") if "shortName" in frame.columns else pl.lit(None))
        parts.append(conform(frame.with_columns(
            kind=pl.lit(op_kind), name_id=name if op_kind == "kernel" else pl.lit(None),
        ).rename({"deviceId": "device", "streamId": "stream", "correlationId": "correlation",
                  "globalPid": "proc", "graphNodeId": "graph_node", "graphId": "graph_id"},
                 strict=False), OPS_SCHEMA))

    strings = (conform(src.read("StringIds", ["id", "value"]), STRINGS_SCHEMA)
               if "StringIds" in tables else empty(STRINGS_SCHEMA))
    graph = read(GRAPH_TRACE, ["start", "end", "deviceId", "streamId", "correlationId",
                               "globalPid", "graphId"])
    if graph is not None and graph.height:
        # Whole-graph executions (--cuda-graph-trace=graph): their kernels were not
        # recorded, so each becomes one opaque op named after its graph.
        base = as_int(strings["id"].max()) + 1
        ids = graph.select(pl.col("graphId").unique().sort()).with_row_index("k")
        strings = pl.concat([strings, conform(ids.select(
            id=pl.col("k").cast(pl.Int64) + base,
            value=pl.format("CUDA graph {} (kernels not traced)", pl.col("graphId"))),
            STRINGS_SCHEMA)])
        graph = graph.join(ids, on="graphId", how="left")
        parts.append(conform(graph.with_columns(
            kind=pl.lit("graph"), name_id=pl.col("k").cast(pl.Int64) + base,
        ).rename({"deviceId": "device", "streamId": "stream", "correlationId": "correlation",
                  "globalPid": "proc", "graphId": "graph_id"}), OPS_SCHEMA))
        notes.append(f"{graph.height:,} CUDA graph executions were traced as whole graphs "
                     "(nsys --cuda-graph-trace=graph): their kernels are hidden, and each "
                     "counts as one opaque op; capture with --cuda-graph-trace=node to see "
                     "inside them")
    ops = pl.concat(parts) if parts else empty(OPS_SCHEMA)

    runtime = read(RUNTIME, RUNTIME_COLUMNS)
    # The launches' process column (10 M rows at scale: 30 ms) is derived on another
    # thread while this one reads the ranges and the small tables.
    with ThreadPoolExecutor(1, thread_name_prefix="agentload-launches") as pool:
        pending = pool.submit(_launches, runtime)
        ranges, range_notes = _ranges(src, tables, strings, ops, pending.result)
        return _finish(src, kind, tables, strings, ops, pending.result, ranges,
                       notes + range_notes, read)


def _launches(runtime: pl.DataFrame | None) -> pl.DataFrame:
    if runtime is None:
        return empty(LAUNCHES_SCHEMA)
    return conform(runtime.with_columns(
        proc=pl.col("globalTid") & pl.lit(PID_MASK, pl.UInt64),
    ).rename({"globalTid": "tid", "correlationId": "correlation", "nameId": "name_id"}),
        LAUNCHES_SCHEMA)


def _finish(src: _Source, kind: str, tables: set[str], strings: pl.DataFrame,
            ops: pl.DataFrame, launches: Callable[[], pl.DataFrame], ranges: pl.DataFrame,
            notes: list[str], read: Callable[[str, list[str]], pl.DataFrame | None]
            ) -> Profile:
    """The profile from its big tables and the small ones read here (graph nodes,
    processes, threads, devices, diagnostics); ``launches`` is waited for last."""
    graph_nodes = empty(GRAPH_NODES_SCHEMA)
    nodes = read(GRAPH_NODES, ["start", "end", "globalTid", "graphNodeId", "originalGraphNodeId"])
    if nodes is not None:
        graph_nodes = conform(nodes.with_columns(
            proc=pl.col("globalTid") & pl.lit(PID_MASK, pl.UInt64),
        ).rename({"globalTid": "tid", "graphNodeId": "node", "originalGraphNodeId": "original"}),
            GRAPH_NODES_SCHEMA)
    node_tracing = bool(ops.height) and ops["graph_node"].is_not_null().any()

    processes = empty(PROCESSES_SCHEMA)
    procs = read("PROCESSES", ["globalPid", "pid", "name"])
    if procs is not None:
        processes = conform(procs.rename({"globalPid": "proc"}), PROCESSES_SCHEMA)
    threads = empty(THREADS_SCHEMA)
    tn = read("ThreadNames", ["nameId", "globalTid"])
    if tn is not None and strings.height:
        threads = conform(tn.join(strings, left_on="nameId", right_on="id", how="left")
                          .rename({"globalTid": "tid", "value": "name"}), THREADS_SCHEMA)
    devices = empty(DEVICES_SCHEMA)
    gpus = read("TARGET_INFO_GPU", ["id", "name"])
    if gpus is not None:
        devices = conform(gpus.rename({"id": "device"}), DEVICES_SCHEMA)
    warnings = _diagnostics(src, tables)
    return Profile(source=kind, path=str(src.path), ops=ops, launches=launches(),
                   ranges=ranges, strings=strings, graph_nodes=graph_nodes,
                   processes=processes, threads=threads, devices=devices, notes=tuple(notes),
                   graph_node_tracing=node_tracing, warnings=warnings)


LOSS_RE = (r"(?i)drop|lost|loss|overflow|discard|buffer (is )?full|missing|incomplete|"
           r"truncat|exceed|could not|failed|not (be )?(collected|traced|recorded)")
"""``DIAGNOSTIC_EVENT`` texts that say events are missing from the trace."""
DIAGNOSTIC = "DIAGNOSTIC_EVENT"
MAX_WARNINGS = 10


def _diagnostics(src: _Source, tables: set[str]) -> tuple[str, ...]:
    """nsys's diagnostics that say the trace lost events, each distinct text once with
    its count (a dropped-events message can repeat per buffer flush)."""
    if DIAGNOSTIC not in tables or "text" not in src.columns(DIAGNOSTIC):
        return ()
    rows = src.read(DIAGNOSTIC, ["text"])
    hits = rows.filter(pl.col("text").is_not_null() & pl.col("text").str.contains(LOSS_RE))
    if not hits.height:
        return ()
    counts = hits.group_by("text", maintain_order=True).agg(n=pl.len())
    out = [f"nsys reported: {t}" + (f" ({n:,} times)" if n > 1 else "")
           for t, n in counts.head(MAX_WARNINGS).iter_rows()]
    if counts.height > MAX_WARNINGS:
        out.append(f"... and {counts.height - MAX_WARNINGS:,} more distinct diagnostics "
                   f"in {DIAGNOSTIC}")
    return tuple(out)


def _schema_version(src: _Source) -> str | None:
    if "META_DATA_EXPORT" not in src.tables():
        return None
    meta = src.read("META_DATA_EXPORT", ["name", "value"])
    if not {"name", "value"} <= set(meta.columns):
        return None
    hit = meta.filter(pl.col("name") == "EXPORT_SCHEMA_VERSION")
    return str(hit["value"][0]) if hit.height else None


def _ranges(src: _Source, tables: set[str], strings: pl.DataFrame, ops: pl.DataFrame,
            launches: Callable[[], pl.DataFrame]) -> tuple[pl.DataFrame, list[str]]:
    """The NVTX ranges; ``launches`` is asked for only when ranges are still open
    (they are closed at the profile's last timestamp)."""
    if NVTX not in tables:
        return empty(RANGES_SCHEMA), []
    raw = _unsigned(src.read(NVTX, NVTX_COLUMNS, NVTX_WHERE))
    if isinstance(src, _DirSource):  # the SQL WHERE above only applies to SQLite
        raw = keep_rows(raw, pl.col("eventType").is_in(NVTX_KINDS))
    raw, categories = _named_ids(raw, strings, CATEGORY_NAME, ["domainId", "category"],
                                 "category_name")
    raw, domains = _named_ids(raw, strings, DOMAIN_CREATE, ["domainId"], "domain")
    notes: list[str] = []
    if not raw.height:
        return empty(RANGES_SCHEMA), notes
    if "eventId" not in raw.columns:
        raw = raw.with_row_index("eventId")
    raw, name = _nvtx_names(raw, strings)
    end_tid = pl.col("endGlobalTid") if "endGlobalTid" in raw.columns else pl.lit(None, pl.UInt64)
    frame = raw.with_columns(
        name=name, proc=pl.col("globalTid") & pl.lit(PID_MASK, pl.UInt64),
        style=pl.when(pl.col("eventType").is_in(PUSHPOP)).then(pl.lit("pushpop"))
        .otherwise(pl.lit("startend")),
        _cross=end_tid.is_not_null() & (end_tid != pl.col("globalTid")),
    )
    crossed = int(frame["_cross"].sum())
    if crossed:
        # nsys's own reports drop these too: the range has no single owning thread.
        notes.append(f"{crossed:,} start/end ranges ended on another thread and own no "
                     "kernels (a range is matched on the thread that launched)")
        frame = frame.filter(~pl.col("_cross"))
    open_ = int(frame["end"].is_null().sum())
    if open_:
        last = max(as_int(x) for x in (ops["end"].max(), launches()["end"].max(),
                                       frame["start"].max(), frame["end"].max()))
        notes.append(f"{open_:,} ranges were still open at the end of capture; they are "
                     "closed at the last timestamp")
        frame = frame.with_columns(pl.col("end").fill_null(last))
    if domains is not None:
        frame = frame.join(domains, on=["proc", "domainId"], how="left", maintain_order="left")
    frame = _with_categories(frame, categories)
    frame = frame.rename({"globalTid": "tid", "eventId": "range_id"})
    return conform(frame, RANGES_SCHEMA), notes


def _nvtx_names(rows: pl.DataFrame, strings: pl.DataFrame) -> tuple[pl.DataFrame, pl.Expr]:
    """``rows`` (row order kept) with what the name expression needs, and the name:
    ``COALESCE(text, StringIds[textId])`` (a registered string has only ``textId``)."""
    text = (pl.col("text") if "text" in rows.columns else pl.lit(None)).cast(pl.String)
    if "textId" not in rows.columns or not strings.height:
        return rows, text
    # No registered string at all, or a text on every row: the join (2 M rows: 20 ms)
    # could change nothing.
    if rows["textId"].null_count() == rows.height or (
            "text" in rows.columns and not rows["text"].null_count()):
        return rows, text
    rows = rows.join(strings.rename({"id": "textId", "value": "_registered"}),
                     on="textId", how="left", maintain_order="left")
    return rows, pl.coalesce(text, pl.col("_registered"))


def _named_ids(raw: pl.DataFrame, strings: pl.DataFrame, event_type: int, ids: list[str],
               out: str) -> tuple[pl.DataFrame, pl.DataFrame | None]:
    """Split the ``event_type`` rows, which name ids, off the ranges: ``(proc, *ids) ->
    out``, the name. ``nvtxDomainCreate`` names a ``domainId``; ``nvtxNameCategory`` a
    ``category`` within a ``domainId``; both per process. None when no row names one."""
    naming = pl.col("eventType") == event_type
    if any(k not in raw.columns for k in ids) or not bool(raw.select(naming.any()).item()):
        return keep_rows(raw, ~naming), None
    rows = raw.filter(naming)
    ranges = raw.filter(~naming)
    rows, name = _nvtx_names(rows, strings)
    named = rows.select((pl.col("globalTid") & pl.lit(PID_MASK, pl.UInt64)).alias("proc"),
                        *ids, name.alias(out))
    return ranges, named.unique(["proc", *ids], keep="last")


def _with_categories(frame: pl.DataFrame, names: pl.DataFrame | None) -> pl.DataFrame:
    """``category``: the range's category name, its number where no row names it, null
    for none (0, NVTX's "no category"). A category named in the default domain has a
    null or 0 ``domainId``, as its ranges may: both count as the default domain."""
    if "category" not in frame.columns:
        return frame
    has = pl.col("category").is_not_null() & (pl.col("category") != 0)
    if not bool(frame.select(has.any()).item()):
        return frame.with_columns(category=pl.lit(None, pl.String))
    number = pl.col("category").cast(pl.String)
    if names is None:
        return frame.with_columns(category=pl.when(has).then(number))
    domain = pl.col("domainId").fill_null(0)
    frame = frame.with_columns(_domain=domain).join(
        names.with_columns(_domain=domain).drop("domainId"),
        on=["proc", "_domain", "category"], how="left", maintain_order="left")
    return frame.with_columns(category=pl.when(has).then(
        pl.coalesce(pl.col("category_name"), number))).drop("_domain", "category_name")


def processes_with_pid(profile: Profile) -> pl.DataFrame:
    """``proc -> pid, name`` for every process seen in ops or launches."""
    seen = pl.concat([profile.ops.select("proc"), profile.launches.select("proc")]).unique()
    out = seen.with_columns(pid=pid_of(pl.col("proc"))).join(
        profile.processes.select("proc", "name"), on="proc", how="left")
    return out.sort("pid")

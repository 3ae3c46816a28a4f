"""The big tables of an Nsight SQLite export, read straight from SQLite's file format.

Why: loading a 10 M-kernel export through ADBC's SQLite driver took 8.7 s (through
Python's ``sqlite3``, about 50 s), while attributing it afterwards takes 0.4 s. Both
step through every value with one ``sqlite3_column_*`` call. SQLite's file format is
documented and has been stable since 2004 (https://www.sqlite.org/fileformat2.html):

- a table is a B-tree of fixed-size pages;
- its leaves hold one cell per row: a payload length, the rowid, then the record;
- a record is a header of varint serial types (NULL, a big-endian integer of 1-8 bytes,
  0, 1, a REAL, text or a blob) followed by the values.

This module lists a table's leaf pages in key order by walking its interior pages. It
decodes them where the page cache holds them, through a read-only memory map (each run
of pages faulted in first, so a page that cannot be read is an error, not SIGBUS), or
else copied in large windows (``preadv`` into one reused buffer); either way memory
stays bounded whatever the file's size. Only the wanted columns of every record are
decoded, in compiled loops (numba, compiled on first use and cached like the
attribution's loops). Rows come out in rowid order, as ``SELECT`` returns them. Text is pooled: each
distinct string is stored once and every row holds its index, because NVTX range names
repeat every step.

It reads only what it fully understands. For anything else it answers ``None`` and the
caller falls back to the SQLite driver, which then reads or reports it:

- a WAL file beside the export, or a text encoding other than UTF-8;
- a record that spills onto overflow pages;
- a value of another type than its column's (a REAL or text in an integer column);
- a column added later with a non-NULL default;
- a WITHOUT ROWID table;
- any structural inconsistency, which is what a damaged file shows.

Every offset is checked against the page it lies in, so a damaged file is refused, not
read out of bounds.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import sqlite3
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from agentload.profiler.sqlite_records import (
    CORRUPT,
    I64,
    INTERIOR,
    LEAF,
    NULL,
    OK,
    PAD,
    TYPE,
    U8,
    UNSUPPORTED,
    StringPool,
    count_cells,
    decode_leaves,
    edge_rowids,
    interior_children,
)

log = logging.getLogger(__name__)

WINDOW_BYTES = 2 << 20
"""Bytes read from the file at a time (and the reused buffer's size)."""
MADV_POPULATE_READ: int | None = getattr(mmap, "MADV_POPULATE_READ",
                                         22 if sys.platform.startswith("linux") else None)
"""Linux 5.14+: fault a mapped range in now, or fail with an error (where touching a
page that cannot be read would raise SIGBUS instead)."""
MAPPED_ENV = "AGENTLOAD_SQLITE_MAP"
"""``0`` reads pages with ``preadv`` copies only, never through a memory map."""
PARTS_PER_THREAD = 4
""":func:`read_tables` cuts the work into this many parts a thread."""
MAX_KEY = (1 << 63) - 1
"""The bound on the rowids of a table's last leaf (none: rowids are signed 64-bit)."""
MAX_DEPTH = 40
"""A B-tree deeper than this is a damaged file (64 KiB pages of 4-child cells would
need more rows than SQLite can hold)."""

_WHY = {CORRUPT: "the page structure is inconsistent (a damaged file?)",
        UNSUPPORTED: "a record spills onto overflow pages or lacks a column with a default",
        TYPE: "a value is not of its column's type"}



@dataclass(frozen=True, slots=True)
class TableLayout:
    """What the schema says about one table: where its B-tree starts and how its
    records are laid out."""

    root: int
    """Root page number."""
    columns: tuple[str, ...]
    """Declared columns, in record order."""
    rowid_alias: int
    """Index of the ``INTEGER PRIMARY KEY`` column (stored as the rowid, NULL in the
    record), or -1."""
    has_default: tuple[bool, ...]
    """Per column: declared with a non-NULL default (a record written before an
    ``ALTER TABLE ADD COLUMN`` lacks it and reads as that default)."""
    real: frozenset[str] = frozenset()
    """Columns of REAL affinity: SQLite stores their whole numbers as integers and hands
    them back as floats, which this reader does not do (it declines them)."""


def table_layout(con: sqlite3.Connection, table: str) -> TableLayout | None:
    """``table``'s layout from the schema, or None for a table this reader skips."""
    row = con.execute("SELECT rootpage, sql FROM sqlite_master WHERE type = 'table' "
                      "AND name = ?", (table,)).fetchone()
    if row is None or not isinstance(row[0], int) or row[0] < 2:
        return None
    sql = str(row[1] or "").upper()
    if "WITHOUT ROWID" in sql:
        return None
    info = con.execute(f'PRAGMA table_xinfo("{table}")').fetchall()
    if any(r[6] for r in info):
        return None  # generated (or hidden) columns: the record's layout is not the list's
    keys = [r for r in info if r[5]]
    # The rowid alias, exactly as SQLite decides it: a lone primary key declared exactly
    # INTEGER, without the index a "PRIMARY KEY DESC" column constraint gets instead.
    alias = -1
    if len(keys) == 1 and str(keys[0][2]).upper() == "INTEGER":
        indexes = con.execute(f'PRAGMA index_list("{table}")').fetchall()
        if not any(str(r[3]) == "pk" for r in indexes):
            alias = int(keys[0][0])
    real = frozenset(str(r[1]) for r in info
                     if any(k in str(r[2]).upper() for k in ("REAL", "FLOA", "DOUB"))
                     and "INT" not in str(r[2]).upper())
    return TableLayout(root=int(row[0]), columns=tuple(str(r[1]) for r in info),
                       rowid_alias=alias, has_default=tuple(r[4] is not None for r in info),
                       real=real)


@dataclass(frozen=True, slots=True)
class _FileHeader:
    page_size: int
    usable: int
    pages: int


def _file_header(fd: int, path: Path, text_wanted: bool) -> _FileHeader | None:
    head = os.pread(fd, 100, 0)
    if len(head) < 100 or head[:16] != b"SQLite format 3\x00":
        return None
    page_size = int.from_bytes(head[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or page_size & (page_size - 1):
        return None
    usable = page_size - head[20]
    if usable < 480:
        return None
    if head[18] == 2 or head[19] == 2:  # WAL mode: committed pages may sit in the -wal file
        wal = Path(f"{path}-wal")
        if wal.exists() and wal.stat().st_size > 0:
            return None
    if text_wanted and int.from_bytes(head[56:60], "big") not in (0, 1):
        return None  # UTF-16 text: the driver converts it
    return _FileHeader(page_size, usable, os.fstat(fd).st_size // page_size)


@dataclass(frozen=True, slots=True)
class TableScan:
    """A table's leaf pages, found by walking its B-tree; :func:`read_tables` decodes
    them in parts, on several threads at once."""

    path: Path
    header: _FileHeader
    layout: TableLayout
    leaves: I64
    """Leaf page numbers in key order."""
    bounds: I64
    """Per leaf the bound its rowids do not exceed, from the interior cells' keys
    (:data:`MAX_KEY` for the last leaf); the previous leaf's bound is exceeded by all."""


def scan_table(path: Path, layout: TableLayout, text_wanted: bool) -> TableScan | None:
    """The table's leaf pages, or None when this reader cannot read the file or tree."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        header = _file_header(fd, path, text_wanted)
        if header is None:
            return None
        tree = _leaf_pages(fd, header, layout.root)
    finally:
        os.close(fd)
    if tree is None:
        log.debug("%s: B-tree of page %d not read natively", path, layout.root)
        return None
    return TableScan(path, header, layout, *tree)


@dataclass(slots=True)
class _Decoded:
    """Rows a part decoded into ``values[:, start:start + rows]`` (a shared output, or
    its own), with its NULL counts, text pool and first and last rowid (NULL: none)."""

    values: I64
    start: int
    rows: int
    nulls: I64
    pool: StringPool
    first_rowid: int
    last_rowid: int

    def frame(self, picked: list[str], text: set[str]) -> pl.DataFrame | None:
        return _frame(picked, text, self.values[:, self.start:self.start + self.rows],
                      self.nulls, self.pool)


def _decode_part(scan: TableScan, picked: list[str], text: set[str], lo: int, hi: int,
                 out: tuple[I64, int, int] | None = None,
                 mapped: _MappedFile | None = None) -> _Decoded | None:
    """Rows of ``scan.leaves[lo:hi]``, into ``out`` = ``(values, first row, row limit)``
    when given (the part's range of a shared output), else into values of its own;
    pages are read from ``mapped`` where it can, else copied."""
    try:
        fd = os.open(scan.path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _decode_table(fd, scan, picked, text, scan.leaves[lo:hi], out, mapped)
    finally:
        os.close(fd)


class _MappedFile:
    """The export mapped read-only into memory, so leaf pages are decoded where the page
    cache holds them instead of copied into a buffer first: at 10 M kernels the copies
    (1.4 GB through ``preadv``) were a fifth of the read.

    A mapped page that cannot be read (the file truncated under us, an I/O error) would
    kill the process with SIGBUS when touched, so each run of pages is faulted in first
    with ``MADV_POPULATE_READ``, which reports those as errors instead; a run that fails
    is read through ``preadv`` (whose short read then declines the table). What that
    cannot cover is the file truncated, or a page evicted and then unreadable, in the
    moments between a run's populate and its decode: that is still SIGBUS, as with
    SQLite's own memory-mapped I/O, and ``AGENTLOAD_SQLITE_MAP=0`` is the way out for
    files that may change while they are read (a writer changing pages in place only
    makes rows decline or mix, never reads out of bounds). The file's last page is
    always copied: the
    8-byte integer loads may reach past a page's end, and past the file's there is no
    next page to land in."""

    def __init__(self, path: Path, file_pages: int, page_size: int) -> None:
        self.page_size = page_size
        with open(path, "rb") as f:  # the mapping outlives the descriptor
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.bytes: U8 = np.frombuffer(self._map, np.uint8)
        # The file may have shrunk since its header was read: only mapped pages count.
        self.pages = min(file_pages, len(self.bytes) // page_size)

    @classmethod
    def open(cls, path: Path, header: _FileHeader) -> _MappedFile | None:
        """The mapping, or None where mapping is off, unsupported or fails."""
        if (MADV_POPULATE_READ is None or os.environ.get(MAPPED_ENV, "1").strip() == "0"
                or header.pages < 2):
            return None
        try:
            mapped = cls(path, header.pages, header.page_size)
        except (OSError, ValueError):
            return None
        if mapped.run(1, 1) is None:  # a kernel without MADV_POPULATE_READ: EINVAL
            mapped.close()
            return None
        return mapped

    def run(self, first: int, span: int) -> U8 | None:
        """Pages ``first .. first + span - 1`` (1-based) and :data:`PAD` bytes after
        them, faulted in; None for a run reaching the file's last page, or one the
        kernel could not fault in."""
        if first < 1 or first + span - 1 >= self.pages or MADV_POPULATE_READ is None:
            return None
        start = (first - 1) * self.page_size
        end = start + span * self.page_size + PAD
        aligned = start - start % mmap.PAGESIZE
        try:
            self._map.madvise(MADV_POPULATE_READ, aligned, end - aligned)
        except (OSError, ValueError):
            return None
        run = self.bytes[start:end]
        # madvise and slicing both shorten a range past the mapping without a word.
        return run if len(run) == end - start else None

    def close(self) -> None:
        del self.bytes
        with contextlib.suppress(BufferError):  # a view still alive: freed with it
            self._map.close()


def _ascending(parts: list[_Decoded]) -> bool:
    """Rowids ascend across the seams of parts in leaf order (else the tree is damaged)."""
    last = NULL
    for part in parts:
        if part.first_rowid == NULL:
            continue
        if part.first_rowid <= last:
            return False
        last = part.last_rowid
    return True


def read_columns(path: Path, layout: TableLayout, columns: list[str],
                 text: set[str]) -> pl.DataFrame | None:
    """The ``columns`` of a table (``Int64``; ``String`` for those in ``text``), every
    row in rowid order and NULLs kept; None when this reader cannot read it exactly."""
    return read_tables(path, [(layout, columns)], text, threads=1)[0]


def read_tables(path: Path, wanted: list[tuple[TableLayout, list[str]]], text: set[str],
                threads: int = 2) -> list[pl.DataFrame | None]:
    """Several tables' columns at once (as :func:`read_columns`), decoded on ``threads``
    threads (the loops release the GIL); None for a table not read.

    Each table without text is cut into parts of about equal size, so the threads finish
    together however unequal the tables are (a 10 M-kernel table on one thread kept it
    busy 1.2 s while the other finished the rest in 0.7). An export's rowids run 1..N
    without gaps, and the interior cells' keys bound each leaf's rowids, so every part's
    rows have a known place in one shared output: the table comes out as one contiguous
    frame, not parts that attribution would copy together (0.14 s at 10 M kernels).
    Tables with gaps in their rowids get an output per part, joined with a copy."""
    picks = [[c for c in cols if c in layout.columns] for layout, cols in wanted]
    # No wanted column, one twice, or a REAL one: the driver reads (or says what is wrong).
    scans = [scan_table(path, layout, any(c in text for c in cols))
             if cols and len(set(cols)) == len(cols) and not layout.real & set(cols) else None
             for (layout, _), cols in zip(wanted, picks, strict=True)]
    total = sum(len(s.leaves) for s in scans if s is not None)
    per_part = max(1, -(-total // (threads * PARTS_PER_THREAD)))
    work: list[tuple[int, int, int]] = []
    whole: set[int] = set()  # tables read as one part
    shared: dict[int, tuple[I64, int]] = {}  # table -> (output, lowest rowid)
    for t, scan in enumerate(scans):
        if scan is None:
            continue
        split = not any(c in text for c in picks[t]) and len(scan.leaves) > per_part
        if not split:
            whole.add(t)
        step = per_part if split else len(scan.leaves)
        work += [(t, lo, min(lo + step, len(scan.leaves)))
                 for lo in range(0, len(scan.leaves), step)]
        if split:
            keys = _key_range(scan)
            if keys is not None:
                # Untouched pages cost nothing: only written rows become memory. A
                # damaged file's key range may not fit at all: then parts have their own.
                with contextlib.suppress(MemoryError, ValueError):
                    shared[t] = (np.empty((len(picks[t]), keys[1] - keys[0] + 1), np.int64),
                                 keys[0])
    # Tables that are one part first (text makes a row dearer than its share of pages
    # says: 2 M NVTX rows take as long as 5 M kernel rows), then the biggest parts, so
    # no big part starts last and the threads finish together.
    work.sort(key=lambda w: (w[0] not in whole, w[1] - w[2]))
    early: dict[int, pl.DataFrame | None] = {}  # frames of one-part tables, built early
    first_scan = next((s for s in scans if s is not None), None)
    mapped = _MappedFile.open(path, first_scan.header) if first_scan is not None else None

    def run(w: tuple[int, int, int]) -> _Decoded | None:
        try:
            return _run(w)
        except (MemoryError, OSError, ValueError):  # what a damaged file can make of sizes
            return None

    def _run(w: tuple[int, int, int]) -> _Decoded | None:
        t, lo, hi = w
        scan = scans[t]
        assert scan is not None
        out = None
        if t in shared:
            values, low = shared[t]
            start = int(scan.bounds[lo - 1]) + 1 - low if lo else 0
            end = min(int(scan.bounds[hi - 1]) + 1 - low, values.shape[1])
            if not 0 <= start <= end:  # keys that contradict the leaves: a damaged tree
                return None
            out = (values, start, end)
        part = _decode_part(scan, picks[t], text, lo, hi, out, mapped)
        if part is not None and t in whole:
            # A one-part table (text: NVTX) starts first and ends early: its frame (the
            # strings gathered, NULLs masked) is built here while the other thread
            # still decodes, not afterwards on one core.
            early[t] = part.frame(picks[t], text)
        return part

    try:
        if threads > 1 and len(work) > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="agentload-sqlitefile") as pool:
                done = list(pool.map(run, work))
        else:
            done = [run(w) for w in work]
    finally:
        if mapped is not None:
            mapped.close()
    by_table: dict[int, list[tuple[int, _Decoded | None]]] = {}
    for (t, lo, _), part in zip(work, done, strict=True):
        by_table.setdefault(t, []).append((lo, part))
    frames: list[pl.DataFrame | None] = []
    for t in range(len(wanted)):
        got = [p for _, p in sorted(by_table.get(t, []), key=lambda lp: lp[0])]
        parts = [p for p in got if p is not None]
        if not got or len(parts) < len(got) or not _ascending(parts):
            frames.append(None)
            continue
        frames.append(early[t] if t in early else _joined(parts, picks[t], text))
    return frames


def _joined(parts: list[_Decoded], picked: list[str], text: set[str]) -> pl.DataFrame | None:
    """One table's parts as one frame: a view of the shared output when the parts filled
    it without gaps, else the parts' rows copied together."""
    first = parts[0]
    if len(parts) == 1:
        return first.frame(picked, text)
    contiguous = all(p.values is first.values for p in parts) and all(
        a.start + a.rows == b.start for a, b in itertools.pairwise(parts))
    if contiguous:
        whole = _Decoded(first.values, first.start, sum(p.rows for p in parts),
                         np.sum([p.nulls for p in parts], axis=0), first.pool,
                         first.first_rowid, parts[-1].last_rowid)
        return whole.frame(picked, text)
    frames = [p.frame(picked, text) for p in parts]
    if any(f is None for f in frames):
        return None
    return pl.concat([f for f in frames if f is not None], rechunk=True)


def _key_range(scan: TableScan) -> tuple[int, int] | None:
    """The lowest and highest rowid of the table (its first and last leaf's first and
    last cell), or None when unreadable or too sparse for a shared output."""
    try:
        fd = os.open(scan.path, os.O_RDONLY)
    except OSError:
        return None
    try:
        pages = _read_pages(fd, scan.header, scan.leaves[[0, -1]])
    finally:
        os.close(fd)
    if pages is None:
        return None
    keys = edge_rowids(pages, scan.header.page_size, scan.header.usable)
    if keys[0] == NULL or keys[1] < keys[0]:
        return None
    # Rows expected: the first leaf's as many on every leaf. Far more keys than that
    # means gaps (deleted rows), and a shared output mostly holes: parts get their own.
    expected = int.from_bytes(bytes(pages[3:5]), "big") * len(scan.leaves)
    if keys[1] - keys[0] + 1 > 2 * expected + 1024:
        return None
    return int(keys[0]), int(keys[1])


def _read_pages(fd: int, header: _FileHeader, pages: I64) -> U8 | None:
    """The given pages, one after another in a new buffer (few pages: interior ones)."""
    size = header.page_size
    buf = np.empty(len(pages) * size, np.uint8)
    view = buf.data
    for i, page in enumerate(pages.tolist()):
        if not 1 <= page <= header.pages:
            return None
        if os.preadv(fd, [view[i * size:(i + 1) * size]], (page - 1) * size) != size:
            return None
    return buf


def _leaf_pages(fd: int, header: _FileHeader, root: int) -> tuple[I64, I64] | None:
    """The table's leaf pages in key order and their rowid bounds, walking the interior
    levels (a B-tree's leaves all lie at one depth, so the first page of a level tells
    what the level is)."""
    level = np.array([root], np.int64)
    bounds = np.array([MAX_KEY], np.int64)
    seen = 0
    for _ in range(MAX_DEPTH):
        first = _read_pages(fd, header, level[:1])
        if first is None:
            return None
        kind = int(first[0])
        if kind == LEAF:
            return level, bounds
        if kind != INTERIOR:
            return None
        buf = _read_pages(fd, header, level)
        if buf is None:
            return None
        # As many children as a page's cell pointers can name, plus its right-most one.
        out = np.empty(len(level) * ((header.usable - 12) // 2 + 1), np.int64)
        out_bounds = np.empty(len(out), np.int64)
        n = interior_children(buf, len(level), header.page_size, header.usable, bounds, out,
                              out_bounds)
        seen += len(level)
        if n < 0 or seen + n > header.pages:
            return None
        level, bounds = out[:n], out_bounds[:n]
        if int(level.min()) < 2 or int(level.max()) > header.pages:
            return None
    return None


def _decode_table(fd: int, scan: TableScan, picked: list[str], text: set[str],
                  leaves: I64, out: tuple[I64, int, int] | None,
                  mapped: _MappedFile | None = None) -> _Decoded | None:
    header, layout, path = scan.header, scan.layout, scan.path
    # Per record column its output slot (-1: not wanted); the rowid alias (NULL in the
    # record) is filled from the cell instead.
    index = {c: i for i, c in enumerate(layout.columns)}
    # Padded to the most columns a record header can name (a byte each, on one page), so
    # the loop indexes it by column without a bounds check.
    slot_of = np.full(max(len(layout.columns), header.usable), -1, np.int64)
    text_of = np.zeros(len(slot_of), np.bool_)
    for slot, c in enumerate(picked):
        if index[c] != layout.rowid_alias:
            slot_of[index[c]] = slot
            text_of[index[c]] = c in text
    want_col = np.flatnonzero(slot_of >= 0).astype(np.int64)
    alias_slot = next((s for s, c in enumerate(picked) if index[c] == layout.rowid_alias), -1)
    has_default = np.zeros(len(slot_of), np.bool_)
    has_default[:len(layout.columns)] = layout.has_default
    n_text = int(text_of.sum())

    size = header.page_size
    per_window = WINDOW_BYTES // size
    buf = np.zeros(per_window * size + PAD, np.uint8)
    view = buf.data
    # The loops see pages read-only whether copied or mapped: one compiled version.
    copied = buf.view()
    copied.flags.writeable = False
    values, rows, limit = (np.empty((len(picked), 0), np.int64), 0, -1) if out is None else out
    start = rows
    nulls = np.zeros(len(picked), np.int64)
    pool = StringPool()
    i = 0
    while i < len(leaves):
        # The run of leaves from i that lie in one window of pages (B-tree order is
        # mostly file order: an export is written front to back).
        first = int(leaves[i])
        ahead = leaves[i:i + per_window]
        inside = (ahead >= first) & (ahead < first + per_window)
        run = len(ahead) if bool(inside.all()) else int(np.argmin(inside))
        pos = ahead[:run] - first
        span = int(pos.max()) + 1
        if first + span - 1 > header.pages:
            return None
        pages = mapped.run(first, span) if mapped is not None else None
        if pages is None:
            if os.preadv(fd, [view[:span * size]], (first - 1) * size) != span * size:
                return None
            pages = copied
        cells = count_cells(pages, pos, size, header.usable)
        if cells < 0:
            log.debug("%s: page of leaf run at %d is not a table leaf", path, first)
            return None
        if limit >= 0 and rows + cells > limit:
            log.debug("%s: leaves hold more rows than their keys allow", path)
            return None
        if limit < 0 and rows + cells > values.shape[1]:
            # First window: a guess from its cells per page; later: grow by half.
            guess = cells * len(leaves) // max(run, 1) + 1024
            grown = np.empty((len(picked), max(rows + cells, guess, values.shape[1] * 3 // 2)),
                             np.int64)
            grown[:, :rows] = values[:, :rows]
            values = grown
        if n_text:
            pool.reserve(cells * n_text, span * size)
        rows, status = decode_leaves(
            pages, pos, size, header.usable, slot_of, text_of, want_col, has_default,
            alias_slot, values, rows, limit if limit >= 0 else values.shape[1], nulls,
            pool.table, pool.data, pool.offsets, pool.hashes, pool.state)
        if status != OK:
            log.debug("%s: not read natively: %s", path, _WHY.get(status, status))
            return None
        i += run
    return _Decoded(values, start, rows - start, nulls, pool, int(pool.state[3]),
                    int(pool.state[2]))


def _frame(picked: list[str], text: set[str], values: I64, nulls: I64,
           pool: StringPool) -> pl.DataFrame | None:
    strings = pool.strings() if any(c in text for c in picked) else None
    out: list[pl.Series] = []
    rows = values.shape[1]
    for slot, name in enumerate(picked):
        col = pl.Series(name, values[slot])  # a view: no copy
        if rows and nulls[slot] == rows:  # all NULL (graph ids outside graphs): no mask
            out.append(pl.repeat(None, rows, dtype=pl.String if name in text else pl.Int64,
                                 eager=True).alias(name))
        elif name in text:
            if strings is None:
                return None
            codes = col.to_frame().select(pl.when(pl.col(name) >= 0).then(pl.col(name)))
            out.append(strings.gather(codes.to_series()).alias(name))
        elif nulls[slot]:
            out.append(col.to_frame().select(
                pl.when(pl.col(name) != NULL).then(pl.col(name))).to_series())
        else:
            out.append(col)
    return pl.DataFrame(out)

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
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt
import polars as pl

from agentload.profiler.compiled import LazyJit

log = logging.getLogger(__name__)

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
BOOL = npt.NDArray[np.bool_]
A = TypeVar("A", bound=np.ndarray[Any, Any])

NULL = -(1 << 63)
"""Integer columns hold this for SQL NULL until the frame is built."""
WINDOW_BYTES = 2 << 20
"""Bytes read from the file at a time (and the reused buffer's size)."""
PAD = 8
"""Bytes after the pages in a decode buffer: an integer is read as one 8-byte load,
which may reach past the last page's last value."""
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

OK, CORRUPT, UNSUPPORTED, TYPE = 0, 1, 2, 3
_WHY = {CORRUPT: "the page structure is inconsistent (a damaged file?)",
        UNSUPPORTED: "a record spills onto overflow pages or lacks a column with a default",
        TYPE: "a value is not of its column's type"}
LEAF, INTERIOR = 13, 5  # table B-tree page types

_jit = LazyJit(globals(), read_only_inputs=False)


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
    pool: _Pool
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


class _Pool:
    """Distinct strings (UTF-8 bytes) of the text columns, filled by the compiled loop:
    ``offsets[d]:offsets[d + 1]`` in ``data`` is string ``d``; an open-addressing hash
    table of string indexes finds repeats. Grown from Python between windows, so the
    loop never runs out of room."""

    def __init__(self) -> None:
        self.data = np.empty(1 << 16, np.uint8)
        self.offsets = np.zeros(1 << 12, np.int64)
        self.hashes = np.empty(1 << 12, np.int64)
        self.table = np.full(1 << 13, -1, np.int64)
        # [distinct strings, bytes used, last and first rowid decoded (the loop checks
        # that keys ascend)]
        self.state = np.array([0, 0, NULL, NULL], np.int64)

    def reserve(self, strings: int, nbytes: int) -> None:
        n, used = int(self.state[0]), int(self.state[1])
        if used + nbytes + PAD > len(self.data):
            self.data = _grown(self.data, used + nbytes + PAD, used)
        if n + strings + 1 > len(self.offsets):
            self.offsets = _grown(self.offsets, n + strings + 1, n + 1)
            self.hashes = _grown(self.hashes, n + strings + 1, n)
        if 2 * (n + strings) > len(self.table):
            size = len(self.table)
            while 2 * (n + strings) > size:
                size *= 2
            self.table = np.full(size, -1, np.int64)
            rehash(self.hashes, n, self.table)

    def strings(self) -> pl.Series | None:
        n = int(self.state[0])
        try:
            values = [bytes(self.data[self.offsets[d]:self.offsets[d + 1]]).decode("utf-8")
                      for d in range(n)]
        except UnicodeDecodeError:
            return None
        return pl.Series(values, dtype=pl.String)


def _grown(array: A, need: int, keep: int) -> A:
    """A bigger copy of ``array`` (by half at least), its first ``keep`` items kept."""
    out = np.empty(max(need, len(array) * 3 // 2), array.dtype)
    out[:keep] = array[:keep]
    return cast(A, out)


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
    pool = _Pool()
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
           pool: _Pool) -> pl.DataFrame | None:
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


# --- compiled loops --------------------------------------------------------------------
# ``int(b[i])`` of a byte stays a uint8 in numba; every expression it meets here is int64,
# to which a uint8 widens exactly (only uint64 and int64 together would become float64).
#
# Arrays are indexed through ``_U`` (an unsigned index): numba wraps a signed index that
# is negative around to the array's end, a compare and a select on every access, which
# also keeps LLVM from merging a run of byte loads into one load. Every index here is
# non-negative (each is checked against its page first), so nothing changes but speed:
# decoding a 40-column kernel row took 1.6x as long with signed indexes.

_U = np.uint64


@_jit.helper
def _u16(b: U8, i: int) -> int:
    a = _U(i)
    return (int(b[a]) << 8) | int(b[a + _U(1)])


@_jit.helper
def _u32(b: U8, i: int) -> int:
    a = _U(i)
    return ((int(b[a]) << 24) | (int(b[a + _U(1)]) << 16) | (int(b[a + _U(2)]) << 8)
            | int(b[a + _U(3)]))


@_jit.helper
def _big_endian(b: U8, at: int, shift: int) -> int:
    """The signed big-endian integer of ``(64 - shift) / 8`` bytes at ``b[at]``: eight
    bytes read as one load, the value's sign-extended by the arithmetic shift. Reads up
    to 7 bytes past the value, so buffers carry :data:`PAD` bytes after their pages."""
    a = _U(at)
    v = ((np.int64(b[a]) << 56) | (np.int64(b[a + _U(1)]) << 48)
         | (np.int64(b[a + _U(2)]) << 40) | (np.int64(b[a + _U(3)]) << 32)
         | (np.int64(b[a + _U(4)]) << 24) | (np.int64(b[a + _U(5)]) << 16)
         | (np.int64(b[a + _U(6)]) << 8) | np.int64(b[a + _U(7)]))
    return int(v >> shift)


@_jit.helper
def _varint(b: U8, i: int, end: int) -> tuple[int, int]:
    """SQLite's varint at ``b[i]`` (1-9 bytes, big-endian, 7 bits a byte but 8 in the
    ninth): ``(value, next index)``, next index -1 when it would run past ``end``."""
    v = 0
    for _ in range(8):
        if i >= end:
            return 0, -1
        c = int(b[_U(i)])
        i += 1
        v = (v << 7) | (c & 0x7F)
        if c < 0x80:
            return v, i
    if i >= end:
        return 0, -1
    return (v << 8) | int(b[_U(i)]), i + 1


@_jit.helper
def _serial_size(st: int) -> int:
    """Bytes a value of serial type ``st`` takes in the record body; -1: invalid."""
    if st < 5:
        return st
    if st == 5:
        return 6
    if st < 8:
        return 8
    if st < 10:
        return 0
    if st < 12:
        return -1
    return (st - 12) >> 1


_SMALL_SIZES = np.array([_serial_size(st) for st in range(0x80)], np.int64)
"""Value sizes of the serial types below 128 (one varint byte), looked up, not computed:
the types alternate within a record, so the comparisons of :func:`_serial_size`
would mispredict on most columns."""
_INT_SHIFTS = np.zeros(0x80, np.int64)
_INT_SHIFTS[1:7] = 64 - 8 * _SMALL_SIZES[1:7]
"""Per integer serial type (1-6), the shift that leaves its value of an 8-byte load."""


@_jit.helper
def _word(b: U8, at: int) -> np.uint64:
    """The 8 bytes at ``b[at]`` as a little-endian word (one load). Reads past a short
    text's end: page buffers and the pool carry :data:`PAD` bytes of slack."""
    a = _U(at)
    return (_U(b[a]) | (_U(b[a + _U(1)]) << _U(8)) | (_U(b[a + _U(2)]) << _U(16))
            | (_U(b[a + _U(3)]) << _U(24)) | (_U(b[a + _U(4)]) << _U(32))
            | (_U(b[a + _U(5)]) << _U(40)) | (_U(b[a + _U(6)]) << _U(48))
            | (_U(b[a + _U(7)]) << _U(56)))


@_jit.helper
def _tail_mask(left: int) -> np.uint64:
    """The low ``left`` (1-7) bytes of a word."""
    return (_U(1) << _U(8 * left)) - _U(1)


@_jit.helper
def _text_hash(b: U8, start: int, size: int) -> int:
    """A 64-bit hash of ``b[start:start + size]``, a word at a time (multiply-xor, then
    a final mix so every byte reaches the low bits that pick the slot). A byte at a
    time (FNV-1a) took a third of an NVTX row's decode."""
    mult = _U(0x9E3779B97F4A7C15)
    h = (_U(size) + _U(1)) * mult
    k = 0
    while k + 8 <= size:
        h = (h ^ _word(b, start + k)) * mult
        k += 8
    if k < size:
        h = (h ^ (_word(b, start + k) & _tail_mask(size - k))) * mult
    h ^= h >> _U(29)
    h *= _U(0xBF58476D1CE4E5B9)
    h ^= h >> _U(32)
    return int(np.int64(h))


@_jit.helper
def _same_text(data: U8, a: int, b: U8, start: int, size: int) -> bool:
    """Whether ``data[a:a + size]`` equals ``b[start:start + size]``, a word at a time."""
    k = 0
    while k + 8 <= size:
        if _word(data, a + k) != _word(b, start + k):
            return False
        k += 8
    if k == size:
        return True
    mask = _tail_mask(size - k)
    return bool((_word(data, a + k) & mask) == (_word(b, start + k) & mask))


@_jit.helper
def _intern(b: U8, start: int, size: int, table: I64, data: U8, offsets: I64, hashes: I64,
            state: I64) -> int:
    """Index of the string ``b[start:start + size]`` in the pool, added when new (open
    addressing, linear probing; the caller reserved room for a sound page's text, and
    :data:`PAD` bytes more); -1 when the pool is full, which only overlapping cells of a
    damaged page can make it."""
    h = _text_hash(b, start, size)
    mask = len(table) - 1
    s = h & mask
    while True:
        d = int(table[_U(s)])
        if d < 0:
            break
        if (hashes[_U(d)] == h and offsets[_U(d + 1)] - offsets[_U(d)] == size
                and _same_text(data, offsets[_U(d)], b, start, size)):
            return d
        s = (s + 1) & mask
    d = int(state[0])
    used = int(state[1])
    if used + size + PAD > len(data) or d + 2 > len(offsets):
        return -1  # more text than a sound page holds: cells overlap, a damaged file
    for k in range(size):
        data[_U(used + k)] = b[_U(start + k)]
    offsets[d + 1] = used + size
    hashes[d] = h
    table[s] = d
    state[0] = d + 1
    state[1] = used + size
    return d


@_jit.loop
def rehash(hashes: I64, n: int, table: I64) -> None:
    """Insert strings ``0..n-1`` into an empty (all -1) hash ``table`` by their hashes."""
    mask = len(table) - 1
    for d in range(n):
        s = hashes[d] & mask
        while table[s] >= 0:
            s = (s + 1) & mask
        table[s] = d


@_jit.loop
def interior_children(buf: U8, n_pages: int, page_size: int, usable: int, bounds: I64,
                      out: I64, out_bounds: I64) -> int:
    """The child pages of ``n_pages`` interior table pages held one after another in
    ``buf``, in key order (each cell's left child, then the page's right-most child),
    with the bound on each child's rowids (its cell's key; for the right-most child the
    page's own bound, from ``bounds``). How many were written to ``out``, or -1 for a
    page that is not an interior page, a cell outside its page or keys out of order."""
    n = 0
    for p in range(n_pages):
        base = p * page_size
        if buf[base] != INTERIOR:
            return -1
        cells = _u16(buf, base + 3)
        if 12 + 2 * cells > usable or n + cells + 1 > len(out):
            return -1
        last = NULL
        for c in range(cells):
            off = _u16(buf, base + 12 + 2 * c)
            if off < 12 or off + 4 > usable:
                return -1
            key, i = _varint(buf, base + off + 4, base + usable)
            if i < 0 or key <= last or key > bounds[p]:
                return -1
            last = key
            out[n] = _u32(buf, base + off)
            out_bounds[n] = key
            n += 1
        out[n] = _u32(buf, base + 8)
        out_bounds[n] = bounds[p]
        n += 1
    return n


@_jit.loop
def edge_rowids(pages: U8, page_size: int, usable: int) -> tuple[int, int]:
    """The first cell's rowid on the first of two leaf pages and the last cell's on the
    second; NULL (both) when either page is not a leaf holding cells."""
    keys = np.full(2, NULL, np.int64)
    for p in range(2):
        base = p * page_size
        if pages[base] != LEAF:
            return NULL, NULL
        cells = _u16(pages, base + 3)
        if cells < 1 or 8 + 2 * cells > usable:
            return NULL, NULL
        off = _u16(pages, base + 8 + 2 * (0 if p == 0 else cells - 1))
        if off < 8 or off >= usable:
            return NULL, NULL
        _, i = _varint(pages, base + off, base + usable)  # payload length
        if i < 0:
            return NULL, NULL
        key, i = _varint(pages, i, base + usable)
        if i < 0:
            return NULL, NULL
        keys[p] = key
    return keys[0], keys[1]


@_jit.loop
def count_cells(buf: U8, pos: I64, page_size: int, usable: int) -> int:
    """Cells on the leaf pages at ``pos`` (page indexes into ``buf``); -1 when one is not
    a table leaf page or its cell pointers would not fit on it."""
    total = 0
    for j in range(len(pos)):
        base = pos[j] * page_size
        if buf[base] != LEAF:
            return -1
        cells = _u16(buf, base + 3)
        if 8 + 2 * cells > usable:
            return -1
        total += cells
    return total


_BYTE_SIZES = np.zeros(256, np.int64)
_BYTE_SIZES[:0x80] = [s if s >= 0 else 1 << 40 for s in _SMALL_SIZES]
"""Value sizes by serial-type byte for the branch-free walk: a reserved type (10, 11)
counts as 2^40 bytes, so the record cannot end where its payload does and is refused;
bytes of 0x80 and up are multi-byte varints, which send the row to the general walk."""


@_jit.loop
def decode_leaves(buf: U8, pos: I64, page_size: int, usable: int, slot_of: I64,
                  text_of: BOOL, want_col: I64, has_default: BOOL, alias_slot: int,
                  values: I64, row: int, row_limit: int, nulls: I64, table: I64, data: U8,
                  offsets: I64, hashes: I64, state: I64) -> tuple[int, int]:
    """Decode every cell of the leaf pages at ``pos`` into ``values[slot, row]``,
    from ``row`` on: integers (NULL as :data:`NULL`), text as pool indexes (NULL -1),
    the rowid alias from the cell. ``slot_of[col]`` is a record column's output slot
    (-1: not wanted), ``text_of[col]`` whether it is text; ``want_col`` the wanted
    columns. ``state`` is the pool's, plus the last rowid read (rowids must ascend).
    Rows at or past ``row_limit`` are refused (the page is called corrupt), as are cell
    pointers past the page. Returns ``(next row, status)``.

    Two walks of a record's header: when every serial type is one byte (any row
    without text of 58+ bytes) the value offsets are a branch-free prefix sum;
    otherwise the general walk decodes varints column by column. Either way the whole
    header is walked, so a record whose values do not end at its payload's end is
    refused, as SQLite refuses it; then the wanted values are read where they lie. The
    loop is written out inline: with a call per value it took twice as long."""
    n_want = len(want_col)
    last_want = want_col[n_want - 1] if n_want else -1  # want_col ascends
    col_st = np.empty(usable, np.int64)  # a record's serial types, by column
    col_at = np.empty(usable, np.int64)  # and its values' offsets in the body
    local_max = usable - 35  # payloads longer than this spill onto overflow pages
    for j in range(len(pos)):
        base = pos[_U(j)] * page_size
        end_of_page = base + usable
        cells = _u16(buf, base + 3)
        # Checked again here, not only by count_cells: mapped pages are the file's own
        # memory, which a writer could change in between, and nothing is written past
        # the page's cell pointers or the rows the caller made room for.
        if 8 + 2 * cells > usable or row + cells > row_limit:
            return row, CORRUPT
        for c in range(cells):
            off = _u16(buf, base + 8 + 2 * c)
            if off < 8 or off >= usable:
                return row, CORRUPT
            # The cell: payload length and rowid, two varints, their one-byte case read
            # inline (short payloads; rowids below 128). Calling _varint for all of them
            # measured no faster, and slower in each of three pairs on a busy host.
            i = base + off
            payload = int(buf[_U(i)])
            i += 1
            if payload >= 0x80:
                payload, i = _varint(buf, i - 1, end_of_page)
                if i < 0:
                    return row, CORRUPT
            if i >= end_of_page:
                return row, CORRUPT
            rowid = int(buf[_U(i)])
            i += 1
            if rowid >= 0x80:
                rowid, i = _varint(buf, i - 1, end_of_page)
                if i < 0:
                    return row, CORRUPT
            if payload > local_max:
                return row, UNSUPPORTED
            rec_end = i + payload
            if rec_end > end_of_page or payload < 1:
                return row, CORRUPT
            if rowid <= state[2]:  # keys ascend through a table's leaves
                return row, CORRUPT
            if state[2] == NULL:
                state[3] = rowid
            state[2] = rowid
            # The record: a header of serial types, then the values.
            header_len = int(buf[_U(i)])
            h = i + 1
            if header_len >= 0x80:
                header_len, h = _varint(buf, i, rec_end)
                if h < 0:
                    return row, CORRUPT
            header_end = i + header_len
            if header_len < 1 or header_end > rec_end or h > header_end:
                return row, CORRUPT
            # Each column's serial type and value offset. Every serial type one byte (no
            # text of 58+ bytes): column c's type is header byte c, and the offsets are a
            # prefix sum, computed without branches.
            # Only the offsets up to the last wanted column are kept, and the types not
            # at all (they are the header's bytes): a kernel row's 40 columns cost 80
            # stores before, 32 now.
            n_types = header_end - h
            types_at = h
            reach = min(n_types, last_want + 1)
            body = 0
            high = 0
            for col in range(reach):
                b = buf[_U(h + col)]
                high |= b
                col_at[_U(col)] = body
                body += _BYTE_SIZES[b]
            for col in range(reach, n_types):
                b = buf[_U(h + col)]
                high |= b
                body += _BYTE_SIZES[b]
            general = high >= 0x80
            if general:  # the general walk: varints of one byte or more
                body = 0
                n_types = 0
                while h < header_end:
                    st, h = _varint(buf, h, header_end)
                    if h < 0:
                        return row, CORRUPT
                    size = _serial_size(st)
                    # Bounded before it is added: sizes of up to 2^62 could wrap the sum.
                    if size < 0 or size > rec_end - header_end - body:
                        return row, CORRUPT
                    col_st[_U(n_types)] = st
                    col_at[_U(n_types)] = body
                    body += size
                    n_types += 1
            # As in SQLite, a record whose values do not end exactly at its payload's end
            # is damaged (this also keeps every value inside the record).
            if header_end + body != rec_end:
                return row, CORRUPT
            for k in range(n_want):
                wc = want_col[_U(k)]
                slot = _U(slot_of[_U(wc)])
                if wc >= n_types:  # added to the table after this row was written
                    if has_default[_U(wc)]:
                        return row, UNSUPPORTED  # the driver applies the default
                    values[slot, _U(row)] = -1 if text_of[_U(wc)] else NULL
                    nulls[slot] += 1
                    continue
                st = col_st[_U(wc)] if general else int(buf[_U(types_at + wc)])
                at = header_end + col_at[_U(wc)]
                if text_of[_U(wc)]:
                    if st == 0:
                        values[slot, _U(row)] = -1
                        nulls[slot] += 1
                    elif st >= 13 and st & 1:
                        code = _intern(buf, at, (st - 13) >> 1, table, data, offsets, hashes,
                                       state)
                        if code < 0:
                            return row, CORRUPT
                        values[slot, _U(row)] = code
                    else:
                        return row, TYPE
                elif 1 <= st <= 6:  # a big-endian two's-complement integer
                    v = _big_endian(buf, at, _INT_SHIFTS[_U(st)])
                    if v == NULL:  # -2^63 would read as NULL: the driver decides
                        return row, UNSUPPORTED
                    values[slot, _U(row)] = v
                elif st == 0:
                    values[slot, _U(row)] = NULL
                    nulls[slot] += 1
                elif st == 8 or st == 9:  # the constants 0 and 1
                    values[slot, _U(row)] = st - 8
                else:
                    return row, TYPE
            if alias_slot >= 0:
                values[_U(alias_slot), _U(row)] = rowid
            row += 1
    return row, OK

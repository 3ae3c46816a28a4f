"""The native SQLite reader (``agentload.profiler.sqlitefile``) reads exactly what
``sqlite3`` reads, or declines (``None``) so the driver reads it; it never reads a
damaged file out of bounds."""

from __future__ import annotations

import importlib
import os
import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from agentload.profiler import load_profile, sqlite_records, sqlitefile
from agentload.profiler.errors import ProfileError
from agentload.profiler.sqlitefile import read_columns, table_layout

nsight = importlib.import_module("agentload.profiler.nsight")
TEXT = {"text", "name", "value"}


def sql_read(db: Path, table: str, columns: list[str]) -> pl.DataFrame:
    con = sqlite3.connect(db)
    try:
        rows = con.execute(f'SELECT {", ".join(columns)} FROM "{table}"').fetchall()
    finally:
        con.close()
    schema = {c: pl.String if c in TEXT else pl.Int64 for c in columns}
    return pl.DataFrame(rows, schema=schema, orient="row")


def native(db: Path, table: str, columns: list[str]) -> pl.DataFrame | None:
    con = sqlite3.connect(db)
    try:
        layout = table_layout(con, table)
    finally:
        con.close()
    assert layout is not None
    return read_columns(db, layout, columns, TEXT)


def make(db: Path, ddl: str, rows: list[tuple[object, ...]], page_size: int = 4096) -> Path:
    con = sqlite3.connect(db)
    con.execute(f"PRAGMA page_size = {page_size}")
    con.execute(ddl)
    marks = ", ".join("?" * len(rows[0])) if rows else ""
    if rows:
        con.executemany(f"INSERT INTO t VALUES ({marks})", rows)
    con.commit()
    con.close()
    return db


INTS = [0, 1, -1, 2, 127, 128, -128, -129, 255, 256, 32767, 32768, -32769, (1 << 23) - 1,
        1 << 23, -(1 << 23) - 1, (1 << 31) - 1, 1 << 31, -(1 << 31) - 1, (1 << 47) - 1,
        1 << 47, -(1 << 47) - 1, (1 << 63) - 1, -(1 << 63) + 1, 1 << 40, -(1 << 55)]


def test_every_integer_width_text_and_null(tmp_path: Path) -> None:
    """Serial types 1-6, 8 and 9 (SQLite stores 0 and 1 without bytes), NULLs, empty and
    repeated text, non-ASCII text, the rowid alias."""
    rows = [(i + 1, v, None if i % 3 == 0 else f"name{i % 4}", "" if i % 5 == 0 else "é ü")
            for i, v in enumerate(INTS)]
    db = make(tmp_path / "t.sqlite", "CREATE TABLE t (id INTEGER PRIMARY KEY, v INTEGER, "
                                     "name TEXT, value TEXT)", rows)
    cols = ["v", "id", "name", "value"]
    got = native(db, "t", cols)
    assert got is not None
    assert got.equals(sql_read(db, "t", cols))
    assert got["v"].to_list() == INTS
    assert got["name"].null_count() == len([r for r in rows if r[2] is None])


@pytest.mark.parametrize("page_size", [512, 4096, 65536])
def test_deep_btree_in_key_order(tmp_path: Path, page_size: int) -> None:
    """Enough rows for interior levels (512-byte pages: a three-level tree)."""
    rows = [(i * 7919 % 100_003, i - 20_000, f"model.layers.{i % 32}.mlp") for i in range(40_000)]
    db = make(tmp_path / "t.sqlite", "CREATE TABLE t (a INTEGER, b INTEGER, text TEXT)",
              rows, page_size)
    got = native(db, "t", ["text", "b", "a"])
    assert got is not None and got.height == 40_000
    assert got.equals(sql_read(db, "t", ["text", "b", "a"]))


def test_rows_stay_in_rowid_order_when_pages_are_not(tmp_path: Path) -> None:
    """Deletes free pages that later inserts reuse: leaf pages out of file order."""
    db = tmp_path / "t.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE t (a INTEGER, b INTEGER)")
    con.execute("CREATE TABLE pad (x TEXT)")
    con.executemany("INSERT INTO pad VALUES (?)", [("x" * 400,)] * 2_000)
    con.executemany("INSERT INTO t VALUES (?, ?)", [(i, -i) for i in range(20_000)])
    con.execute("DELETE FROM pad")
    con.executemany("INSERT INTO t VALUES (?, ?)", [(i, i * i) for i in range(20_000, 60_000)])
    con.commit()
    con.close()
    got = native(db, "t", ["a", "b"])
    assert got is not None
    assert got["a"].to_list() == list(range(60_000))
    assert got.equals(sql_read(db, "t", ["a", "b"]))


def test_columns_added_later(tmp_path: Path) -> None:
    """Rows written before ALTER TABLE ADD COLUMN lack the column: NULL, as SQLite reads
    it; with a non-NULL default the reader declines (the driver applies the default)."""
    db = make(tmp_path / "t.sqlite", "CREATE TABLE t (a INTEGER)", [(1,), (2,)])
    con = sqlite3.connect(db)
    con.execute("ALTER TABLE t ADD COLUMN b INTEGER")
    con.execute("INSERT INTO t VALUES (3, 30)")
    con.commit()
    got = native(db, "t", ["a", "b"])
    assert got is not None and got["b"].to_list() == [None, None, 30]
    con.execute("ALTER TABLE t ADD COLUMN c INTEGER DEFAULT 5")
    con.commit()
    con.close()
    assert native(db, "t", ["a", "b"]) is not None  # c not wanted: no default read
    assert native(db, "t", ["a", "c"]) is None


@pytest.mark.parametrize(("value", "column"), [(1.5, "a"), ("seven", "a"), (b"\x00", "a"),
                                               (12, "text")])
def test_a_value_of_another_type_declines(tmp_path: Path, value: object, column: str) -> None:
    db = make(tmp_path / "t.sqlite", "CREATE TABLE t (a, text)", [(1, "x"), (2, "y")])
    con = sqlite3.connect(db)
    con.execute(f"UPDATE t SET {column} = ? WHERE rowid = 2", (value,))
    con.commit()
    con.close()
    assert native(db, "t", ["a", "text"]) is None
    assert native(db, "t", ["text" if column == "a" else "a"]) is not None


def test_overflow_pages_decline_and_the_driver_reads_them(tmp_path: Path) -> None:
    """A range name longer than a page spills onto overflow pages: the profile still
    loads (through the driver), with the whole name."""
    from agentload.profiler.synthetic import SyntheticExport

    x = SyntheticExport()
    x.process(1, "p")
    th = x.thread(1, 2)
    long_name = "model.layers.0." + "x" * 9_000
    x.push(th, 0, 1_000_000, long_name)
    x.launch_kernel(th, 1_000, 2_000, "k", api_ns=100, gpu_ns=100)
    db = x.write(tmp_path / "x.sqlite")
    assert native(db, nsight.NVTX, ["start", "text"]) is None
    assert load_profile(db).ranges["name"].to_list() == [long_name]


def test_invalid_utf8_declines_and_is_reported(tmp_path: Path) -> None:
    db = make(tmp_path / "t.sqlite", "CREATE TABLE t (name TEXT)", [("ok",)])
    con = sqlite3.connect(db)
    con.execute("INSERT INTO t VALUES (CAST(X'FFFE' AS TEXT))")
    con.commit()
    con.close()
    assert native(db, "t", ["name"]) is None


def test_without_rowid_and_wal_decline(tmp_path: Path) -> None:
    db = make(tmp_path / "t.sqlite", "CREATE TABLE t (a INTEGER PRIMARY KEY, b) WITHOUT ROWID",
              [(1, 2)])
    con = sqlite3.connect(db)
    assert table_layout(con, "t") is None
    con.close()
    wal = make(tmp_path / "w.sqlite", "CREATE TABLE t (a INTEGER)", [(1,)])
    con = sqlite3.connect(wal)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("INSERT INTO t VALUES (2)")
    con.commit()
    # The connection stays open, so the -wal file holds the second row.
    assert Path(f"{wal}-wal").stat().st_size > 0
    assert native(wal, "t", ["a"]) is None
    con.close()


def test_load_profile_native_equals_the_driver(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole profile read natively equals the one read through ADBC and through
    ``sqlite3`` (native reader switched off with AGENTLOAD_SQLITE_READER=driver)."""
    from tests.profiler.test_sqlite_reader import export, frames

    db = export(tmp_path / "x.sqlite")
    calls: list[str] = []
    real = nsight.sqlitefile.read_columns

    def counting(path: Path, layout: object, columns: list[str], text: set[str]) -> object:
        out = real(path, layout, columns, text)  # type: ignore[arg-type]
        calls.append("native" if out is not None else "declined")
        return out

    real_tables = nsight.sqlitefile.read_tables

    def counting_tables(path: Path, wanted: list[object], text: set[str],
                        threads: int = 2) -> object:
        out = real_tables(path, wanted, text, threads)  # type: ignore[arg-type]
        calls.extend("native" if f is not None else "declined" for f in out)
        return out

    monkeypatch.setattr(nsight.sqlitefile, "read_columns", counting)
    monkeypatch.setattr(nsight.sqlitefile, "read_tables", counting_tables)
    fast = frames(db)
    assert calls.count("native") >= 3 + 3  # the three big tables, then the small ones
    assert "native" in calls and "declined" not in calls
    calls.clear()
    monkeypatch.setenv(nsight.SQLITE_READER_ENV, "driver")  # the documented way out
    driver = frames(db)
    assert calls == []
    monkeypatch.setattr(nsight, "_adbc", lambda: None)
    slow = frames(db)
    for a, b, c in zip(fast, driver, slow, strict=True):
        assert a.schema == b.schema == c.schema
        assert a.equals(b) and a.equals(c), (a, b, c)


def test_damaged_pages_never_crash(tmp_path: Path) -> None:
    """Random bytes overwritten in a table's pages: the reader declines or reads what
    ``sqlite3`` reads; it never crashes (an out-of-bounds read would kill the test)."""
    rows = [(i, i * 1_000, f"model.layers.{i % 40}") for i in range(3_000)]
    clean = make(tmp_path / "clean.sqlite", "CREATE TABLE t (a INTEGER, b INTEGER, text TEXT)",
                 rows, 1024)
    data = clean.read_bytes()
    page = 1024
    rng = random.Random(7)
    outcomes = {"declined": 0, "same": 0, "sqlite3 failed": 0}
    for trial in range(300):
        damaged = bytearray(data)
        for _ in range(rng.choice((1, 4, 32))):
            at = rng.randrange(2 * page, len(data))  # past page 1 (the schema)
            damaged[at] = rng.randrange(256)
        db = tmp_path / f"d{trial % 4}.sqlite"
        db.write_bytes(bytes(damaged))
        got = native(db, "t", ["a", "b", "text"])
        try:
            want = sql_read(db, "t", ["a", "b", "text"])
        except (sqlite3.Error, pl.exceptions.PolarsError, OverflowError, UnicodeDecodeError):
            want = None
        if got is None:
            outcomes["declined"] += 1
        elif want is None:
            outcomes["sqlite3 failed"] += 1
        else:
            assert got.equals(want), trial
            outcomes["same"] += 1
    assert outcomes["declined"] > 0 and outcomes["same"] > 0
    # Where SQLite calls the file malformed, the native reader declined too (the record
    # and key-order checks it makes; 3,000 trials with other seeds agreed as well).
    assert outcomes["sqlite3 failed"] == 0


def test_a_damaged_export_is_one_line_error(tmp_path: Path) -> None:
    """Through the whole chain: the native reader declines, the driver fails, sqlite3
    reports, and the profile command gets one ProfileError."""
    from tests.profiler.test_sqlite_reader import export

    db = export(tmp_path / "x.sqlite")
    data = bytearray(db.read_bytes())
    con = sqlite3.connect(db)
    root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = ?",
                       (nsight.KERNEL,)).fetchone()[0]
    con.close()
    page = 4096
    data[(root - 1) * page] = 0x42  # the kernel table's root: no longer a B-tree page
    db.write_bytes(bytes(data))
    with pytest.raises(ProfileError, match=r"CUPTI_ACTIVITY_KIND_KERNEL|malformed"):
        load_profile(db)


def test_parts_fill_one_output_without_copies(tmp_path: Path) -> None:
    """Rowids 1..N (as nsys writes them): the parts decoded on two threads land in one
    shared output, so the frame is a single chunk."""
    from agentload.profiler.sqlitefile import read_tables

    rows = [(i, -i) for i in range(30_000)]
    db = make(tmp_path / "t.sqlite", "CREATE TABLE t (a INTEGER, b INTEGER)", rows, 1024)
    con = sqlite3.connect(db)
    layout = table_layout(con, "t")
    con.close()
    assert layout is not None
    (got,) = read_tables(db, [(layout, ["a", "b"])], TEXT, threads=2)
    assert got is not None and got.n_chunks() == 1
    assert got.equals(sql_read(db, "t", ["a", "b"]))


def _mapped(db: Path) -> sqlitefile._MappedFile | None:
    fd = os.open(db, os.O_RDONLY)
    try:
        header = sqlitefile._file_header(fd, db, True)
    finally:
        os.close(fd)
    assert header is not None
    return sqlitefile._MappedFile.open(db, header)


def _many_pages(tmp_path: Path) -> Path:
    rows = [(i * 7919 % 100_003, i - 20_000, f"model.layers.{i % 32}.mlp")
            for i in range(40_000)]
    return make(tmp_path / "t.sqlite", "CREATE TABLE t (a INTEGER, b INTEGER, text TEXT)",
                rows)


def test_mapped_and_copied_pages_read_the_same(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages decoded in place through the memory map (every run but the one holding the
    file's last page, which is copied) give what ``preadv`` copies give, and ``sqlite3``."""
    db = _many_pages(tmp_path)
    cols = ["a", "b", "text"]
    if _mapped(db) is None:
        pytest.skip("no MADV_POPULATE_READ here: pages are always copied")
    runs: list[bool] = []
    real_run = sqlitefile._MappedFile.run

    def spy(self: sqlitefile._MappedFile, first: int, span: int) -> object:
        got = real_run(self, first, span)
        runs.append(got is not None)
        return got

    monkeypatch.setattr(sqlitefile._MappedFile, "run", spy)
    mapped = native(db, "t", cols)
    assert sum(runs) >= 1 and not all(runs)  # mapped runs, and the last page's copied
    runs.clear()
    monkeypatch.setenv(sqlitefile.MAPPED_ENV, "0")
    copied = native(db, "t", cols)
    assert not runs  # no mapping at all
    assert mapped is not None and copied is not None
    assert mapped.equals(copied) and mapped.equals(sql_read(db, "t", cols))


def test_without_populate_pages_are_copied(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that refuses ``MADV_POPULATE_READ`` (before Linux 5.14: EINVAL) gets no
    mapping, and the read goes on through copies."""
    db = _many_pages(tmp_path)
    monkeypatch.setattr(sqlitefile, "MADV_POPULATE_READ", 0x7FFF)  # no such advice
    assert _mapped(db) is None
    got = native(db, "t", ["a", "text"])
    assert got is not None and got.equals(sql_read(db, "t", ["a", "text"]))


def test_a_file_truncated_under_the_map_is_an_error_not_sigbus(tmp_path: Path) -> None:
    """Pages past the file's new end are reported by the populate call (EFAULT), where
    touching them would kill the process with SIGBUS; the reader then copies with
    ``preadv``, whose short read declines the table."""
    db = _many_pages(tmp_path)
    mapped = _mapped(db)
    if mapped is None:
        pytest.skip("no MADV_POPULATE_READ here: pages are always copied")
    try:
        assert mapped.run(2, 4) is not None
        os.truncate(db, 4 * 4096)
        assert mapped.run(8, 4) is None
    finally:
        mapped.close()


@pytest.mark.parametrize("deleted", ["every_third", "sparse_keys"])
def test_rowid_gaps(tmp_path: Path, deleted: str) -> None:
    """Deleted rows leave gaps in the rowids: parts are copied together (some gaps) or
    get outputs of their own (keys far sparser than rows); the rows are the same."""
    db = make(tmp_path / "t.sqlite", "CREATE TABLE t (a INTEGER, b INTEGER)",
              [(i, i % 7) for i in range(30_000)], 1024)
    con = sqlite3.connect(db)
    if deleted == "every_third":
        con.execute("DELETE FROM t WHERE rowid % 3 = 0")
    else:
        con.execute("DELETE FROM t WHERE rowid % 100 != 0")
        con.execute("INSERT INTO t (rowid, a, b) VALUES (1000000000000, -1, -1)")
    con.commit()
    con.close()
    got = native(db, "t", ["b", "a"])
    assert got is not None
    assert got.equals(sql_read(db, "t", ["b", "a"]))


# --- crafted pages (found in review): each must be declined, nothing read or written
# out of bounds --------------------------------------------------------------------------

PAGE = 4096


def varint(v: int) -> bytes:
    """SQLite's varint of ``v`` (taken as unsigned 64-bit)."""
    v &= (1 << 64) - 1
    if v >= 1 << 56:
        high = v >> 8
        return bytes(0x80 | ((high >> (7 * (7 - k))) & 0x7F) for k in range(8)) + bytes([v & 0xFF])
    out = [v & 0x7F]
    v >>= 7
    while v:
        out.append(0x80 | (v & 0x7F))
        v >>= 7
    return bytes(reversed(out))


def with_root_page(tmp_path: Path, ddl: str, page: bytes, rows: list[tuple[object, ...]]) -> Path:
    """A database whose table ``t`` has ``page`` written over its root page."""
    db = make(tmp_path / "crafted.sqlite", ddl, rows)
    con = sqlite3.connect(db)
    root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 't'").fetchone()[0]
    con.close()
    data = bytearray(db.read_bytes())
    data[(root - 1) * PAGE:root * PAGE] = page
    db.write_bytes(bytes(data))
    return db


def leaf(cells: list[tuple[int, bytes]]) -> bytes:
    page = bytearray(PAGE)
    page[0] = 13
    page[3:5] = len(cells).to_bytes(2, "big")
    for k, (at, cell) in enumerate(cells):
        page[8 + 2 * k:10 + 2 * k] = at.to_bytes(2, "big")
        page[at:at + len(cell)] = cell
    return bytes(page)


def test_serial_type_sizes_that_wrap_are_refused(tmp_path: Path) -> None:
    """Blob sizes near 2^62 whose sum wraps 64 bits back to the payload's length: the
    wanted value's offset would land far outside the page (it crashed) or before the
    record (it read the cell's own header)."""
    huge = (1 << 62) - 7
    types = b"".join(varint(12 + 2 * n) for n in (huge, huge)) + bytes([6])
    types += b"".join(varint(12 + 2 * n) for n in (huge, huge))
    pad = (8 - 8 - 4 * huge) % (1 << 64)
    types += varint(12 + 2 * pad)
    record = varint(1 + len(types)) + types + (0x1122334455667788).to_bytes(8, "big")
    cell = varint(len(record)) + varint(1) + record
    db = with_root_page(tmp_path, "CREATE TABLE t (x, y, a INTEGER, z, w, pad)",
                        leaf([(3000, cell)]), [(1, 2, 3, 4, 5, 6)])
    assert native(db, "t", ["a"]) is None


def test_overlapping_text_cells_cannot_overrun_the_pool(tmp_path: Path) -> None:
    """300 cells, each starting inside the previous one's text and running to the page's
    end: 685 kB of distinct strings from one 4 kB page (it wrote past the pool)."""
    cells = []
    start = 8 + 2 * 300
    for k in range(300):
        at = start + 8 * k
        size = PAGE - at - 7
        cells.append((at, varint(3 + size) + varint(128 + k) + bytes([3]) + varint(13 + 2 * size)))
    db = with_root_page(tmp_path, "CREATE TABLE t (text TEXT)", leaf(cells), [("x",)])
    assert native(db, "t", ["text"]) is None


def test_an_interior_page_naming_too_many_children_is_refused(tmp_path: Path) -> None:
    """1,300 overlapping interior cells with ascending keys (it wrote past the child
    list sized for cells that do not overlap)."""
    rng = random.Random(1)
    count = 1_300
    page = bytearray(PAGE)
    page[0] = 5
    page[3:5] = count.to_bytes(2, "big")
    page[8:12] = (3).to_bytes(4, "big")
    first = 12 + 2 * count
    for k in range(first, PAGE):
        page[k] = rng.randrange(0x80, 0xC0)  # every offset starts a 9-byte varint

    def key(at: int) -> int:
        v = 0
        for b in page[at + 4:at + 12]:
            v = (v << 7) | (b & 0x7F)
        return (v << 8) | page[at + 12]

    chosen = sorted(range(first, first + count), key=key)
    for k, at in enumerate(chosen):
        page[12 + 2 * k:14 + 2 * k] = at.to_bytes(2, "big")
    db = with_root_page(tmp_path, "CREATE TABLE t (a INTEGER, b TEXT)", bytes(page),
                        [(i, "x" * 200) for i in range(200)])
    assert native(db, "t", ["a"]) is None


@pytest.mark.parametrize(("ddl", "insert", "cols", "read"), [
    # The rowid alias decided as SQLite does, not by looking for " DESC" in the DDL.
    ("CREATE TABLE t (id INTEGER PRIMARY KEY, description TEXT)",
     "INSERT INTO t VALUES (10, 'a'), (20, 'b')", ["id"], True),
    ("CREATE TABLE t (id INTEGER, x INTEGER, PRIMARY KEY (id DESC))",
     "INSERT INTO t VALUES (10, 1), (20, 2)", ["id", "x"], True),
    ("CREATE TABLE t (id INTEGER PRIMARY KEY DESC, x INTEGER)",
     "INSERT INTO t VALUES (10, 1), (20, 2)", ["id", "x"], True),
    ("CREATE TABLE t (id INT PRIMARY KEY, x INTEGER)",
     "INSERT INTO t VALUES (10, 1), (20, 2)", ["id", "x"], True),
    # Declined: the record holds a generated column the column list leaves out; -2^63
    # is the NULL marker; REAL columns come back as floats from SQLite.
    ("CREATE TABLE t (a INTEGER, g INTEGER GENERATED ALWAYS AS (a * 100) STORED, b INTEGER)",
     "INSERT INTO t (a, b) VALUES (1, 7), (2, 8)", ["a", "b"], False),
    ("CREATE TABLE t (a INTEGER)", "INSERT INTO t VALUES (-9223372036854775808), (5)",
     ["a"], False),
    ("CREATE TABLE t (a REAL, b INTEGER)", "INSERT INTO t VALUES (1.0, 1), (2.0, 2)",
     ["a", "b"], False),
])
def test_schema_cases(tmp_path: Path, ddl: str, insert: str, cols: list[str],
                      read: bool) -> None:
    db = tmp_path / "t.sqlite"
    con = sqlite3.connect(db)
    con.execute(ddl)
    con.execute(insert)
    con.commit()
    want = con.execute(f"SELECT {', '.join(cols)} FROM t").fetchall()
    layout = table_layout(con, "t")
    con.close()
    got = None if layout is None else read_columns(db, layout, cols, TEXT)
    if read:
        assert got is not None and [tuple(r) for r in got.rows()] == want
    else:
        assert got is None


def _decode_page(page: bytes, row_limit: int) -> tuple[int, int, list[int]]:
    """decode_leaves over one crafted leaf of a one-integer-column table: (rows, status,
    the output row past the limit, which must stay untouched)."""
    buf = np.frombuffer(page + bytes(sqlite_records.PAD), np.uint8).copy()
    buf.flags.writeable = False
    values = np.full((1, row_limit + 1), 7, np.int64)
    slot_of = np.full(PAGE, -1, np.int64)
    slot_of[0] = 0
    pool = sqlite_records.StringPool()
    rows, status = sqlite_records.decode_leaves(
        buf, np.zeros(1, np.int64), PAGE, PAGE, slot_of, np.zeros(PAGE, np.bool_),
        np.zeros(1, np.int64), np.zeros(PAGE, np.bool_), -1, values, 0, row_limit,
        np.zeros(1, np.int64), pool.table, pool.data, pool.offsets, pool.hashes, pool.state)
    return rows, status, values[0, row_limit:].tolist()


def test_the_decoder_checks_cell_counts_itself() -> None:
    """The decoder does not rely on ``count_cells`` having seen the same page: a mapped
    page is the file's memory, which a writer may change in between. More cells than
    the caller made room for, or cell pointers running off the page, are refused
    before anything is written past the room."""
    cells = [(PAGE - 8 * (k + 1), varint(3) + varint(k + 1) + bytes([2, 1, k])) for k in range(3)]
    page = leaf(cells)
    assert _decode_page(page, 3)[:2] == (3, sqlite_records.OK)
    rows, status, past = _decode_page(page, 2)  # room for 2 rows, 3 cells
    assert status == sqlite_records.CORRUPT and rows == 0 and past == [7]
    huge = bytearray(page)
    huge[3:5] = (PAGE // 2).to_bytes(2, "big")  # pointers would run past the page
    rows, status, past = _decode_page(bytes(huge), PAGE)
    assert status == sqlite_records.CORRUPT and rows == 0


SHRUNK_CHILD = """
import os, sqlite3, sys
from pathlib import Path
from agentload.profiler import sqlitefile
from agentload.profiler.sqlitefile import read_columns, table_layout
db = Path(sys.argv[1])
con = sqlite3.connect(db)
con.execute("PRAGMA page_size=4096")
con.execute("CREATE TABLE t (a INTEGER, b INTEGER)")
con.executemany("INSERT INTO t VALUES (?,?)", [(i, i * 3) for i in range(300_000)])
con.commit()
layout = table_layout(con, "t")
con.close()
scan = sqlitefile.scan_table
def shrinking(*a, **k):
    found = scan(*a, **k)
    os.truncate(db, 600 * 4096)  # after the header was read, before the map is made
    return found
sqlitefile.scan_table = shrinking
print(read_columns(db, layout, ["a", "b"], set()))
"""


def test_a_file_shrunk_before_the_map_is_declined(tmp_path: Path) -> None:
    """The map is as long as the file is when it is made, not when its header was read:
    runs past it are copies (short reads, so the table declines), never reads past the
    mapping (this crashed with SIGSEGV before)."""
    out = subprocess.run([sys.executable, "-c", SHRUNK_CHILD, str(tmp_path / "s.sqlite")],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "None"

"""Records of SQLite table leaf pages, decoded in compiled loops, and their string pool.

The half of the native reader (:mod:`agentload.profiler.sqlitefile`) that runs per cell:
varints and serial types, big-endian integers read as one 8-byte load, interior pages'
children, leaves' edge rowids, and the decode of the wanted columns of every record into
integer slots, with text interned into :class:`StringPool` (NVTX names repeat every step,
so each distinct string is stored once). Compiled with numba on first use and cached.
Every offset is checked against its page: a damaged page is ``CORRUPT``, not read out of
bounds.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt
import polars as pl

from agentload.profiler.compiled import LazyJit

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
BOOL = npt.NDArray[np.bool_]
A = TypeVar("A", bound=np.ndarray[Any, Any])


NULL = -(1 << 63)
"""Integer columns hold this for SQL NULL until the frame is built."""
PAD = 8
"""Bytes after the pages in a decode buffer: an integer is read as one 8-byte load,
which may reach past the last page's last value."""

OK, CORRUPT, UNSUPPORTED, TYPE = 0, 1, 2, 3
"""Status codes of :func:`decode_leaves`."""
LEAF, INTERIOR = 13, 5  # table B-tree page types

_jit = LazyJit(globals(), read_only_inputs=False)


class StringPool:
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

"""Stream one array of a JSON document in bounded memory (Chrome traces' ``traceEvents``).

:func:`stream_array` reads a binary stream chunk by chunk and yields the items of the
array under a top-level key (or of the document itself when it is a bare array) as
parsed batches, so only one batch of items is alive as Python objects at a time.

Item boundaries: the fast path guesses where the last complete item of the buffer ends
(:func:`_cut`: a ``}`` followed by ``, {"key":``, found with ``bytes.rfind``) and lets
orjson parse the run of items up to there, which also proves the guess right (see
:func:`_items`); scanning then costs next to nothing beside the parse. When a guess is
wrong, the buffer goes through an exact scanner that knows JSON strings (with escapes)
and bracket nesting: one call of a compiled, possessive regular expression
(:data:`_RUN`) matches as many complete ``item,`` pairs as the buffer holds, in C, and
items nested deeper than it knows, or cut by a chunk edge, go through
:class:`_ItemScanner`, which jumps between quotes and brackets with ``re.search`` and
keeps its state across chunks. Every batch is parsed by orjson, which checks it
strictly, so whatever the scanner lets through is valid JSON or an error. The other
top-level values are scanned the same way; the ones named in ``keep`` are parsed and
returned, the rest are validated and dropped (each is held whole while it is read:
Chrome traces keep only small metadata there).

Any damage (truncation, a corrupt byte, a missing array) is one :class:`JSONStreamError`
whose message says where, in bytes of the (decompressed) stream.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

CHUNK = 4 << 20

_WS = rb"[ \t\n\r]*+"
_STR = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'


def _nested(depth: int) -> bytes:
    """A possessive expression for bracket-free text with ``depth`` levels of nesting."""
    inner = rb'(?:[^"\[\]{}]++|' + _STR + rb")*+"
    for _ in range(depth):
        inner = (rb'(?:[^"\[\]{}]++|' + _STR + rb"|\{" + inner + rb"\}|\[" + inner
                 + rb"\])*+")
    return inner


_DEPTH = 4  # an event, its args, an arg's list, that list's lists: Kineto's deepest
_VALUE = (rb"(?:\{" + _nested(_DEPTH) + rb"\}|\[" + _nested(_DEPTH) + rb"\]|" + _STR
          + rb'|[^"\[\]{},: \t\n\r]++)')
#: As many ``value ,`` pairs as follow (possessive, so no backtracking): one C call.
_RUN = re.compile(rb"(?:" + _WS + _VALUE + _WS + rb",)*+", re.S)
_WS_RE = re.compile(_WS)
_STR_RE = re.compile(_STR, re.S)
_STRUCT = re.compile(rb'["\[\]{}]')
_STR_END = re.compile(rb'["\\]')
_SCALAR_END = re.compile(rb'[\[\]{},:" \t\n\r]')
_CLOSE = {ord("]"): ord("["), ord("}"): ord("{")}


class Readable(Protocol):
    """A binary stream: a file, a ``GzipFile``, a ``BytesIO``."""

    def read(self, size: int, /) -> bytes: ...


class JSONStreamError(ValueError):
    """The stream is not the JSON document expected; the message says where and why."""


@dataclass
class StreamResult:
    """What :func:`stream_array` found besides the items; filled in when it finishes."""

    found: bool = False  # the array was there (a bare-array document counts)
    bare: bool = False  # the document itself was the array
    extras: dict[str, Any] = field(default_factory=dict)  # kept top-level values, parsed


class _ItemScanner:
    """Find where one JSON value ends, resumably across chunks (the slow, exact path)."""

    def __init__(self) -> None:
        self.stack = bytearray()
        self.in_str = False
        self.started = False
        self.scalar = False
        self.resume_at_escape = False

    def end(self, buf: bytes, pos: int) -> int:
        """End offset of the value starting at ``pos`` (resumed at ``pos``); -1: need more."""
        n = len(buf)
        while pos < n:
            if self.in_str:
                m = _STR_END.search(buf, pos)
                if m is None:
                    return -1
                pos = m.end()
                if buf[m.start()] == 0x5C:  # backslash: skip the escaped byte
                    if pos >= n:
                        self.resume_at_escape = True
                        return -1
                    pos += 1
                    continue
                self.in_str = False
                if not self.stack:
                    return pos
                continue
            if self.scalar:
                m = _SCALAR_END.search(buf, pos)
                return -1 if m is None else m.start()
            if not self.started:
                self.started = True
                c = buf[pos]
                if c == 0x22:
                    self.in_str = True
                    pos += 1
                    continue
                if c not in (0x7B, 0x5B):
                    self.scalar = True
                    continue
            m = _STRUCT.search(buf, pos)
            if m is None:
                return -1
            c = buf[m.start()]
            pos = m.end()
            if c == 0x22:
                self.in_str = True
            elif c in (0x7B, 0x5B):
                self.stack.append(c)
            else:
                if not self.stack or self.stack[-1] != _CLOSE[c]:
                    raise JSONStreamError(f"unbalanced {chr(c)!r}")
                self.stack.pop()
                if not self.stack:
                    return pos
        return -1


class _Reader:
    """A byte buffer over ``read`` with an absolute offset for messages."""

    def __init__(self, read: Callable[[int], bytes], chunk: int) -> None:
        self.read_fn = read
        self.chunk = chunk
        self.buf = b""
        self.pos = 0
        self.base = 0  # stream offset of buf[0]
        self.eof = False

    def more(self) -> bool:
        """Drop consumed bytes and append a chunk; False at the end of the stream."""
        if self.eof:
            return False
        data = self.read_fn(self.chunk)
        if not data:
            self.eof = True
            return False
        self.base += self.pos
        self.buf = self.buf[self.pos:] + data
        self.pos = 0
        return True

    def where(self, pos: int | None = None) -> str:
        return f"at byte {self.base + (self.pos if pos is None else pos)}"

    def truncated(self) -> JSONStreamError:
        return JSONStreamError(f"ends early {self.where(len(self.buf))}, truncated")

    def peek(self) -> int:
        """The next non-blank byte (consumed blanks), reading on as needed; -1 at the end."""
        while True:
            self.pos = _WS_RE.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return -1

    def expect(self, allowed: bytes) -> int:
        c = self.peek()
        if c < 0:
            raise self.truncated()
        if c not in allowed:
            raise JSONStreamError(f"unexpected {chr(c)!r} {self.where()}, expected one of "
                                  f"{allowed.decode()!r}")
        self.pos += 1
        return c

    def value(self) -> bytes:
        """The raw bytes of the next value (held whole), read on across chunks."""
        self.peek()
        scanner = _ItemScanner()
        start, resume = self.pos, self.pos
        while True:
            try:
                end = scanner.end(self.buf, resume)
            except JSONStreamError as exc:
                raise JSONStreamError(f"{exc} after {self.where(start)}") from None
            if end >= 0:
                self.pos = end
                return self.buf[start:end]
            resume = len(self.buf) - start + (1 if scanner.resume_at_escape else 0)
            scanner.resume_at_escape = False
            self.pos = start
            if not self.more():
                if scanner.scalar and not scanner.stack:  # a bare scalar at the very end
                    self.pos = len(self.buf)
                    return self.buf[start:]
                raise self.truncated()
            start = 0
            resume = min(resume, len(self.buf))

    def string(self) -> str:
        raw = self.value()
        text = _parse(raw, self) if raw.startswith(b'"') else None
        if not isinstance(text, str):
            raise JSONStreamError(f"expected a key string {self.where()}")
        return text


def _parse(raw: bytes, reader: _Reader) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise JSONStreamError(f"{exc} (in the value ending {reader.where()})") from None


_NEXT_EVENT = re.compile(rb',[ \t\n\r]*+\{[ \t\n\r]*+"[^"\\]*+"[ \t\n\r]*+:')


def _cut(buf: bytes, pos: int) -> int:
    """End of the last ``}`` in ``buf[pos:]`` that ``, {"key":`` follows; -1 if none.

    That is how one event ends and the next begins. Strings rarely hold it (a raw
    ``"`` ends a string, so only a key or a string ending in ``}, {`` could), and the
    caller's check catches those; kernel names hold ``{lambda(float)#1}, ...`` freely.
    """
    i = len(buf)
    while True:
        i = buf.rfind(b",", pos, i)
        if i < 0:
            return -1
        j = i - 1
        while j >= pos and buf[j] in b" \t\r\n":
            j -= 1
        if j >= pos and buf[j] == 0x7D and _NEXT_EVENT.match(buf, i):
            return j + 1


def _items(reader: _Reader, batch_bytes: int) -> Iterator[list[Any]]:
    """Yield parsed batches of an array's items; the ``[`` has been consumed.

    ``reader.pos`` is always where an item may start (after ``[`` or a top comma). The
    fast path guesses the buffer's last item end (:func:`_cut`) and lets orjson check
    the guess: JSON is read left to right without lookahead past a
    closing bracket, so if ``"[" + buf[pos:cut] + "]"`` parses, the guess was outside
    every string and at the array's own depth, and those are exactly its items. A
    wrong guess (the brace sat in a string or deeper) fails to parse and that buffer
    goes through the scanner instead (and is not guessed again).
    """
    if reader.peek() == 0x5D:
        reader.pos += 1
        return
    pending: list[bytes] = []
    size = 0
    failed: bytes | None = None  # the buffer whose guess failed: not guessed again
    while True:
        buf, pos = reader.buf, reader.pos
        cut = _cut(buf, pos) if buf is not failed else -1
        failed = None if buf is not failed else failed
        if cut > pos:
            try:
                batch = orjson.loads(b"[" + b",".join([*pending, buf[pos:cut]]) + b"]")
            except orjson.JSONDecodeError:
                failed = buf
            else:
                reader.pos = buf.index(b",", cut) + 1
                pending, size = [], 0
                yield batch
                del batch
                if reader.peek() < 0:
                    raise reader.truncated()
                continue
        end = _RUN.match(buf, pos).end()  # type: ignore[union-attr]
        if end > pos:  # a run of complete "item," pairs
            pending.append(buf[pos:end - 1])
            size += end - pos
            reader.pos = end
        else:  # one item the run cannot take: cut by the chunk end, deep, or bad
            pending.append(reader.value())
            if reader.expect(b",]") == 0x5D:
                break
            size += len(pending[-1])
        if size >= batch_bytes:
            yield _parse(b"[" + b",".join(pending) + b"]", reader)
            pending, size = [], 0
        if reader.peek() < 0:
            raise reader.truncated()
    if pending:
        yield _parse(b"[" + b",".join(pending) + b"]", reader)


def stream_array(stream: Readable, key: str, keep: frozenset[str] = frozenset(),
                 result: StreamResult | None = None, *, chunk: int = CHUNK,
                 batch_bytes: int = CHUNK) -> Iterator[list[Any]]:
    """Yield the items of ``doc[key]`` (or of ``doc`` when it is an array) in batches.

    ``result`` is filled in as the document is read: whether the array was found, and
    the top-level values named in ``keep``. It is complete once the iterator is
    exhausted, which also checks the rest of the document.
    """
    res = result if result is not None else StreamResult()
    reader = _Reader(stream.read, chunk)
    first = reader.peek()
    if first < 0:
        raise JSONStreamError("empty document")
    if first == 0x5B:
        reader.pos += 1
        res.found = res.bare = True
        yield from _items(reader, batch_bytes)
    elif first == 0x7B:
        reader.pos += 1
        if reader.peek() == 0x7D:
            reader.pos += 1
        else:
            while True:
                if reader.peek() != 0x22:
                    reader.expect(b'"')
                name = reader.string()
                reader.expect(b":")
                if name == key and reader.peek() == 0x5B:
                    if res.found:
                        raise JSONStreamError(f"{key!r} appears twice {reader.where()}")
                    reader.pos += 1
                    res.found = True
                    yield from _items(reader, batch_bytes)
                else:
                    value = _parse(reader.value(), reader)
                    if name in keep:
                        res.extras[name] = value
                if reader.expect(b",}") == 0x7D:
                    break
    else:  # a scalar document: valid JSON perhaps, but no array in it
        _parse(reader.value(), reader)
    if reader.peek() >= 0:
        raise JSONStreamError(f"trailing data {reader.where()}")

"""An httpx transport that stamps every socket read with the kernel's receive time.

``StampedTransport`` keeps httpx's API (``httpx.AsyncClient(transport=...)``,
``client.stream(...)``, ``aiter_raw()``) but replaces httpcore (whose pool rescans
every connection on every request, and whose anyio layer costs tens of µs a read) with
a small HTTP/1.1 client on plain asyncio:

- one non-blocking socket per connection, ``TCP_NODELAY``, a large ``SO_RCVBUF`` and
  ``SO_TIMESTAMPNS`` on; an O(1) pool of idle keep-alive connections per origin;
- reads through a persistent ``loop.add_reader`` callback calling ``recvmsg``: the
  callback takes ``time.perf_counter_ns()`` the instant the loop serves the socket
  (the Python stamp) and the cmsg carries the kernel's receive time of the latest
  segment read (``SCM_TIMESTAMPNS``, CLOCK_REALTIME, converted to CLOCK_MONOTONIC with
  an offset sampled as the narrowest (perf, wall, perf) bracket, refreshed every second);
- chunked and content-length bodies decoded in place; one ``aiter_raw`` item per read.

The stamps of the read that produced the bytes just yielded are in
``response.extensions["agentload_stamps"]`` (a ``ReadStamps``): ``user_ns`` and
``kernel_ns`` (``None`` where the kernel gave none), and the read count. Their
difference is the client's own error: time the bytes waited in the socket while the
loop served other streams. When the client falls behind, one read drains several
events and they share the stamp of the latest segment, so events per read > 1 is
reported too (``agentload.replay.client.diagnostics``).

Failures map onto httpx's exceptions as httpcore's would (``ConnectError``,
``ConnectTimeout``, ``ReadTimeout``, ``RemoteProtocolError``, ``ReadError``), so the
client's error classification is unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import struct
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

SO_TIMESTAMPNS: int = getattr(socket, "SO_TIMESTAMPNS", 35)
SCM_TIMESTAMPNS: int = getattr(socket, "SCM_TIMESTAMPNS", SO_TIMESTAMPNS)
_TIMESPEC = struct.Struct("@qq")
_CMSG_SPACE = socket.CMSG_SPACE(_TIMESPEC.size)
# Bytes asked of one recvmsg. Not more than 64 KiB: recvmsg allocates the whole buffer
# before it shrinks it to what came, and glibc serves a 256 KiB request with mmap/munmap
# (its mmap threshold is 128 KiB), which cost 12 us a read here, 4x the read itself.
# A backlog larger than this is read in several calls, one stamp each.
READ_SIZE = 1 << 16
RCVBUF = 8 << 20
# Batched wake-ups: once a chunked body has started, the reader callback stamps and
# queues every read at once but wakes the consumer only every LAZY_READS reads, after
# LAZY_NS, or at the body's end. Stamps are taken in the callback, so this changes when
# bytes are parsed, never when they are stamped; it saves a task switch per event. A
# woken body hands over every queued read as one ``aiter_raw`` item, with each read's
# stamps and end offset in ``ReadStamps.batch``, so the generator layers run once per
# wake-up, not once per read. The thresholds count per stream, and streams start at
# different times, so wake-ups spread over the engine steps instead of bunching. The
# bounds (64 reads, about 20 KiB per stream, or a second) were tuned with `agentload bench
# client`: docs/results/client-bench.md.
LAZY_READS = 64
LAZY_NS = 1_000_000_000
# Only while this many bodies stream at once: with a few streams there is CPU to spare,
# and a deferred parse at a stream's end delays a closed-loop lane's next request
# (bench agree at 4 streams: last token -> next send p50 3.5 ms batched, 2.1 ms not).
LAZY_MIN_STREAMS = 64
IDLE_EXPIRY_NS = 4_000_000_000
# A stream of small segments with nothing sent back makes Linux ACK every read (a pushed
# segment below the receive MSS, and not in "pingpong" mode), and each ACK runs the whole
# loopback path in the reader's syscall. TCP_QUICKACK=0 after each read re-enters
# pingpong (delayed-ACK) mode, which the delayed-ACK timer leaves again: measured at
# 1,000 streams, ACKs per event 1.3 -> 1.0 and client kernel time 9.9 -> 7.9 us/event.
# Receive stamps are unaffected (they are taken when the segment arrives).
TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


def realtime_offset_ns(samples: int = 7) -> int:
    """CLOCK_REALTIME minus CLOCK_MONOTONIC (ns), from the narrowest of a few brackets."""
    best_width, best = 1 << 62, 0
    perf, wall = time.perf_counter_ns, time.time_ns
    for _ in range(samples):
        a = perf()
        w = wall()
        b = perf()
        if b - a < best_width:
            best_width, best = b - a, w - (a + b) // 2
    return best


class _Clock:
    """The realtime->monotonic offset, re-sampled at most once a second."""

    __slots__ = ("next_ns", "offset")

    def __init__(self) -> None:
        self.offset = realtime_offset_ns()
        self.next_ns = time.perf_counter_ns() + 1_000_000_000

    def refresh(self, now: int) -> None:
        self.offset = realtime_offset_ns()
        self.next_ns = now + 1_000_000_000


_CLOCK = _Clock()


@dataclass(slots=True)
class ReadStamps:
    """Stamps of the reads behind the latest ``aiter_raw`` item of one response.

    ``user_ns``/``kernel_ns`` are the latest read's (ns, ``time.perf_counter_ns``
    clock); ``batch`` holds every read the item is made of, in order, as ``(end,
    user_ns, kernel_ns)`` where ``end`` is the offset in the item just past that read's
    decoded bytes (an item is one read or several queued ones).
    """

    user_ns: int = 0
    kernel_ns: int | None = None
    reads: int = 0
    batch: list[tuple[int, int, int | None]] | None = None
    # The response body (a ``_Body``), for readers that take its reads one by one
    # (``_Body.next_reads``) instead of through httpx's ``aiter_raw`` layers.
    body: Any = None


class _Conn:
    """One HTTP/1.1 connection: a socket, its reader callback and a queue of reads."""

    __slots__ = ("closed", "deadline", "eof", "error", "idle_since", "kernel_ok", "key",
                 "last_wake", "lazy", "loop", "queue", "reading", "sock", "waiter")

    def __init__(self, sock: socket.socket, key: tuple[str, int],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.sock, self.key, self.loop = sock, key, loop
        self.queue: deque[tuple[bytes, int, int | None]] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.deadline = 0  # perf_counter_ns by which the waiting read must get bytes
        self.lazy = False  # batch wake-ups (set while a chunked body streams)
        self.last_wake = 0
        self.idle_since = 0
        self.reading = False
        self.eof = False
        self.closed = False
        self.error: OSError | None = None
        self.kernel_ok = True

    def start_reading(self) -> None:
        if not self.reading and not self.closed:
            self.loop.add_reader(self.sock.fileno(), self._on_readable)
            self.reading = True

    def stop_reading(self) -> None:
        if self.reading:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.sock.fileno())
            self.reading = False

    def _on_readable(self) -> None:
        # Stamp first: this is the moment the loop served the socket.
        user = time.perf_counter_ns()
        try:
            data, anc, _flags, _addr = self.sock.recvmsg(READ_SIZE, _CMSG_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.error = exc
            self.eof = True
            self.stop_reading()
            self._wake()
            return
        if not data:
            self.eof = True
            self.stop_reading()
            self._wake()
            return
        if TCP_QUICKACK is not None:
            self.sock.setsockopt(socket.IPPROTO_TCP, TCP_QUICKACK, 0)
        kernel = None
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS:
                sec, nsec = _TIMESPEC.unpack_from(raw)
                if user >= _CLOCK.next_ns:
                    _CLOCK.refresh(user)
                kernel = sec * 1_000_000_000 + nsec - _CLOCK.offset
        queue = self.queue
        queue.append((data, user, kernel))
        if (self.lazy and len(queue) < LAZY_READS and user - self.last_wake < LAZY_NS
                and not data.endswith(b"\r\n\r\n") and data != b"\r\n"):
            return
        self.last_wake = user
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def read(self, timeout_s: float | None) -> tuple[bytes, int, int | None]:
        """The next read's bytes and stamps; ``b""`` at end of stream."""
        while not self.queue:
            if self.error is not None:
                raise httpx.ReadError(f"{self.error.strerror or self.error}")
            if self.eof:
                return b"", time.perf_counter_ns(), None
            self.start_reading()
            self.waiter = self.loop.create_future()
            # No timer per read (a loop timer costs more than the read itself): the
            # transport's sweeper fails waiters whose deadline has passed.
            self.deadline = (time.perf_counter_ns() + int(timeout_s * 1e9)
                             if timeout_s is not None else 0)
            try:
                await self.waiter
            finally:
                self.waiter = None
                self.deadline = 0
        return self.queue.popleft()

    async def write(self, data: bytes, timeout_s: float | None) -> None:
        try:
            sent = self.sock.send(data)  # a request fits the send buffer almost always
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            raise httpx.WriteError(str(exc) or type(exc).__name__) from exc
        if sent == len(data):
            return
        data = data[sent:]
        try:
            async with asyncio.timeout(timeout_s):
                await self.loop.sock_sendall(self.sock, data)
        except TimeoutError:
            raise httpx.WriteTimeout(f"write took more than {timeout_s} s") from None
        except OSError as exc:
            raise httpx.WriteError(str(exc) or type(exc).__name__) from exc

    def close(self) -> None:
        self.lazy = False
        if not self.closed:
            self.stop_reading()
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()

    def reusable(self) -> bool:
        return not (self.closed or self.eof or self.error or self.queue)

    def alive(self) -> bool:
        """Whether an idle connection is still open (the server may have closed it)."""
        if not self.reusable():
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True  # nothing to read: open and quiet, as an idle connection should be
        except OSError:
            return False
        return False  # EOF (b""), or bytes nobody asked for


class _Body(httpx.AsyncByteStream):
    """The response body, decoded (chunked or content-length) one read at a time."""

    def __init__(self, transport: StampedTransport, conn: _Conn, first: bytes,
                 chunked: bool, length: int | None, keep_alive: bool,
                 stamps: ReadStamps, read_timeout: float | None) -> None:
        self.t, self.conn, self.first = transport, conn, first
        self.carry = b""  # a chunk-size line split across reads
        self.chunked, self.left, self.keep_alive = chunked, length, keep_alive
        self.stamps, self.read_timeout = stamps, read_timeout
        self.done = False
        self.chunk_left = 0  # payload bytes of the current chunk still to come
        self.trailer = False
        self.counted = True  # in the transport's count of streaming bodies
        self.released = False  # the connection went back (idle or closed) exactly once
        transport.streaming += 1

    def _lazy(self) -> bool:
        return self.chunked and self.t.streaming >= LAZY_MIN_STREAMS

    def _uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.t.streaming -= 1

    async def __aiter__(self) -> AsyncIterator[bytes]:
        stamps = self.stamps
        if self.first:
            # The body bytes that came with the head, with the head read's stamps.
            out = (self._decode_chunked if self.chunked else self._decode_plain)(self.first)
            self.first = b""
            if out:
                stamps.batch = [(len(out), stamps.user_ns, stamps.kernel_ns)]
                yield out
        while not self.done:
            items = await self._next_read()
            if items is None:
                break
            if not items:
                continue
            # Every read queued so far, as one item; the marks are cumulative sizes.
            marks: list[tuple[int, int, int | None]] = []
            size = 0
            for out, user, kernel in items:
                size += len(out)
                marks.append((size, user, kernel))
            stamps.batch = marks
            yield items[0][0] if len(items) == 1 else b"".join([item[0] for item in items])
        # Everything was read: the connection can serve the next request.
        self._finish()

    async def next_reads(self) -> list[tuple[bytes, int, int | None]] | None:
        """Every read queued now, decoded: ``(payload, user_ns, kernel_ns)`` per read
        that carried body bytes (possibly none); ``None`` once the body has ended.

        The lean way through a body for the SSE client: one call per wake-up, no
        generator layers, each read's payload kept apart with its own stamps (so an
        event that is one read keeps that read's stamp without offset bookkeeping).
        Use either this or ``aiter_raw``, not both.
        """
        stamps = self.stamps
        if self.first:
            out = (self._decode_chunked if self.chunked else self._decode_plain)(self.first)
            self.first = b""
            if self.done:
                self._finish()
            return [(out, stamps.user_ns, stamps.kernel_ns)] if out else []
        if self.done:
            return None
        items = await self._next_read()
        if self.done:  # also at the end of an unframed body (items is None)
            self._finish()
        return items

    async def _next_read(self) -> list[tuple[bytes, int, int | None]] | None:
        """Wait for one wake-up and decode every read queued by then:
        ``(payload, user_ns, kernel_ns)`` per read that carried body bytes; ``None``
        when the peer closed an unframed body (then ``done``, no keep-alive). Sets
        the stamps' last read and read count; finishing is the caller's."""
        conn = self.conn
        data, user, kernel = await conn.read(self.read_timeout)
        # After the first body read (the first token is parsed on time) wake-ups of a
        # chunked stream are batched (see LAZY_READS); the stamps are the read
        # callback's either way.
        conn.lazy = self._lazy()
        if not data:
            if self.chunked or self.left is not None:
                raise httpx.RemoteProtocolError(
                    "peer closed connection without sending complete message body")
            self.done = True
            self.keep_alive = False
            return None
        decode = self._decode_chunked if self.chunked else self._decode_plain
        queue = conn.queue
        items: list[tuple[bytes, int, int | None]] = []
        reads = 0
        while True:
            reads += 1
            out = decode(data)
            if out:
                items.append((out, user, kernel))
            if self.done or not queue:
                break
            data, user, kernel = queue.popleft()
        stamps = self.stamps
        stamps.user_ns, stamps.kernel_ns = user, kernel
        stamps.reads += reads
        return items

    def _finish(self) -> None:
        self.conn.lazy = False
        self._release()

    def _decode_plain(self, data: bytes) -> bytes:
        if self.left is None:
            return data
        if len(data) >= self.left:
            out = data[: self.left]
            self.left = 0
            self.done = True
            return out
        self.left -= len(data)
        return data

    def _decode_chunked(self, data: bytes) -> bytes:
        if not (self.carry or self.chunk_left or self.trailer):
            # The usual read: exactly one whole chunk (size line, payload, CRLF).
            end = data.find(b"\r\n", 0, 18)
            if end > 0:
                try:
                    size = int(data[:end], 16)
                except ValueError:
                    size = 0
                if size and end + size + 4 == len(data) and data.endswith(b"\r\n"):
                    return data[end + 2:end + 2 + size]
        parts: list[bytes] = []
        if self.carry:
            data, self.carry = self.carry + data, b""
        pos, n = 0, len(data)
        find = data.find
        while pos < n:
            left = self.chunk_left
            if left > 0:
                take = left if left <= n - pos else n - pos
                parts.append(data[pos:pos + take])
                pos += take
                left -= take
                self.chunk_left = left if left else -2  # then the payload's CRLF
                continue
            if left < 0:
                # Skip the payload's CRLF (possibly split across reads).
                take = -left if -left <= n - pos else n - pos
                pos += take
                self.chunk_left = left + take
                continue
            end = find(b"\r\n", pos)
            if end < 0:
                self.carry = data[pos:]  # a size line split across reads
                break
            line = data[pos:end]
            pos = end + 2
            if self.trailer:
                if not line:
                    self.done = True
                    break
                continue
            try:
                size = int(line, 16)
            except ValueError:
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise httpx.RemoteProtocolError(
                        f"bad chunk size line {line[:40]!r}") from None
            if size == 0:
                self.trailer = True
                continue
            stop = pos + size
            if stop + 2 <= n:
                # The usual case: the whole chunk and its CRLF are in this read.
                parts.append(data[pos:stop])
                pos = stop + 2
            else:
                self.chunk_left = size
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _release(self) -> None:
        self._uncount()
        # Once only: an empty body is released when its head is parsed and again when the
        # caller reads it to the end; twice in the idle list, one connection would serve
        # two requests at once and one of them would wait for ever (its read's waiter
        # replaced by the other's, so no read timeout fired either).
        if self.released:
            return
        self.released = True
        if self.conn.closed:
            return
        if self.done and self.keep_alive and self.conn.reusable():
            self.t._put_idle(self.conn)
        else:
            self.conn.close()

    async def aclose(self) -> None:
        self._uncount()
        if not self.done:
            self.conn.close()  # an unfinished body: the connection cannot be reused
        self._release()


class StampedTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over plain asyncio sockets with kernel receive stamps on every read.

    Only ``http://`` is supported (the loopback emulator and local vLLM servers); use
    the aiohttp transport for TLS targets. Connection limits are not enforced: the
    caller's lanes bound concurrency.
    """

    def __init__(self, connect_timeout_s: float | None = 10.0,
                 kernel_stamps: bool = True) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.kernel_stamps = kernel_stamps
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._all: set[_Conn] = set()
        self.streaming = 0  # response bodies open now (batched wake-ups above LAZY_MIN_STREAMS)
        self._resolved: dict[tuple[str, int], Any] = {}
        self._sweeper: asyncio.Task[None] | None = None
        # Every sweep visits every connection, so not more often than a timeout's
        # precision needs: a quarter second, or a fifth of a shorter read timeout.
        self._sweep_s = 0.25

    async def _sweep(self) -> None:
        """Fail reads that waited past their deadline (the read timeout), a few times a second."""
        while self._all:
            await asyncio.sleep(self._sweep_s)
            now = time.perf_counter_ns()
            for conn in list(self._all):
                if conn.closed:
                    self._all.discard(conn)
                    continue
                w = conn.waiter
                if w is None or w.done():
                    continue
                if conn.queue:
                    # Reads waiting behind a batched wake-up: hand them over.
                    if now - conn.last_wake >= LAZY_NS:
                        conn.last_wake = now
                        w.set_result(None)
                elif conn.deadline and now > conn.deadline:
                    w.set_exception(httpx.ReadTimeout("no bytes within the read timeout"))
        self._sweeper = None

    def _put_idle(self, conn: _Conn) -> None:
        conn.stop_reading()
        conn.idle_since = time.perf_counter_ns()
        self._idle.setdefault(conn.key, []).append(conn)

    def _checkout(self, key: tuple[str, int]) -> _Conn | None:
        """A live idle connection to ``key``, dropping stale ones (servers close idle
        keep-alive connections: uvicorn after 5 s, so ours expire after 4 s)."""
        idle = self._idle.get(key)
        now = time.perf_counter_ns()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < IDLE_EXPIRY_NS and conn.alive():
                return conn
            conn.close()
            self._all.discard(conn)
        return None

    async def _connect(self, key: tuple[str, int], timeout_s: float | None) -> _Conn:
        loop = asyncio.get_running_loop()
        host, port = key
        resolved = self._resolved.get(key)
        if resolved is None:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise httpx.ConnectError(f"cannot resolve {host}: {exc}") from exc
            resolved = self._resolved[key] = infos[0]
        family, kind, proto, _, addr = resolved
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            if self.kernel_stamps:
                sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            async with asyncio.timeout(timeout_s):
                await loop.sock_connect(sock, addr)
        except TimeoutError:
            sock.close()
            raise httpx.ConnectTimeout(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            sock.close()
            if exc.errno == errno.ECONNREFUSED:
                raise httpx.ConnectError(f"[Errno {exc.errno}] Connect call failed "
                                         f"{addr!r}: connection refused") from exc
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        conn = _Conn(sock, key, loop)
        self._all.add(conn)
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep())
        return conn

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol("StampedTransport speaks plain http:// only")
        key = (url.host, url.port or 80)
        timeouts = request.extensions.get("timeout", {})
        connect_t = timeouts.get("connect", self.connect_timeout_s)
        read_t = timeouts.get("read")
        if read_t is not None:
            self._sweep_s = min(self._sweep_s, max(read_t / 5, 0.005))
        write_t = timeouts.get("write")
        body = await request.aread()
        head = [f"{request.method} {url.raw_path.decode('ascii')} HTTP/1.1"]
        headers = request.headers
        if "host" not in headers:
            head.append(f"Host: {url.netloc.decode('ascii')}")
        for name, value in headers.multi_items():
            if name.lower() in ("transfer-encoding", "content-length"):
                continue
            head.append(f"{name}: {value}")
        head.append(f"Content-Length: {len(body)}")
        wire = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        while True:
            conn = self._checkout(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key, connect_t)
            try:
                return await self._exchange(conn, wire, request, read_t, write_t)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                conn.close()
                # A kept-alive connection the server closed under us, before it answered:
                # send again (on another idle one, or a fresh one).
                if reused and (getattr(exc, "before_response", False)
                               or not isinstance(exc, httpx.RemoteProtocolError)):
                    continue
                raise
            except BaseException:
                conn.close()
                raise

    async def _exchange(self, conn: _Conn, wire: bytes, request: httpx.Request,
                        read_t: float | None, write_t: float | None) -> httpx.Response:
        conn.start_reading()
        await conn.write(wire, write_t)
        buf = b""
        stamps = ReadStamps()
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            data, user, kernel = await conn.read(read_t)
            if not data:
                exc = httpx.RemoteProtocolError(
                    "Server disconnected without sending a response." if not buf else
                    "peer closed connection in the response head")
                exc.before_response = not buf  # type: ignore[attr-defined]
                raise exc
            stamps.user_ns, stamps.kernel_ns = user, kernel
            stamps.reads += 1
            buf += data
            if len(buf) > 1 << 20:
                raise httpx.RemoteProtocolError("response head larger than 1 MiB")
        lines = buf[:end].split(b"\r\n")
        try:
            _version, code, *_ = lines[0].split(b" ", 2)
            status = int(code)
        except ValueError:
            raise httpx.RemoteProtocolError(f"bad status line {lines[0][:60]!r}") from None
        header_list: list[tuple[bytes, bytes]] = []
        chunked, length, keep_alive = False, None, True
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip(), value.strip()
            header_list.append((name, value))
            low = name.lower()
            if low == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif low == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise httpx.RemoteProtocolError("bad content-length") from None
            elif low == b"connection" and value.lower() == b"close":
                keep_alive = False
        if request.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            length = 0
        if not chunked and length is None:
            keep_alive = False  # the body runs to the end of the connection
        rest = buf[end + 4:]
        stream = _Body(self, conn, rest, chunked, length, keep_alive, stamps, read_t)
        stamps.body = stream
        if length == 0 and not chunked:
            stream.done = True
            stream._release()
        return httpx.Response(status, headers=header_list, stream=stream,
                              extensions={"http_version": b"HTTP/1.1",
                                          "agentload_stamps": stamps})

    async def aclose(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None


def stamps_of(response: httpx.Response) -> ReadStamps | None:
    """The ``ReadStamps`` of a response from ``StampedTransport`` (else ``None``)."""
    stamps = response.extensions.get("agentload_stamps")
    return stamps if isinstance(stamps, ReadStamps) else None


def kernel_stamps_work(host: str = "127.0.0.1") -> bool:
    """Whether this kernel returns SO_TIMESTAMPNS on a loopback TCP socket."""
    with socket.socket() as srv:
        srv.bind((host, 0))
        srv.listen(1)
        with socket.create_connection(srv.getsockname()) as cli:
            cli.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            peer, _ = srv.accept()
            with peer:
                cli.settimeout(2.0)
                # Linux turns receive stamping on through a deferred static key, so the
                # first segments after the first SO_TIMESTAMPNS socket may come unstamped:
                # ask a few times before calling the kernel unable.
                for _ in range(50):
                    peer.sendall(b"x")
                    _, anc, _, _ = cli.recvmsg(16, _CMSG_SPACE)
                    if any(level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS
                           for level, kind, _ in anc):
                        return True
                    time.sleep(0.002)
    return False

"""Stream one completion over SSE and stamp when its bytes arrive.

Per-event work is stamp first, parse after: the arrival time is read the moment a read
returns, before any JSON is decoded, so parsing cost never shifts a timestamp. Over
``agentload.replay.client.netstamp.StampedTransport`` the stamps come from the transport's read
callback instead: the kernel's receive time of the read (the arrival time used, where the
kernel gives one) and the Python time the loop served the socket; their difference per
token chunk is kept as the client's own error (``chunk_user_ns``), and token events per
read (> 1 means the client is behind) are counted for the self-diagnostics. A
"token chunk" is any event whose choice carries text, reasoning or token ids; the
trailing usage-only event is not one. Errors (HTTP status, transport, timeout, an
``error`` event mid-stream) are returned in the result, never raised: one failed
request must not end a run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import orjson

from agentload.replay.client.netstamp import stamps_of

# How a request failed; the summary counts each kind.
ErrorKind = Literal["refused", "connect_timeout", "http_4xx", "http_5xx", "stall", "timeout",
                    "cut", "malformed", "server_error", "no_tokens", "transport"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("refused", "connect_timeout", "http_4xx", "http_5xx",
                                      "stall", "timeout", "cut", "malformed", "server_error",
                                      "no_tokens", "transport")


@dataclass(slots=True)
class StreamResult:
    """Timestamps (``time.perf_counter_ns``) and server counts of one streamed request."""

    sent_ns: int
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    done_ns: int | None = None
    chunks: int = 0
    client_tokens: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    status: int | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    on_first_token: Callable[[], None] | None = field(default=None, repr=False)
    # Arrival stamp and token count of every token chunk, for chunks.parquet.
    chunk_ns: list[int] = field(default_factory=list, repr=False)
    chunk_tokens: list[int] = field(default_factory=list, repr=False)
    # The generated token ids, when asked for (``return_token_ids``).
    output_ids: list[int] | None = field(default=None, repr=False)
    # The generated text (content deltas, or completion text), when asked for.
    output_text: list[str] | None = field(default=None, repr=False)
    # Python stamps of the token chunks when ``chunk_ns`` holds kernel receive stamps.
    chunk_user_ns: list[int] | None = field(default=None, repr=False)
    # The emulator's emission stamp (``t_emit_ns``) of each token chunk, when asked for.
    chunk_emit_ns: list[int] | None = field(default=None, repr=False)
    # When the emulator took the request in (its first event's ``t_arrive_ns``), likewise.
    emulator_arrive_ns: int | None = field(default=None, repr=False)
    # Reads that carried at least one token event; those that carried more than one
    # because the client read late (with kernel stamps: over ``LATE_READ_NS`` after the
    # read's last segment came; events the server sent together do not count); and the
    # most events in one read.
    reads: int = 0
    multi_event_reads: int = 0
    max_events_per_read: int = 0

    def fail(self, kind: ErrorKind, message: str) -> None:
        self.error_kind, self.error = kind, message

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_ns is not None


def _chunk_tokens(choice: dict[str, Any]) -> int:
    """How many tokens one streamed choice carries (0 for a usage-only event)."""
    token_ids = choice.get("token_ids")
    if token_ids:
        return len(token_ids)
    delta = choice.get("delta")
    if isinstance(delta, dict):
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
            return 1
        return 0
    # A completions event is one generated token even when its text is "": the token
    # decoded to part of a UTF-8 character, its bytes come with a later one. Skipping it
    # moved TTFT to the second token (and merged two ITL gaps); ``vllm bench serve``
    # counts it. Only a trailing finish-only event with no text carries no token.
    text = choice.get("text")
    if text:
        return 1
    return 1 if text == "" and choice.get("finish_reason") is None else 0


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any] | bytes,
    headers: dict[str, str] | None = None,
    total_timeout_s: float | None = None,
    on_first_token: Callable[[], None] | None = None,
    collect_token_ids: bool = False,
    collect_emit_ns: bool = False,
    collect_text: bool = False,
) -> StreamResult:
    """POST ``body`` (with ``stream: true``) to ``url`` and follow the SSE stream.

    ``body`` may be pre-encoded JSON, so a caller can build a large prompt before the
    moment it is due instead of on the send path. The client's read timeout bounds the
    gap between chunks (a stall); ``total_timeout_s`` bounds the whole request.
    ``on_first_token`` runs once, when the first token arrives (the prompt is computed).
    ``collect_emit_ns`` keeps each token event's ``t_emit_ns`` (the loopback emulator's
    emission stamp), parsed after the stamp, for the client benchmark.
    """
    payload = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if headers:
        hdrs.update(headers)
    result = StreamResult(sent_ns=time.perf_counter_ns(), on_first_token=on_first_token,
                          output_ids=[] if collect_token_ids else None,
                          output_text=[] if collect_text else None,
                          chunk_emit_ns=[] if collect_emit_ns else None)
    try:
        async with asyncio.timeout(total_timeout_s):
            await _follow(client, url, payload, hdrs, result)
    except TimeoutError:
        result.fail("timeout", f"timeout (no end within {total_timeout_s:g} s)")
    except httpx.ConnectTimeout as exc:
        if _refused(exc):
            result.fail("refused", f"connection refused ({_short(str(exc))})")
        else:
            result.fail("connect_timeout", "timeout (ConnectTimeout)")
    except httpx.TimeoutException as exc:
        result.fail("stall", f"stalled ({type(exc).__name__}: no bytes within the read "
                             "timeout)")
    except httpx.ConnectError as exc:
        result.fail("refused", f"connection failed ({_short(str(exc)) or 'refused'})")
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        result.fail("cut", f"stream cut ({type(exc).__name__}: "
                           f"{_short(str(exc)) or 'connection closed'})")
    except httpx.HTTPError as exc:
        result.fail("transport", f"{type(exc).__name__}: {_short(str(exc)) or 'failed'}")
    finally:
        result.done_ns = time.perf_counter_ns()
    if result.error is None and result.first_token_ns is None:
        result.fail("no_tokens", "stream ended without a token")
    return result


# Parsed URLs by string: httpx parses a str URL on every request (about 50 us here).
_URLS: dict[str, httpx.URL] = {}


def _parsed(url: str) -> httpx.URL:
    got = _URLS.get(url)
    if got is None:
        if len(_URLS) > 1024:
            _URLS.clear()
        got = _URLS[url] = httpx.URL(url)
    return got


async def _follow(client: httpx.AsyncClient, url: str, payload: bytes, hdrs: dict[str, str],
                  result: StreamResult) -> None:
    async with client.stream("POST", _parsed(url), content=payload, headers=hdrs) as resp:
        result.status = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            result.fail("http_5xx" if resp.status_code >= 500 else "http_4xx",
                        f"HTTP {resp.status_code}: {_short(text)}")
            return
        stamps = stamps_of(resp)
        if stamps is not None and stamps.body is not None:
            await _follow_reads(stamps.body, result)
            return
        buffer = b""
        async for raw in resp.aiter_raw():
            base = len(buffer)
            buffer += raw
            if b"\n\n" not in buffer:
                continue
            batch = stamps.batch if stamps is not None else None
            if batch is None:
                now = time.perf_counter_ns()
                batch = [(len(raw), now, None)]
            _handle_events(buffer, base, batch, result)
            if result.error is not None:
                return
            buffer = buffer[buffer.rfind(b"\n\n") + 2:]
        if buffer.strip():
            before = result.chunks
            _handle_event(buffer, time.perf_counter_ns(), result)
            if result.chunk_user_ns is not None and result.chunks > before:
                result.chunk_user_ns.append(result.chunk_ns[-1])


async def _follow_reads(body: Any, result: StreamResult) -> None:
    """Follow a ``StampedTransport`` body read by read: stamp now, parse later.

    The usual read after the first token is exactly one event (``data: {...}`` and its
    blank line) with the read's own stamps: it is only checked for shape (and for an
    ``"error"`` key) and kept, raw, with its stamp; the kept events are JSON-decoded
    together (one ``orjson.loads`` of a list) at the stream's end, or before anything
    else is applied, so order is kept. The first token, error events and any read
    that is not exactly one event (several queued, or one split across reads) take the
    general path at once. Per event that leaves a few byte tests and three appends on
    the hot path.
    """
    pending: list[bytes] = []   # JSON of kept token events, in order
    stamp_of: list[int] = []    # their recorded stamp (kernel's, else Python's)
    user_of: list[int] = []     # their Python stamp
    kernel_seen = False
    buffer = b""
    keep = pending.append
    keep_stamp = stamp_of.append
    keep_user = user_of.append
    try:
        while True:
            items = await body.next_reads()
            if items is None:
                break
            for data, user, kernel in items:
                if kernel is not None:
                    stamp = kernel
                    kernel_seen = True
                else:
                    stamp = user
                if (not buffer and result.first_token_ns is not None
                        and data.startswith(b"data: {") and data.endswith(b"\n\n")
                        and b'"error"' not in data):
                    if data.find(b"\n", 7) == len(data) - 2:
                        keep(data[6:-2])  # the usual read: one event
                        keep_stamp(stamp)
                        keep_user(user)
                        continue
                    # Several whole events in one read (sent together, or queued while
                    # the client was behind):
                    # they share the read's stamps, and the read counts them together.
                    events = data[:-2].split(b"\n\n")
                    if all(e.startswith(b"data: {") and b"\n" not in e for e in events):
                        for e in events:
                            keep(e[6:])
                            keep_stamp(stamp)
                            keep_user(user)
                        continue
                if pending:
                    _apply_pending(pending, stamp_of, user_of, kernel_seen, result)
                    if result.error is not None:
                        return
                base = len(buffer)
                buffer += data
                if b"\n\n" not in buffer:
                    continue
                _handle_events(buffer, base, [(len(data), user, kernel)], result)
                if result.error is not None:
                    return
                buffer = buffer[buffer.rfind(b"\n\n") + 2:]
    finally:
        # Also when the request is cut or times out: what came is counted.
        if pending:
            _apply_pending(pending, stamp_of, user_of, kernel_seen, result)
    if buffer.strip() and result.error is None:
        before = result.chunks
        _handle_event(buffer, time.perf_counter_ns(), result)
        if result.chunk_user_ns is not None and result.chunks > before:
            result.chunk_user_ns.append(result.chunk_ns[-1])


def _apply_pending(pending: list[bytes], stamp_of: list[int], user_of: list[int],
                   kernel_seen: bool, result: StreamResult) -> None:
    """Apply the kept events in order (those of one read share its stamps and count as
    one read with several events); empties the lists."""
    try:
        objs = orjson.loads(b"[" + b",".join(pending) + b"]")
    except orjson.JSONDecodeError:
        objs = None  # one is malformed: apply one by one, so the error names it
    if kernel_seen and result.chunk_user_ns is None:
        result.chunk_user_ns = []
    user_list = result.chunk_user_ns
    # Events of one read share its Python stamp (each read callback takes its own).
    read_user, got, late = None, 0, True
    for i, stamp in enumerate(stamp_of):
        user = user_of[i]
        if user != read_user:
            _close_read(result, got, late)
            read_user, got = user, 0
            late = not kernel_seen or user - stamp > LATE_READ_NS
        before = result.chunks
        if objs is None:
            _handle_data(pending[i], stamp, result)
        else:
            _apply(objs[i], stamp, result)
        got = _count_event(result, before, got, user_list, user)
        if result.error is not None:
            break
    _close_read(result, got, late)
    pending.clear()
    stamp_of.clear()
    user_of.clear()


def _handle_events(buffer: bytes, base: int, batch: list[tuple[int, int, int | None]],
                   result: StreamResult) -> None:
    """Apply every complete SSE event in ``buffer``; bytes from ``base`` on are the new
    item, made of the reads in ``batch`` (``(end offset in the item, Python stamp,
    kernel stamp)``). An event is stamped with the read its end (``\n\n``) arrived in:
    the kernel's stamp where there is one, else the Python stamp."""
    start = 0
    find = buffer.find
    i, n = 0, len(batch)
    read_end, user, kernel = batch[0]
    read_end += base
    got = 0  # token events that ended in read i
    user_list = result.chunk_user_ns
    while True:
        end = find(b"\n\n", start)
        if end < 0:
            break
        # The separator's last byte (end + 1) came in the first read reaching past it.
        if end + 1 >= read_end:
            _close_read(result, got, _late(user, kernel))
            got = 0
            while end + 1 >= read_end and i + 1 < n:
                i += 1
                read_end, user, kernel = batch[i]
                read_end += base
        if kernel is not None and user_list is None:
            user_list = result.chunk_user_ns = []
        before = result.chunks
        event = buffer[start:end]
        if event.startswith(b"data: ") and b"\n" not in event:
            _handle_data(event[6:], kernel if kernel is not None else user, result)
        else:
            _handle_event(event, kernel if kernel is not None else user, result)
        start = end + 2
        got = _count_event(result, before, got, user_list, user)
        if result.error is not None:
            break
    _close_read(result, got, _late(user, kernel))


def _count_event(result: StreamResult, before: int, got: int, user_list: list[int] | None,
                 user: int) -> int:
    """After one event was applied (``before``: the chunk count ahead of it): when it
    was a token event, count it for its read and keep its read's Python stamp (where
    the kernel stamps are kept); returns the read's new count of token events."""
    if result.chunks > before:
        if user_list is not None:
            user_list.append(user)
        return got + 1
    return got


LATE_READ_NS = 1_000_000
"""A read served this long after its last segment came was late: its events may have
waited in the socket. Sooner, several events in it came together: the server sent them
in one burst (a busy API server does), and their shared stamp is their true arrival."""


def _late(user: int, kernel: int | None) -> bool:
    """Whether a read was late (without a kernel stamp it cannot be told: assume so)."""
    return kernel is None or user - kernel > LATE_READ_NS


def _close_read(result: StreamResult, got: int, late: bool) -> None:
    """Count one read's token events; several in a late read mean events waited in the
    socket (the client was behind), in a prompt one that they came together."""
    if not got:
        return
    result.reads += 1
    if got > 1:
        if late:
            result.multi_event_reads += 1
        if got > result.max_events_per_read:
            result.max_events_per_read = got
    elif not result.max_events_per_read:
        result.max_events_per_read = 1


def _refused(exc: BaseException) -> bool:
    """Whether a "connect timeout" was really a refusal.

    httpx-aiohttp maps aiohttp's ClientConnectorError (refused, unreachable) to
    ConnectTimeout; the OSError underneath says what actually happened.
    """
    cause: BaseException | None = exc
    while cause is not None:
        os_error = getattr(cause, "os_error", None)
        if isinstance(cause, ConnectionRefusedError) or isinstance(os_error,
                                                                  ConnectionRefusedError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _handle_event(event: bytes, now: int, result: StreamResult) -> None:
    """Apply one SSE event (stamped ``now``) to ``result``."""
    if event.startswith(b"data: ") and b"\n" not in event:
        # The usual event: one data line.
        _handle_data(event[6:], now, result)
        return
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            _handle_data(line[5:].strip(), now, result)
            if result.error is not None:
                return


def _handle_data(data: bytes, now: int, result: StreamResult) -> None:
    if not data or data == b"[DONE]":
        return
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        result.fail("malformed", f"malformed SSE data: {_short(data.decode(errors='replace'))}")
        return
    _apply(obj, now, result)


def _apply(obj: Any, now: int, result: StreamResult) -> None:
    """Apply one decoded SSE data object (stamped ``now``) to ``result``."""
    if not isinstance(obj, dict):
        result.fail("malformed", f"malformed SSE data: {_short(str(obj))}")
        return
    if "error" in obj:
        err = obj["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        result.fail("server_error", f"server error mid-stream: {_short(str(msg))}")
        return
    choices: list[dict[str, Any]] = obj.get("choices") or []
    tokens = _chunk_tokens(choices[0]) if len(choices) == 1 else sum(
        _chunk_tokens(c) for c in choices)
    if result.output_ids is not None:
        for choice in choices:
            result.output_ids.extend(choice.get("token_ids") or ())
    if result.output_text is not None:
        for choice in choices:
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if piece:
                result.output_text.append(piece)
    if tokens:
        if result.first_token_ns is None:
            result.first_token_ns = now
            if result.on_first_token is not None:
                result.on_first_token()
        result.last_token_ns = now
        result.chunks += 1
        result.client_tokens += tokens
        result.chunk_ns.append(now)
        result.chunk_tokens.append(tokens)
        if result.chunk_emit_ns is not None:
            result.chunk_emit_ns.append(int(obj.get("t_emit_ns") or 0))
            if "t_arrive_ns" in obj:
                result.emulator_arrive_ns = int(obj["t_arrive_ns"])
    usage = obj.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens")


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."

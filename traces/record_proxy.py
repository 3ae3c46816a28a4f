"""The recording proxy itself: an OpenAI-compatible pass-through that notes what it saw.

Every request is forwarded to the upstream unchanged (method, path, query, body and
headers, less the hop-by-hop ones), and every response comes back unchanged: the same
status, headers and body bytes, streamed through as each upstream read returns. Only
successful ``POST /v1/completions`` and ``POST /v1/chat/completions`` calls are
recorded; requests carrying ``X-Agentload-Probe`` (agentload's own probes) are
forwarded and left out.

On the request path the proxy only stamps ``time.perf_counter_ns`` (arrival, each
upstream read, the end) and keeps references to the bytes. Everything else runs after
the response has finished, in a background task: decoding both bodies, counting tokens
(exact for token-id prompts, the upstream's vLLM ``/tokenize`` for text and chat,
4 characters a token when that fails), and handing the call to the ``Recorder``, whose
trace is then rewritten in a worker thread. Calls are recorded in the order they
completed, which is what dependencies are computed from.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from agentload.traces.headers import PROBE_HEADER, SESSION_HEADER
from agentload.traces.model import Message
from agentload.traces.record_trace import (
    Call,
    IslSource,
    OslSource,
    Recorded,
    Recorder,
    estimate_tokens,
    fit_tokens,
    pseudo_tokens,
    valid_token_ids,
)

RECORDED_PATHS: dict[str, Literal["completions", "chat"]] = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
}
# RFC 9110 7.6.1 connection-specific fields, plus what the two HTTP stacks set themselves
# (Expect too: the proxy's own server answers it, and it holds the whole body by then).
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "proxy-connection", "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host",
    "content-length", "expect",
})
# Request fields that change how vLLM renders or tokenizes a prompt; /tokenize takes them.
_TOKENIZE_CHAT_KEYS = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                       "chat_template", "chat_template_kwargs", "tools")
_TOKENIZE_TEXT_KEYS = ("add_special_tokens",)

Say = Callable[[str], None]
ChunkObserver = Callable[[int, int], None]


@dataclass(slots=True)
class _Exchange:
    """One proxied model call, kept as raw bytes and stamps until it is recorded."""

    kind: Literal["completions", "chat"]
    body: bytes
    session_key: str | None
    # Only what /tokenize may need to authenticate; used in memory, never recorded.
    auth: dict[str, str]
    sent_ns: int
    status: int = 0
    content_type: str = ""
    content_encoding: str = ""
    chunks: list[bytes] = field(default_factory=list)
    stamps: list[int] = field(default_factory=list)
    done_ns: int = 0


@dataclass(frozen=True, slots=True)
class _Response:
    """What the upstream answered, decoded after the fact."""

    usage: dict[str, Any]
    text: str
    content_chunks: int
    first_token_ns: int | None
    error: str | None = None


def forward_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """``headers`` without the hop-by-hop fields (and any the Connection field names)."""
    named = {h.strip().lower() for h in headers.get("Connection", "").split(",") if h.strip()}
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        low = key.lower()
        if low not in _HOP_BY_HOP and low not in named:
            out.add(key, value)
    return out


def upstream_error(message: str, status: int = 502) -> web.Response:
    """An OpenAI-style error body for failures of the proxy itself."""
    body = {"error": {"message": message, "type": "upstream_error", "param": None,
                      "code": status}}
    return web.Response(status=status, body=orjson.dumps(body),
                        content_type="application/json")


class RecordingProxy:
    """Forward everything to ``upstream``; record model calls into ``recorder``.

    ``start()`` listens, ``drain()`` waits until every finished call is in the file,
    ``close()`` stops listening, lets calls in flight finish (up to ``grace_s``),
    records them and writes the file a last time.
    """

    def __init__(
        self,
        upstream: str,
        recorder: Recorder,
        *,
        session_header: str = SESSION_HEADER,
        keep_content: bool = False,
        say: Say | None = None,
        grace_s: float = 5.0,
        chunk_observer: ChunkObserver | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.recorder = recorder
        self.session_header = session_header
        self.keep_content = keep_content
        self.say = say
        self.grace_s = grace_s
        self.chunk_observer = chunk_observer
        self.counts = recorder.counts
        self.t0_ns = time.perf_counter_ns()
        self._client: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._queue: asyncio.Queue[asyncio.Task[Call | None]] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self._tokenize_missing = False
        self.url = ""

    def app(self) -> web.Application:
        # Agent prompts run to megabytes; aiohttp's default cap is 1 MiB.
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (``OSError`` if that is impossible)."""
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            # Nothing the agent did not send may reach the upstream, and bodies pass
            # through still encoded, exactly as the upstream sent them.
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=30.0, sock_read=None),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._worker = asyncio.create_task(self._record_loop())
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False,
                                     shutdown_timeout=self.grace_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except BaseException:
            await self._shutdown()
            raise
        bound = self._runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in str(bound[0]) else bound[0]
        self.url = f"http://{shown}:{bound[1]}"

    @property
    def port(self) -> int:
        assert self._runner is not None
        return int(self._runner.addresses[0][1])

    async def drain(self) -> None:
        """Return once every call that has finished is recorded and written."""
        await self._queue.join()

    async def close(self) -> None:
        await self._shutdown()

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # waits for handlers in flight, up to grace_s
            self._runner = None
        if self._worker is not None:
            await self._queue.join()
            self._worker.cancel()
            self._worker = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    # -- the request path -----------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        sent_ns = time.perf_counter_ns()
        body = await request.read()
        kind = RECORDED_PATHS.get(request.path.rstrip("/")) if request.method == "POST" else None
        exchange: _Exchange | None = None
        if kind is not None and PROBE_HEADER not in request.headers:
            auth = {k: v for k, v in request.headers.items()
                    if k.lower() in ("authorization", "api-key", "x-api-key")}
            exchange = _Exchange(kind, body, request.headers.get(self.session_header), auth,
                                 sent_ns)
        elif kind is not None:
            self.counts["probes_skipped"] += 1
        assert self._client is not None
        try:
            upstream = await self._client.request(
                request.method, URL(self.upstream + request.raw_path, encoded=True),
                data=body or None,
                headers=forward_headers(request.headers), allow_redirects=False)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if kind is not None:
                self.counts["upstream_unreachable"] += 1
            reason = str(exc) or type(exc).__name__
            return upstream_error(f"agentload record: cannot reach the upstream "
                                  f"{self.upstream}: {reason}")
        try:
            return await self._relay(request, upstream, exchange)
        finally:
            upstream.release()

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse,
                     exchange: _Exchange | None) -> web.StreamResponse:
        out = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                 headers=forward_headers(upstream.headers))
        if upstream.content_length is not None:
            out.content_length = upstream.content_length
        await out.prepare(request)
        observer = self.chunk_observer if exchange is not None else None
        chunks = stamps = None
        if exchange is not None:
            chunks, stamps = exchange.chunks, exchange.stamps
        try:
            async for chunk in upstream.content.iter_any():
                now = time.perf_counter_ns()
                await out.write(chunk)
                if chunks is not None and stamps is not None:
                    chunks.append(chunk)
                    stamps.append(now)
                    if observer is not None:
                        observer(now, len(chunk))
        except (ConnectionError, aiohttp.ClientError, asyncio.CancelledError) as exc:
            # The agent went away, or the upstream broke off: drop the upstream
            # connection (which aborts the generation), cut the agent's connection
            # rather than end its response as if it were complete, record nothing.
            if exchange is not None:
                self.counts["aborted"] += 1
            upstream.close()
            if request.transport is not None:
                request.transport.abort()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return out
        done_ns = time.perf_counter_ns()
        if exchange is not None:
            exchange.status = upstream.status
            exchange.content_type = upstream.headers.get("Content-Type", "")
            exchange.content_encoding = upstream.headers.get("Content-Encoding", "")
            exchange.done_ns = done_ns
            if upstream.status == 200:
                # Queued in completion order, before any await, so dependencies (which
                # look at completion times) see every call that finished earlier.
                self._queue.put_nowait(asyncio.create_task(self._prepare(exchange)))
            else:
                self.counts[f"upstream_http_{upstream.status}"] += 1
        with contextlib.suppress(ConnectionError):
            await out.write_eof()
        return out

    # -- off the request path -------------------------------------------------------

    async def _record_loop(self) -> None:
        unsaved: list[Recorded] = []
        while True:
            task = await self._queue.get()
            try:
                call = await task
                if call is not None:
                    unsaved.append(self.recorder.add(call))
                if self._queue.empty() and unsaved:
                    # A backlog is written once, not once per call.
                    await self._save()
                    for rec in unsaved:
                        self._report(rec)
                    unsaved.clear()
            except Exception as exc:  # a bug here must not stop recording or forwarding
                self.counts["not_recorded_internal_error"] += 1
                self._say(f"agentload record: could not record a call: {exc!r}")
            finally:
                self._queue.task_done()

    async def _save(self) -> None:
        try:
            # In a thread: rewriting a long recording must not stall streams in flight.
            await asyncio.to_thread(self.recorder.save)
        except OSError as exc:
            self._say(f"agentload record: cannot write {self.recorder.path}: {exc}")

    def _report(self, rec: Recorded) -> None:
        elapsed = (time.perf_counter_ns() - self.t0_ns) / 1e9
        mark = " (estimated)" if rec.estimated else ""
        self._say(f"[{elapsed:7.1f} s] {rec.request_id}  isl {rec.isl}  osl {rec.osl}{mark}  "
                  f"({self.recorder.num_sessions} sessions, {self.recorder.num_requests} "
                  "requests)")

    def _say(self, line: str) -> None:
        if self.say is not None:
            self.say(line)

    async def _prepare(self, ex: _Exchange) -> Call | None:
        """Decode a finished exchange and count its tokens; None if it cannot be used."""
        try:
            req = orjson.loads(ex.body)
        except orjson.JSONDecodeError:
            req = None
        if not isinstance(req, dict):
            self.counts["not_recorded_bad_request_body"] += 1
            return None
        resp = _decode_response(ex)
        if resp.error is not None:
            self.counts[f"not_recorded_{resp.error}"] += 1
            return None
        model = req.get("model") if isinstance(req.get("model"), str) else None
        prompt = await self._prompt_tokens(ex, req, model, resp.usage.get("prompt_tokens"))
        if prompt is None:
            return None
        tokens, isl_source, messages = prompt
        if not tokens:
            self.counts["not_recorded_empty_prompt"] += 1
            return None
        osl, osl_source = await self._output_tokens(ex, model, resp)
        return Call(tokens=tuple(tokens), isl_source=isl_source, output_tokens=osl,
                    osl_source=osl_source, sent_ns=ex.sent_ns, done_ns=ex.done_ns,
                    first_token_ns=resp.first_token_ns, session_key=ex.session_key,
                    model=model, messages=messages if self.keep_content else None)

    async def _prompt_tokens(self, ex: _Exchange, req: dict[str, Any], model: str | None,
                             usage_prompt: Any,
                             ) -> tuple[list[int], IslSource, tuple[Message, ...] | None] | None:
        server_count = usage_prompt if isinstance(usage_prompt, int) and usage_prompt > 0 else None
        source: IslSource
        messages: tuple[Message, ...] | None
        if ex.kind == "completions":
            prompt = req.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
                prompt = prompt[0]
            if valid_token_ids(prompt):
                assert isinstance(prompt, list)
                tokens, source, messages = prompt, "exact", None
            elif isinstance(prompt, str):
                messages = (Message("prompt", prompt),)
                keys = {k: req[k] for k in _TOKENIZE_TEXT_KEYS if k in req}
                found = await self._tokenize(ex, {"model": model, "prompt": prompt, **keys})
                tokens, source = ((found, "tokenize") if found is not None
                                  else (pseudo_tokens(prompt), "estimate"))
            else:
                self.counts["not_recorded_batch_or_unknown_prompt"] += 1
                return None
        else:
            raw = req.get("messages")
            if not isinstance(raw, list) or not raw:
                self.counts["not_recorded_no_messages"] += 1
                return None
            messages = chat_messages(raw)
            keys = {k: req[k] for k in _TOKENIZE_CHAT_KEYS if k in req}
            found = await self._tokenize(ex, {"model": model, "messages": raw, **keys})
            if found is not None:
                tokens, source = found, "tokenize"
            else:
                text = "".join(f"{m.role}: {m.content}\n" for m in messages)
                tokens, source = pseudo_tokens(text), "estimate"
        if server_count is not None and server_count != len(tokens):
            # The server's count is what it prefilled, so the length follows it; block
            # contents stay ours (an estimate's pieces, or the tokenizer's ids).
            if source != "estimate":
                self.counts["isl_fitted_to_usage"] += 1
            tokens = fit_tokens(tokens, server_count)
            if source == "estimate":
                source = "usage"
        return tokens, source, messages

    async def _output_tokens(self, ex: _Exchange, model: str | None,
                             resp: _Response) -> tuple[int, OslSource]:
        completion = resp.usage.get("completion_tokens")
        if isinstance(completion, int) and not isinstance(completion, bool):
            return completion, "usage"
        streamed = ex.content_type.lower().startswith("text/event-stream")
        if resp.text:
            found = await self._tokenize(ex, {"model": model, "prompt": resp.text,
                                              "add_special_tokens": False})
            if found is not None:
                return len(found), "tokenize"
        if streamed:
            return resp.content_chunks, "chunks"
        return estimate_tokens(resp.text), "estimate"

    async def _tokenize(self, ex: _Exchange, payload: dict[str, Any]) -> list[int] | None:
        """Token ids from the upstream's ``/tokenize`` (vLLM), or None if it cannot say."""
        if self._tokenize_missing or self._client is None:
            return None
        if payload.get("model") is None:
            del payload["model"]
        try:
            async with self._client.post(
                    self.upstream + "/tokenize", data=orjson.dumps(payload),
                    headers={"Content-Type": "application/json", **ex.auth},
                    timeout=aiohttp.ClientTimeout(total=60.0)) as resp:
                if resp.status in (404, 405):
                    self._tokenize_missing = True  # not vLLM; stop asking
                    return None
                if resp.status != 200:
                    return None
                obj = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError):
            return None
        tokens = obj.get("tokens") if isinstance(obj, dict) else None
        return tokens if valid_token_ids(tokens) else None


def chat_messages(raw: list[Any]) -> tuple[Message, ...]:
    """Chat messages as (role, text): structured content's text parts joined."""
    out = []
    for m in raw:
        if not isinstance(m, dict):
            continue
        role = m.get("role") if isinstance(m.get("role"), str) else "unknown"
        out.append(Message(role=str(role), content=content_text(m.get("content"))))
    return tuple(out)


def content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return ""


def _decode_response(ex: _Exchange) -> _Response:
    stamps = ex.stamps
    encoding = ex.content_encoding.lower().strip()
    if encoding in ("", "identity"):
        chunks = ex.chunks
    else:
        try:
            chunks = [_decompress(b"".join(ex.chunks), encoding)]
        except (zlib.error, ValueError):
            return _Response({}, "", 0, None, "undecodable_response")
        stamps = [ex.done_ns]  # read times of compressed bytes say nothing of tokens
    if ex.content_type.lower().startswith("text/event-stream"):
        return _decode_stream(chunks, stamps)
    try:
        obj = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError:
        return _Response({}, "", 0, None, "unparsable_response")
    if not isinstance(obj, dict) or "error" in obj:
        return _Response({}, "", 0, None, "error_response")
    usage = obj.get("usage")
    text = "".join(_choice_text(c) for c in obj.get("choices") or () if isinstance(c, dict))
    return _Response(usage if isinstance(usage, dict) else {}, text, 0, None)


def _decompress(raw: bytes, encoding: str) -> bytes:
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompress(raw, 16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompress(raw)
    raise ValueError(f"unsupported Content-Encoding {encoding!r}")


def _decode_stream(chunks: list[bytes], stamps: list[int]) -> _Response:
    """Walk the SSE events; an event counts as arriving with the read that completed it."""
    usage: dict[str, Any] = {}
    texts: list[str] = []
    content_chunks = 0
    first: int | None = None
    buffer = b""
    for chunk, stamp in zip(chunks, stamps, strict=True):
        buffer += chunk.replace(b"\r\n", b"\n")
        if b"\n\n" not in buffer:
            continue
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if not data or data == b"[DONE]":
                    continue
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError:
                    return _Response({}, "", 0, None, "unparsable_stream")
                if not isinstance(obj, dict):
                    continue
                if "error" in obj:
                    return _Response({}, "", 0, None, "error_in_stream")
                piece = "".join(_choice_text(c) for c in obj.get("choices") or ()
                                if isinstance(c, dict))
                if piece:
                    texts.append(piece)
                    content_chunks += 1
                    if first is None:
                        first = stamp
                if isinstance(obj.get("usage"), dict):
                    usage = obj["usage"]
    return _Response(usage, "".join(texts), content_chunks, first)


def _choice_text(choice: dict[str, Any]) -> str:
    """Everything a choice generated: text, content, reasoning and tool-call arguments."""
    parts: list[str] = []
    for holder in (choice, choice.get("delta"), choice.get("message")):
        if not isinstance(holder, dict):
            continue
        for key in ("text", "content", "reasoning_content", "reasoning"):
            value = holder.get(key)
            if isinstance(value, str):
                parts.append(value)
        calls = holder.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict):
                    parts.extend(v for v in (fn.get("name"), fn.get("arguments"))
                                 if isinstance(v, str))
    return "".join(parts)

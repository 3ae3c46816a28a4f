"""Stream one completion over SSE and stamp when its bytes arrive.

Per-event work is stamp first, parse after: the arrival time is read the moment a read
returns, before any JSON is decoded, so parsing cost never shifts a timestamp. A
"token chunk" is any event whose choice carries text, reasoning or token ids; the
trailing usage-only event is not one. Errors (HTTP status, transport, timeout, an
``error`` event mid-stream) are returned in the result, never raised: one failed
request must not end a run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson


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
    return 1 if choice.get("text") else 0


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any] | bytes,
    headers: dict[str, str] | None = None,
) -> StreamResult:
    """POST ``body`` (with ``stream: true``) to ``url`` and follow the SSE stream.

    ``body`` may be pre-encoded JSON, so a caller can build a large prompt before the
    moment it is due instead of on the send path.
    """
    payload = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if headers:
        hdrs.update(headers)
    result = StreamResult(sent_ns=time.perf_counter_ns())
    try:
        async with client.stream("POST", url, content=payload, headers=hdrs) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {_short(text)}"
                return result
            buffer = b""
            async for raw in resp.aiter_raw():
                now = time.perf_counter_ns()
                buffer += raw
                if b"\n\n" not in buffer:
                    continue
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    _handle_event(event, now, result)
                if result.error is not None:
                    return result
            if buffer.strip():
                _handle_event(buffer, time.perf_counter_ns(), result)
    except httpx.TimeoutException as exc:
        result.error = f"timeout ({type(exc).__name__})"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {_short(str(exc)) or 'connection failed'}"
    finally:
        result.done_ns = time.perf_counter_ns()
    if result.error is None and result.first_token_ns is None:
        result.error = "stream ended without a token"
    return result


def _handle_event(event: bytes, now: int, result: StreamResult) -> None:
    """Apply one SSE event (stamped ``now``) to ``result``."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            result.error = f"malformed SSE data: {_short(data.decode(errors='replace'))}"
            return
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            result.error = f"server error mid-stream: {_short(str(msg))}"
            return
        tokens = sum(_chunk_tokens(c) for c in obj.get("choices") or ())
        if tokens:
            if result.first_token_ns is None:
                result.first_token_ns = now
            result.last_token_ns = now
            result.chunks += 1
            result.client_tokens += tokens
        usage = obj.get("usage")
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens")
            result.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""The SSE client against scripted streams: stamps, token counts, usage and every error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson

from agentload.replay.client.sse import stream_completion


def sse(*objs: object) -> list[bytes]:
    return [b"data: " + orjson.dumps(o) + b"\n\n" for o in objs] + [b"data: [DONE]\n\n"]


class Slow(httpx.AsyncByteStream):
    """Yields chunks with a pause before each, like tokens from a decoding server."""

    def __init__(self, chunks: list[bytes], gap_s: float = 0.02) -> None:
        self.chunks, self.gap_s = chunks, gap_s

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            await asyncio.sleep(self.gap_s)
            yield chunk


def client_for(chunks: list[bytes], status: int = 200, gap_s: float = 0.02) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, stream=Slow(chunks, gap_s))
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_tokens_stamps_and_usage() -> None:
    tokens = [{"choices": [{"index": 0, "text": f"t{i}"}]} for i in range(5)]
    usage = {"choices": [], "usage": {"prompt_tokens": 640, "completion_tokens": 5,
                                      "prompt_tokens_details": {"cached_tokens": 576}}}
    async with client_for(sse(*tokens, usage)) as client:
        res = await stream_completion(client, "http://x/v1/completions", {"stream": True})
    assert res.ok and res.error is None
    assert res.chunks == 5 and res.client_tokens == 5
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (640, 5, 576)
    assert res.sent_ns < res.first_token_ns < res.last_token_ns <= res.done_ns
    # Five chunks 20 ms apart: the last token arrives at least ~80 ms after the first
    # (no upper bound: a loaded host only delays it).
    assert (res.last_token_ns - res.first_token_ns) / 1e9 > 0.075


async def test_events_split_across_reads_and_several_per_read() -> None:
    body = b"".join(sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                        {"choices": [{"text": "c", "token_ids": [7, 8]}]}))
    pieces = [body[i:i + 7] for i in range(0, len(body), 7)]
    async with client_for(pieces, gap_s=0) as client:
        res = await stream_completion(client, "http://x/v1/completions", {})
    assert res.chunks == 3 and res.client_tokens == 4


async def test_chat_deltas_count_reasoning_as_tokens() -> None:
    events = sse({"choices": [{"delta": {"role": "assistant"}}]},
                 {"choices": [{"delta": {"reasoning_content": "hmm"}}]},
                 {"choices": [{"delta": {"content": "hi"}}]})
    async with client_for(events) as client:
        res = await stream_completion(client, "http://x/v1/chat/completions", {})
    assert res.chunks == 2  # the role-only delta carries no token


async def test_http_error_status_is_reported_not_raised() -> None:
    async with client_for([b'{"error": "max_tokens too large"}'], status=400) as client:
        res = await stream_completion(client, "http://x/v1/completions", {})
    assert not res.ok and res.status == 400
    assert res.error is not None and res.error.startswith("HTTP 400") and "max_tokens" in res.error


async def test_error_event_mid_stream() -> None:
    events = sse({"choices": [{"text": "a"}]}, {"error": {"message": "engine dead"}})
    async with client_for(events) as client:
        res = await stream_completion(client, "http://x/v1/completions", {})
    assert not res.ok and "engine dead" in (res.error or "")


async def test_stream_without_tokens_is_a_failure() -> None:
    async with client_for([b"data: [DONE]\n\n"]) as client:
        res = await stream_completion(client, "http://x/v1/completions", {})
    assert not res.ok and res.error == "stream ended without a token"


async def test_connection_refused_is_reported() -> None:
    async with httpx.AsyncClient() as client:
        res = await stream_completion(client, "http://127.0.0.1:9/v1/completions", {})
    assert not res.ok and res.error_kind == "refused"
    assert "connection failed" in (res.error or "")

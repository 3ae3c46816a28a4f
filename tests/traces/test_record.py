"""The recording proxy (``agentload record``): pass-through, grouping, tokens, the file.

Unit tests run the proxy in-process in front of a fake OpenAI/vLLM upstream (an
aiohttp app defined here: completions and chat, streaming and not, ``/tokenize``);
the ``vllm``-marked tests record a real replay through ``agentload record`` in front of
the embedded vLLM CPU server and replay the recording.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import polars as pl
import pytest
from aiohttp import web

from agentload.traces import Trace, demo_trace_path
from agentload.traces.files import load_native
from agentload.traces.record_bench import run_proxy_bench
from agentload.traces.record_proxy import PROBE_HEADER, RecordingProxy
from agentload.traces.record_trace import BlockIds, Recorder, pseudo_tokens
from tests.support import run_cli

MODEL = "fake-model"


# -- a fake upstream ------------------------------------------------------------------


def fake_tokens(text: str) -> list[int]:
    """A word tokenizer: one id per whitespace-separated word, equal words equal ids."""
    return [100 + zlib.crc32(w.encode()) % 30000 for w in text.split()]


def render_chat(messages: list[dict[str, Any]]) -> str:
    def text(content: Any) -> str:
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content)
        return str(content or "")
    return "".join(f"<{m['role']}> {text(m.get('content'))} " for m in messages) + "<assistant>"


class FakeUpstream:
    """A deterministic OpenAI-compatible server; it remembers every request it got."""

    def __init__(self, tokenize: bool = True) -> None:
        self.tokenize = tokenize
        self.seen: list[tuple[str, bytes, dict[str, str]]] = []
        self.gate: asyncio.Event | None = None  # if set: pause after the first event
        self.token_delay_s = 0.001
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize_handler)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/gz", self.gz)
        return app

    def _remember(self, request: web.Request, body: bytes) -> None:
        if request.path != "/tokenize":
            self.seen.append((request.path, body, dict(request.headers)))

    async def models(self, request: web.Request) -> web.Response:
        self._remember(request, b"")
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def gz(self, request: web.Request) -> web.Response:
        return web.Response(body=gzip.compress(b"compressed " * 50, mtime=0),
                            headers={"Content-Encoding": "gzip",
                                     "Content-Type": "text/plain"})

    async def tokenize_handler(self, request: web.Request) -> web.Response:
        if not self.tokenize:
            raise web.HTTPNotFound()
        req = await request.json()
        text = render_chat(req["messages"]) if "messages" in req else req["prompt"]
        tokens = fake_tokens(text)
        return web.json_response({"tokens": tokens, "count": len(tokens)})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self._remember(request, body)
        req = orjson.loads(body)
        if "model" not in req:
            return web.json_response({"error": {"message": "model is required"}}, status=400)
        prompt = req["prompt"]
        isl = len(prompt) if isinstance(prompt, list) else len(fake_tokens(prompt))
        return await self._answer(request, req, isl, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self._remember(request, body)
        req = orjson.loads(body)
        return await self._answer(request, req, len(fake_tokens(render_chat(req["messages"]))),
                                  chat=True)

    async def _answer(self, request: web.Request, req: dict[str, Any], isl: int,
                      chat: bool) -> web.StreamResponse:
        n = int(req.get("max_tokens") or 4)
        words = [f" w{i}" for i in range(n)]
        usage = {"prompt_tokens": isl, "completion_tokens": n, "total_tokens": isl + n}
        head = {"id": "cmpl-1", "created": 0, "model": req.get("model")}
        if not req.get("stream"):
            if chat:
                choice: dict[str, Any] = {"index": 0, "message": {
                    "role": "assistant", "content": "".join(words)}, "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": "".join(words), "finish_reason": "length"}
            return web.Response(body=orjson.dumps({**head, "choices": [choice],
                                                   "usage": usage}),
                                content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events: list[dict[str, Any]] = []
        if chat:
            events.append({**head, "choices": [{"index": 0, "delta": {
                "role": "assistant", "content": ""}}]})
        for w in words:
            choice = ({"index": 0, "delta": {"content": w}} if chat
                      else {"index": 0, "text": w})
            events.append({**head, "choices": [choice]})
        if (req.get("stream_options") or {}).get("include_usage"):
            events.append({**head, "choices": [], "usage": usage})
        for i, event in enumerate(events):
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
            if i == 0 and self.gate is not None:
                await asyncio.wait_for(self.gate.wait(), 10)
            await asyncio.sleep(self.token_delay_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@asynccontextmanager
async def serving(fake: FakeUpstream) -> AsyncIterator[FakeUpstream]:
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield fake
    finally:
        await runner.cleanup()


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with serving(FakeUpstream()) as fake:
        yield fake


@asynccontextmanager
async def recording(upstream_url: str, path: Path, block_size: int = 4,
                    **kwargs: Any) -> AsyncIterator[RecordingProxy]:
    recorder = Recorder(path, block_size=block_size)
    recorder.save()
    proxy = RecordingProxy(upstream_url, recorder, **kwargs)
    await proxy.start("127.0.0.1", 0)
    try:
        yield proxy
    finally:
        await proxy.close()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    # auto_decompress off: the test compares the bytes on the wire.
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        yield session


async def post(client: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    async with client.post(url, data=orjson.dumps(body),
                           headers={"Content-Type": "application/json", **(headers or {})}
                           ) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


def completion(prompt: Any, stream: bool = True, max_tokens: int = 3,
               usage: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                            "stream": stream}
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def chat(messages: list[dict[str, Any]], stream: bool = True,
         max_tokens: int = 3) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream}


def sessions_of(trace: Trace) -> dict[str, list[str]]:
    return {s.id: [r.id for r in s.requests] for s in trace.sessions}


# -- pass-through -------------------------------------------------------------------------

BODIES = {
    "completions stream": ("/v1/completions", completion([5, 6, 7])),
    "completions stream usage": ("/v1/completions", completion("a b c", usage=True)),
    "completions json": ("/v1/completions", completion("a b c", stream=False)),
    "chat stream": ("/v1/chat/completions", chat([{"role": "user", "content": "hi there"}])),
    "chat json": ("/v1/chat/completions",
                  chat([{"role": "user", "content": "hi there"}], stream=False)),
    "upstream 400": ("/v1/completions", {"prompt": "no model"}),
}


@pytest.mark.parametrize("case", list(BODIES))
async def test_agent_gets_the_upstream_bytes_and_upstream_the_agent_bytes(
        upstream: FakeUpstream, client: aiohttp.ClientSession, tmp_path: Path,
        case: str) -> None:
    path, body = BODIES[case]
    headers = {"Authorization": "Bearer sk-secret-123", "X-Custom": "kept"}
    async with recording(upstream.url, tmp_path / "t.jsonl") as proxy:
        direct = await post(client, upstream.url + path, body, headers)
        proxied = await post(client, proxy.url + path, body, headers)
        await proxy.drain()
    assert proxied == direct
    (_, sent_direct, hdr_direct), (_, sent_proxied, hdr_proxied) = upstream.seen
    # The request reached the upstream byte for byte (nothing added, e.g. include_usage),
    # with the agent's headers and no others.
    assert sent_proxied == sent_direct == orjson.dumps(body)
    assert {k.lower() for k in hdr_proxied} == {k.lower() for k in hdr_direct}
    assert hdr_proxied["Authorization"] == "Bearer sk-secret-123"
    assert all(hdr_proxied[k] == v for k, v in hdr_direct.items() if k.lower() != "host")
    assert b"sk-secret" not in (tmp_path / "t.jsonl").read_bytes()
    recorded = load_native(tmp_path / "t.jsonl").num_requests
    assert recorded == (0 if case == "upstream 400" else 1)


async def test_other_paths_pass_through_encoded_and_unrecorded(
        upstream: FakeUpstream, client: aiohttp.ClientSession, tmp_path: Path) -> None:
    async with recording(upstream.url, tmp_path / "t.jsonl") as proxy:
        async with client.get(upstream.url + "/gz") as resp:
            direct = (resp.status, resp.headers.get("Content-Encoding"), await resp.read())
        async with client.get(proxy.url + "/gz?x=1") as resp:
            proxied = (resp.status, resp.headers.get("Content-Encoding"), await resp.read())
        async with client.get(proxy.url + "/v1/models") as resp:
            assert resp.status == 200 and (await resp.json())["data"][0]["id"] == MODEL
    assert proxied == direct and direct[1] == "gzip"
    assert load_native(tmp_path / "t.jsonl").num_requests == 0


async def test_stream_is_forwarded_as_it_arrives(upstream: FakeUpstream,
                                                 client: aiohttp.ClientSession,
                                                 tmp_path: Path) -> None:
    # The upstream holds the rest of its stream until the agent has the first event;
    # a proxy that buffered would never deliver it.
    upstream.gate = asyncio.Event()
    async with recording(upstream.url, tmp_path / "t.jsonl") as proxy:
        async with client.post(proxy.url + "/v1/completions",
                               data=orjson.dumps(completion([1, 2, 3], max_tokens=5))) as resp:
            first = await asyncio.wait_for(resp.content.readany(), 5)
            assert first.startswith(b"data: ") and b" w0" in first
            upstream.gate.set()
            rest = await resp.read()
        await proxy.drain()
    assert rest.endswith(b"data: [DONE]\n\n")
    req = load_native(tmp_path / "t.jsonl").sessions[0].requests[0]
    assert req.output_tokens == 5 and req.input_tokens == 3


async def test_upstream_down_is_502_and_unrecorded(client: aiohttp.ClientSession,
                                                   tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening
        async with recording(dead, tmp_path / "t.jsonl") as proxy:
            status, ctype, body = await post(client, proxy.url + "/v1/completions",
                                             completion([1, 2]))
            await proxy.drain()
    assert status == 502 and ctype == "application/json"
    assert "cannot reach the upstream" in orjson.loads(body)["error"]["message"]
    assert load_native(tmp_path / "t.jsonl").num_requests == 0
    assert proxy.counts["upstream_unreachable"] == 1


async def test_probe_requests_are_forwarded_not_recorded(upstream: FakeUpstream,
                                                         client: aiohttp.ClientSession,
                                                         tmp_path: Path) -> None:
    async with recording(upstream.url, tmp_path / "t.jsonl") as proxy:
        status, _, body = await post(client, proxy.url + "/v1/completions",
                                     completion([9], stream=False, max_tokens=1),
                                     {PROBE_HEADER: "1"})
        await proxy.drain()
    assert status == 200 and b"usage" in body and len(upstream.seen) == 1
    assert load_native(tmp_path / "t.jsonl").num_requests == 0
    assert proxy.counts["probes_skipped"] == 1


# -- sessions, dependencies, blocks ---------------------------------------------------


async def test_sessions_by_header_any_case(upstream: FakeUpstream,
                                           client: aiohttp.ClientSession,
                                           tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    async with recording(upstream.url, out, session_header="x-conversation") as proxy:
        for name, value in (("X-Conversation", "alpha"), ("x-conversation", "beta"),
                            ("X-CONVERSATION", "alpha"), ("X-Session-ID", "ignored")):
            await post(client, proxy.url + "/v1/completions", completion([1, 2, 3]),
                       {name: value})
        await proxy.drain()
    trace = load_native(out)
    assert sessions_of(trace) == {"alpha": ["alpha/0", "alpha/1"], "beta": ["beta/0"],
                                  "rec-0001": ["rec-0001/0"]}
    assert trace.source == "record" and trace.name == "t" and trace.block_size == 4


async def test_sessions_by_prefix_continuity(upstream: FakeUpstream,
                                             client: aiohttp.ClientSession,
                                             tmp_path: Path) -> None:
    a = list(range(100, 120))
    prompts = [
        a[:9],            # rec-0001: full blocks a1 a2 (+1 token)
        a[:5],            # a1 only: rec-0001's a1 a2 is no prefix of it -> rec-0002
        a[:13],           # a1 a2 a3: rec-0001 (2 blocks) beats rec-0002 (1 block)
        [7, 7, 7, 7, 7],  # unrelated -> rec-0003
        [1, 2],           # shorter than a block -> rec-0004
        [1, 2, 3],        # its tokens extend [1, 2] -> rec-0004
        a[:17],           # continues rec-0001, whose last prompt is now a[:13]
        [*a[:4], 5, 5, 5, 5, 5],  # a1 + other: rec-0002's last (a1) is its prefix
    ]
    out = tmp_path / "t.jsonl"
    async with recording(upstream.url, out) as proxy:
        for prompt in prompts:
            await post(client, proxy.url + "/v1/completions", completion(prompt))
        await proxy.drain()
    assert sessions_of(load_native(out)) == {
        "rec-0001": ["rec-0001/0", "rec-0001/1", "rec-0001/2"],
        "rec-0002": ["rec-0002/0", "rec-0002/1"],
        "rec-0003": ["rec-0003/0"],
        "rec-0004": ["rec-0004/0", "rec-0004/1"],
    }


async def test_growing_chat_is_one_session_via_tokenize(upstream: FakeUpstream,
                                                        client: aiohttp.ClientSession,
                                                        tmp_path: Path) -> None:
    system = {"role": "system", "content": "you are a careful coding agent " * 6}
    turns = [system, {"role": "user", "content": "fix the failing test please"}]
    other = [{"role": "system", "content": "a different agent entirely " * 6},
             {"role": "user", "content": "hello"}]
    out = tmp_path / "t.jsonl"
    async with recording(upstream.url, out, block_size=8) as proxy:
        for _ in range(3):
            await post(client, proxy.url + "/v1/chat/completions", chat(turns))
            turns = [*turns, {"role": "assistant", "content": "w0 w1 w2"},
                     {"role": "user", "content": [{"type": "text", "text": "and now "},
                                                  {"type": "text", "text": "the next"}]}]
        await post(client, proxy.url + "/v1/chat/completions", chat(other))
        await proxy.drain()
    trace = load_native(out)
    assert [len(s.requests) for s in trace.sessions] == [3, 1]
    reqs = trace.sessions[0].requests
    assert reqs[1].depends_on == (reqs[0].id,) and reqs[2].depends_on == (reqs[1].id,)
    # Exact lengths from /tokenize, and each turn reuses the previous turn's full blocks.
    assert [r.input_tokens for r in reqs] == [
        len(fake_tokens(render_chat(m))) for m in (turns[:2], turns[:4], turns[:6])]
    for prev, cur in itertools.pairwise(reqs):
        full = [b for b in prev.blocks if b.tokens == 8]
        assert cur.blocks[: len(full)] == tuple(full)


async def test_dependencies_follow_completion_times(upstream: FakeUpstream,
                                                    client: aiohttp.ClientSession,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    sid = {"X-Session-ID": "s"}
    url = ""

    async def send(max_tokens: int = 3) -> None:
        await post(client, url, completion([1, 2, 3], max_tokens=max_tokens), sid)

    async with recording(upstream.url, out) as proxy:
        url = proxy.url + "/v1/completions"
        await send()                                  # s/0
        await asyncio.sleep(0.2)
        await send()                                  # s/1 waited 0.2 s for s/0
        await asyncio.gather(send(), send())          # s/2, s/3 both after s/1
        await send()                                  # s/4 after the later of them
        slow = asyncio.create_task(send(max_tokens=60))  # in flight while the next is sent
        await asyncio.sleep(0.03)
        await send()
        await slow
        await proxy.drain()
    reqs = {r.id: r for r in load_native(out).sessions[0].requests}
    assert reqs["s/0"].depends_on == () and reqs["s/0"].pause_s == 0
    assert reqs["s/1"].depends_on == ("s/0",) and 0.2 <= reqs["s/1"].pause_s < 1.0
    assert reqs["s/2"].depends_on == reqs["s/3"].depends_on == ("s/1",)
    def finished(rid: str) -> float:
        rec = reqs[rid].recorded
        assert rec is not None and rec.t is not None and rec.api_time is not None
        return rec.t + rec.api_time

    assert reqs["s/4"].depends_on == (max(("s/2", "s/3"), key=finished),)
    # Recorded in completion order: the short request sent during the slow one finished
    # first (s/5) and did not wait for the slow one (s/6); both followed s/4.
    assert reqs["s/5"].output_tokens == 3 and reqs["s/6"].output_tokens == 60
    assert reqs["s/5"].depends_on == reqs["s/6"].depends_on == ("s/4",)
    rec = reqs["s/1"].recorded
    assert rec is not None and rec.t is not None and rec.t >= 0.2
    assert rec.ttft is not None and rec.api_time is not None and 0 < rec.ttft <= rec.api_time


def test_block_ids_chain_and_partial_blocks() -> None:
    ids = BlockIds(64)
    base = list(range(1000, 1150))                      # 2 full blocks + 22 tokens
    first = ids.blocks(base)
    assert [b.tokens for b in first] == [64, 64, 22] and [b.id for b in first] == [1, 2, 3]
    shared = ids.blocks(base[:128] + [5] * 30)
    assert shared[:2] == first[:2] and shared[2].id == 4
    assert ids.blocks(base) == first                    # same partial content, same id
    # The same 64 tokens after a different prefix are a different block (chained hash).
    moved = ids.blocks(base[64:128])
    assert moved[0].id not in {b.id for b in first}
    # Equal ids mean equal lengths: a partial block never shares an id with a full one.
    assert ids.blocks(base[:64])[0] == first[0]
    assert ids.blocks(base[:63])[0].id == len(ids) == 6  # new: ids 1-5 were taken
    assert len(pseudo_tokens("abcdabcdab")) == 3
    assert pseudo_tokens("abcd")[0] == pseudo_tokens("abcdabcd")[1]


async def test_shared_prefix_gets_shared_block_ids_in_the_file(
        upstream: FakeUpstream, client: aiohttp.ClientSession, tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    common = list(range(200, 330))
    async with recording(upstream.url, out, block_size=64) as proxy:
        for tail, sid in (([1] * 10, "a"), ([2] * 10, "b"), ([1] * 10, "c")):
            await post(client, proxy.url + "/v1/completions", completion(common + tail),
                       {"X-Session-ID": sid})
        await proxy.drain()
    a, b, c = (s.requests[0].blocks for s in load_native(out).sessions)
    assert a[:2] == b[:2] == c[:2] and a[2] != b[2]
    assert a == c  # the same whole prompt, the same blocks (partial one included)


# -- the output file -----------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
async def test_file_is_a_complete_trace_after_every_request(
        upstream: FakeUpstream, client: aiohttp.ClientSession, tmp_path: Path,
        suffix: str) -> None:
    out = tmp_path / f"rec{suffix}"
    async with recording(upstream.url, out) as proxy:
        assert load_native(out).num_requests == 0  # valid before anything happened
        for i in range(4):
            await post(client, proxy.url + "/v1/completions", completion([i, 1, 2, 3, 4]))
            await proxy.drain()
            trace = load_native(out)
            assert trace.num_requests == i + 1 and trace.source == "record"
            assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temp left


async def test_token_counts_from_tokenize_and_usage(upstream: FakeUpstream,
                                                    client: aiohttp.ClientSession,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    text = "one two three four five six"
    async with recording(upstream.url, out) as proxy:
        await post(client, proxy.url + "/v1/completions", completion(text, max_tokens=5))
        await post(client, proxy.url + "/v1/completions",
                   completion(text, max_tokens=5, usage=True))
        await post(client, proxy.url + "/v1/chat/completions",
                   chat([{"role": "user", "content": text}], max_tokens=4))
        await proxy.drain()
    r1, r2, r3 = (r for s in load_native(out).sessions for r in s.requests)
    assert r1.input_tokens == r2.input_tokens == 6
    assert r3.input_tokens == len(fake_tokens(render_chat([{"role": "user", "content": text}])))
    assert (r1.output_tokens, r2.output_tokens, r3.output_tokens) == (5, 5, 4)
    c = proxy.counts
    assert (c["isl_tokenize"], c["osl_tokenize"], c["osl_usage"]) == (3, 2, 1)
    assert c["isl_estimate"] == c["osl_chunks"] == 0


async def test_without_tokenize_lengths_are_estimated_and_flagged(
        client: aiohttp.ClientSession, tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    text = "x" * 40
    async with serving(FakeUpstream(tokenize=False)) as fake, \
            recording(fake.url, out) as proxy:
        await post(client, proxy.url + "/v1/chat/completions",
                   chat([{"role": "user", "content": text}], max_tokens=6))
        await post(client, proxy.url + "/v1/completions",
                   completion(text, stream=False, max_tokens=2))
        await proxy.drain()
    est, with_usage = (r for s in load_native(out).sessions for r in s.requests)
    assert est.input_tokens == -(-len(f"user: {text}\n") // 4) and est.output_tokens == 6
    assert with_usage.input_tokens == 1 and with_usage.output_tokens == 2  # server's usage
    c = proxy.counts
    assert (c["isl_estimate"], c["osl_chunks"], c["isl_usage"], c["osl_usage"]) == (1, 1, 1, 1)


async def test_content_only_with_keep_content(upstream: FakeUpstream,
                                              client: aiohttp.ClientSession,
                                              tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "SECRET-SYSTEM-PROMPT"},
                {"role": "user", "content": [{"type": "text", "text": "part one, "},
                                             {"type": "text", "text": "part two"}]}]
    for keep in (False, True):
        out = tmp_path / f"keep-{keep}.jsonl"
        async with recording(upstream.url, out, keep_content=keep) as proxy:
            await post(client, proxy.url + "/v1/chat/completions", chat(messages),
                       {"Authorization": "Bearer sk-never-written"})
            await post(client, proxy.url + "/v1/completions", completion("SECRET PROMPT"))
            await post(client, proxy.url + "/v1/completions", completion([4, 5, 6]))
            await proxy.drain()
        raw = out.read_bytes()
        assert b"sk-never-written" not in raw
        reqs = [r for s in load_native(out).sessions for r in s.requests]
        if not keep:
            assert b"SECRET" not in raw and all(r.messages is None for r in reqs)
        else:
            assert [(m.role, m.content) for m in reqs[0].messages or ()] == [
                ("system", "SECRET-SYSTEM-PROMPT"), ("user", "part one, part two")]
            assert [(m.role, m.content) for m in reqs[1].messages or ()] == [
                ("prompt", "SECRET PROMPT")]
            assert reqs[2].messages is None  # token ids carry no text


def test_bench_runs_against_a_fake_upstream() -> None:
    async def go() -> None:
        async with serving(FakeUpstream()) as fake:
            bench = await run_proxy_bench(fake.url, requests=2, max_tokens=4,
                                          prompt_tokens=8)
        assert len(bench.direct_ttft) == len(bench.proxied_e2e) == 2
        assert bench.chunk_delays and bench.recorded_requests == 3
    asyncio.run(go())


# -- the command ---------------------------------------------------------------------------


def one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentload: error: "), proc.stderr
    assert all(f in lines[0] for f in fragments), lines[0]


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1:99999", "127.0.0.1:", ":80x"])
def test_bad_listen_is_one_line(tmp_path: Path, listen: str) -> None:
    proc = run_cli("record", "--upstream", "http://127.0.0.1:9", "--listen", listen,
                   "-o", str(tmp_path / "t.jsonl"), timeout=60)
    one_line_error(proc, "--listen")


def test_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = run_cli("record", "--upstream", "http://127.0.0.1:9", "--listen",
                       f"127.0.0.1:{port}", "-o", str(tmp_path / "t.jsonl"), timeout=60)
    one_line_error(proc, "cannot listen", str(port))


@pytest.mark.parametrize("upstream_url", ["localhost:8000", "ftp://x", "http://h:notaport"])
def test_bad_upstream_is_one_line(tmp_path: Path, upstream_url: str) -> None:
    proc = run_cli("record", "--upstream", upstream_url, "-o", str(tmp_path / "t.jsonl"),
                   timeout=60)
    one_line_error(proc, "--upstream")


def test_existing_output_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    out.write_text("precious\n")
    proc = run_cli("record", "--upstream", "http://127.0.0.1:9", "-o", str(out), timeout=60)
    one_line_error(proc, "already exists", "--force")
    assert out.read_text() == "precious\n"


def test_help_says_what_is_and_is_not_recorded() -> None:
    proc = run_cli("record", "--help", timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--keep-content" in text and "API keys" in text and "Not recorded" in text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_recorder(upstream_url: str, out: Path, *extra: str
                   ) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentload", "record", "--upstream", upstream_url,
         "--listen", f"127.0.0.1:{port}", "-o", str(out), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return proc, url
        if proc.poll() is not None:
            raise AssertionError(f"agentload record exited: {proc.communicate()[1]}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("agentload record did not start listening")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_command_records_until_a_signal(upstream: FakeUpstream,
                                              client: aiohttp.ClientSession, tmp_path: Path,
                                              sig: signal.Signals) -> None:
    out = tmp_path / "t.parquet"
    proc, url = await asyncio.to_thread(start_recorder, upstream.url + "/v1", out)
    for prompt in ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9]):
        await post(client, url + "/v1/completions", completion(prompt, usage=True))
    # The file follows each request, before the recorder is stopped. It is read from a
    # copy: polars opens a Parquet path more than once, so reading it in place while it
    # is being replaced can mix two versions; a single open always sees a whole one.
    snapshot = tmp_path / "snapshot.parquet"
    for _ in range(100):
        shutil.copyfile(out, snapshot)
        if load_native(snapshot).num_requests == 2:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the file never held both requests")
    proc.send_signal(sig)
    _, stderr = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert lines[0].startswith(f"agentload record: listening on {url}")
    assert f"recorded 2 requests in 1 sessions to {out}" in stderr
    assert "2 exact (token ids)" in stderr and "2 from server usage" in stderr
    trace = load_native(out)
    assert sessions_of(trace) == {"rec-0001": ["rec-0001/0", "rec-0001/1"]}


# -- against real vLLM ----------------------------------------------------------------------


def by_session(frame: pl.DataFrame) -> dict[str, Counter[tuple[int, int]]]:
    out: dict[str, Counter[tuple[int, int]]] = {}
    for row in frame.iter_rows(named=True):
        out.setdefault(row["session_id"], Counter())[(row["isl"], row["osl"])] += 1
    return out


@pytest.mark.vllm
def test_recorded_replay_replays_with_the_same_lengths(embedded_server: str,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "recorded.jsonl"
    proc, proxy_url = start_recorder(embedded_server, out)
    try:
        first = tmp_path / "through-proxy"
        replay = run_cli("replay", str(demo_trace_path()), "--target", proxy_url, "--headless",
                         "-o", str(first), "--users", "2", "--max-requests", "12",
                         "--time-scale", "0", "--no-report", timeout=600)
        assert replay.returncode == 0, replay.stderr
        # One chat request too: the tiny model has a chat template.
        with httpx.Client(timeout=120, trust_env=False) as http:
            model = http.get(proxy_url + "/v1/models").json()["data"][0]["id"]
            resp = http.post(proxy_url + "/v1/chat/completions",
                             headers={"X-Session-ID": "chat-1"},
                             json={"model": model, "max_tokens": 7, "stream": True,
                                   "stream_options": {"include_usage": True},
                                   "messages": [{"role": "user",
                                                 "content": "list the files"}]})
            assert resp.status_code == 200 and "[DONE]" in resp.text
            counted = http.post(embedded_server + "/tokenize", json={
                "model": model, "messages": [{"role": "user",
                                              "content": "list the files"}]}).json()["count"]
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "recorded 13 requests" in stderr, stderr

    recorded = load_native(out)
    seen = pl.read_parquet(first / "requests.parquet")
    assert seen.height == 12 and seen["ok"].all()
    chat_session = next(s for s in recorded.sessions if s.id == "chat-1")
    (chat_req,) = chat_session.requests
    assert chat_req.input_tokens == counted and chat_req.output_tokens == 7
    # The replay tagged each request with its session, so the recording has the same
    # sessions, and per session the same (ISL, OSL) the server counted.
    replayed = [s for s in recorded.sessions if s.id != "chat-1"]
    assert sum(len(s.requests) for s in replayed) == seen.height
    assert {s.id: Counter((r.input_tokens, r.output_tokens) for r in s.requests)
            for s in replayed} == by_session(seen)

    # The recording replays directly with the same counts and lengths, request by request.
    second = tmp_path / "recording-replayed"
    again = run_cli("replay", str(out), "--target", embedded_server, "--headless",
                    "-o", str(second), "--users", "2", "--time-scale", "0", "--no-report",
                    timeout=600)
    assert again.returncode == 0, again.stderr
    frame = pl.read_parquet(second / "requests.parquet")
    assert frame.height == recorded.num_requests and frame["ok"].all()
    want = {r.id: (r.input_tokens, r.output_tokens) for r in recorded.requests()}
    got = {row["request_id"]: (row["isl"], row["osl"]) for row in frame.iter_rows(named=True)}
    assert got == want


@pytest.mark.vllm
def test_file_survives_kill_9(embedded_server: str, tmp_path: Path) -> None:
    out = tmp_path / "recorded.jsonl"
    proc, proxy_url = start_recorder(embedded_server, out)
    try:
        with httpx.Client(timeout=120, trust_env=False) as http:
            for n in (3, 4):
                r = http.post(proxy_url + "/v1/completions", json={
                    "model": "agentload-tiny-llama", "prompt": list(range(20, 20 + 10 * n)),
                    "max_tokens": n})
                assert r.status_code == 200
        deadline = time.monotonic() + 30
        while load_native(out).num_requests < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    trace = load_native(out)
    assert [(r.input_tokens, r.output_tokens) for r in trace.requests()] == [(30, 3), (40, 4)]

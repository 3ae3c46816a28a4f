"""Every fault class against a fault-injecting server: recorded with its cause, the run goes on.

The server is a real aiohttp app on a local port, answering the N-th request with the
N-th fault; the replay uses agentload's own HTTP client (the aiohttp transport), so the
exceptions seen are the ones a real run sees.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
from aiohttp import web

from agentload.replay.engine.core import ReplayEngine, ReplayOptions, Target, build_http_client
from agentload.replay.journal import Journal, read_journal, request_frame
from agentload.replay.results.metrics import summarize
from agentload.replay.serve.server import free_port
from agentload.traces import Block, Request, Session, Trace

FAULTS = ["ok", "http_5xx", "http_4xx", "stall", "cut", "malformed", "server_error",
          "no_tokens", "timeout", "ok"]


def _chunk(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


TOKEN = _chunk({"choices": [{"text": "x"}]})


def _fault_app() -> web.Application:
    count = {"n": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        fault = FAULTS[count["n"] % len(FAULTS)]
        count["n"] += 1
        body = await request.json()
        if fault == "http_5xx":
            return web.json_response({"error": "overloaded"}, status=503)
        if fault == "http_4xx":
            return web.json_response({"error": "too many requests"}, status=429)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if fault == "stall":
            await resp.write(TOKEN)
            await asyncio.sleep(3)
        elif fault == "cut":
            await resp.write(TOKEN + TOKEN)
            assert request.transport is not None
            request.transport.close()
            return resp
        elif fault == "malformed":
            await resp.write(TOKEN + b"data: {not json\n\n")
        elif fault == "server_error":
            await resp.write(TOKEN + _chunk({"error": {"message": "engine died"}}))
        elif fault == "timeout":
            for _ in range(15):  # a slow drip: never a stall, always too long in total
                await resp.write(TOKEN)
                await asyncio.sleep(0.2)
        elif fault == "ok":
            n = body["max_tokens"]
            await resp.write(TOKEN * n + _chunk({"choices": [], "usage": {
                "prompt_tokens": len(body["prompt"]), "completion_tokens": n}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def _trace(n: int) -> Trace:
    sessions = tuple(Session(f"s{i}", (Request(f"s{i}/0", f"s{i}", (Block(i + 1, 8),), 3),))
                     for i in range(n))
    return Trace("faults", sessions, block_size=8)


async def _replay(url: str, trace: Trace, journal_path: Path, **options: float) -> object:
    opts = ReplayOptions(users=1, time_scale=0.0, stall_timeout_s=0.5, request_timeout_s=1.5,
                         connect_timeout_s=1.0, **options)  # type: ignore[arg-type]
    with Journal(journal_path) as journal:
        engine = ReplayEngine(trace, Target(url, "m"), opts, journal, build_http_client(opts))
        async with engine.client:
            return await engine.run()


def test_every_fault_is_recorded_with_its_cause_and_the_run_goes_on(tmp_path: Path) -> None:
    async def main() -> None:
        runner = web.AppRunner(_fault_app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            await _replay(f"http://127.0.0.1:{port}", _trace(len(FAULTS)), tmp_path / "j.jsonl")
        finally:
            await runner.cleanup()

    asyncio.run(main())
    _, rows = read_journal(tmp_path / "j.jsonl")
    kinds = [r["error_kind"] or "ok" for r in sorted(rows, key=lambda r: r["sent_ns"])]
    assert kinds == FAULTS
    assert all(r["error"] for r in rows if r["error_kind"])
    summary = summarize(request_frame(rows), 1)
    assert summary["requests_completed"] == 2 and summary["requests_failed"] == 8
    assert summary["errors_by_kind"] == {k: 1 for k in FAULTS if k != "ok"}


def test_refused_connections_back_off_and_are_counted(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here
    outcome = asyncio.run(_replay(f"http://127.0.0.1:{port}", _trace(3), tmp_path / "j.jsonl"))
    meta, rows = read_journal(tmp_path / "j.jsonl")
    assert [r["error_kind"] for r in rows] == ["refused"] * 3
    backoffs = [m["s"] for m in meta if m.get("kind") == "backoff"]
    assert backoffs == [1.0, 2.0, 4.0]
    assert outcome.failed == 3  # type: ignore[attr-defined]

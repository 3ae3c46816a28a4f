"""Profiling hooks: the nsys wrapper's argv and the /start_profile .. /stop_profile window."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import polars as pl
import pytest
from aiohttp import web

from agentload.replay.errors import ReplayError
from agentload.replay.serve.profile_window import (
    ProfileWindowLog,
    parse_window,
    run_profile_window,
    unprofiled,
    window_effect,
    window_warning,
)
from agentload.replay.serve.server import ServerSpec, effective_config, nsys_wrap


def test_nsys_wrap_uses_vllms_recommended_flags(tmp_path: Path) -> None:
    spec = ServerSpec(argv=("vllm", "serve", "m", "--port", "1"), host="h", port=1,
                      served_model="m", label="arm x")
    wrapped = nsys_wrap(spec, tmp_path / "p.nsys-rep")
    argv = list(wrapped.argv)
    assert argv[:4] == ["nsys", "profile", "-o", str(tmp_path / "p.nsys-rep")]
    for flag in ("--trace-fork-before-exec=true", "--cuda-graph-trace=node",
                 "--capture-range=cudaProfilerApi", "--capture-range-end=repeat"):
        assert flag in argv
    assert argv[argv.index("vllm"):][:3] == ["vllm", "serve", "m"]
    assert argv[-2:] == ["--profiler-config", '{"profiler":"cuda"}']
    assert wrapped.env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    whole = nsys_wrap(spec, tmp_path / "p.nsys-rep", whole_run=True)
    assert "--capture-range=cudaProfilerApi" not in whole.argv
    assert "--profiler-config" not in whole.argv


def test_parse_window() -> None:
    assert parse_window("2:5.5") == (2.0, 5.5)
    for bad in ("5", "5:2", "a:b", "-1:2"):
        with pytest.raises(ReplayError, match="--profile-window"):
            parse_window(bad)


def test_effective_config_reads_the_start_up_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) INFO 12-03 05:59:42 [api_utils.py:286] non-default args: "
        "{'host': '127.0.0.1', 'max_num_seqs': 2, 'enable_prefix_caching': False}\n"
        "(EngineCore pid=2) INFO 12-03 05:59:50 [core.py:133] Initializing a V1 LLM engine "
        "(v0.32.0) with config: model='/m', speculative_config=None\n")
    found = effective_config(log)
    assert found["non_default_args"] == {"host": "127.0.0.1", "max_num_seqs": 2,
                                         "enable_prefix_caching": False}
    assert found["engine_version"] == "v0.32.0"
    assert found["engine_config"].startswith("model='/m'")
    assert effective_config(tmp_path / "missing.log") == {}


Handler = Callable[[web.Request], Awaitable[web.Response]]


@contextlib.asynccontextmanager
async def _profiler_server(start: Handler, stop: Handler) -> AsyncIterator[str]:
    """A local server answering /start_profile and /stop_profile; yields its base URL."""
    app = web.Application()
    app.router.add_post("/start_profile", start)
    app.router.add_post("/stop_profile", stop)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_window_starts_and_stops_the_server_profiler() -> None:
    calls: list[tuple[str, float]] = []
    t0 = time.monotonic()

    async def record(request: web.Request) -> web.Response:
        calls.append((request.path, time.monotonic() - t0))
        return web.Response(text="ok")

    async with _profiler_server(record, record) as url:
        log = ProfileWindowLog((0.2, 0.5))
        async with httpx.AsyncClient() as client:
            await run_profile_window(client, url, log, lambda _: None)
            # A replay that ends inside the window still stops the profiler.
            early = ProfileWindowLog((0.0, 30.0))
            task = asyncio.create_task(run_profile_window(client, url, early, lambda _: None))
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert [c[0] for c in calls] == ["/start_profile", "/stop_profile"] * 2
    assert 0.15 < calls[0][1] < 0.45 and 0.45 < calls[1][1] < 0.9
    assert [e["status"] for e in log.events] == [200, 200]
    assert [e["what"] for e in early.events] == ["start_profile", "stop_profile"]


async def test_the_flush_is_timed_and_the_requests_it_slowed_are_counted() -> None:
    """vLLM answers /stop_profile once its trace is written (seconds on a GPU server)."""
    async def start(_: web.Request) -> web.Response:
        return web.Response()

    async def stop(_: web.Request) -> web.Response:
        await asyncio.sleep(0.3)  # the flush
        return web.Response()

    log = ProfileWindowLog((0.0, 0.1))
    async with _profiler_server(start, stop) as url, httpx.AsyncClient() as client:
        await run_profile_window(client, url, log, lambda _: None)
    start_ev, stop_ev = log.events
    assert stop_ev["took_s"] >= 0.29 and start_ev["took_s"] < 0.29
    lo, hi = start_ev["sent_ns"], stop_ev["answered_ns"]
    s = 1_000_000_000
    frame = pl.DataFrame({  # before, across the start, inside the flush, after; one failed
        "phase": ["measure"] * 5, "ok": [True, True, True, True, False],
        "sent_ns": [lo - 2 * s, lo - s, hi - 1000, hi + 10, lo],
        "done_ns": [lo - s, lo + 1000, hi + s, hi + s, hi]})
    effect = window_effect(log.as_dict(), frame)
    assert effect is not None
    assert effect["requests_overlapping"] == 2 and effect["share_overlapping"] == 0.5
    assert effect["flush_s"] == stop_ev["took_s"] and effect["profiled_s"] >= 0.39
    text = window_warning(effect)
    assert text is not None and "2 measured requests (50%)" in text
    # A run without a window, or from before the stamps, says nothing it cannot know.
    assert window_effect(None, frame) is None
    old = {"requested_s": [1, 2], "events": [{"what": "start_profile", "at_s": 1.0},
                                             {"what": "stop_profile", "at_s": 2.0}]}
    assert window_warning(window_effect(old, frame)) is None
    # What a comparison keeps: the requests clear of the window (the failed one too,
    # which overlaps it, goes), everything without a window or its stamps.
    kept = unprofiled(frame, log.as_dict())
    assert kept["sent_ns"].to_list() == [lo - 2 * s, hi + 10]
    assert unprofiled(frame, None).height == unprofiled(frame, old).height == 5

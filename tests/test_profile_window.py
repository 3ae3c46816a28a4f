"""Profiling hooks: the nsys wrapper's argv and the /start_profile .. /stop_profile window."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from agentload.replay.errors import ReplayError
from agentload.replay.profile_window import ProfileWindowLog, parse_window, run_profile_window
from agentload.replay.server import ServerSpec, effective_config, nsys_wrap


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


async def test_window_starts_and_stops_the_server_profiler() -> None:
    calls: list[tuple[str, float]] = []
    t0 = time.monotonic()

    async def record(request: web.Request) -> web.Response:
        calls.append((request.path, time.monotonic() - t0))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/start_profile", record)
    app.router.add_post("/stop_profile", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        log = ProfileWindowLog((0.2, 0.5))
        async with httpx.AsyncClient() as client:
            await run_profile_window(client, f"http://127.0.0.1:{port}", log, lambda _: None)
            # A replay that ends inside the window still stops the profiler.
            early = ProfileWindowLog((0.0, 30.0))
            task = asyncio.create_task(run_profile_window(
                client, f"http://127.0.0.1:{port}", early, lambda _: None))
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        await runner.cleanup()
    assert [c[0] for c in calls] == ["/start_profile", "/stop_profile"] * 2
    assert 0.15 < calls[0][1] < 0.45 and 0.45 < calls[1][1] < 0.9
    assert [e["status"] for e in log.events] == [200, 200]
    assert [e["what"] for e in early.events] == ["start_profile", "stop_profile"]

"""Helpers shared by the tests of every room: paths, the CLI as a user runs it, a fake
server's streamed completion, and an aiohttp app served on its own thread. Fixtures stay
in ``tests/conftest.py`` (and each room's ``conftest.py``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m agentload ARGS`` as a user would, capturing both streams."""
    return subprocess.run(
        [sys.executable, "-m", "agentload", *args], capture_output=True, text=True,
        timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})},
    )


async def sse_completion(request: Any, prompt_tokens: int, n: int) -> Any:
    """A fake server's streamed /v1/completions answer: ``n`` one-token events, the usage
    (``prompt_tokens``, ``n``) and ``[DONE]`` (an aiohttp ``StreamResponse``)."""
    import orjson
    from aiohttp import web

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b"".join(b"data: " + orjson.dumps({"choices": [{"text": "x"}]})
                              + b"\n\n" for _ in range(n)))
    await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": {
        "prompt_tokens": prompt_tokens, "completion_tokens": n}}) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


@contextlib.contextmanager
def app_on_thread(app: Any) -> Iterator[str]:
    """An aiohttp ``app`` served on its own thread and loop (so subprocess clients and
    the test's own loop both reach it); yields its base URL, and cleans it up."""
    import asyncio
    import threading

    from aiohttp import web

    from agentload.replay.serve.server import free_port

    port = free_port()
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)

"""Fixtures of the replay room's tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from agentload.replay.serve.server import free_port
from tests.tui.test_live import sse_app


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The small SSE server of ``tests/tui/test_live`` on its own thread and loop."""
    port = free_port()
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(sse_app(ttft_s=0.01, itl_s=0.002))

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)



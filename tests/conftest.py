"""Shared fixtures: the one embedded vLLM CPU server of a test session, and CLI helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m agentload ARGS`` as a user would, capturing both streams."""
    return subprocess.run(
        [sys.executable, "-m", "agentload", *args], capture_output=True, text=True,
        timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="session")
def embedded_server_with_log(tmp_path_factory: pytest.TempPathFactory
                             ) -> Iterator[tuple[str, Path]]:
    """Start the embedded tiny-Llama vLLM CPU server once; yield its base URL and log."""
    from agentload.replay.server import ManagedServer, embedded_server_spec

    log = tmp_path_factory.mktemp("embedded-server") / "server.log"
    spec = embedded_server_spec()
    lines: list[str] = []
    with ManagedServer(spec, log, progress=lines.append) as server:
        assert server.running()
        yield spec.base_url, log


@pytest.fixture(scope="session")
def embedded_server(embedded_server_with_log: tuple[str, Path]) -> str:
    """The embedded server's base URL."""
    return embedded_server_with_log[0]


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

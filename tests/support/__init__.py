"""Helpers shared by the tests of every room: paths, the CLI as a user runs it, and a
fake server's streamed completion. Fixtures stay in ``tests/conftest.py``."""

from __future__ import annotations

import os
import subprocess
import sys
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

"""Shared fixtures: the one embedded vLLM CPU server of a test session, and CLI helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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

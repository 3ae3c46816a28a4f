"""Shared fixtures: the one embedded vLLM CPU server of a test session. Helpers the tests
import (paths, ``run_cli``, a fake SSE answer) are in ``tests/support``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def embedded_server_with_log(tmp_path_factory: pytest.TempPathFactory
                             ) -> Iterator[tuple[str, Path]]:
    """Start the embedded tiny-Llama vLLM CPU server once; yield its base URL and log."""
    from agentload.replay.serve.server import ManagedServer, embedded_server_spec

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

"""Fixtures of the replay room's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import app_on_thread
from tests.tui.test_live import sse_app


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The small SSE server of ``tests/tui/test_live`` on its own thread and loop."""
    with app_on_thread(sse_app(ttft_s=0.01, itl_s=0.002)) as url:
        yield url

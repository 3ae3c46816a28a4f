"""NVTX annotations for agentload's own phases that survive ``await``.

``with nvtx.annotate()`` pushes and pops on the *thread*: with many coroutines on one
event loop the pops land in the wrong order and ranges mis-nest. Start/end ranges
(``nvtxRangeStartEx`` / ``End``) are matched by handle instead, so a request's range
can open in one task step and close several awaits later. Everything is a no-op when
the ``nvtx`` package is not installed or ``NVTX_DISABLE`` is set, so callers never guard.

    handle = start("request r17", domain="agentload")
    ...  # awaits
    end(handle)

    async with arange("prefill"):
        await ...
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

try:  # optional: the [gpu] extra installs it
    import nvtx as _nvtx  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # pragma: no cover - exercised where nvtx is missing
    _nvtx = None

DOMAIN = "agentload"


def enabled() -> bool:
    """True when ranges are really emitted (nvtx importable, NVTX_DISABLE unset)."""
    return _nvtx is not None and not os.environ.get("NVTX_DISABLE")


@dataclass(frozen=True, slots=True)
class RangeHandle:
    """What :func:`start` returns; pass it to :func:`end` (from any task or thread)."""

    message: str
    domain: str
    token: Any


def start(message: str, domain: str = DOMAIN, color: str | None = None) -> RangeHandle:
    """Open a start/end range; it stays open across ``await`` until :func:`end`."""
    token = None
    if enabled():
        assert _nvtx is not None
        token = _nvtx.start_range(message=message, domain=domain, color=color)
    return RangeHandle(message, domain, token)


def end(handle: RangeHandle) -> None:
    """Close a range opened by :func:`start`; closing a no-op handle does nothing."""
    if handle.token is not None and _nvtx is not None:
        _nvtx.end_range(handle.token)


@contextlib.asynccontextmanager
async def arange(message: str, domain: str = DOMAIN) -> AsyncIterator[RangeHandle]:
    """``async with arange("prefill"):`` a start/end range around an awaited block."""
    handle = start(message, domain)
    try:
        yield handle
    finally:
        end(handle)


@contextlib.contextmanager
def srange(message: str, domain: str = DOMAIN) -> Iterator[RangeHandle]:
    """The synchronous spelling, also start/end (safe if the block hands off threads)."""
    handle = start(message, domain)
    try:
        yield handle
    finally:
        end(handle)


def mark(message: str, domain: str = DOMAIN) -> None:
    """An instant marker (no-op without nvtx)."""
    if enabled():
        assert _nvtx is not None
        _nvtx.mark(message=message, domain=domain)

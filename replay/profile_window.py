"""Ask the server to profile a window of the replay (``/start_profile`` .. ``/stop_profile``).

vLLM starts its profiler (torch, or CUDA's profiler API that ``nsys --capture-range
=cudaProfilerApi`` waits for) on ``POST /start_profile`` and flushes it on ``POST
/stop_profile``; the server must have been started with a profiler configured
(``agentload serve --arm ... --nsys``, or ``--profiler-config`` on your own server).
The window is counted from the start of the replay, so warmup can be left out of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from agentload.replay.errors import ReplayError


def parse_window(text: str) -> tuple[float, float]:
    """``START:END`` seconds into the replay, with an error that shows the form."""
    try:
        lo, _, hi = text.partition(":")
        start, end = float(lo), float(hi)
    except ValueError:
        raise ReplayError(f"--profile-window must be START:END seconds, e.g. 30:40; "
                          f"got {text!r}") from None
    if not 0.0 <= start < end:
        raise ReplayError(f"--profile-window needs 0 <= START < END, got {text!r}")
    return start, end


@dataclass(slots=True)
class ProfileWindowLog:
    """What happened to the window, for run.json."""

    requested_s: tuple[float, float]
    events: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"requested_s": list(self.requested_s), "events": self.events}


async def _post(client: httpx.AsyncClient, url: str, log: ProfileWindowLog, what: str,
                t0: float, say: Callable[[str], None]) -> None:
    at = time.monotonic() - t0
    try:
        resp = await client.post(url, timeout=600.0)  # stopping flushes; it can take minutes
        status: int | str = resp.status_code
    except httpx.HTTPError as exc:
        status = f"{type(exc).__name__}: {exc}"
    log.events.append({"what": what, "at_s": round(at, 3), "status": status})
    if status != 200:
        say(f"profile window: {what} answered {status} (was the server started with a "
            "profiler configured?)")


async def run_profile_window(client: httpx.AsyncClient, base_url: str, log: ProfileWindowLog,
                             say: Callable[[str], None]) -> None:
    """Start the server's profiler at START and stop it at END (or when cancelled)."""
    t0 = time.monotonic()
    start, end = log.requested_s
    await asyncio.sleep(start)
    await _post(client, base_url + "/start_profile", log, "start_profile", t0, say)
    try:
        await asyncio.sleep(max(0.0, end - (time.monotonic() - t0)))
    finally:
        # Also when the replay ends first: a profiler left running would never be flushed.
        await asyncio.shield(_post(client, base_url + "/stop_profile", log, "stop_profile",
                                   t0, say))

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
import polars as pl

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
    # On the journal's clock, so the requests the profiler slowed can be found.
    sent_ns = time.perf_counter_ns()
    try:
        resp = await client.post(url, timeout=600.0)  # stopping flushes; it can take minutes
        status: int | str = resp.status_code
    except httpx.HTTPError as exc:
        status = f"{type(exc).__name__}: {exc}"
    answered_ns = time.perf_counter_ns()
    log.events.append({"what": what, "at_s": round(at, 3), "status": status,
                       "sent_ns": sent_ns, "answered_ns": answered_ns,
                       "took_s": round((answered_ns - sent_ns) / 1e9, 3)})
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


def window_effect(window: dict[str, Any] | None, frame: pl.DataFrame) -> dict[str, Any] | None:
    """How much of the run the server's profiler touched: from ``start_profile`` sent to
    ``stop_profile`` answered (the flush of the trace stalls a vLLM server for seconds),
    the measured requests in flight then, whose latencies include the profiler's cost.
    None without a window; without the stamps (older runs) only the flush is unknown."""
    if not window:
        return None
    by_what = {e.get("what"): e for e in window.get("events", [])}
    out: dict[str, Any] = {"requested_s": window.get("requested_s"),
                           "flush_s": (by_what.get("stop_profile") or {}).get("took_s")}
    bounds = window_bounds(window)
    if bounds is None:
        return out | {"requests_overlapping": None, "share_overlapping": None}
    lo, hi = bounds
    done = frame.filter((pl.col("phase") == "measure") & pl.col("ok"))
    hit = done.filter(_overlapping(lo, hi)).height
    return out | {"profiled_s": round((hi - lo) / 1e9, 3), "requests_overlapping": hit,
                  "share_overlapping": hit / done.height if done.height else None}


def window_bounds(window: dict[str, Any] | None) -> tuple[int, int] | None:
    """From ``start_profile`` sent to ``stop_profile`` answered (ns on the run's clock),
    or None without a window or its stamps."""
    by_what = {e.get("what"): e for e in (window or {}).get("events", [])}
    start, stop = by_what.get("start_profile"), by_what.get("stop_profile")
    if not (start and stop and "sent_ns" in start and "answered_ns" in stop):
        return None
    return int(start["sent_ns"]), int(stop["answered_ns"])


def _overlapping(lo: int, hi: int) -> pl.Expr:
    return (pl.col("sent_ns") < hi) & (pl.col("done_ns") > lo)


def unprofiled(frame: pl.DataFrame, window: dict[str, Any] | None) -> pl.DataFrame:
    """``frame`` less the requests in flight while the server's profiler ran (their
    latencies include its cost); all of it without a window. A window without stamps
    (runs before they were kept) sets nothing aside."""
    bounds = window_bounds(window)
    return frame if bounds is None else frame.filter(~_overlapping(*bounds))


def window_warning(effect: dict[str, Any] | None) -> str | None:
    """The report's line on a profiled run, or None."""
    if not effect or not effect.get("requests_overlapping"):
        return None
    flush = effect.get("flush_s")
    return (f"PROFILED: the server's profiler ran for {effect['profiled_s']:.1f} s"
            + (f" (its trace took {flush:.1f} s to write)" if flush is not None else "")
            + f"; {effect['requests_overlapping']} measured requests "
            f"({effect['share_overlapping']:.0%}) were in flight then and their latencies "
            "include the profiler's cost: compare arms on unprofiled runs")

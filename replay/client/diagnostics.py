"""The client's own health, measured in every run: is agentload the bottleneck?

``ClientDiagnostics`` rides along a replay and records, without touching the request
path beyond a few integer appends per request:

- the client's stamp error: per token chunk, the Python stamp (when the loop served the
  socket) minus the kernel's receive stamp (``SO_TIMESTAMPNS``, from the stamped
  transport). That is how long bytes waited in the socket while the loop was busy;
  the run's timestamps are the kernel's, so this is the error they avoided, and it
  grows as the client nears saturation;
- token events per read: 1 when the client keeps up; more when events queued in the
  socket (they then share one stamp) or the server sent them in one burst. Only late
  reads (served over 1 ms after their last segment came, by the kernel stamps) count as
  the client behind: a burst read at once has its true arrival time;
- event-loop lag: the oversleep of a 10 ms sleep (how long a ready callback waits);
- GC pauses (``gc.callbacks``) and process CPU over the run (``time.process_time``);
- the OS's share of the lag: how long the loop's thread sat runnable but off-CPU
  (Linux ``schedstat`` run delay, read at each probe). On an oversubscribed machine a
  client using 1 % of a core can wait seconds for a CPU; the run is still invalid (its
  stamps were late) but the reasons then say the machine, not the client, was the cause.

``summary()`` goes into ``summary.json`` under ``"client"``; its
``saturation_reasons`` (empty when healthy) make the run's validity verdict "invalid".

Live: when ``on_figures`` is set (the engine sets it, to journal the figures and feed
the dashboard), the probe hands it ``live()`` once a second: the same keys, over the
run so far, with the percentiles read from log-bucket histograms (``LogHistogram``,
within 3 % of the exact value) so a second's update costs only the second's new
samples. ``stop()`` hands it the exact ``summary()`` with ``final`` set, so the last
figures the dashboard shows are summary.json's.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from agentload.replay.client.sse import StreamResult

# The error budget of a valid run: beyond any of these the client, not the server, may
# be what the numbers show.
MAX_CLIENT_CPU = 0.90          # share of one core over the run
MAX_MULTI_EVENT_READS = 0.10   # share of token reads that carried more than one event
MAX_LOOP_LAG_P99_S = 0.050
MAX_STAMP_ERROR_P99_S = 0.050  # Python minus kernel stamp, when kernel stamps exist
PROBE_S = 0.010
LIVE_EVERY_S = 1.0


def _open_run_delay() -> int | None:
    """A descriptor on the calling thread's schedstat (None where Linux gives none)."""
    try:
        return os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
    except OSError:
        return None


def _run_delay_ns(fd: int) -> int | None:
    """Nanoseconds the thread has spent runnable but waiting for a CPU, so far."""
    try:
        return int(os.pread(fd, 64, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return None


class LogHistogram:
    """Counts of nanosecond values in geometric buckets (``PER_DECADE`` per decade, from
    1 us to 1000 s): adding costs only the new values, and a quantile is read off the
    cumulative counts, to within half a bucket (about 3 %)."""

    PER_DECADE = 40
    LOW_NS = 1_000
    DECADES = 9

    def __init__(self) -> None:
        self.counts = np.zeros(self.PER_DECADE * self.DECADES + 2, dtype=np.int64)
        self.n = 0

    def add(self, values_ns: np.ndarray) -> None:
        if not values_ns.size:
            return
        v = np.maximum(values_ns.astype(np.float64), self.LOW_NS)
        idx = np.floor(np.log10(v / self.LOW_NS) * self.PER_DECADE).astype(np.int64) + 1
        # Bucket 0 holds values at or below 1 us (a negative stamp error included).
        idx[values_ns <= self.LOW_NS] = 0
        np.clip(idx, 0, len(self.counts) - 1, out=idx)
        self.counts += np.bincount(idx, minlength=len(self.counts))
        self.n += int(values_ns.size)

    def quantile_s(self, q: float) -> float | None:
        """The ``q``-quantile (0..1) in seconds: the geometric middle of its bucket."""
        if not self.n:
            return None
        k = int(np.searchsorted(np.cumsum(self.counts), max(1, math.ceil(q * self.n))))
        if k == 0:
            return self.LOW_NS / 1e9
        mid = self.LOW_NS * 10 ** ((k - 0.5) / self.PER_DECADE)
        return mid / 1e9


class ClientDiagnostics:
    """Collects the client's self-measurements during one run (one event loop)."""

    def __init__(self) -> None:
        self.stamp_error_ns: array[int] = array("q")
        self.loop_lag_ns: array[int] = array("q")
        self.gc_pause_ns: array[int] = array("q")
        self.reads = 0
        self.multi_event_reads = 0
        self.max_events_per_read = 0
        self.events = 0
        self.kernel_chunks = 0
        self._cpu0 = self._wall0 = 0.0
        self.cpu_s = self.wall_s = 0.0
        self._gc_t = 0
        self._running = False
        self.os_wait_ns = 0        # the loop thread's run-queue wait over the run
        self.os_wait_max_ns = 0    # the longest within one probe interval
        self._os_wait_seen = False
        self.on_figures: Callable[[dict[str, Any], bool], None] | None = None
        """Called with ``live()`` once a second by the probe, and with the exact
        ``summary()`` (``final=True``) by ``stop()``."""
        self._hist = {"stamp_error": LogHistogram(), "loop_lag": LogHistogram()}
        self._fed = {"stamp_error": 0, "loop_lag": 0}

    def observe(self, res: StreamResult) -> None:
        """Fold one finished request's stamps and read counts in."""
        self.reads += res.reads
        self.multi_event_reads += res.multi_event_reads
        if res.max_events_per_read > self.max_events_per_read:
            self.max_events_per_read = res.max_events_per_read
        self.events += res.chunks
        user = res.chunk_user_ns
        if user is not None and len(user) == len(res.chunk_ns):
            self.kernel_chunks += len(user)
            self.stamp_error_ns.extend(u - k for u, k in zip(user, res.chunk_ns, strict=True))

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter_ns()
        elif self._gc_t:
            self.gc_pause_ns.append(time.perf_counter_ns() - self._gc_t)

    def start(self) -> None:
        """Begin the run's window: CPU clock, GC pause hook (the heap is frozen first)."""
        gc.collect()
        gc.freeze()  # what exists before the run is never scanned again
        gc.callbacks.append(self._on_gc)
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
        self._running = True

    def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        self.cpu_s = time.process_time() - self._cpu0
        self.wall_s = time.perf_counter() - self._wall0
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self.on_figures is not None:
            self.on_figures(self.summary(), True)

    async def probe(self, interval_s: float = PROBE_S) -> None:
        """Run until cancelled: the loop's oversleep of ``interval_s`` sleeps."""
        perf = time.perf_counter_ns
        want = int(interval_s * 1e9)
        every = max(1, round(LIVE_EVERY_S / interval_s))
        k = 0
        # The probe runs on the loop's thread: its run delay is the loop's.
        fd = _open_run_delay()
        waited = _run_delay_ns(fd) if fd is not None else None
        try:
            while True:
                t = perf()
                await asyncio.sleep(interval_s)
                self.loop_lag_ns.append(perf() - t - want)
                if waited is not None:
                    now = _run_delay_ns(fd)  # type: ignore[arg-type]
                    if now is not None:
                        self._os_waited(now - waited)
                        waited = now
                k += 1
                if k >= every and self.on_figures is not None:
                    k = 0
                    self.on_figures(self.live(), False)
        finally:
            if fd is not None:
                os.close(fd)

    def _os_waited(self, ns: int) -> None:
        self._os_wait_seen = True
        if self._running:
            self.os_wait_ns += ns
            if ns > self.os_wait_max_ns:
                self.os_wait_max_ns = ns

    def _os_wait_max_s(self) -> float | None:
        return self.os_wait_max_ns / 1e9 if self._os_wait_seen else None

    def _feed(self, name: str, values: array[int]) -> None:
        start = self._fed[name]
        if len(values) > start:
            # A copy of the new tail: a buffer view would pin the array (no appends).
            self._hist[name].add(np.array(values[start:], dtype=np.int64))
            self._fed[name] = len(values)

    def live(self) -> dict[str, Any]:
        """``summary()``'s figures over the run so far, cheaply (histogram percentiles;
        requests count once they have finished)."""
        self._feed("stamp_error", self.stamp_error_ns)
        self._feed("loop_lag", self.loop_lag_ns)
        wall = time.perf_counter() - self._wall0 if self._running else self.wall_s
        cpu_s = time.process_time() - self._cpu0 if self._running else self.cpu_s
        out: dict[str, Any] = {
            "kernel_stamps": self.kernel_chunks > 0,
            "stamp_error_p99_s": self._hist["stamp_error"].quantile_s(0.99),
            "events_per_read": (self.events / self.reads) if self.reads else None,
            "multi_event_read_share": (self.multi_event_reads / self.reads
                                       if self.reads else None),
            "max_events_per_read": self.max_events_per_read,
            "loop_lag_p99_s": self._hist["loop_lag"].quantile_s(0.99),
            "os_wait_max_s": self._os_wait_max_s(),
            "gc_collections": len(self.gc_pause_ns),
            "cpu_cores": cpu_s / wall if wall > 0 else None,
        }
        out["saturation_reasons"] = saturation_reasons(out)
        return out

    def summary(self) -> dict[str, Any]:
        """The figures for ``summary.json``; ``saturation_reasons`` empty when healthy."""
        def q(values: array[int], p: float) -> float | None:
            if not values:
                return None
            return float(np.percentile(np.frombuffer(values, dtype=np.int64), p)) / 1e9

        cpu = self.cpu_s / self.wall_s if self.wall_s > 0 else None
        multi = self.multi_event_reads / self.reads if self.reads else None
        out: dict[str, Any] = {
            "kernel_stamps": self.kernel_chunks > 0,
            "stamp_error_p50_s": q(self.stamp_error_ns, 50),
            "stamp_error_p99_s": q(self.stamp_error_ns, 99),
            "stamp_error_max_s": (max(self.stamp_error_ns) / 1e9) if self.stamp_error_ns
            else None,
            "events_per_read": (self.events / self.reads) if self.reads else None,
            "multi_event_read_share": multi,
            "max_events_per_read": self.max_events_per_read,
            "loop_lag_p50_s": q(self.loop_lag_ns, 50),
            "loop_lag_p99_s": q(self.loop_lag_ns, 99),
            "loop_lag_max_s": (max(self.loop_lag_ns) / 1e9) if self.loop_lag_ns else None,
            "os_wait_s": self.os_wait_ns / 1e9 if self._os_wait_seen else None,
            "os_wait_max_s": self._os_wait_max_s(),
            "gc_collections": len(self.gc_pause_ns),
            "gc_max_pause_s": (max(self.gc_pause_ns) / 1e9) if self.gc_pause_ns else 0.0,
            "cpu_cores": cpu,
            "definitions": {
                "stamp_error": "Python stamp (loop served the socket) minus kernel receive "
                               "stamp, per token chunk; the run's stamps are the kernel's",
                "events_per_read": "token events per socket read; > 1 means events queued "
                                   "in the socket, or that the server sent them together",
                "multi_event_read_share": "share of token reads with several events that "
                                          "were served over 1 ms after their last segment "
                                          "came (without kernel stamps: all such reads)",
                "loop_lag": f"oversleep of a {PROBE_S * 1e3:g} ms asyncio.sleep",
                "os_wait": "time the event loop's thread was runnable but not running "
                           "(Linux schedstat run delay): the OS, not the client, held it "
                           f"back; the max is over one {PROBE_S * 1e3:g} ms probe interval",
                "percentiles": "linear interpolation (numpy)",
            },
        }
        if not out["kernel_stamps"]:
            out["stamp_error_note"] = ("no kernel receive stamps (aiohttp transport, TLS, or "
                                       "a kernel without SO_TIMESTAMPNS): the run's stamps "
                                       "are Python stamps and their own error is not measured")
        out["starved_by_os"] = starved_by_os(out)
        out["saturation_reasons"] = saturation_reasons(out)
        return out


def worst_of_workers(by_worker: Mapping[int, Mapping[str, Any]],
                     keys: Iterable[str]) -> dict[str, Any]:
    """Several worker processes' diagnostics as one (a verdict on the client must hold for
    every process): each of ``keys`` the worst (largest) worker's value, kernel stamps only
    if every worker had them, and every worker's saturation reasons, named by worker."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [d[key] for d in by_worker.values() if d.get(key) is not None]
        out[key] = max(values) if values else None
    out["kernel_stamps"] = all(d.get("kernel_stamps") for d in by_worker.values())
    out["saturation_reasons"] = [f"worker {w}: {r}" for w, d in sorted(by_worker.items())
                                 for r in d.get("saturation_reasons") or ()]
    return out


def saturation_reasons(d: dict[str, Any]) -> list[str]:
    """Why the client may have been the bottleneck (empty when it was not)."""
    reasons = []
    if d.get("cpu_cores") is not None and d["cpu_cores"] > MAX_CLIENT_CPU:
        reasons.append(f"client saturated: it used {d['cpu_cores']:.0%} of a core "
                       f"(> {MAX_CLIENT_CPU:.0%})")
    share = d.get("multi_event_read_share")
    if share is not None and share > MAX_MULTI_EVENT_READS:
        reasons.append(f"client behind: {share:.0%} of token reads carried more than one event "
                       f"that had waited for it (> {MAX_MULTI_EVENT_READS:.0%}); their stamps "
                       "are shared, so ITL is blurred")
    lag = d.get("loop_lag_p99_s")
    if lag is not None and lag > MAX_LOOP_LAG_P99_S:
        reasons.append(f"client event loop lagged: p99 {lag * 1e3:.1f} ms "
                       f"(> {MAX_LOOP_LAG_P99_S * 1e3:.0f} ms)")
    err = d.get("stamp_error_p99_s")
    if err is not None and err > MAX_STAMP_ERROR_P99_S:
        reasons.append(f"client stamp error: Python stamps p99 {err * 1e3:.1f} ms after the "
                       f"kernel's (> {MAX_STAMP_ERROR_P99_S * 1e3:.0f} ms)")
    if reasons and starved_by_os(d):
        reasons.append(f"the OS held the client back: its event loop waited up to "
                       f"{d['os_wait_max_s'] * 1e3:.0f} ms for a CPU while the client used "
                       f"{(d.get('cpu_cores') or 0):.0%} of a core; the machine is "
                       "oversubscribed (give the client its own cores, e.g. with taskset, "
                       "or run the server elsewhere)")
    return reasons


def starved_by_os(d: dict[str, Any]) -> bool:
    """Whether the OS kept a client that was not CPU-bound waiting for a CPU longer than
    the loop-lag budget: then late stamps are the machine's doing, not the client's."""
    wait, cpu = d.get("os_wait_max_s"), d.get("cpu_cores")
    return (wait is not None and wait > MAX_LOOP_LAG_P99_S
            and (cpu is None or cpu <= MAX_CLIENT_CPU))

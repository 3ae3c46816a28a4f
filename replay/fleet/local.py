"""Shards of one replay as worker processes on this host (``replay --workers N``).

Lane ``i`` of a run goes to worker ``i % N``. Each worker is a spawned process with its
own event loop, HTTP client (stamped transport) and ``ReplayEngine`` restricted to its
lanes (``shard=(k, N)``), and appends to its own journal, ``journal.shard-<k>.jsonl``
in the run directory. Every worker starts at one agreed ``perf_counter_ns`` instant
(the same CLOCK_MONOTONIC in every process of a host), so all journals share the run's
time origin; ``journal.merge_shards`` folds them into the one journal afterwards and
the metrics are computed from the union of the requests, never averaged over shards.

``FleetEngine`` is the driver's side. It has the engine's surface that ``run.py``
drives (``run``, ``stop``, ``snapshot``, ``now_ns``, ``journal``, ``live``,
``diagnostics``), so the server sampler, profile window, progress lines and dashboard
work unchanged: the dashboard's board is fed by tailing the shard journals four times
a second. A worker that dies (``kill -9``) leaves every request it had finished in its
journal; the run goes on (or stops, ``on_loss="stop"``) and the loss, with its reason,
goes to ``run.json`` and ``summary.json``. Ctrl-C is the driver's: workers ignore
SIGINT and are terminated by the driver, which then finalizes what they journaled.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections import Counter
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

from agentload.replay.client.diagnostics import worst_of_workers
from agentload.replay.engine.core import (
    EngineOutcome,
    ProgressSnapshot,
    ReplayEngine,
    ReplayOptions,
    Target,
    build_http_client,
    unshardable,
)
from agentload.replay.errors import ReplayError
from agentload.replay.journal import Journal, shard_journal_path
from agentload.replay.live import Header, JournalPlayback, LiveBoard

OnLoss = Literal["continue", "stop"]
STATUS_EVERY_S = 0.25  # a worker's counters reach the driver this often
USERS_PER_WORKER = 250  # one event loop keeps up with about this many agent users
_QUIET_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def quiet_blas_threads() -> Iterator[None]:
    """One BLAS thread for the processes started inside (restored after): workers import
    numpy but never compute with it, and OpenBLAS's idle threads spin (2 % of a worker's
    samples)."""
    saved = {k: os.environ.get(k) for k in _QUIET_THREADS}
    os.environ.update(dict.fromkeys(_QUIET_THREADS, "1"))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def auto_workers(users: int, cpus: int | None = None) -> int:
    """The default ``--workers``: a process per ``USERS_PER_WORKER`` users, leaving a core
    to the driver (and at least one worker)."""
    cpus = cpus or os.cpu_count() or 1
    wanted = -(-users // USERS_PER_WORKER)
    return max(1, min(wanted, cpus - 1, users))


def parse_workers(text: str) -> int | None:
    """``--workers``: a count >= 1, or ``auto`` (None: ``auto_workers`` decides)."""
    if text.strip().lower() == "auto":
        return None
    try:
        count = int(text)
    except ValueError:
        raise ReplayError(f"--workers must be a count or 'auto', got {text!r}") from None
    if count < 1:
        raise ReplayError(f"--workers must be at least 1, got {count}")
    return count


def parse_cpus(text: str) -> list[int]:
    """``--cpus``: CPU numbers and ranges (``2-5,8``) that exist here, for the workers."""
    cpus: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ReplayError(f"--cpus must list CPUs like 2-5,8; got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if not cpus:
        raise ReplayError(f"--cpus {text!r} names no CPU")
    if missing := sorted(set(cpus) - allowed):
        raise ReplayError(f"--cpus {text!r}: CPUs {_ranges(missing)} are not this "
                          f"process's (it may use {_ranges(sorted(allowed))})")
    return cpus


def _ranges(cpus: list[int]) -> str:
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


@dataclass(frozen=True, slots=True)
class ShardJob:
    """What one worker needs (pickled to the spawned process)."""

    index: int
    count: int
    trace: Any  # agentload.traces.Trace
    target: Target
    options: ReplayOptions
    run_dir: Path
    slo: Mapping[str, float] | None = None
    cpu: int | None = None


class WorkerLink:
    """How the driver reaches one worker, wherever it runs (a local process here; a Ray
    actor in ``fleet/ray.py``). Messages from a worker: ``("status", counters)``,
    ``("done", outcome, diagnostics)``, ``("error", text, traceback)``."""

    index: int
    lanes: tuple[int, ...]

    def launch(self) -> None:
        """Start the worker (returns at once)."""
        raise NotImplementedError

    async def ready(self) -> int | None:
        """The worker's planned request total once it is ready; None while it is not."""
        raise NotImplementedError

    def go(self, start_at_ns: int) -> None:
        """Start playing at ``start_at_ns`` on the driver's ``perf_counter_ns`` clock."""
        raise NotImplementedError

    async def messages(self) -> list[tuple[Any, ...]]:
        """What the worker said since the last call (and its journal lines, fetched)."""
        raise NotImplementedError

    def gone(self) -> str | None:
        """Why the worker ended without a result (None while it runs)."""
        raise NotImplementedError

    def stop(self, reason: str) -> None:
        raise NotImplementedError

    def terminate(self, wait_s: float = 0.0) -> None:
        """End the worker, after ``wait_s`` for it to exit by itself (what it journaled
        stays)."""
        raise NotImplementedError

    def record(self) -> dict[str, Any]:
        """Where it ran, for ``run.json``."""
        return {}


class ProcessLink(WorkerLink):
    """A worker process on this host, spoken to over a pipe."""

    def __init__(self, job: ShardJob, lanes: tuple[int, ...]) -> None:
        self.index, self.lanes, self.job = job.index, lanes, job
        self.pipe: Connection | None = None
        self.process: Any = None

    def launch(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(self.job, child), daemon=True,
                                   name=f"agentload-shard-{self.index}")
        # A Ctrl-C while the child imports would print its traceback: it ignores SIGINT
        # from the start (the disposition is inherited), as it does once running.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.process.start()
        finally:
            signal.signal(signal.SIGINT, previous)
        child.close()
        self.pipe = parent

    async def ready(self) -> int | None:
        assert self.pipe is not None
        if self.pipe.poll():
            try:
                message = self.pipe.recv()
            except (EOFError, OSError):  # the pipe closed: the worker died
                self.process.join(timeout=5)
                raise ReplayError(f"worker {self.index} died while starting "
                                  f"({_exit_reason(self.process.exitcode)})") from None
            if message[0] != "ready":
                raise ReplayError(f"worker {self.index} failed to start: {message[1]}")
            return int(message[1])
        if not self.process.is_alive():
            raise ReplayError(f"worker {self.index} died while starting "
                               f"({_exit_reason(self.process.exitcode)})")
        return None

    def go(self, start_at_ns: int) -> None:
        assert self.pipe is not None
        with contextlib.suppress(OSError, BrokenPipeError):  # a dead one is found by gone()
            self.pipe.send(("go", start_at_ns))

    async def messages(self) -> list[tuple[Any, ...]]:
        assert self.pipe is not None
        out = []
        with contextlib.suppress(EOFError, OSError):
            while self.pipe.poll():
                out.append(self.pipe.recv())
        return out

    def gone(self) -> str | None:
        if self.process.is_alive():
            return None
        self.process.join(timeout=0)
        return _exit_reason(self.process.exitcode)

    def stop(self, reason: str) -> None:
        if self.pipe is not None:
            with contextlib.suppress(OSError, BrokenPipeError):
                self.pipe.send(("stop", reason))

    def terminate(self, wait_s: float = 0.0) -> None:
        if self.process is None:
            return
        self.process.join(timeout=wait_s)
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        if self.pipe is not None:
            self.pipe.close()

    def record(self) -> dict[str, Any]:
        return {"pid": self.process.pid if self.process is not None else None,
                "cpu": self.job.cpu}


@dataclass(slots=True)
class _Shard:
    """The driver's view of one worker."""

    link: WorkerLink
    planned: int = 0
    status: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    lost: dict[str, Any] | None = None

    @property
    def index(self) -> int:
        return self.link.index

    @property
    def lanes(self) -> tuple[int, ...]:
        return self.link.lanes

    @property
    def over(self) -> bool:
        return self.result is not None or self.lost is not None


# ----------------------------------------------------------------------------- worker


def _worker(job: ShardJob, conn: Connection) -> None:
    """A worker process: build the shard's engine, wait for the start, play, report."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    try:
        if job.cpu is not None:
            os.sched_setaffinity(0, {job.cpu})
        with Journal(shard_journal_path(job.run_dir, job.index)) as journal:
            journal.write_event("worker", 0, worker=job.index, pid=os.getpid(), cpu=job.cpu)
            engine = shard_engine(job, journal)
            conn.send(("ready", engine.total_requests))
            message = conn.recv()
            if message[0] != "go":
                return
            outcome, diagnostics = asyncio.run(_play(engine, conn, message[1]))
        conn.send(("done", asdict(outcome), diagnostics))
    except BaseException as exc:  # the driver records it; a worker never hangs the run
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}",
                       traceback.format_exc(limit=6)))
    finally:
        conn.close()


def shard_engine(job: ShardJob, journal: Journal) -> ReplayEngine:
    """The engine of one shard, with its own HTTP client (``engine.client``)."""
    client = build_http_client(job.options, job.target.base_url)
    return ReplayEngine(job.trace, job.target, job.options, journal, client, slo=job.slo,
                        shard=(job.index, job.count))


async def run_shard_engine(engine: ReplayEngine, start_at_ns: int,
                     *helpers: Coroutine[Any, Any, None]) -> tuple[EngineOutcome, dict[str, Any]]:
    """Play a shard's engine from ``start_at_ns`` with its loop-lag probe (and ``helpers``
    beside it); its outcome and its client diagnostics."""
    async with engine.client:
        engine.diagnostics.start()
        tasks = [asyncio.create_task(engine.diagnostics.probe()),
                 *(asyncio.create_task(h) for h in helpers)]
        try:
            outcome = await engine.run(start_at_ns=start_at_ns)
            engine.diagnostics.stop()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return outcome, engine.diagnostics.summary()


async def _play(engine: ReplayEngine, conn: Connection,
                start_at_ns: int) -> tuple[EngineOutcome, dict[str, Any]]:
    loop = asyncio.get_running_loop()

    def on_message() -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            engine.stop("the driver went away")
            return
        if message[0] == "stop":
            engine.stop(message[1])

    async def report() -> None:
        while True:
            await asyncio.sleep(STATUS_EVERY_S)
            conn.send(("status", shard_counters(engine)))

    loop.add_reader(conn.fileno(), on_message)
    try:
        outcome, diagnostics = await run_shard_engine(engine, start_at_ns, report())
    finally:
        loop.remove_reader(conn.fileno())
    conn.send(("status", shard_counters(engine)))
    return outcome, diagnostics


def shard_counters(engine: ReplayEngine) -> dict[str, Any]:
    snap = engine.snapshot()
    return {"sent": engine.requests_sent, "done": snap.requests_done,
            "failed": snap.requests_failed, "skipped": snap.requests_skipped,
            "in_flight": snap.in_flight,
            "users_active": snap.users_active, "reasons": list(snap.invalid_reasons)}


# ----------------------------------------------------------------------------- driver


class FleetDiagnostics:
    """The workers' client diagnostics, merged worst-first for ``run.json``."""

    def __init__(self) -> None:
        self.shards: dict[int, dict[str, Any]] = {}

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    async def probe(self) -> None:  # each worker probes its own loop
        await asyncio.Event().wait()

    def summary(self) -> dict[str, Any]:
        return merge_diagnostics(self.shards)


_WORST = ("stamp_error_p50_s", "stamp_error_p99_s", "stamp_error_max_s", "events_per_read",
          "multi_event_read_share", "max_events_per_read", "loop_lag_p50_s", "loop_lag_p99_s",
          "loop_lag_max_s", "os_wait_s", "os_wait_max_s", "gc_collections", "gc_max_pause_s",
          "cpu_cores")


def merge_diagnostics(shards: Mapping[int, dict[str, Any]]) -> dict[str, Any]:
    """One summary for all workers: each figure the worst worker's (a verdict on the
    client must hold for every process), the reasons of each, and every worker's own."""
    if not shards:
        return {"available": False, "reason": "no worker reported its diagnostics"}
    first = next(iter(shards.values()))
    out: dict[str, Any] = {k: v for k, v in first.items() if k not in _WORST}
    out |= worst_of_workers(shards, _WORST)
    out["starved_by_os"] = any(d.get("starved_by_os") for d in shards.values())
    out["workers"] = {str(k): d for k, d in sorted(shards.items())}
    out["merged"] = "each figure is the worst worker's; per worker under 'workers'"
    return out


class FleetEngine:
    """The driver of a ``--workers`` run: the engine's surface over N worker processes."""

    def __init__(self, trace: Any, target: Target, options: ReplayOptions,
                 journal: Journal, run_dir: Path, workers: int,
                 slo: Mapping[str, float] | None = None,
                 cpus: Sequence[int] | None = None, on_loss: OnLoss = "continue",
                 start_timeout_s: float = 120.0) -> None:
        if workers < 1:
            raise ValueError("--workers must be at least 1")
        self.trace, self.target, self.options = trace, target, options
        self.journal, self.run_dir, self.workers = journal, Path(run_dir), workers
        self.slo, self.cpus, self.on_loss = slo, list(cpus or ()), on_loss
        self.start_timeout_s = start_timeout_s
        # Checked here too (each worker would refuse): one line, before any spawn.
        if workers > 1 and (problem := unshardable(options)) is not None:
            raise ValueError(problem)
        lanes = len(trace.sessions) if options.open_loop else options.users
        self.lanes = {k: tuple(i for i in range(lanes) if i % workers == k)
                      for k in range(workers)}
        # Recycled runs are bounded by time (--max-requests is refused), others by the trace.
        self.total_requests = 0 if options.recycle else trace.num_requests
        self.diagnostics = FleetDiagnostics()
        self.live = LiveBoard(Header(target.label, trace.name, target.gpus, lanes,
                                     self.total_requests, options.duration_s,
                                     recycle=options.recycle,
                                     slo=tuple((slo or {}).items())))
        self._started_event = asyncio.Event()
        self._shards: list[_Shard] = []
        self._t0_ns = time.perf_counter_ns()
        self._stop_reason: str | None = None
        self._finished = False
        self._tail: JournalPlayback | None = None

    placement = "local processes"

    # -- the engine's surface

    def now_ns(self) -> int:
        return time.perf_counter_ns() - self._t0_ns

    async def wait_started(self) -> None:
        """Return once every worker is ready and the run's clock has started."""
        await self._started_event.wait()

    def stop(self, reason: str) -> None:
        """Every worker sends nothing more (what is in flight finishes)."""
        if self._stop_reason is not None:
            return
        self._stop_reason = reason
        self.journal.write_event("stop", self.now_ns(), reason=reason)
        self.live.stopping(self.now_ns(), reason)
        for shard in self._shards:
            if not shard.over:
                shard.link.stop(reason)

    def snapshot(self) -> ProgressSnapshot:
        counts = Counter[str]()
        reasons: list[str] = []
        for shard in self._shards:
            for key in ("done", "failed", "skipped", "in_flight", "users_active"):
                counts[key] += int(shard.status.get(key, 0))
            reasons += [f"worker {shard.index}: {r}" for r in shard.status.get("reasons", ())]
        reasons += [f"worker {s.index} lost: {s.lost['reason']}" for s in self._shards
                    if s.lost is not None]
        latest = self.live.latest
        head = latest.headlines[0] if latest is not None and latest.headlines else None
        elapsed = self.now_ns() / 1e9 if self._started_event.is_set() else 0.0
        eta = None
        if self.options.duration_s is not None:
            eta = max(0.0, self.options.duration_s - elapsed)
        return ProgressSnapshot(
            elapsed_s=elapsed, requests_total=self.total_requests,
            requests_done=counts["done"], requests_failed=counts["failed"],
            requests_skipped=counts["skipped"], in_flight=counts["in_flight"],
            users_active=counts["users_active"], users=self.live.header.users,
            p90_interactivity_tok_s=head.p90_interactivity_tok_s if head else None,
            ttft_p90_s=head.ttft_p90_s if head else None, eta_s=eta,
            finished=self._finished, invalid_reasons=tuple(reasons))

    async def run(self) -> EngineOutcome:
        try:
            await self._spawn()
            if self._stop_reason is not None:  # stopped (server died, q) while starting
                for shard in self._shards:
                    shard.result = {"outcome": {"stop_reason": self._stop_reason}}
                return self._outcome()
            start_at = time.perf_counter_ns() + int(0.2e9)
            self._t0_ns = start_at
            self._started_event.set()
            for shard in self._shards:
                shard.link.go(start_at)
            self.journal.write_event("replay_start", 0, users=self.options.users,
                                     recycle=self.options.recycle, workers=self.workers)
            self._tail = JournalPlayback(self.run_dir, board=self.live,
                                         paths=[shard_journal_path(self.run_dir, k)
                                                for k in range(self.workers)])
            published = 0
            while not all(shard.over for shard in self._shards):
                await self._poll()
                self._tail.advance(self.now_ns())
                if self.now_ns() - published >= 250_000_000:
                    # The headline the progress lines read (the dashboard publishes too).
                    published = self.now_ns()
                    self.live.publish(published)
                await asyncio.sleep(0.05)
            self._tail.advance(self.now_ns())
        finally:
            self._finished = True
            self._terminate()
            if self._tail is not None:
                self._tail.close()
        outcome = self._outcome()
        self.live.finish(self.now_ns(), outcome.stop_reason)
        self.journal.write_event("replay_end", self.now_ns(), stop_reason=outcome.stop_reason)
        return outcome

    # -- workers

    def links(self) -> list[WorkerLink]:
        """One link per worker: local processes (``fleet/ray.py`` overrides this)."""
        return [ProcessLink(ShardJob(k, self.workers, self.trace, self.target, self.options,
                                     self.run_dir, self.slo,
                                     self.cpus[k % len(self.cpus)] if self.cpus else None),
                            self.lanes[k]) for k in range(self.workers)]

    async def _spawn(self) -> None:
        with quiet_blas_threads():
            for link in self.links():
                self._shards.append(_Shard(link))
                link.launch()
        deadline = time.monotonic() + self.start_timeout_s
        waiting = {s.index: s for s in self._shards}
        while waiting:
            for index, shard in list(waiting.items()):
                total = await shard.link.ready()
                if total is not None:
                    shard.planned = total
                    del waiting[index]
            if time.monotonic() > deadline:
                raise ReplayError(f"workers {sorted(waiting)} did not start in "
                                  f"{self.start_timeout_s:g} s")
            await asyncio.sleep(0.02)

    async def _poll(self) -> None:
        live = [shard for shard in self._shards if not shard.over]
        inboxes = await asyncio.gather(*(shard.link.messages() for shard in live))
        for shard, messages in zip(live, inboxes, strict=True):
            self._take(shard, messages)
            if not shard.over and (why := shard.link.gone()) is not None:
                # It may have said "done" just before it exited: read once more first.
                self._take(shard, await shard.link.messages())
                if not shard.over:
                    self._lose(shard, why)

    def _take(self, shard: _Shard, messages: list[tuple[Any, ...]]) -> None:
        for message in messages:
            if message[0] == "status":
                shard.status = message[1]
            elif message[0] == "done":
                shard.result = {"outcome": message[1]}
                self.diagnostics.shards[shard.index] = message[2]
                return
            elif message[0] == "error":
                self._lose(shard, f"failed: {message[1]}", message[2])
                return

    def _lose(self, shard: _Shard, reason: str, detail: str | None = None) -> None:
        """A worker ended without finishing: keep what it journaled, record the rest."""
        shard.lost = {"worker": shard.index, "lanes": list(shard.lanes), "reason": reason,
                      "at_s": round(self.now_ns() / 1e9, 3),
                      "in_flight_at_last_report": int(shard.status.get("in_flight", 0)),
                      "sent_at_last_report": int(shard.status.get("sent", 0))}
        if detail:
            shard.lost["detail"] = detail
        self.journal.write_event("worker_lost", self.now_ns(), **shard.lost)
        self.live.event(self.now_ns(), "worker_lost", f"worker {shard.index} lost: {reason}; "
                        f"its {len(shard.lanes)} lanes stop", "error")
        if self.on_loss == "stop":
            self.stop(f"worker {shard.index} lost ({reason}; --on-worker-loss stop)")

    def _terminate(self) -> None:
        """End every worker still running (the run ended, or the driver was interrupted:
        what they journaled stays, and the loss is recorded as the driver's doing)."""
        for shard in self._shards:
            shard.link.terminate(wait_s=5.0 if shard.result is not None else 0.0)
            if not shard.over:
                self._lose(shard, "stopped by the driver (interrupted)")

    def _outcome(self) -> EngineOutcome:
        """Every worker's outcome summed; a lost worker counts what it last reported as
        sent, done and failed, and (a run over the trace) the rest of its plan as not sent."""
        outcomes = []
        for shard in self._shards:
            if shard.result is not None:
                outcomes.append(shard.result["outcome"])
            elif shard.lost is not None:
                status = shard.status
                sent = int(status.get("sent", 0))
                outcomes.append({
                    "sent": sent, "completed": int(status.get("done", 0)),
                    "failed": int(status.get("failed", 0)),
                    "skipped": (0 if self.options.recycle
                                else max(0, shard.planned - sent)
                                + int(status.get("skipped", 0)))})

        def total(key: str) -> int:
            return sum(int(o.get(key) or 0) for o in outcomes)

        reasons = Counter(o["stop_reason"] for o in outcomes if o.get("stop_reason"))
        stop_reason = self._stop_reason or (reasons.most_common(1)[0][0] if reasons
                                            else "every worker was lost")
        cut_reasons = [o["cut_reason"] for o in outcomes if o.get("cut_reason")]
        return EngineOutcome(
            total("sent"), total("completed"), total("failed"), total("skipped"),
            stop_reason, self.now_ns() / 1e9, total("cut"),
            cut_reasons[0] if cut_reasons else None)

    def fleet_record(self) -> dict[str, Any]:
        """``run.json``'s ``workers``: how the lanes were split and which workers were lost."""
        return {"count": self.workers, "placement": self.placement,
                "lanes": {str(k): list(v) for k, v in self.lanes.items()},
                "where": {str(s.index): s.link.record() for s in self._shards},
                "cpus": self.cpus or None, "on_loss": self.on_loss,
                "lost": [s.lost for s in self._shards if s.lost is not None]}


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "ended without a result"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code} before finishing"

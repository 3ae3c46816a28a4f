"""Shards of one replay as Ray actors spread over a cluster's nodes (``--ray``).

agentload does not schedule hosts itself: with ``--ray auto|ADDRESS`` each worker is a
Ray actor (``SPREAD`` over the nodes, one CPU each) running the ordinary engine over its
lanes, on its own event loop, appending to a journal on its own node. The driver pulls
each actor's new journal lines four times a second into ``journal.shard-<k>.jsonl``
beside the run, so the run directory, the merge, the dashboard and the reports are those
of a local ``--workers`` run. A node or actor lost mid-run keeps what it had streamed;
the rest is recorded as lost with Ray's reason.

Clocks: every actor stamps with its own host's ``perf_counter_ns``. The driver measures
each actor's clock offset by round trips (the tightest of several: offset = actor clock
- midpoint of the driver's send and receive) before the start and again at the end, and
tells each actor the common start instant in its own clock. Per-request metrics (TTFT,
ITL, E2EL) are differences of one host's stamps and do not depend on the offset; the
run's timeline (the time series, the dashboard, throughput windows) is aligned to
within the measured round-trip uncertainty, recorded in ``run.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agentload.replay.engine.core import ReplayEngine
from agentload.replay.errors import ReplayError
from agentload.replay.fleet.local import (
    FleetEngine,
    ShardJob,
    WorkerLink,
    run_shard_engine,
    shard_counters,
    shard_engine,
)
from agentload.replay.journal import Journal, shard_journal_path

RAY_MISSING = ("--ray needs Ray, an optional extra: pip install 'agentload[ray]' "
               "(ray>=2.60)")
CLOCK_PROBES = 8
DRAIN_TIMEOUT_S = 5.0


def connect(address: str) -> int:
    """Join the Ray cluster at ``address`` (``auto``: the one this host belongs to); the
    number of its live nodes. Every failure is one line (``ReplayError``)."""
    try:
        import ray
    except ImportError:
        raise ReplayError(RAY_MISSING) from None
    if address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ReplayError(f"cannot reach the Ray cluster at {address}: {why}") from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR,
                 configure_logging=False, ignore_reinit_error=True)
    except Exception as exc:  # ConnectionError, RuntimeError, ...: one line either way
        raise ReplayError(f"cannot join the Ray cluster at {address}: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                          ) from None
    return len([node for node in cluster_nodes() if node.get("Resources", {}).get("CPU")])


def cluster_nodes() -> list[dict[str, Any]]:
    """The live nodes of the Ray cluster this process has joined."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [node for node in nodes if node.get("Alive")]


def check_reachable(url: str) -> None:
    """Refuse a loopback target when the cluster has nodes on other hosts: from there,
    127.0.0.1 is that node, not the server (start it on an address the nodes reach)."""
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        return
    mine = {"127.0.0.1", _own_address()}
    others = sorted({str(n.get("NodeManagerAddress")) for n in cluster_nodes()} - mine)
    if others:
        raise ReplayError(f"{url} is a loopback address, but Ray nodes on other hosts "
                          f"({', '.join(others)}) would each reach their own 127.0.0.1: serve "
                          "on an address every node reaches and give that")


def _own_address() -> str:
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def tightest_offset(trips: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(offset, round trip) in ns from (sent, their clock, received) round trips: the
    other clock minus the midpoint of the tightest trip (its error is within half of it)."""
    sent, theirs, received = min(trips, key=lambda t: t[2] - t[0])
    return theirs - (sent + received) // 2, received - sent


def disconnect() -> None:
    with contextlib.suppress(ImportError):
        import ray

        if ray.is_initialized():
            ray.shutdown()


class ShardActor:
    """One shard on a Ray node (made a Ray actor class by ``_actor_class``)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.engine: ReplayEngine | None = None
        self.result: tuple[Any, ...] | None = None
        self.task: asyncio.Task[None] | None = None

    async def clock(self) -> int:
        return time.perf_counter_ns()

    async def prepare(self, job: ShardJob) -> dict[str, Any]:
        self.path = Path(tempfile.mkdtemp(prefix="agentload-ray-")) / "journal.jsonl"
        self.journal = Journal(self.path)
        self.journal.write_event("worker", 0, worker=job.index, pid=os.getpid(),
                                 host=socket.gethostname())
        self.engine = shard_engine(job, self.journal)
        import ray

        return {"total": self.engine.total_requests, "host": socket.gethostname(),
                "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "journal": str(self.path)}

    async def go(self, start_at_ns: int) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(start_at_ns))

    async def _run(self, start_at_ns: int) -> None:
        engine = self.engine
        assert engine is not None
        try:
            outcome, diagnostics = await run_shard_engine(engine, start_at_ns)
            self.journal.close()
            self.result = ("done", asdict(outcome), diagnostics)
        except BaseException as exc:
            self.journal.close()
            self.result = ("error", f"{type(exc).__name__}: {exc}", None)

    async def drain(self, offset: int) -> tuple[bytes, dict[str, Any], tuple[Any, ...] | None]:
        """Journal bytes from ``offset`` to the last whole line, the counters, the result
        (read first, so that a result comes with every line written before it)."""
        result = self.result
        data = b""
        if self.path is not None:
            with open(self.path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
            data = data[:data.rfind(b"\n") + 1]
        counters = shard_counters(self.engine) if self.engine is not None else {}
        return data, counters, result

    async def stop(self, reason: str) -> None:
        if self.engine is not None:
            self.engine.stop(reason)

    async def cleanup(self) -> None:
        """Remove this node's copy of the journal (the driver holds every line)."""
        if self.path is not None:
            self.journal.close()
            shutil.rmtree(self.path.parent, ignore_errors=True)


_ACTOR: Any = None


def _actor_class() -> Any:
    global _ACTOR
    if _ACTOR is None:
        import ray

        _ACTOR = ray.remote(num_cpus=1, max_restarts=0)(ShardActor)
    return _ACTOR


class RayLink(WorkerLink):
    """A shard as a Ray actor; its journal lines are pulled into the run directory."""

    def __init__(self, job: ShardJob, lanes: tuple[int, ...]) -> None:
        self.index, self.lanes, self.job = job.index, lanes, job
        self.actor: Any = None
        self._prepared: Any = None
        self._where: dict[str, Any] = {}
        self._offset = 0
        self._gone: str | None = None
        self._clock: dict[str, Any] = {}
        self._local = shard_journal_path(job.run_dir, job.index)

    def launch(self) -> None:
        self.actor = _actor_class().options(
            scheduling_strategy="SPREAD", name=None).remote()
        self._prepared = self.actor.prepare.remote(self.job)

    async def ready(self) -> int | None:
        import ray

        done, _ = ray.wait([self._prepared], timeout=0)
        if not done:
            return None
        try:
            self._where = await self._prepared
        except ray.exceptions.RayError as exc:
            raise ReplayError(f"worker {self.index} failed to start on Ray: "
                              f"{_first_line(exc)}") from None
        self._clock["start"] = await self._offset_probe()
        return int(self._where["total"])

    async def _offset_probe(self) -> dict[str, int]:
        """The actor's clock minus the driver's, from the tightest of a few round trips."""
        trips = []
        for _ in range(CLOCK_PROBES):
            t1 = time.perf_counter_ns()
            theirs = await self.actor.clock.remote()
            trips.append((t1, theirs, time.perf_counter_ns()))
        offset, round_trip = tightest_offset(trips)
        return {"offset_ns": offset, "round_trip_ns": round_trip}

    def go(self, start_at_ns: int) -> None:
        self.actor.go.remote(start_at_ns + self._clock["start"]["offset_ns"])

    async def messages(self) -> list[tuple[Any, ...]]:
        import ray

        if self._gone is not None:
            return []
        try:
            # A node cut off answers nothing: the poll goes on; Ray declares it dead later.
            data, counters, result = await asyncio.wait_for(
                asyncio.wrap_future(self.actor.drain.remote(self._offset).future()),
                DRAIN_TIMEOUT_S)
        except TimeoutError:
            return []
        except ray.exceptions.RayError as exc:
            self._gone = f"Ray actor lost: {_first_line(exc)}"
            return []
        self._append(data)
        out: list[tuple[Any, ...]] = [("status", counters)]
        if result is not None:
            with contextlib.suppress(ray.exceptions.RayError, asyncio.TimeoutError):
                self._clock["end"] = await asyncio.wait_for(self._offset_probe(), 10)
            out.append(result if result[0] == "done" else (*result[:2], None))
        return out

    def _append(self, data: bytes) -> None:
        if data:
            with open(self._local, "ab") as fh:
                fh.write(data)
            self._offset += len(data)

    def gone(self) -> str | None:
        return self._gone

    def stop(self, reason: str) -> None:
        if self.actor is not None and self._gone is None:
            self.actor.stop.remote(reason)

    def terminate(self, wait_s: float = 0.0) -> None:
        """Pull what the actor journaled since the last poll, let it remove its journal,
        then end it."""
        import ray

        if self.actor is None:
            return
        if self._gone is None:
            with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                self._append(ray.get(self.actor.drain.remote(self._offset), timeout=10)[0])
                ray.get(self.actor.cleanup.remote(), timeout=10)
        with contextlib.suppress(ray.exceptions.RayError):
            ray.kill(self.actor, no_restart=True)

    def record(self) -> dict[str, Any]:
        return {**{k: v for k, v in self._where.items() if k != "total"},
                "clock": self._clock}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class RayFleetEngine(FleetEngine):
    """The driver of a ``--ray`` run: shards as Ray actors over the cluster's nodes."""

    placement = "ray"

    def links(self) -> list[WorkerLink]:
        return [RayLink(ShardJob(k, self.workers, self.trace, self.target, self.options,
                                 self.run_dir, self.slo), self.lanes[k])
                for k in range(self.workers)]

"""Lanes sharded over worker processes, merged exactly afterwards.

One Python core tops out near 48k SSE events/s, and a loop serving N ready sockets
stamps the last one N x (per-event cost) late, so load beyond one core's share goes to
worker processes. Each worker owns a pre-partitioned share of the lanes (lane ``i`` of
``N`` goes to worker ``i % W``), runs its own event loop (uvloop when installed) with
the GC collected, frozen and disabled for the run, and keeps raw per-event stamps in
``array('q')`` (no IPC in the hot path). All workers start at one agreed
CLOCK_MONOTONIC instant (``perf_counter_ns`` is the same clock in every process on the
host); afterwards the parent concatenates their raw samples, so merged percentiles are
exact, not sketched.

``run_shards`` drives the closed-loop client benchmark (``agentload bench client``);
``replay --workers N`` splits its lanes the same way (lane ``i`` to worker ``i % W``) in
``fleet/local.py``.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import time
from array import array
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

import orjson

from agentload.replay.fleet.local import quiet_blas_threads

GcMode = Literal["off", "on"]


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """What one worker plays: its lanes and requests, against one URL."""

    index: int
    shards: int
    url: str
    lanes: int
    requests: int
    max_tokens: int = 200
    prompt_tokens: int = 16
    api: Literal["completions", "chat"] = "completions"
    transport: Literal["stamped", "aiohttp"] = "stamped"
    gc_mode: GcMode = "off"
    cpu: int | None = None
    timeout_s: float = 120.0
    # Lane starts spread evenly over this long (all shards together), as in a steady
    # state; 0 starts every lane at once.
    stagger_s: float = 0.0


@dataclass(slots=True)
class ShardResult:
    """One worker's raw samples (ns, ``perf_counter_ns`` clock) and counters."""

    index: int
    loop: str = "asyncio"
    ok: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    first_send_ns: int = 0
    last_event_ns: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    reads: int = 0
    multi_event_reads: int = 0
    max_events_per_read: int = 0
    gc_collections: int = 0
    gc_max_pause_ns: int = 0
    # Per token event: the stamp agentload records, the Python stamp, the emission stamp.
    event_ns: array[int] = field(default_factory=lambda: array("q"))
    user_ns: array[int] = field(default_factory=lambda: array("q"))
    emit_ns: array[int] = field(default_factory=lambda: array("q"))
    # Per request: TTFT and schedule lag (sent - when the lane was ready).
    ttft_ns: array[int] = field(default_factory=lambda: array("q"))
    schedule_lag_ns: array[int] = field(default_factory=lambda: array("q"))
    loop_lag_ns: array[int] = field(default_factory=lambda: array("q"))
    # Token events of each ok request, in the order their stamps are in ``event_ns``.
    request_events: array[int] = field(default_factory=lambda: array("q"))
    kernel_stamps: bool = False


def _payload(spec: ShardSpec, model: str) -> bytes:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if spec.api == "chat":
        body["messages"] = [{"role": "user", "content": " ".join(["w"] * spec.prompt_tokens)}]
    else:
        body["prompt"] = list(range(16, 16 + spec.prompt_tokens))
    return orjson.dumps(body)


async def _loop_lag(into: array[int], stop: asyncio.Event) -> None:
    """Oversleep of a 10 ms sleep: how long ready callbacks wait for the loop (the same
    probe as a replay's diagnostics; a 1 ms probe cost the worker 1-2 % of its CPU)."""
    perf = time.perf_counter_ns
    while not stop.is_set():
        t = perf()
        await asyncio.sleep(0.010)
        into.append(perf() - t - 10_000_000)


async def play_shard(spec: ShardSpec, start_at_ns: int, model: str) -> ShardResult:
    """Play ``spec`` in this process's running loop, starting at ``start_at_ns``."""
    import httpx

    from agentload.replay.client.netstamp import StampedTransport, kernel_stamps_work
    from agentload.replay.client.sse import stream_completion

    out = ShardResult(spec.index)
    transport: httpx.AsyncBaseTransport
    if spec.transport == "stamped":
        transport = StampedTransport()
        out.kernel_stamps = kernel_stamps_work()
    else:
        from httpx_aiohttp import AiohttpTransport
        transport = AiohttpTransport(limits=httpx.Limits(max_connections=None,
                                                         max_keepalive_connections=None))
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(spec.timeout_s),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=None),
                               trust_env=False)
    path = "/v1/chat/completions" if spec.api == "chat" else "/v1/completions"
    url = spec.url.rstrip("/") + path
    payload = _payload(spec, model)
    left = [spec.requests]
    perf = time.perf_counter_ns

    async def lane(j: int) -> None:
        # Global lane index j * shards + index of lanes * shards: its share of the stagger.
        total = spec.lanes * spec.shards
        ready = start_at_ns + int(spec.stagger_s * 1e9 * (j * spec.shards + spec.index) / total)
        delay = (ready - perf()) / 1e9
        if delay > 0:
            await asyncio.sleep(delay)
        while left[0] > 0:
            left[0] -= 1
            sent = perf()
            out.schedule_lag_ns.append(sent - ready)
            res = await stream_completion(client, url, payload, collect_emit_ns=True)
            ready = perf()
            if not res.ok:
                out.failed += 1
                kind = res.error_kind or "unknown"
                out.errors[kind] = out.errors.get(kind, 0) + 1
                continue
            out.ok += 1
            assert res.first_token_ns is not None
            out.ttft_ns.append(res.first_token_ns - res.sent_ns)
            out.event_ns.extend(res.chunk_ns)
            out.request_events.append(len(res.chunk_ns))
            out.user_ns.extend(res.chunk_user_ns if res.chunk_user_ns is not None
                               else res.chunk_ns)
            if res.chunk_emit_ns is not None:
                out.emit_ns.extend(res.chunk_emit_ns)
            out.reads += res.reads
            out.multi_event_reads += res.multi_event_reads
            out.max_events_per_read = max(out.max_events_per_read, res.max_events_per_read)
            if res.chunk_ns and res.chunk_ns[-1] > out.last_event_ns:
                out.last_event_ns = res.chunk_ns[-1]

    pauses: list[int] = []
    gc_start = [0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_start[0] = perf()
        else:
            pauses.append(perf() - gc_start[0])

    gc.callbacks.append(on_gc)
    stop = asyncio.Event()
    try:
        async with client:
            delay = (start_at_ns - perf()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)
            probe = asyncio.create_task(_loop_lag(out.loop_lag_ns, stop))
            out.first_send_ns = perf()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(lane(j) for j in range(spec.lanes)))
            out.cpu_s = time.process_time() - cpu0
            out.wall_s = time.perf_counter() - wall0
            stop.set()
            await probe
    finally:
        gc.callbacks.remove(on_gc)
    out.gc_collections = len(pauses)
    out.gc_max_pause_ns = max(pauses, default=0)
    return out


def prepare_process(spec: ShardSpec) -> str:
    """Pin, pick the loop and quiet the GC, as a measuring worker should; the loop's name."""
    from agentload.replay.bench.emulator import install_uvloop

    if spec.cpu is not None:
        os.sched_setaffinity(0, {spec.cpu})
    loop = install_uvloop()
    gc.collect()
    gc.collect()
    gc.freeze()
    if spec.gc_mode == "off":
        gc.disable()
    return loop


def _worker(spec: ShardSpec, model: str, conn: Connection) -> None:
    loop = prepare_process(spec)
    conn.send("ready")
    start_at_ns = conn.recv()
    try:
        result = asyncio.run(play_shard(spec, start_at_ns, model))
        result.loop = loop
        conn.send(result)
    except BaseException as exc:  # the parent reports it; a worker never hangs it
        conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def run_shards(specs: list[ShardSpec], model: str, lead_s: float = 0.5,
               timeout_s: float = 900.0) -> list[ShardResult]:
    """Run every shard in its own process, all starting together; their results."""
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    with quiet_blas_threads():
        for spec in specs:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(spec, model, child), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            pipes.append(parent)
    try:
        for pipe in pipes:
            if not pipe.poll(120) or pipe.recv() != "ready":
                raise RuntimeError("a worker did not start")
        start_at = time.perf_counter_ns() + int(lead_s * 1e9)
        for pipe in pipes:
            pipe.send(start_at)
        results: list[ShardResult] = []
        for pipe in pipes:
            if not pipe.poll(timeout_s):
                raise RuntimeError("a worker did not finish in time")
            got = pipe.recv()
            if isinstance(got, str):
                raise RuntimeError(f"a worker failed: {got}")
            results.append(got)
        return results
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal whole shares (the first ones larger)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class _RayShard:
    """A shard on a Ray node (``run_shards_ray`` makes it an actor)."""

    def clock(self) -> int:
        return time.perf_counter_ns()

    def node(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]

    def play(self, spec: ShardSpec, start_at_ns: int, model: str) -> ShardResult:
        loop = prepare_process(spec)
        result = asyncio.run(play_shard(spec, start_at_ns, model))
        result.loop = loop
        return result


def run_shards_ray(specs: list[ShardSpec], model: str, address: str, lead_s: float = 1.0,
                   timeout_s: float = 900.0) -> list[ShardResult]:
    """Every shard as a Ray actor (``SPREAD`` over the cluster's nodes), all starting at one
    instant of this process's clock, translated into each node's by measured offsets.

    A shard on this host keeps its stamps (one clock: its stamp error against the
    emulator's emission stamps is exact); one on another host has its stamps moved onto
    this host's clock by its measured offset (within half a round trip), so the merged
    rate is right, and its stamp error against emission means little.
    """
    import dataclasses

    import ray

    from agentload.replay.errors import ReplayError
    from agentload.replay.fleet.ray import (
        CLOCK_PROBES,
        check_reachable,
        connect,
        disconnect,
        tightest_offset,
    )

    connect(address)
    try:
        check_reachable(specs[0].url)
    except ReplayError:
        disconnect()
        raise
    here = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    runner: Any = ray.remote(num_cpus=1, max_restarts=0)(_RayShard)
    actors: list[Any] = [runner.options(scheduling_strategy="SPREAD").remote() for _ in specs]
    try:
        offsets, nodes = [], []
        for actor in actors:
            nodes.append(ray.get(actor.node.remote(), timeout=120))
            trips = []
            for _ in range(CLOCK_PROBES):
                t1 = time.perf_counter_ns()
                theirs: int = ray.get(actor.clock.remote(), timeout=120)
                trips.append((t1, theirs, time.perf_counter_ns()))
            offsets.append(tightest_offset(trips)[0])
        start_at = time.perf_counter_ns() + int(lead_s * 1e9)
        # CPU numbers are this host's: a Ray node places its actor itself.
        refs = [actor.play.remote(dataclasses.replace(spec, cpu=None), start_at + offset,
                                  model)
                for actor, spec, offset in zip(actors, specs, offsets, strict=True)]
        results: list[ShardResult] = ray.get(refs, timeout=timeout_s)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
        text = str(exc).strip()
        raise ReplayError(f"a Ray shard failed: {text.splitlines()[0] if text else exc!r}"
                          ) from None
    finally:
        for actor in actors:
            ray.kill(actor)
        # Leave the cluster: a driver still joined when the cluster stops is ended by Ray.
        disconnect()
    for result, node, offset in zip(results, nodes, offsets, strict=True):
        if node != here:
            _shift(result, -offset)
    return results


def _shift(result: ShardResult, by_ns: int) -> None:
    """Move a shard's own stamps (not the emulator's) by ``by_ns``."""
    for name in ("event_ns", "user_ns"):
        values = getattr(result, name)
        setattr(result, name, array("q", (v + by_ns for v in values)))
    result.first_send_ns += by_ns
    result.last_event_ns += by_ns

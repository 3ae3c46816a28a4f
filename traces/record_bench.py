"""``agentload bench proxy``: what the recording proxy adds to each request's latency.

The same kind of streaming completion request goes straight to the upstream and through
an in-process ``RecordingProxy`` (recording to a temporary file), alternating A/B and
B/A so drift in the server hits both paths alike; one request is in flight at a time,
and the proxy's recording work is drained before the next request starts, so the two
paths never compete. Each request has its own random token-id prompt (no path gets
the other's prefix-cache hits) and ``ignore_eos`` output of ``--max-tokens``.

Reported: median and p90 TTFT and end-to-end latency per path and their difference
(proxied - direct), and the per-chunk delivery delay: for each byte range the agent
read, the time from the proxy's upstream read that carried it to the agent's read (one
clock, ``perf_counter_ns``, since both ends live in this process).
"""

from __future__ import annotations

import asyncio
import bisect
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import aiohttp
import orjson
import typer

from agentload.traces.errors import TraceError
from agentload.traces.record import check_upstream, say_stderr
from agentload.traces.record_proxy import RecordingProxy
from agentload.traces.record_trace import Recorder


@dataclass(slots=True)
class _Sample:
    ttft_ms: float
    e2e_ms: float
    chunk_delays_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ProxyBench:
    """Latencies in milliseconds, per path, in request order."""

    direct_ttft: list[float]
    direct_e2e: list[float]
    proxied_ttft: list[float]
    proxied_e2e: list[float]
    chunk_delays: list[float]
    recorded_requests: int


def percentile(values: list[float], q: float) -> float:
    """Linearly interpolated percentile ``q`` (0-100) of ``values``."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class _UpstreamReads:
    """The proxy's upstream reads of the current request: (stamp, cumulative bytes)."""

    def __init__(self) -> None:
        self.stamps: list[int] = []
        self.ends: list[int] = []

    def clear(self) -> None:
        self.stamps.clear()
        self.ends.clear()

    def __call__(self, stamp_ns: int, nbytes: int) -> None:
        self.stamps.append(stamp_ns)
        self.ends.append((self.ends[-1] if self.ends else 0) + nbytes)

    def read_at(self, offset: int) -> int | None:
        """When the proxy read the byte at ``offset`` from the upstream."""
        i = bisect.bisect_right(self.ends, offset)
        return self.stamps[i] if i < len(self.stamps) else None


def _has_token(event: bytes) -> bool:
    for line in event.split(b"\n"):
        if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
            try:
                obj = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            if any(c.get("text") for c in obj.get("choices") or () if isinstance(c, dict)):
                return True
    return False


async def _one(client: aiohttp.ClientSession, url: str, body: bytes,
               reads: _UpstreamReads | None) -> _Sample:
    stamps: list[int] = []
    chunks: list[bytes] = []
    sent = time.perf_counter_ns()
    async with client.post(url, data=body,
                           headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            text = (await resp.read()).decode(errors="replace")[:200]
            raise TraceError(f"{url} answered HTTP {resp.status}: {text}")
        async for chunk in resp.content.iter_any():
            stamps.append(time.perf_counter_ns())
            chunks.append(chunk)
    # Stamp first, parse after: find the reads that completed token events.
    first = last = None
    buffer = b""
    offset = 0
    delays: list[float] = []
    for chunk, stamp in zip(chunks, stamps, strict=True):
        offset += len(chunk)
        if reads is not None:
            upstream_at = reads.read_at(offset - 1)
            if upstream_at is not None:
                delays.append((stamp - upstream_at) / 1e6)
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")
        if any(_has_token(e) for e in events):
            first = stamp if first is None else first
            last = stamp
    if first is None or last is None:
        raise TraceError(f"{url} streamed no tokens")
    return _Sample((first - sent) / 1e6, (last - sent) / 1e6, delays)


async def _model(client: aiohttp.ClientSession, upstream: str) -> str:
    try:
        async with client.get(upstream + "/v1/models") as resp:
            obj = orjson.loads(await resp.read())
        return str(obj["data"][0]["id"])
    except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError, KeyError,
            IndexError, TypeError) as exc:
        raise TraceError(f"cannot ask {upstream} for its models: "
                         f"{str(exc) or type(exc).__name__}") from None


async def run_proxy_bench(upstream: str, requests: int = 20, max_tokens: int = 64,
                          prompt_tokens: int = 128, model: str | None = None,
                          seed: int = 0) -> ProxyBench:
    """Send ``requests`` requests each way (plus one warm-up each), interleaved."""
    rng = random.Random(seed)
    reads = _UpstreamReads()
    result: dict[str, list[float]] = {k: [] for k in ("dt", "de", "pt", "pe", "cd")}
    with tempfile.TemporaryDirectory(prefix="agentload-bench-proxy-") as tmp:
        recorder = Recorder(Path(tmp) / "bench.jsonl")
        proxy = RecordingProxy(upstream, recorder, chunk_observer=reads)
        await proxy.start("127.0.0.1", 0)
        connector = aiohttp.TCPConnector(limit=0)
        try:
            async with aiohttp.ClientSession(
                    connector=connector,
                    timeout=aiohttp.ClientTimeout(total=600.0, connect=10.0)) as client:
                model = model or await _model(client, upstream)

                def body() -> bytes:
                    # A fresh prompt per request: neither path sees the other's cache hits.
                    ids = [rng.randrange(16, 4000) for _ in range(prompt_tokens)]
                    return orjson.dumps({
                        "model": model, "prompt": ids, "max_tokens": max_tokens,
                        "ignore_eos": True, "temperature": 0.0, "stream": True,
                        "stream_options": {"include_usage": True}})

                direct_url = upstream + "/v1/completions"
                proxied_url = proxy.url + "/v1/completions"
                for i in range(requests + 1):  # round 0 warms both paths up
                    order = ("direct", "proxied") if i % 2 == 0 else ("proxied", "direct")
                    for path in order:
                        reads.clear()
                        if path == "direct":
                            s = await _one(client, direct_url, body(), None)
                        else:
                            s = await _one(client, proxied_url, body(), reads)
                            await proxy.drain()
                        if i == 0:
                            continue
                        key = "d" if path == "direct" else "p"
                        result[key + "t"].append(s.ttft_ms)
                        result[key + "e"].append(s.e2e_ms)
                        result["cd"].extend(s.chunk_delays_ms)
        finally:
            await proxy.close()
        recorded = recorder.num_requests
    return ProxyBench(result["dt"], result["de"], result["pt"], result["pe"], result["cd"],
                      recorded)


def report_lines(bench: ProxyBench) -> list[str]:
    def row(label: str, values: list[float]) -> str:
        return f"  {label:<16}{percentile(values, 50):>12.3f}{percentile(values, 90):>12.3f}"

    def added(label: str, proxied: list[float], direct: list[float]) -> str:
        med = percentile(proxied, 50) - percentile(direct, 50)
        p90 = percentile(proxied, 90) - percentile(direct, 90)
        return f"  {label:<16}{med:>+12.3f}{p90:>+12.3f}"

    lines = [f"  {'ms':<16}{'median':>12}{'p90':>12}",
             row("TTFT direct", bench.direct_ttft), row("TTFT proxied", bench.proxied_ttft),
             added("TTFT added", bench.proxied_ttft, bench.direct_ttft),
             row("E2E direct", bench.direct_e2e), row("E2E proxied", bench.proxied_e2e),
             added("E2E added", bench.proxied_e2e, bench.direct_e2e)]
    # Neighbouring requests (one round) see nearly the same server state, so their
    # difference cancels drift that the two medians above still carry.
    for label, proxied, direct in (("TTFT", bench.proxied_ttft, bench.direct_ttft),
                                   ("E2E", bench.proxied_e2e, bench.direct_e2e)):
        paired = [p - d for p, d in zip(proxied, direct, strict=True)]
        lines.append(f"  {label + ' paired':<16}{percentile(paired, 50):>+12.3f}"
                     f"{percentile(paired, 90):>+12.3f}   (proxied - direct, same round)")
    if bench.chunk_delays:
        cd = bench.chunk_delays
        lines.append(f"  per-chunk delivery delay (upstream read -> agent read, {len(cd)} "
                     f"reads): median {percentile(cd, 50):.3f} ms, p90 "
                     f"{percentile(cd, 90):.3f} ms, p99 {percentile(cd, 99):.3f} ms, "
                     f"max {max(cd):.3f} ms")
    lines.append(f"  the proxy recorded {bench.recorded_requests} requests meanwhile")
    return lines


def bench_proxy_command(
    upstream: Annotated[str, typer.Option(
        "--upstream", help="Base URL of a vLLM (OpenAI-compatible) server.",
        show_default=False)],
    requests: Annotated[int, typer.Option(
        "--requests", "-n", min=1, help="Requests per path (after one warm-up each).")] = 20,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", min=1, help="Output tokens per request (ignore_eos).")] = 64,
    prompt_tokens: Annotated[int, typer.Option(
        "--prompt-tokens", min=1, help="Prompt length in token ids.")] = 128,
    model: Annotated[str | None, typer.Option(
        "--model", help="Model to request (default: the upstream's first).")] = None,
) -> None:
    """Measure the latency the recording proxy adds: direct vs proxied, A/B.

    Sends streaming /v1/completions requests (random token-id prompts,
    ignore_eos) one at a time, alternating between the upstream and an
    in-process recording proxy in front of it, and prints median and p90 TTFT
    and end-to-end latency per path, their difference, and the per-chunk
    delivery delay through the proxy.

    Example: agentload bench proxy --upstream http://127.0.0.1:8000 -n 40
    """
    base = check_upstream(upstream)
    say_stderr(f"bench proxy: {requests} streaming requests per path against {base}, "
               f"interleaved, {prompt_tokens}-token prompts, max_tokens {max_tokens}")
    bench = asyncio.run(run_proxy_bench(base, requests, max_tokens, prompt_tokens, model))
    for line in report_lines(bench):
        typer.echo(line)


"""``agentload bench replay``: how faithfully a replay keeps the trace's schedule and cache.

It replays the real WEKA sessions (scaled to fit the target) at several user counts
against one server, side by side in one run, and prints for each: the pause error
(measured gap minus intended gap), the schedule lag, the share of requests with exact
OSL, and the server's prefix-cache hit rate next to the theoretical one. Rows with more
users than the trace has sessions recycle (``--recycle``). Without ``--target`` it
starts the tiny-model CPU server once for all rows.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from agentload.replay.engine.core import ReplayOptions
from agentload.replay.engine.fit import FitOptions
from agentload.replay.run import new_cache_salt, run_replay
from agentload.replay.serve.server import embedded_server_spec, serving
from agentload.traces.formats import load_any

DEFAULT_TRACE = Path("tests/data/weka")


def _row(users: int, s: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        v = s.get(key)
        return f"{v * 1e3:9.1f}" if v is not None else f"{'n/a':>9}"

    def pct(key: str) -> str:
        v = s.get(key)
        return f"{v:8.1%}" if v is not None else f"{'n/a':>8}"

    def diff(a: str, b: str) -> str:
        x, y = s.get(a), s.get(b)
        return f"{(x - y) * 100:+7.2f}" if x is not None and y is not None else f"{'n/a':>7}"

    gap = diff("server_prefix_cache_hit_rate", "theoretical_prefix_cache_hit_rate_all")
    per_request = diff("usage_cached_tokens_rate", "theoretical_prefix_cache_hit_rate")
    return (f"{users:>5}{s['requests_completed']:>6}{s['requests_failed']:>5}"
            f"{ms('pause_error_p50_s')}{ms('pause_error_p99_s')}{ms('schedule_lag_p99_s')}"
            f"{pct('osl_exact_fraction')}{pct('server_prefix_cache_hit_rate')}"
            f"{pct('theoretical_prefix_cache_hit_rate_all')}{gap}"
            f"{pct('usage_cached_tokens_rate')}{pct('theoretical_prefix_cache_hit_rate')}"
            f"{per_request}")


def replay_fidelity(
    trace: Annotated[Path, typer.Option("--trace", help="Trace to replay.")] = DEFAULT_TRACE,
    target: Annotated[str | None, typer.Option("--target", help="Server URL (default: start "
                                               "the embedded one).")] = None,
    users: Annotated[str, typer.Option("--users", help="User counts, comma-separated.")
                     ] = "4,16",
    scale_tokens: Annotated[float, typer.Option("--scale-tokens")] = 0.12,
    pause_cap: Annotated[float, typer.Option("--pause-cap", help="Seconds.")] = 2.0,
    time_scale: Annotated[float, typer.Option("--time-scale")] = 1.0,
    max_requests: Annotated[int, typer.Option(
        "--max-requests", help="Measured requests of a recycled row.")] = 64,
) -> None:
    """Pause error, schedule lag, exact OSL and server vs theoretical prefix hits, per user
    count, in one run against one server."""
    counts = [int(u) for u in users.split(",") if u.strip()]
    fit = FitOptions(scale_tokens=scale_tokens, pause_cap_s=pause_cap)
    header = (f"{'users':>5}{'done':>6}{'fail':>5}{'gap p50':>9}{'gap p99':>9}{'lag p99':>9}"
              f"{'OSL ok':>8}{'srv':>8}{'theo':>8}{'pt':>7}{'usage':>8}{'theo':>8}{'pt':>7}")
    with tempfile.TemporaryDirectory(prefix="agentload-bench-") as tmp:
        def run_all(url: str) -> None:
            typer.echo(f"{trace} scaled x{scale_tokens}, pauses capped at {pause_cap} s, "
                       f"time scale {time_scale}; gap = measured - intended pause (ms);\n"
                       "prefix hits: server counter vs theoretical over all requests "
                       "(warmup too), per-request usage vs theoretical over measured ones")
            typer.echo(header)
            sessions = len(load_any(trace).trace.sessions)
            for n in counts:
                # More users than sessions: recycle (mid-session starts, warmup, salts).
                recycle = n > sessions
                result = run_replay(
                    trace, Path(tmp) / f"u{n}", target_url=url,
                    options=ReplayOptions(users=n, time_scale=time_scale,
                                          cache_salt=new_cache_salt(), recycle=recycle,
                                          max_requests=max_requests if recycle else None),
                    fit=fit, progress="none", report=False, say=lambda _: None)
                typer.echo(_row(n, result.summary) + ("  (recycled)" if recycle else ""))

        if target is not None:
            run_all(target)
            return
        spec = embedded_server_spec()
        typer.echo("starting the embedded vLLM CPU server ...", err=True)
        with serving(spec, Path(tmp) / "server.log", progress=lambda _: None):
            run_all(spec.base_url)

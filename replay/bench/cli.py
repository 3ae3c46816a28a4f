"""``agentload bench emulator | client | agree | replay``: measurement truth, as commands.

Thin typer wrappers over ``emulator.main``, ``client_bench.client_benchmark``,
``agree.agreement`` and (``agree --peer aiperf``) ``agree_aiperf.agreement_aiperf``; each
is usable from Python the same way. ``bench replay`` (``replay_fidelity``) replays the
real WEKA sessions at several user counts against one server and prints, per count, the
pause error, the schedule lag, exact OSL and the server's prefix hits beside the
theoretical ones.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from agentload.replay.engine.core import ReplayOptions
from agentload.replay.engine.fit import FitOptions
from agentload.replay.errors import ReplayError
from agentload.replay.run import new_cache_salt, run_replay
from agentload.replay.serve.server import embedded_server_spec, serving
from agentload.traces.formats import load_any

EMULATOR_HELP = ("Run the loopback SSE emulator (test equipment for measuring clients, not "
                 "a server to benchmark) until Ctrl-C.")


def emulator_command(
    port: Annotated[int, typer.Option("--port")] = 8100,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    ttft_ms: Annotated[float, typer.Option("--ttft-ms", help="Time to first token.")] = 50.0,
    itl_ms: Annotated[float, typer.Option("--itl-ms", help="Engine step (ms).")] = 20.0,
    jitter_ms: Annotated[float, typer.Option("--jitter-ms", help="Step jitter SD.")] = 0.0,
    tokens_per_event: Annotated[int, typer.Option("--tokens-per-event")] = 1,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    stats: Annotated[str | None, typer.Option("--stats", help="Write final stats JSON.")
                     ] = None,
) -> None:
    """Run the loopback SSE emulator (test equipment) until Ctrl-C.

    One event per stream per engine step, an emission stamp in every event.
    """
    from agentload.replay.bench.emulator import main

    argv = ["--host", host, "--port", str(port), "--ttft-ms", str(ttft_ms), "--itl-ms",
            str(itl_ms), "--jitter-ms", str(jitter_ms), "--tokens-per-event",
            str(tokens_per_event), "--seed", str(seed)]
    main(argv + (["--stats", stats] if stats else []))


def client_command(
    streams: Annotated[int, typer.Option("--streams", help="Concurrent streams.")] = 1000,
    requests: Annotated[int | None, typer.Option(
        "--requests", help="Requests in all (default 4 per stream).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 200,
    workers: Annotated[str, typer.Option(
        "--workers", help="agentload worker processes; a list (1,2,4,8) measures the "
        "scaling: each count in turn against one emulator, delivered events/s against N x "
        "the first count's per worker.")] = "2",
    ttft_ms: Annotated[float, typer.Option("--ttft-ms")] = 50.0,
    itl_ms: Annotated[float, typer.Option("--itl-ms")] = 20.0,
    tokens_per_event: Annotated[int, typer.Option("--tokens-per-event")] = 1,
    vllm_bench: Annotated[bool, typer.Option("--vllm-bench/--no-vllm-bench",
                                             help="Also run vllm bench serve.")] = True,
    emulator_procs: Annotated[int, typer.Option(
        "--emulator-procs", min=1, help="Emulator processes sharing its port (its ceiling "
        "is about one core's worth of events per process).")] = 1,
    emulator_cpus: Annotated[str | None, typer.Option(
        "--emulator-cpus", help="Pin the emulator's processes to these CPUs (e.g. 0-3).")
    ] = None,
    cpus: Annotated[str | None, typer.Option(
        "--cpus", help="Pin agentload's workers (and vllm bench serve) to these CPUs, apart "
        "from the emulator's (e.g. 4-15).")] = None,
    ray_address: Annotated[str | None, typer.Option(
        "--ray", help="Run the workers as Ray actors over this cluster's nodes (auto or "
        "HOST:PORT); with a list of --workers, each count runs locally and then on Ray, "
        "side by side.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON only.")] = False,
) -> None:
    """Is the client the bottleneck? agentload vs vllm bench serve on the emulator.

    Delivered vs offered token events/s, CPU per event, stamp error vs emission, events
    per read, loop lag, GC, and ratios (AIPerf too where it is installed). With a list of
    worker counts: how delivered events/s scales with agentload's worker processes.

    Example (16 cores: the emulator on 0-3, the clients on 4-15):

      agentload bench client --streams 2000 --workers 1,2,4,8 --emulator-procs 4 \\
          --emulator-cpus 0-3 --cpus 4-15
    """
    from agentload.replay.bench.client_bench import (
        ClientBenchConfig,
        client_benchmark,
        report_lines,
        scaling_benchmark,
        scaling_lines,
    )
    from agentload.replay.fleet.local import parse_cpus

    try:
        counts = [int(w) for w in workers.split(",") if w.strip()]
    except ValueError:
        raise ReplayError(f"--workers must be a count or a list like 1,2,4; got {workers!r}"
                          ) from None
    if not counts or min(counts) < 1:
        raise ReplayError(f"--workers must be at least 1, got {workers!r}")
    cfg = ClientBenchConfig(
        streams=streams, requests=requests, max_tokens=max_tokens, workers=counts[-1],
        ttft_ms=ttft_ms, itl_ms=itl_ms, tokens_per_event=tokens_per_event,
        vllm_bench=vllm_bench, emulator_procs=emulator_procs,
        emulator_cpus=tuple(parse_cpus(emulator_cpus)) if emulator_cpus else (),
        worker_cpus=tuple(parse_cpus(cpus)) if cpus else (), ray_address=ray_address)
    say = None if as_json else (lambda line: typer.echo(line, err=True))
    if len(counts) > 1:
        result = scaling_benchmark(cfg, counts, say=say)
        lines = scaling_lines(result)
    else:
        result = client_benchmark(cfg, say=say)
        lines = report_lines(result)
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
    else:
        typer.echo("\n".join(lines))


def agree_command(
    target: Annotated[str | None, typer.Option(
        "--target", help="vLLM server URL (default: start the embedded one).")] = None,
    requests: Annotated[int, typer.Option(
        "--requests", help="Requests per run and tool (128: ~25 s runs on the embedded CPU "
        "server; 32-request runs are short enough for the server's own drift to move "
        "TTFT by 10 %).")] = 128,
    concurrency: Annotated[int, typer.Option("--concurrency")] = 4,
    input_len: Annotated[int, typer.Option("--input-len")] = 128,
    output_len: Annotated[int, typer.Option("--output-len")] = 64,
    runs: Annotated[int, typer.Option("--runs", help="Runs per tool (medians).")] = 3,
    retries: Annotated[int, typer.Option(
        "--retries", help="Pairs run again, in all, when a tool read over 10 % of its token "
        "events together (its client was held back, not the server).")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON only.")] = False,
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="Tokenizer folder of the server's model, for vllm bench serve "
        "and AIPerf (default: the embedded tiny model's, or the dummy preset's the server "
        "names).")
    ] = None,
    peer: Annotated[str, typer.Option(
        "--peer", help="vllm: vllm bench serve on synthetic prompts. aiperf: AIPerf's "
        "AgentX scenario (inferencex-agentx-mvp) and agentload replay on --trace, from "
        "AIPerf's own virtualenv (`make peers`).")] = "vllm",
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="With --peer aiperf: a folder of WEKA session files.")] = None,
    duration: Annotated[float, typer.Option(
        "--duration", help="With --peer aiperf: seconds per run and tool (AIPerf adds a "
        "10 s grace period and its own warm-up).")] = 60.0,
    seed: Annotated[int, typer.Option("--seed", help="With --peer aiperf: both tools' "
                                      "seed.")] = 0,
    warmup: Annotated[float, typer.Option(
        "--warmup", help="With --peer aiperf: seconds of the unmeasured agentload warm-up "
        "run before the first measured run (0: none).")] = 20.0,
    keep: Annotated[Path | None, typer.Option(
        "--keep", help="With --peer aiperf: keep every run's folder here.")] = None,
    same_prompts: Annotated[bool, typer.Option(
        "--same-prompts", help="Both tools send the very same prompts in each pair, so the "
        "server does the same work for both (needs a server without prefix caching; "
        "otherwise each tool gets prompts of its own).")] = False,
    transport: Annotated[str, typer.Option(
        "--transport", help="agentload's client against vllm bench serve: stamped (kernel "
        "receive stamps, replay's default) or aiohttp (stamped in Python after parsing, "
        "where vllm bench serve stamps).")] = "stamped",
    warmup_requests: Annotated[int | None, typer.Option(
        "--warmup-requests", help="Unmeasured requests sent first at the full concurrency "
        "(default: as many as one run; 0: none).")] = None,
    together: Annotated[bool, typer.Option(
        "--together", help="Run both tools of each pair at the same time, half the "
        "concurrency each and prompts of their own, so the server's drift between runs "
        "hits both alike. Needs cores for both clients: on 2 cores they hold each other "
        "back (the pair is set aside as spoiled).")] = False,
) -> None:
    """TTFT and ITL P50/P90 of agentload vs vllm bench serve (or AIPerf) on one server.

    The same requests, alternating, median of --runs runs each, with ratios. With
    --peer aiperf: AIPerf's AgentX scenario and agentload replay on the same --trace
    folder, users (--concurrency), duration and seed; AIPerf marks such runs
    submission_valid=false (unsafe_override).
    """
    if peer == "aiperf":
        _agree_aiperf(target, trace, concurrency, duration, runs, seed, warmup, tokenizer,
                      keep, as_json)
        return
    if peer != "vllm":
        raise typer.BadParameter(f"{peer!r}: expected vllm or aiperf", param_hint="--peer")
    if transport not in ("stamped", "aiohttp"):
        raise typer.BadParameter(f"{transport!r}: expected stamped or aiohttp",
                                 param_hint="--transport")
    from agentload.replay.bench.agree import agree_lines, agreement

    result = agreement(target, requests=requests, concurrency=concurrency,
                       input_len=input_len, output_len=output_len, runs=runs,
                       retries=retries, tokenizer=tokenizer, same_prompts=same_prompts,
                       transport=transport,  # type: ignore[arg-type]  # checked above
                       together=together, warmup_requests=warmup_requests,
                       say=lambda line: typer.echo(line, err=True))
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
    else:
        typer.echo("\n".join(agree_lines(result)))


def _agree_aiperf(target: str | None, trace: Path | None, users: int, duration: float,
                  runs: int, seed: int, warmup: float, tokenizer: Path | None,
                  keep: Path | None, as_json: bool) -> None:
    from agentload.replay.bench.agree_aiperf import (
        PeerRunError,
        agree_aiperf_lines,
        agreement_aiperf,
    )

    if trace is None:
        raise typer.BadParameter("--peer aiperf needs --trace DIR (WEKA session files)",
                                 param_hint="--trace")
    try:
        result = agreement_aiperf(trace, target, users=users, duration_s=duration, runs=runs,
                                  seed=seed, warmup_s=warmup, tokenizer=tokenizer,
                                  workdir=keep, say=lambda line: typer.echo(line, err=True))
    except PeerRunError as exc:
        typer.echo(exc.log_tail, err=True)
        typer.echo(f"error: {exc}; its folder is kept: {exc.kept}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
    else:
        typer.echo("\n".join(agree_aiperf_lines(result)))


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

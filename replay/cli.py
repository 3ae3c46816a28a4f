"""The replay room's commands: ``agentload serve``, ``agentload replay``, ``agentload demo``.

Thin wrappers over ``agentload.replay.run_replay`` and ``agentload.replay.server``; each
option maps to a field of ``ReplayOptions`` or an argument of ``run_replay``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from agentload.replay.engine import ReplayOptions
from agentload.replay.errors import ReplayError
from agentload.replay.fit import FitOptions
from agentload.replay.run import (
    ProgressMode,
    RunResult,
    default_demo_dir,
    new_cache_salt,
    run_replay,
    say_stderr,
    summary_lines,
    write_results,
)
from agentload.replay.server import ManagedServer, embedded_server_spec
from agentload.replay.tiny_model import ensure_tiny_model
from agentload.traces import demo_trace_path

app = typer.Typer(no_args_is_help=True)

Users = Annotated[int, typer.Option("--users", "-u", min=1,
                                    help="Number of user lanes (closed loop).")]
Duration = Annotated[float | None, typer.Option(
    "--duration", min=0.0, help="Stop sending new requests after this many seconds.")]
Headless = Annotated[bool | None, typer.Option(
    "--headless/--no-headless",
    help="Plain progress lines every 5 s instead of a live status line (the default when "
    "stdout is not a TTY).")]


def _options(users: int, duration: float | None, max_requests: int | None, time_scale: float,
             cache_salt: int | None, request_timeout: float, open_loop: bool = False,
             stall_timeout: float = 120.0,
             recycle: bool = False, seed: int = 0, start_range: str = "0.25:0.75",
             warmup_turns: int = 1, api: str = "completions",
             outputs: str = "canned") -> ReplayOptions:
    if outputs not in ("canned", "actual"):
        raise ReplayError(f"--outputs must be canned or actual, got {outputs!r}")
    if api not in ("completions", "chat"):
        raise ReplayError(f"--api must be completions or chat, got {api!r}")
    if recycle and open_loop:
        raise ReplayError("--recycle and --open-loop do not mix (open loop plays every "
                          "session once, at its arrival)")
    if recycle and duration is None and max_requests is None:
        raise ReplayError("--recycle plays sessions for ever; bound the run with --duration "
                          "or --max-requests")
    return ReplayOptions(
        users=users, duration_s=duration, max_requests=max_requests, time_scale=time_scale,
        cache_salt=cache_salt if cache_salt is not None else new_cache_salt(),
        request_timeout_s=request_timeout, stall_timeout_s=stall_timeout,
        open_loop=open_loop, recycle=recycle, seed=seed,
        start_range=_start_range(start_range), warmup_turns=warmup_turns,
        api="chat" if api == "chat" else "completions",
        output_mode="actual" if outputs == "actual" else "canned",
    )


def _start_range(text: str) -> tuple[float, float]:
    try:
        lo, _, hi = text.partition(":")
        low, high = float(lo), float(hi or lo)
    except ValueError:
        raise ReplayError(f"--start-range must be LOW:HIGH fractions, got {text!r}") from None
    if not 0.0 <= low <= high <= 1.0:
        raise ReplayError(f"--start-range needs 0 <= LOW <= HIGH <= 1, got {text!r}")
    return low, high


def _progress_mode(headless: bool | None) -> ProgressMode:
    if headless is None:
        headless = not sys.stdout.isatty()
    return "headless" if headless else "live"


def _print_result(result: RunResult) -> None:
    """Print where the run went and its headline numbers; exit 130 if it was interrupted."""
    head = "interrupted run" if result.interrupted else "run"
    typer.echo(f"{head} written to {result.run_dir}")
    for line in summary_lines(result.summary):
        typer.echo(line)
    if result.report_html is not None:
        typer.echo(f"report: {result.report_html}")
        typer.echo(f"        {result.report_md}")
    if result.interrupted:
        raise typer.Exit(130)


@app.command()
def replay(
    trace: Annotated[Path, typer.Argument(
        help="Trace: native .jsonl / .parquet, or a foreign file or directory (see --format).")],
    trace_format: Annotated[str, typer.Option(
        "--format", "-f", help="Trace format: auto (native, or recognised from the first "
        "record), native, weka, mooncake, dynamo, openai-messages.")] = "auto",
    target: Annotated[str | None, typer.Option(
        "--target", "-t", help="Base URL of an OpenAI-compatible server, e.g. "
        "http://127.0.0.1:8000.")] = None,
    embedded: Annotated[bool, typer.Option(
        "--embedded", help="Start the embedded vLLM CPU server for this run.")] = False,
    output: Annotated[Path, typer.Option("--output", "-o", help="Run directory.")] = Path(
        "runs/replay"),
    users: Users = 4,
    duration: Duration = None,
    max_requests: Annotated[int | None, typer.Option(
        "--max-requests", min=1, help="Send at most this many requests.")] = None,
    time_scale: Annotated[float, typer.Option(
        "--time-scale", min=0.0, help="Multiply every pause by this (0 = no pauses).")] = 1.0,
    model: Annotated[str | None, typer.Option(
        "--model", help="Model name to request (default: the server's first model).")] = None,
    gpus: Annotated[int | None, typer.Option(
        "--gpus", min=1, help="GPUs behind the target, for throughput per GPU (default 1).")
    ] = None,
    cache_salt: Annotated[int | None, typer.Option(
        "--cache-salt", help="Seed of the prompt token ids (default: fresh per run, so no "
        "cache hits carry over from earlier runs).")] = None,
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", min=1.0, help="Seconds a request may take end to end.")] = 600.0,
    api_key_env: Annotated[str, typer.Option(
        "--api-key-env", help="Environment variable holding the API key, if any.")
    ] = "OPENAI_API_KEY",
    no_report: Annotated[bool, typer.Option("--no-report", help="Skip report.md/html.")] = False,
    headless: Headless = None,
    scale_tokens: Annotated[float, typer.Option(
        "--scale-tokens", min=0.0, help="Multiply every prompt block and output length by "
        "this (reuse is kept exactly), so long traces fit a small model.")] = 1.0,
    max_context: Annotated[int | None, typer.Option(
        "--max-context", min=2, help="After scaling, cut prompts so ISL + OSL fit this many "
        "tokens (leading blocks are kept).")] = None,
    pause_cap: Annotated[float | None, typer.Option(
        "--pause-cap", min=0.0, help="Cap every pause at this many seconds (before "
        "--time-scale); recorded traces hold pauses of many minutes.")] = None,
    open_loop: Annotated[bool, typer.Option(
        "--open-loop", help="Start every session at its recorded arrival time (Mooncake-"
        "style traces), however many are in flight; --users is then ignored.")] = False,
    recycle: Annotated[bool, typer.Option(
        "--recycle", help="Steady state: each lane plays sessions one after another until "
        "--duration / --max-requests; its first play starts part-way in (--start-range) "
        "after a warmup, and every play gets its own cache salt.")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the start points.")] = 0,
    start_range: Annotated[str, typer.Option(
        "--start-range", help="With --recycle: where initial plays start, as fractions of "
        "the session's main turns (0:0 = from the beginning).")] = "0.25:0.75",
    api: Annotated[str, typer.Option(
        "--api", help="completions: token-id prompts, exact lengths (vLLM). chat: "
        "/v1/chat/completions with deterministic text per block, for endpoints that take "
        "only messages; ISL is then what the server counts.")] = "completions",
    outputs: Annotated[str, typer.Option(
        "--outputs", help="canned: later prompts carry the trace's answer blocks. actual: "
        "the model's own output token ids (return_token_ids) replace them, so the server "
        "can reuse the KV it generated, as with a real agent.")] = "canned",
    stall_timeout: Annotated[float, typer.Option(
        "--stall-timeout", min=0.1, help="Seconds a stream may go without a byte before the "
        "request counts as stalled.")] = 120.0,
    warmup_turns: Annotated[int, typer.Option(
        "--warmup-turns", min=0, help="With --recycle: main turns replayed as warmup "
        "before a mid-session start (after one max_tokens=1 priming request).")] = 1,
) -> None:
    """Replay TRACE against a server and write the run to --output.

    Every prompt is sent as token ids to /v1/completions with exact lengths and exact
    reuse of earlier blocks, max_tokens = the trace's output length and ignore_eos.

    Examples:

      agentload replay trace.jsonl --target http://127.0.0.1:8000 --users 8 -o runs/a

      agentload replay trace.jsonl --embedded --duration 60 -o runs/cpu

      agentload replay ../cc-traces/ --format weka --target http://gpu-node:8000 -o runs/weka

      agentload replay tests/data/weka --embedded --scale-tokens 0.12 --pause-cap 10 -o runs/w

      agentload replay mooncake.jsonl --target http://gpu-node:8000 --open-loop -o runs/mc
    """
    result = run_replay(
        trace, output, target_url=target, embedded=embedded,
        options=_options(users, duration, max_requests, time_scale, cache_salt,
                         request_timeout, open_loop, stall_timeout, recycle, seed, start_range,
                         warmup_turns, api, outputs),
        model=model, gpus=gpus, api_key=os.environ.get(api_key_env) or None,
        report=not no_report, progress=_progress_mode(headless), trace_format=trace_format,
        fit=FitOptions(scale_tokens=scale_tokens, max_context=max_context,
                       pause_cap_s=pause_cap),
    )
    _print_result(result)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (with journal.jsonl).")],
) -> None:
    """Rebuild requests.parquet, summary.json and the reports of a run from its journal.

    Use it on a run that was killed before it could write them (kill -9, power loss):
    every request that had finished is in the journal.
    """
    result = write_results(run_dir)
    typer.echo(f"rebuilt {result.run_dir}")
    for line in summary_lines(result.summary):
        typer.echo(line)
    typer.echo(f"report: {result.report_html}")


@app.command()
def demo(
    duration: Duration = None,
    users: Users = 4,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Run directory (default runs/<timestamp>).")] = None,
    target: Annotated[str | None, typer.Option(
        "--target", "-t", help="Use this running server instead of starting the embedded one.")
    ] = None,
    headless: Headless = None,
) -> None:
    """Start the embedded vLLM CPU server, replay the bundled agent trace, write a report.

    Takes about two minutes on 2 cores (most of it vLLM starting up); --duration bounds
    the replay itself. The report lands in runs/<timestamp>/ unless -o says otherwise.
    """
    result = run_replay(
        demo_trace_path(), output or default_demo_dir(), embedded=target is None,
        target_url=target,
        options=_options(users, duration, None, 1.0, None, 600.0),
        progress=_progress_mode(headless),
    )
    _print_result(result)


@app.command()
def serve(
    embedded: Annotated[bool, typer.Option(
        "--embedded", help="Serve the embedded tiny Llama on vLLM's CPU build.")] = False,
    port: Annotated[int | None, typer.Option(
        "--port", min=1, max=65535, help="Port (default: a free one).")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    log: Annotated[Path, typer.Option("--log", help="Where the server log goes.")] = Path(
        "runs/server.log"),
    build_only: Annotated[bool, typer.Option(
        "--build-only", help="Only build the tiny model (into the cache) and print its path.")
    ] = False,
) -> None:
    """Start a server and keep it running until Ctrl-C.

    Example: agentload serve --embedded --port 8000
    """
    if not embedded:
        raise ReplayError("serve needs --embedded (arm files for real vLLM deployments are "
                          "not supported yet)")
    if build_only:
        typer.echo(ensure_tiny_model())
        return
    spec = embedded_server_spec(port=port, host=host)
    with ManagedServer(spec, log, progress=say_stderr) as server:
        typer.echo(f"serving {spec.served_model} at {spec.base_url} (pid {server.pid}, "
                   f"log {log}); Ctrl-C stops it")
        sys.stdout.flush()
        try:
            while server.running():
                time.sleep(1.0)
        except KeyboardInterrupt:
            typer.echo("stopping")
            return
    raise ReplayError(f"the server exited on its own; see {log}")

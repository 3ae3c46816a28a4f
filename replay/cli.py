"""The replay room's commands: ``agentload serve``, ``agentload replay``, ``agentload demo``.

Thin wrappers over ``agentload.replay.run_replay`` and ``agentload.replay.serve.server``; each
option maps to a field of ``ReplayOptions`` or an argument of ``run_replay``.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from agentload.replay.engine.core import ReplayOptions
from agentload.replay.engine.fit import PAUSE_RULES, FitOptions
from agentload.replay.engine.presets import headline_line, preset
from agentload.replay.errors import ReplayError
from agentload.replay.fleet.local import parse_cpus, parse_workers
from agentload.replay.fleet.recount import merge_and_recount
from agentload.replay.live import dashboard_factory
from agentload.replay.results.compare import compare_arms, dry_run_lines, select_arms
from agentload.replay.results.compare_report import write_comparison
from agentload.replay.results.finalize import RunResult, summary_lines, write_results
from agentload.replay.results.slo import parse_slo
from agentload.replay.run import (
    ProgressMode,
    default_demo_dir,
    new_cache_salt,
    run_replay,
    say_stderr,
)
from agentload.replay.serve.arms import arm_server_spec, check_gpu_count, load_arm, serve_argv
from agentload.replay.serve.profile_window import parse_window
from agentload.replay.serve.server import (
    ManagedServer,
    effective_config,
    embedded_server_spec,
    nsys_wrap,
)
from agentload.replay.serve.tiny_model import ensure_tiny_model
from agentload.traces import demo_trace_path

app = typer.Typer(no_args_is_help=True)

Users = Annotated[int, typer.Option("--users", "-u", min=1,
                                    help="Number of user lanes (closed loop).")]
Duration = Annotated[float | None, typer.Option(
    "--duration", min=0.0, help="Stop sending new requests after this many seconds.")]
Headless = Annotated[bool | None, typer.Option(
    "--headless/--no-headless",
    help="Plain progress lines every 5 s (requests done/total, users active, P90 "
    "interactivity, errors, ETA) instead of the dashboard; the default when stdout is not "
    "a terminal.")]


def _options(users: int, duration: float | None, max_requests: int | None, time_scale: float,
             cache_salt: int | None, request_timeout: float, open_loop: bool = False,
             stall_timeout: float = 120.0,
             recycle: bool = False, seed: int = 0, start_range: str = "0.25:0.75",
             warmup_turns: int = 1, api: str = "completions",
             outputs: str = "canned", session_order: str = "pinned",
             preset_name: str | None = None, idle_cap: float | None = None,
             cache_bust: str = "head", grace: float | None = None,
             aiperf_compatible: bool = False) -> ReplayOptions:
    if outputs not in ("canned", "actual"):
        raise ReplayError(f"--outputs must be canned or actual, got {outputs!r}")
    if api not in ("completions", "chat"):
        raise ReplayError(f"--api must be completions or chat, got {api!r}")
    if session_order not in ("pinned", "pool", "sequential"):
        raise ReplayError("--session-order must be pinned, pool or sequential, got "
                          f"{session_order!r}")
    if cache_bust not in ("head", "after-shared-prefix"):
        raise ReplayError(f"--cache-bust must be head or after-shared-prefix, got {cache_bust!r}")
    if grace is not None and duration is None:
        raise ReplayError("--grace is the time allowed after --duration; give --duration too")
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
        # AIPerf's AgentX scenario draws start points over the whole session (0-1).
        start_range=_start_range("0:1" if aiperf_compatible and start_range == "0.25:0.75"
                                 else start_range), warmup_turns=warmup_turns,
        api="chat" if api == "chat" else "completions",
        output_mode="actual" if outputs == "actual" else "canned",
        session_order=("pool" if session_order == "pool" else "sequential"
                       if session_order == "sequential" else "pinned"),
        # AIPerf draws each lane's start as an instant of the recorded session
        # (trajectory_source.py); ``plan.aiperf_start_s`` draws the same one.
        start_at="time" if aiperf_compatible else "turn",
        preset=preset_name, idle_cap_s=idle_cap,
        cache_bust="after-shared-prefix" if cache_bust == "after-shared-prefix" else "head",
        grace_s=grace, aiperf_compatible=aiperf_compatible,
    )


@dataclass(frozen=True, slots=True)
class Traffic:
    """The traffic-shaping switches ``--aiperf-compatible`` fills in."""

    pauses: str
    idle_cap: float | None
    cache_bust: str
    api: str
    session_order: str
    pause_cap: float | None


# NVIDIA AIPerf (AgentX scenario): end-to-start gaps from the recording, a 10 s idle cap
# that applies only while nothing is in flight, the sessions in trace order from one
# shared sampler (its SequentialSampler for WEKA traces), the cache-bust
# marker after the shared system/tool prefix, no per-pause cap, streaming chat requests.
AIPERF = Traffic(pauses="end-to-start", idle_cap=10.0, cache_bust="after-shared-prefix",
                 api="chat", session_order="sequential", pause_cap=None)


def with_aiperf(enabled: bool, pauses: str | None, idle_cap: float | None,
                cache_bust: str | None, api: str | None, session_order: str,
                pause_cap: float | None) -> Traffic:
    """AIPerf's traffic rules where the user left the default (explicit flags win); the
    applied settings are said on stderr. Without ``enabled``, the defaults."""
    if pauses is not None and pauses not in PAUSE_RULES:
        raise ReplayError(f"--pauses must be one of {', '.join(PAUSE_RULES)}, got {pauses!r}")
    if not enabled:
        return Traffic(pauses or "trace", idle_cap, cache_bust or "head",
                       api or "completions", session_order, pause_cap)
    chosen = Traffic(
        pauses=pauses or AIPERF.pauses,
        idle_cap=idle_cap if idle_cap is not None else AIPERF.idle_cap,
        cache_bust=cache_bust or AIPERF.cache_bust, api=api or AIPERF.api,
        session_order=AIPERF.session_order if session_order == "pinned" else session_order,
        pause_cap=pause_cap)
    cap = "no --pause-cap" if chosen.pause_cap is None else f"--pause-cap {chosen.pause_cap:g}"
    api_text = ("--api chat (streaming, max_completion_tokens, ignore_eos, no temperature)"
                if chosen.api == "chat" else f"--api {chosen.api}")
    idle = "no --idle-cap" if chosen.idle_cap is None else f"--idle-cap {chosen.idle_cap:g}"
    say_stderr(f"aiperf-compatible: --pauses {chosen.pauses}, {idle}, --session-order "
               f"{chosen.session_order}, --cache-bust {chosen.cache_bust}, {cap}, {api_text}")
    return chosen


def with_preset(name: str | None, recycle: bool, duration: float | None,
                 pause_cap: float | None, session_order: str, *, keep_pause_cap: bool = False
                 ) -> tuple[bool, float | None, float | None, str]:
    """A preset's settings where the user left the default (explicit flags win);
    ``keep_pause_cap`` (``--aiperf-compatible``: no pause cap) keeps ``pause_cap``."""
    if not name:
        return recycle, duration, pause_cap, session_order
    chosen = preset(name)
    say_stderr(f"preset {chosen.name}: {chosen.source}")
    return (chosen.recycle or recycle,
            duration if duration is not None else chosen.duration_s,
            pause_cap if pause_cap is not None or keep_pause_cap else chosen.pause_cap_s,
            chosen.session_order if session_order == "pinned" else session_order)


def _fleet(workers: str, cpus: str | None, on_loss: str,
           ray_address: str | None = None) -> dict[str, Any]:
    """``run_replay``'s worker arguments from --workers, --cpus, --on-worker-loss, --ray."""
    if on_loss not in ("continue", "stop"):
        raise ReplayError(f"--on-worker-loss must be continue or stop, got {on_loss!r}")
    if ray_address is not None and cpus is not None:
        raise ReplayError("--cpus pins local workers; with --ray, Ray places them")
    return {"workers": parse_workers(workers),
            "cpus": parse_cpus(cpus) if cpus is not None else None,
            "on_worker_loss": on_loss, "ray_address": ray_address}


def _start_range(text: str) -> tuple[float, float]:
    try:
        lo, _, hi = text.partition(":")
        low, high = float(lo), float(hi or lo)
    except ValueError:
        raise ReplayError(f"--start-range must be LOW:HIGH fractions, got {text!r}") from None
    if not 0.0 <= low <= high <= 1.0:
        raise ReplayError(f"--start-range needs 0 <= LOW <= HIGH <= 1, got {text!r}")
    return low, high


def _progress_mode(headless: bool | None, dashboard: bool = True) -> ProgressMode:
    """Progress lines when headless; on a terminal the dashboard (when agentload.tui is
    installed and registered) or else a one-line live status."""
    if headless is None:
        headless = not sys.stdout.isatty()
    if headless:
        return "headless"
    if dashboard and sys.stdout.isatty() and sys.stdin.isatty() and (
            dashboard_factory() is not None):
        return "dashboard"
    return "live"


def _print_result(result: RunResult, preset_name: str | None = None) -> None:
    """Print where the run went and its headline numbers; exit 130 if it was interrupted."""
    head = "interrupted run" if result.interrupted else "run"
    typer.echo(f"{head} written to {result.run_dir}")
    if preset_name:
        typer.echo(headline_line(result.summary, preset(preset_name)))
    for line in summary_lines(result.summary):
        typer.echo(line)
    if result.report_html is not None:
        typer.echo(f"report: {result.report_html}")
        typer.echo(f"        {result.report_md}")
    if result.interrupted:
        raise typer.Exit(130)


TraceFormat = Annotated[str, typer.Option(
    "--format", "-f", help="Trace format: auto (native, or recognised from the first "
    "record), native, weka, mooncake, dynamo, openai-messages.")]
MaxRequests = Annotated[int | None, typer.Option(
    "--max-requests", min=1, help="Send at most this many requests.")]
TimeScale = Annotated[float, typer.Option(
    "--time-scale", min=0.0, help="Multiply every pause by this (0 = no pauses).")]
CacheSalt = Annotated[int | None, typer.Option(
    "--cache-salt", help="Seed of the prompt token ids (default: fresh per run, so no "
    "cache hits carry over from earlier runs).")]
RequestTimeout = Annotated[float, typer.Option(
    "--request-timeout", min=1.0, help="Seconds a request may take end to end.")]
NoReport = Annotated[bool, typer.Option("--no-report", help="Skip report.md/html.")]
ScaleTokens = Annotated[float, typer.Option(
    "--scale-tokens", min=0.0, help="Multiply every prompt block and output length by "
    "this (reuse is kept exactly), so long traces fit a small model.")]
MaxContext = Annotated[int | None, typer.Option(
    "--max-context", min=2, help="After scaling, cut prompts so ISL + OSL fit this many "
    "tokens (leading blocks are kept).")]
PauseCap = Annotated[float | None, typer.Option(
    "--pause-cap", min=0.0, help="Cap every pause at this many seconds (before "
    "--time-scale); recorded traces hold pauses of many minutes.")]
OpenLoop = Annotated[bool, typer.Option(
    "--open-loop", help="Start every session at its recorded arrival time (Mooncake-"
    "style traces), however many are in flight; --users is then ignored.")]
Recycle = Annotated[bool, typer.Option(
    "--recycle", help="Steady state: each lane plays sessions one after another until "
    "--duration / --max-requests; its first play starts part-way in (--start-range) "
    "after a warmup, and every play gets its own cache salt.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the start points.")]
StartRange = Annotated[str, typer.Option(
    "--start-range", help="With --recycle: where initial plays start, as fractions of "
    "the session's main turns (0:0 = from the beginning).")]
Api = Annotated[str | None, typer.Option(
    "--api", help="completions (default): token-id prompts, exact lengths (vLLM). chat: "
    "/v1/chat/completions with deterministic text per block, for endpoints that take "
    "only messages; ISL is then what the server counts.")]
Pauses = Annotated[str | None, typer.Option(
    "--pauses", help="trace (default): each request waits the pause its trace gives (WEKA: "
    "the recorded think_time, else the recorded gap) after the requests it depends on end. "
    "end-to-start: AIPerf's rule, every pause recomputed from the recording as max(0, "
    "t_k - t_prev - api_time_prev), waited after the previous request ends.")]
IdleCapOpt = Annotated[float | None, typer.Option(
    "--idle-cap", min=0.0, help="AIPerf's system idle cap (s): only while no request is "
    "in flight on any lane and no lane sends within this long, every pending send is "
    "pulled forward by the same amount (the earliest goes this long after the last "
    "request ended). Unlike --pause-cap, a pause beside work is never shortened.")]
CacheBust = Annotated[str | None, typer.Option(
    "--cache-bust", help="head (default): with --recycle, each play's marker block heads "
    "every prompt. after-shared-prefix: every play's marker goes after the leading blocks "
    "other sessions share (the system/tool prefix), where AIPerf puts its [rid:...] "
    "marker, so that prefix stays cached across sessions.")]
Grace = Annotated[float | None, typer.Option(
    "--grace", min=0.0, help="With --duration: requests in flight at the deadline may "
    "take this many more seconds, then are cut (summary.json requests_cut; never "
    "measured). Default: each may take --request-timeout.")]
AiperfCompatible = Annotated[bool, typer.Option(
    "--aiperf-compatible", help="Send what NVIDIA AIPerf's AgentX scenario sends, where a "
    "flag is left at its default: --pauses end-to-start, --idle-cap 10, --session-order "
    "sequential, --cache-bust after-shared-prefix, no --pause-cap (also with --preset), "
    "--api chat (streaming, max_completion_tokens, ignore_eos, no temperature sent); with "
    "--recycle, --start-range 0:1 and each lane's first play starts at the instant AIPerf "
    "draws for the same --seed, every agent live then primed with one max_tokens=1 "
    "request, and --duration counts from the end of that warm-up.")]
Outputs = Annotated[str, typer.Option(
    "--outputs", help="canned: later prompts carry the trace's answer blocks. actual: "
    "the model's own output token ids (return_token_ids) replace them, so the server "
    "can reuse the KV it generated, as with a real agent.")]
StallTimeout = Annotated[float, typer.Option(
    "--stall-timeout", min=0.1, help="Seconds a stream may go without a byte before the "
    "request counts as stalled.")]
WarmupTurns = Annotated[int, typer.Option(
    "--warmup-turns", min=0, help="With --recycle: main turns replayed as warmup "
    "before a mid-session start (after one max_tokens=1 priming request).")]
ArmRef = Annotated[str | None, typer.Option(
    "--arm", help="FILE:NAME of a serving arm (see arms/*.toml): agentload starts that "
    "server for the run and stops it after.")]
NsysOut = Annotated[Path | None, typer.Option(
    "--nsys", help="Run the started server under `nsys profile`, writing this "
    ".nsys-rep (with --profile-window: only that window is captured).")]
PresetOpt = Annotated[str | None, typer.Option(
    "--preset", help="agentx: SemiAnalysis AgentX v1.0's methodology where a flag is left "
    "at its default: --recycle, --start-range 0.25:0.75, one warm-up turn per user "
    "(unmeasured), --pause-cap 300, --duration 3600, --session-order pool, and "
    "E2E-normalized P90 interactivity printed as the headline.")]
SessionOrder = Annotated[str, typer.Option(
    "--session-order", help="pinned: lane i plays sessions i, i+N, ... pool: every lane "
    "takes the next session from one seeded shuffle, whichever is free. sequential: the "
    "same in trace order, wrapping (AIPerf's rule for WEKA traces).")]
SloOpt = Annotated[str | None, typer.Option(
    "--slo", help="Service-level objectives, e.g. ttft=2s,itl=50ms,e2e_norm=40ms (also "
    "e2el): goodput (requests and tokens/s meeting every bound) and the share of users and "
    "sessions whose P90 met each, in summary.json, the console and the reports.")]
WorkersOpt = Annotated[str, typer.Option(
    "--workers", help="Client processes the lanes are split over (lane i to worker i mod "
    "N), each with its own event loop; the run directory and metrics are one run's. auto: "
    "one per 250 users, at most the cores less one (printed at start).")]
CpusOpt = Annotated[str | None, typer.Option(
    "--cpus", help="With --workers: pin the workers to these CPUs, round-robin (e.g. 2-5).")]
OnWorkerLoss = Annotated[str, typer.Option(
    "--on-worker-loss", help="continue (default): a worker that dies leaves its finished "
    "requests, the rest of the run goes on, and summary.json records the loss. stop: the "
    "whole run stops sending then.")]
RayOpt = Annotated[str | None, typer.Option(
    "--ray", help="Place the workers as Ray actors over the nodes of this Ray cluster "
    "(auto: the one this host belongs to; or HOST:PORT of its head). Needs the extra: pip "
    "install 'agentload[ray]'. --workers auto then means one per node.")]
ProfileWindow = Annotated[str | None, typer.Option(
    "--profile-window", help="START:END seconds into the replay: POST /start_profile "
    "and /stop_profile to the server around that window.")]


@app.command()
def replay(
    trace: Annotated[Path, typer.Argument(
        help="Trace: native .jsonl / .parquet, or a foreign file or directory (see --format).")],
    trace_format: TraceFormat = "auto",
    target: Annotated[str | None, typer.Option(
        "--target", "-t", help="Base URL of an OpenAI-compatible server, e.g. "
        "http://127.0.0.1:8000.")] = None,
    embedded: Annotated[bool, typer.Option(
        "--embedded", help="Start the embedded vLLM CPU server for this run.")] = False,
    arm: ArmRef = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="Run directory.")] = Path(
        "runs/replay"),
    users: Users = 4,
    duration: Duration = None,
    max_requests: MaxRequests = None,
    time_scale: TimeScale = 1.0,
    model: Annotated[str | None, typer.Option(
        "--model", help="Model name to request (default: the server's first model).")] = None,
    gpus: Annotated[int | None, typer.Option(
        "--gpus", min=1, help="GPUs behind the target, for throughput per GPU (default 1).")
    ] = None,
    cache_salt: CacheSalt = None,
    request_timeout: RequestTimeout = 600.0,
    api_key_env: Annotated[str, typer.Option(
        "--api-key-env", help="Environment variable holding the API key, if any.")
    ] = "OPENAI_API_KEY",
    no_report: NoReport = False,
    headless: Headless = None,
    scale_tokens: ScaleTokens = 1.0,
    max_context: MaxContext = None,
    pause_cap: PauseCap = None,
    open_loop: OpenLoop = False,
    recycle: Recycle = False,
    seed: Seed = 0,
    start_range: StartRange = "0.25:0.75",
    api: Api = None,
    outputs: Outputs = "canned",
    stall_timeout: StallTimeout = 120.0,
    warmup_turns: WarmupTurns = 1,
    session_order: SessionOrder = "pinned",
    preset_name: PresetOpt = None,
    pauses: Pauses = None,
    idle_cap: IdleCapOpt = None,
    cache_bust: CacheBust = None,
    grace: Grace = None,
    aiperf_compatible: AiperfCompatible = False,
    nsys: NsysOut = None,
    profile_window: ProfileWindow = None,
    slo: SloOpt = None,
    workers: WorkersOpt = "auto",
    cpus: CpusOpt = None,
    on_worker_loss: OnWorkerLoss = "continue",
    ray_address: RayOpt = None,
) -> None:
    """Replay TRACE against a server and write the run to --output.

    Every prompt is sent as token ids to /v1/completions with exact lengths and exact
    reuse of earlier blocks, max_tokens = the trace's output length and ignore_eos.

    Examples:

      agentload replay trace.jsonl --target http://127.0.0.1:8000 --users 8 -o runs/a

      agentload replay trace.jsonl --embedded --duration 60 -o runs/cpu

      agentload replay trace.jsonl --arm arms/embedded-cpu.toml:no-prefix-cache -o runs/nopc

      agentload replay ../cc-traces/ --format weka --target http://gpu-node:8000 -o runs/weka

      agentload replay tests/data/weka --embedded --scale-tokens 0.12 --pause-cap 10 -o runs/w

      agentload replay mooncake.jsonl --target http://gpu-node:8000 --open-loop -o runs/mc
    """
    traffic = with_aiperf(aiperf_compatible, pauses, idle_cap, cache_bust, api, session_order,
                          pause_cap)
    recycle, duration, pause_cap, session_order = with_preset(
        preset_name, recycle, duration, traffic.pause_cap, traffic.session_order,
        keep_pause_cap=aiperf_compatible)
    result = run_replay(
        trace, output, target_url=target, embedded=embedded,
        arm=load_arm(arm) if arm is not None else None, nsys_output=nsys,
        profile_window=parse_window(profile_window) if profile_window else None,
        slo=parse_slo(slo) if slo else None,
        options=_options(users, duration, max_requests, time_scale, cache_salt,
                         request_timeout, open_loop, stall_timeout, recycle, seed, start_range,
                         warmup_turns, traffic.api, outputs, session_order, preset_name,
                         traffic.idle_cap, traffic.cache_bust, grace, aiperf_compatible),
        model=model, gpus=gpus, api_key=os.environ.get(api_key_env) or None,
        report=not no_report, progress=_progress_mode(headless), trace_format=trace_format,
        fit=FitOptions(scale_tokens=scale_tokens, max_context=max_context,
                       pause_cap_s=pause_cap,
                       pause_rule="end-to-start" if traffic.pauses == "end-to-start"
                       else "trace"),
        **_fleet(workers, cpus, on_worker_loss, ray_address),
    )
    _print_result(result, preset_name)


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(
        help="One run directory (with journal.jsonl), or several to compare (the first is "
        "the baseline).")],
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="With several runs: where the comparison goes (default: "
        "comparison/ beside the first run).")] = None,
    slo: SloOpt = None,
) -> None:
    """Rebuild a run's tables, summary.json and reports from its journal, or compare runs.

    With one RUN_DIR it works on a run that was killed before it could finish (kill -9,
    power loss): every request that had finished is in the journal. With several, each is
    read as it stands and report.md / report.html / comparison.json put them side by side,
    with ratios to the first and each run's GPU count.

    Examples:

      agentload report runs/replay

      agentload report runs/ab/prefix-cache runs/ab/no-prefix-cache -o runs/ab
    """
    objectives = parse_slo(slo) if slo else None
    if len(run_dirs) == 1 and output is not None:
        raise ReplayError(f"-o is where a comparison of several runs goes; one run is rebuilt "
                          f"in place, in {run_dirs[0]} (copy it first to keep the original)")
    if len(run_dirs) == 1:
        # A --workers run whose driver was killed: its workers' journals are merged first.
        if (merged := merge_and_recount(run_dirs[0])) is not None:
            typer.echo(merged)
        result = write_results(run_dirs[0], slo=objectives)
        typer.echo(f"rebuilt {result.run_dir}")
        for line in summary_lines(result.summary):
            typer.echo(line)
        typer.echo(f"report: {result.report_html}")
        return
    if objectives:  # every run judged by the same objectives before they are compared
        for run_dir in run_dirs:
            write_results(run_dir, report=False, slo=objectives)
    out = output or run_dirs[0].parent / "comparison"
    _, md, page = write_comparison(out, run_dirs)
    typer.echo(f"comparison of {len(run_dirs)} runs written to {out}")
    typer.echo(md.read_text())
    typer.echo(f"report: {page}")


@app.command()
def compare(
    arms: Annotated[Path, typer.Option(
        "--arms", help="Arm file (TOML, one [arm.<name>] table per arm).")],
    only: Annotated[str | None, typer.Option(
        "--only", help="Comma-separated arm names, in order (the first is the baseline; "
        "default: every arm of the file).")] = None,
    trace: Annotated[Path | None, typer.Option(
        "--trace", help="Trace to replay against each arm (default: the bundled demo "
        "trace).")] = None,
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Comparison directory: one run directory per arm, plus "
        "report.html, report.md and comparison.json.")] = Path("runs/compare"),
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print each arm's server command line and launch nothing.")
    ] = False,
    allow_gpu_count_change: Annotated[bool, typer.Option(
        "--allow-gpu-count-change", help="Compare arms of different GPU counts (every row "
        "is then labelled with both counts).")] = False,
    trace_format: TraceFormat = "auto",
    users: Users = 4,
    duration: Duration = None,
    max_requests: MaxRequests = None,
    time_scale: TimeScale = 1.0,
    cache_salt: CacheSalt = None,
    request_timeout: RequestTimeout = 600.0,
    no_report: NoReport = False,
    headless: Headless = None,
    scale_tokens: ScaleTokens = 1.0,
    max_context: MaxContext = None,
    pause_cap: PauseCap = None,
    open_loop: OpenLoop = False,
    recycle: Recycle = False,
    seed: Seed = 0,
    start_range: StartRange = "0.25:0.75",
    api: Api = None,
    outputs: Outputs = "canned",
    stall_timeout: StallTimeout = 120.0,
    warmup_turns: WarmupTurns = 1,
    session_order: SessionOrder = "pinned",
    preset_name: PresetOpt = None,
    pauses: Pauses = None,
    idle_cap: IdleCapOpt = None,
    cache_bust: CacheBust = None,
    grace: Grace = None,
    aiperf_compatible: AiperfCompatible = False,
    profile_window: ProfileWindow = None,
    slo: SloOpt = None,
    workers: WorkersOpt = "auto",
    cpus: CpusOpt = None,
    on_worker_loss: OnWorkerLoss = "continue",
    ray_address: RayOpt = None,
) -> None:
    """Replay the same workload against each arm in turn and compare them.

    Each arm's server is started, replayed against with the same trace, seed, users,
    duration and prompts (one cache salt for all), and stopped before the next starts.
    Arms must use the same GPU count unless --allow-gpu-count-change.

    Examples:

      agentload compare --arms arms/embedded-cpu.toml --only prefix-cache,no-prefix-cache \\
          --users 4 --duration 60 -o runs/cpu-ab

      agentload compare --arms arms/kimi-k3-gb300.toml --only tp8-auto,tp8-specialized \\
          --trace agents.jsonl --users 32 --recycle --duration 900 -o runs/k3 --dry-run
    """
    chosen = select_arms(arms, [n.strip() for n in only.split(",") if n.strip()]
                         if only else None)
    if dry_run:
        for line in dry_run_lines(chosen):
            typer.echo(line)
        return
    traffic = with_aiperf(aiperf_compatible, pauses, idle_cap, cache_bust, api, session_order,
                          pause_cap)
    recycle, duration, pause_cap, session_order = with_preset(
        preset_name, recycle, duration, traffic.pause_cap, traffic.session_order,
        keep_pause_cap=aiperf_compatible)
    # One options object for every arm: one cache salt, so the prompts are identical.
    options = _options(users, duration, max_requests, time_scale, cache_salt,
                       request_timeout, open_loop, stall_timeout, recycle, seed, start_range,
                       warmup_turns, traffic.api, outputs, session_order, preset_name,
                       traffic.idle_cap, traffic.cache_bust, grace, aiperf_compatible)
    result = compare_arms(
        chosen, trace or demo_trace_path(), output,
        allow_gpu_count_change=allow_gpu_count_change, say=say_stderr, options=options,
        report=not no_report, progress=_progress_mode(headless, dashboard=False),
        trace_format=trace_format,
        profile_window=parse_window(profile_window) if profile_window else None,
        slo=parse_slo(slo) if slo else None,
        fit=FitOptions(scale_tokens=scale_tokens, max_context=max_context,
                       pause_cap_s=pause_cap,
                       pause_rule="end-to-start" if traffic.pauses == "end-to-start"
                       else "trace"),
        **_fleet(workers, cpus, on_worker_loss, ray_address),
    )
    for name, run in result.runs:
        typer.echo(f"{name}: {run.run_dir}")
        for line in summary_lines(run.summary):
            typer.echo(line)
    for name, reason in result.failed:
        typer.echo(f"{name}: FAILED: {reason}")
    if result.report_html is not None:
        assert result.report_md is not None
        typer.echo(result.report_md.read_text())
        typer.echo(f"comparison report: {result.report_html}")
    if result.interrupted:
        raise typer.Exit(130)
    if result.failed:
        raise typer.Exit(1)


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
    workers: WorkersOpt = "auto",
) -> None:
    """Start the embedded vLLM CPU server, replay the bundled agent trace, write a report.

    Takes about two minutes on 2 cores (most of it vLLM starting up); --duration bounds
    the replay itself. The report lands in runs/<timestamp>/ unless -o says otherwise.
    """
    result = run_replay(
        demo_trace_path(), output or default_demo_dir(), embedded=target is None,
        target_url=target,
        options=_options(users, duration, None, 1.0, None, 600.0),
        progress=_progress_mode(headless), **_fleet(workers, None, "continue"),
    )
    _print_result(result)


@app.command()
def serve(
    embedded: Annotated[bool, typer.Option(
        "--embedded", help="Serve the embedded tiny Llama on vLLM's CPU build.")] = False,
    arm: ArmRef = None,
    port: Annotated[int | None, typer.Option(
        "--port", min=1, max=65535, help="Port (default: a free one).")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    log: Annotated[Path, typer.Option("--log", help="Where the server log goes.")] = Path(
        "runs/server.log"),
    build_only: Annotated[bool, typer.Option(
        "--build-only", help="Only build the tiny model (into the cache) and print its path.")
    ] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the exact server command line and start nothing.")] = False,
    node_rank: Annotated[int, typer.Option(
        "--node-rank", min=0, help="For an arm spanning several nodes: this node's rank "
        "(0 serves the API; others run headless workers).")] = 0,
    nsys: NsysOut = None,
    nsys_whole_run: Annotated[bool, typer.Option(
        "--nsys-whole-run", help="With --nsys: record from process start (CUDA graphs are "
        "captured at start-up, outside a /start_profile window).")] = False,
    follow: Annotated[bool, typer.Option(
        "--follow/--no-follow", help="Print the server's log lines as they come (they "
        "are always in --log).")] = True,
) -> None:
    """Start a server and keep it running until Ctrl-C.

    Examples:

      agentload serve --embedded --port 8000

      agentload serve --arm arms/kimi-k3-gb300.toml:tp8-specialized --dry-run

      agentload serve --arm arms/embedded-cpu.toml:no-prefix-cache --port 8001
    """
    if embedded == (arm is not None) and not build_only:
        raise ReplayError("serve needs exactly one of --embedded or --arm FILE:NAME")
    if build_only:
        typer.echo(ensure_tiny_model())
        return
    if arm is not None:
        chosen = load_arm(arm)
        if dry_run:
            argv = serve_argv(chosen, host, port or 8000,
                              "<tiny-model-dir>" if chosen.embedded else None, node_rank)
            env = " ".join(f"{k}={v}" for k, v in chosen.get("env", {}).items())
            typer.echo((env + " " if env else "") + shlex.join(argv))
            return
        check_gpu_count(chosen)
        spec = arm_server_spec(chosen, host, port)
        if node_rank:
            spec = replace(spec, argv=tuple(serve_argv(chosen, host, spec.port,
                                                       node_rank=node_rank)))
    else:
        spec = embedded_server_spec(port=port, host=host)
        if dry_run:
            typer.echo(shlex.join(spec.argv))
            return
    if nsys is not None:
        spec = nsys_wrap(spec, nsys, whole_run=nsys_whole_run)
    with ManagedServer(spec, log, progress=say_stderr) as server:
        typer.echo(f"serving {spec.served_model} at {spec.base_url} (pid {server.pid}, "
                   f"log {log}); Ctrl-C stops it")
        config = effective_config(log)
        if config.get("non_default_args"):
            typer.echo(f"non-default args: {config['non_default_args']}")
        sys.stdout.flush()
        try:
            with open(log, "rb") as tail:
                while server.running():
                    chunk = tail.read()
                    if follow and chunk:
                        sys.stdout.write(chunk.decode(errors="replace"))
                        sys.stdout.flush()
                    time.sleep(0.5)
        except KeyboardInterrupt:
            typer.echo("stopping")
            return
    raise ReplayError(f"the server exited on its own; see {log}")

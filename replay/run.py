"""Run a replay end to end: resolve the target, replay, finalize, summarize, report.

``run_replay`` is what ``agentload replay`` and ``agentload demo`` call, and is usable
from Python the same way. A run directory ends up holding:

- ``run.json``: what was run (trace, target, options, server version) and how it ended;
- ``journal.jsonl``: every finished request, appended as it finished;
- ``requests.parquet``: the journal as a table; ``summary.json``: the headline numbers;
- ``report.md`` / ``report.html`` (unless ``report=False``); ``server.log`` when
  agentload started the server.

Ctrl-C (or SIGTERM) stops the replay, stops any server agentload started, and still
writes the summary and reports of what completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Literal

import httpx

from agentload import __version__
from agentload.replay.engine.core import (
    EngineOutcome,
    ProgressSnapshot,
    ReplayEngine,
    ReplayOptions,
    Target,
    build_http_client,
    unshardable,
)
from agentload.replay.engine.fit import FitOptions, check_fits, fit_trace
from agentload.replay.errors import ReplayError
from agentload.replay.fleet.local import FleetEngine, OnLoss, auto_workers
from agentload.replay.fleet.ray import RayFleetEngine, check_reachable, connect, disconnect
from agentload.replay.fleet.recount import recount_note, recount_theoretical
from agentload.replay.journal import (
    JOURNAL_NAME,
    SERVER_METRICS_TEXT,
    Journal,
    merge_shards,
)
from agentload.replay.live import Viewer, open_viewer
from agentload.replay.results.finalize import RunResult, write_json, write_results
from agentload.replay.results.report import fmt
from agentload.replay.serve import prometheus
from agentload.replay.serve.arms import Arm, arm_server_spec, check_gpu_count
from agentload.replay.serve.gpu_telemetry import GpuSampler, open_sampler
from agentload.replay.serve.probe import (
    calibrate_words,
    check_target_url,
    detect_token_id_range,
    probe_target,
)
from agentload.replay.serve.profile_window import (
    ProfileWindowLog,
    run_profile_window,
)
from agentload.replay.serve.server import (
    ManagedServer,
    ServerSpec,
    effective_config,
    embedded_server_spec,
    last_log_error,
    nsys_wrap,
    serving,
)
from agentload.traces import Trace
from agentload.traces.formats import AUTO, NATIVE, detect_format, load_any

# live: one status line rewritten every second (a TTY); headless: a line every few seconds.
# dashboard: the Textual dashboard (agentload.tui) draws the run from published snapshots.
ProgressMode = Literal["live", "headless", "none", "dashboard"]
Say = Callable[[str], None]
# What run.py drives: one engine in this process, or the driver of worker processes.
Engine = ReplayEngine | FleetEngine


def say_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def new_cache_salt() -> int:
    return secrets.randbits(32)


def _prepare_run_dir(run_dir: Path) -> None:
    if (run_dir / JOURNAL_NAME).exists():
        raise ReplayError(f"{run_dir} already holds a run; choose another output directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReplayError(f"cannot create run directory {run_dir}: {exc.strerror}") from None


def _load(trace: Trace | Path, fmt: str, say: Say) -> tuple[Trace, str, str]:
    """The trace, where it came from, and its format (foreign files are imported)."""
    if isinstance(trace, Trace):
        return trace, "<in memory>", "native"
    if fmt == AUTO:
        fmt = detect_format(Path(trace))
    result = load_any(trace, fmt)
    if fmt != NATIVE:
        say(f"imported {trace} as {fmt}: {result.trace.num_requests} requests in "
            f"{len(result.trace.sessions)} sessions")
        for note in result.notes:
            say(f"  note: {note}")
    return result.trace, str(trace), fmt


def progress_line(snap: ProgressSnapshot) -> str:
    p90 = fmt(snap.p90_interactivity_tok_s, "tok/s")
    eta = f"{snap.eta_s:.0f} s" if snap.eta_s is not None else "?"
    # A recycling run bounded by time has no request total: "?" as the dashboard says.
    total = snap.requests_total or "?"
    line = (f"[{snap.elapsed_s:6.1f} s] requests {snap.requests_done}/{total} "
            f"done, {snap.in_flight} in flight, users active {snap.users_active}/{snap.users}, "
            f"P90 interactivity {p90}, errors {snap.requests_failed}, ETA {eta}")
    if snap.invalid_reasons:  # said as soon as it happens, not only in summary.json
        line += " | INVALID: " + "; ".join(snap.invalid_reasons)
    return line


async def _progress_loop(engine: Engine, mode: ProgressMode, say: Say,
                         interval_s: float) -> None:
    if mode == "live":
        try:
            while True:
                await asyncio.sleep(1.0)
                sys.stderr.write("\r\x1b[K" + progress_line(engine.snapshot()))
                sys.stderr.flush()
        finally:
            sys.stderr.write("\n")
    while True:
        await asyncio.sleep(interval_s)
        say(progress_line(engine.snapshot()))


async def _watch_server(engine: Engine, server: ManagedServer, say: Say) -> None:
    """Stop the replay as soon as a server agentload started has died."""
    while server.running():
        await asyncio.sleep(0.5)
    reason = f"server died: {last_log_error(server.log_path)}"
    say(f"{reason} (log: {server.log_path})")
    engine.stop(reason)


async def _publish(engine: Engine, interval_s: float = 0.25) -> None:
    """Publish the dashboard's snapshot four times a second; act on its stop request.

    Building a snapshot is cheap and the dashboard only reads the published one, so the
    requests' timing never waits on the display.
    """
    board = engine.live
    try:
        while True:
            if board.stop_requested is not None:
                engine.stop(board.stop_requested)
            board.publish(engine.now_ns())
            await asyncio.sleep(interval_s)
    finally:
        board.publish(engine.now_ns())


async def _sample_server(engine: Engine, client: httpx.AsyncClient, base_url: str,
                         gpus: GpuSampler | None, interval_s: float = 1.0) -> None:
    """Journal the server's metrics (and local GPUs') every ``interval_s``."""
    # A --workers driver starts its clock once every worker is ready: nothing is journaled
    # before, so the samples' times never run back.
    await engine.wait_started()
    while True:
        scrape = await prometheus.scrape(client, base_url)
        if scrape.ok:
            engine.journal.write_server_metrics(engine.now_ns(), scrape.values)
        engine.live.server_sample(engine.now_ns(), scrape.values if scrape.ok else None)
        if gpus is not None:
            engine.journal.write_gpu(engine.now_ns(), gpus.sample())
        await asyncio.sleep(interval_s)


async def _replay(engine: Engine, client: httpx.AsyncClient, base_url: str,
                  server: ManagedServer | None, progress: ProgressMode, say: Say,
                  interval_s: float, gpus: GpuSampler | None = None,
                  window: ProfileWindowLog | None = None,
                  ) -> tuple[EngineOutcome, prometheus.MetricsScrape, prometheus.MetricsScrape]:
    if progress == "dashboard":
        say = engine.live.say  # lines go to the dashboard's event log, not over its screen
    async with client:
        before = await prometheus.scrape(client, base_url)
        helpers = [asyncio.create_task(_sample_server(engine, client, base_url, gpus))]
        if progress == "dashboard":
            helpers.append(asyncio.create_task(_publish(engine)))
        elif progress != "none":
            helpers.append(asyncio.create_task(_progress_loop(engine, progress, say,
                                                              interval_s)))
        if server is not None:
            helpers.append(asyncio.create_task(_watch_server(engine, server, say)))
        if window is not None:
            async def profile_window(window: ProfileWindowLog = window) -> None:
                await engine.wait_started()  # START counts from the run's start
                await run_profile_window(client, base_url, window, say)
            helpers.append(asyncio.create_task(profile_window()))
        try:
            # The client's self-diagnostics: CPU, GC pauses and loop lag over the run.
            engine.diagnostics.start()
            helpers.append(asyncio.create_task(engine.diagnostics.probe()))
            outcome = await engine.run()
            engine.diagnostics.stop()
        finally:
            for task in helpers:
                task.cancel()
            # Let cancelled helpers finish their cleanup (the profile window's stop call).
            await asyncio.gather(*helpers, return_exceptions=True)
        after = await prometheus.scrape(client, base_url)
    return outcome, before, after


@contextlib.contextmanager
def _ray_session(address: str | None) -> Iterator[None]:
    """Leave the Ray cluster (joined by ``connect`` before anything else) however the run
    ends."""
    try:
        yield
    finally:
        if address is not None:
            disconnect()


@contextlib.contextmanager
def _target_for(spec: ServerSpec | None, target_url: str | None, model: str | None,
                gpus: int | None, api_key: str | None, run_dir: Path, say: Say,
                startup_timeout_s: float,
                ) -> Iterator[tuple[Target, dict[str, Any], ManagedServer | None]]:
    if spec is not None:
        with serving(spec, run_dir / "server.log", progress=say,
                     startup_timeout_s=startup_timeout_s) as server:
            served, facts = probe_target(spec.base_url, None, None)
            facts |= {"argv": list(spec.argv), "startup_s": server.startup_s,
                      "effective_config": effective_config(server.log_path)}
            low = 16  # past the tiny tokenizer's special tokens
            yield Target(spec.base_url, served, gpus=gpus or spec.gpus, device=spec.device,
                         label=spec.label,
                         token_id_range=(low, spec.vocab_size or 32000),
                         kv_block_size=facts["kv_block_size"]), facts, server
        return
    assert target_url is not None
    base = check_target_url(target_url)
    served, facts = probe_target(base, model, api_key)
    token_range = detect_token_id_range(base, served, api_key)
    yield Target(base, served, gpus=gpus or 1, label=base, token_id_range=token_range,
                 kv_block_size=facts["kv_block_size"], api_key=api_key), facts, None


def run_replay(
    trace: Trace | Path,
    run_dir: Path,
    *,
    target_url: str | None = None,
    embedded: bool = False,
    options: ReplayOptions | None = None,
    model: str | None = None,
    gpus: int | None = None,
    api_key: str | None = None,
    progress: ProgressMode = "headless",
    progress_interval_s: float = 5.0,
    report: bool = True,
    startup_timeout_s: float = 600.0,
    say: Say = say_stderr,
    trace_format: str = AUTO,
    fit: FitOptions | None = None,
    viewer: Viewer | None = None,
    arm: Arm | None = None,
    nsys_output: Path | None = None,
    profile_window: tuple[float, float] | None = None,
    slo: dict[str, float] | None = None,
    workers: int | None = 1,
    cpus: list[int] | None = None,
    on_worker_loss: OnLoss = "continue",
    ray_address: str | None = None,
) -> RunResult:
    """Replay ``trace`` against ``target_url``, a fresh embedded server, or ``arm``'s server.

    ``nsys_output`` runs a started server under ``nsys profile``; ``profile_window``
    (START, END seconds into the replay) calls the server's /start_profile and
    /stop_profile around that window. ``workers`` > 1 plays the lanes in that many
    worker processes (``fleet/local.py``; None: ``auto_workers``), pinned round-robin to
    ``cpus`` when given; ``on_worker_loss`` says whether the run goes on without a worker
    that died. ``ray_address`` (``auto`` or HOST:PORT) places the workers as Ray actors
    over that cluster's nodes instead (``fleet/ray.py``).
    """
    if embedded + (target_url is not None) + (arm is not None) != 1:
        raise ReplayError("give exactly one target: --target URL, --arm FILE:NAME or "
                          "--embedded")
    if nsys_output is not None and target_url is not None:
        raise ReplayError("--nsys wraps a server agentload starts; with --target, start "
                          "your server under nsys yourself")
    if gpus is not None and gpus < 1:
        raise ReplayError("--gpus must be at least 1")
    options = options or ReplayOptions(cache_salt=new_cache_salt())
    if options.users < 1:
        raise ReplayError("--users must be at least 1")
    if ray_address is not None:
        nodes = connect(ray_address)  # first: a bad address is one line, nothing written
        if workers is None:
            workers = nodes if unshardable(options) is None else 1
            say(f"workers: {workers} (auto: one per node of the Ray cluster at "
                f"{ray_address}; --workers N to choose)")
    if workers is None:
        problem = unshardable(options)
        workers = auto_workers(options.users) if problem is None else 1
        why = (f"{options.users} users, {os.cpu_count()} cores" if problem is None
               else problem.split(";")[0])
        say(f"workers: {workers} (auto: {why}; --workers N to choose)")
    if workers < 1:
        raise ReplayError("--workers must be at least 1")
    if workers > 1 and (problem := unshardable(options)) is not None:
        raise ReplayError(problem)
    trace_obj, trace_path, trace_format = _load(trace, trace_format, say)
    run_dir = Path(run_dir)
    _prepare_run_dir(run_dir)
    if arm is not None:
        check_gpu_count(arm)
        spec: ServerSpec | None = arm_server_spec(arm)
    else:
        spec = embedded_server_spec() if embedded else None
    if spec is not None and nsys_output is not None:
        spec = nsys_wrap(spec, nsys_output)
    window = ProfileWindowLog(profile_window) if profile_window is not None else None
    run: dict[str, Any] = {
        "agentload_version": __version__,
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "trace": {"name": trace_obj.name, "path": trace_path, "format": trace_format,
                  "sessions": len(trace_obj.sessions),
                  "requests": trace_obj.num_requests, "block_size": trace_obj.block_size},
        "options": asdict(options),
        "slo_s": slo,
        "arm": arm.describe() if arm is not None else None,
        "nsys_output": str(nsys_output) if nsys_output is not None else None,
        "prompt_mode": "token-ids",
        "output_tokens": (
            ("actual (the trace's output length with ignore_eos; the model's own token ids "
             "replace the trace's answer blocks in later prompts)") if options.api != "chat"
            else ("actual (the trace's output length with ignore_eos; the model's own text "
                  "comes back as an assistant message in place of the trace's answer "
                  "blocks)")
            if options.output_mode == "actual" else
            "canned (the trace's output length with ignore_eos; later prompts carry the "
            "trace's answer blocks)"),
    }
    interrupted = False
    outcome: EngineOutcome | None = None
    server_hit: float | None = None
    # The journal opens only once the target answers, so a target that fails leaves
    # nothing but its log behind and the same directory can be used again.
    with _ray_session(ray_address), _target_for(
            spec, target_url, model, gpus, api_key, run_dir, say,
            startup_timeout_s) as (target, facts, server):
        trace_obj, fitted = fit_trace(trace_obj, fit or FitOptions())
        check_fits(trace_obj, facts.get("max_model_len"))
        if options.api == "chat":
            wpt, how, word_tokens = calibrate_words(target.base_url, target.model, api_key)
            options = replace(options, words_per_token=wpt, chat_word_tokens=word_tokens)
            run["options"] = asdict(options)
            run["prompt_mode"] = f"chat text ({wpt:.3f} words per token; {how})"
        if ray_address is not None:
            check_reachable(target.base_url)  # before anything is written
        run |= {"target": target.public(), "server": facts, "fit": fitted.as_dict()}
        write_json(run_dir / "run.json", run)
        with Journal(run_dir / JOURNAL_NAME) as journal:
            journal.write_run(run)
            client = build_http_client(options, target.base_url)
            engine: Engine
            if ray_address is not None:
                engine = RayFleetEngine(trace_obj, target, options, journal, run_dir,
                                        workers, slo=slo, on_loss=on_worker_loss)
            elif workers > 1:
                engine = FleetEngine(trace_obj, target, options, journal, run_dir, workers,
                                     slo=slo, cpus=cpus, on_loss=on_worker_loss)
            else:
                engine = ReplayEngine(trace_obj, target, options, journal, client, slo=slo)
            planned = (f"{engine.total_requests} requests" if engine.total_requests else
                       f"sessions recycled for {options.duration_s:g} s" if options.duration_s
                       else "sessions recycled")
            spread = (f", {workers} Ray actors" if ray_address is not None else
                      f", {workers} worker processes" if workers > 1 else "")
            say(f"replaying {trace_obj.name} ({planned}, "
                f"{options.users} users{spread}) against {target.label} -> {run_dir}")
            sampler, gpu_note = open_sampler(target.base_url, managed=server is not None)
            run["gpu_telemetry"] = gpu_note
            write_json(run_dir / "run.json", run)
            # The dashboard (given, or registered by agentload.tui) when one is wanted.
            viewer = open_viewer(progress, viewer, engine.live)
            if progress == "dashboard" and viewer is None:
                progress = "live"
            try:
                outcome, before, after = asyncio.run(_replay(
                    engine, client, target.base_url, server, progress, say,
                    progress_interval_s, sampler, window))
            except KeyboardInterrupt:
                interrupted = True
                say("interrupted: stopping, and writing what completed")
            except BaseException:
                if viewer is not None:
                    viewer.close()  # give the terminal back before the error is shown
                raise
            else:
                server_hit = prometheus.prefix_cache_hit_rate(before, after)
                if after.ok:  # every series the server exposes, as it was at the end
                    (run_dir / SERVER_METRICS_TEXT).write_text(after.text)
                run["server"]["metrics_delta"] = {
                    name: prometheus.counter_delta(before, after, name)
                    for name in prometheus.WANTED if name.endswith("_total")}
            finally:
                if sampler is not None:
                    sampler.close()
    if isinstance(engine, FleetEngine):
        run["workers"] = engine.fleet_record()
        merge_shards(run_dir)
        changed = recount_theoretical(run_dir / JOURNAL_NAME, trace_obj, options,
                                      target.kv_block_size or trace_obj.block_size)
        run["workers"]["theoretical_cache"] = recount_note(changed)
    if outcome is not None:
        run["outcome"] = asdict(outcome)
        run["client_diagnostics"] = engine.diagnostics.summary()
    if window is not None:
        run["profile_window"] = window.as_dict()
    run["finished_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    run["interrupted"] = interrupted
    run["server_prefix_cache_hit_rate"] = server_hit
    write_json(run_dir / "run.json", run)
    result = write_results(run_dir, report=report)
    if viewer is not None:
        # The dashboard shows where the run went and stays until its user leaves.
        viewer.finish(f"run written to {run_dir}"
                      + (f"; report {result.report_html}" if result.report_html else ""))
    return result


def default_demo_dir(root: Path = Path("runs")) -> Path:
    return root / time.strftime("%Y%m%d-%H%M%S")



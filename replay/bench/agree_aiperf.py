"""``agentload bench agree --peer aiperf``: agentload and AIPerf's AgentX scenario, one trace.

NVIDIA AIPerf (its own virtualenv under ``.peers/aiperf``, built by ``make peers``) runs
its ``inferencex-agentx-mvp`` scenario on a WEKA trace folder, and ``agentload replay``
runs the same folder with the options that make its traffic AIPerf's (``AGENTLOAD_*``),
against one server, with the same model, tokenizer, users, duration and
seed: one unmeasured agentload warm-up, then agentload, AIPerf, agentload, AIPerf, ...

Every figure is computed by one function for both tools: AIPerf's per-request records
(``profile_export.jsonl``, profiling phase, errors excluded) are put into agentload's
request table and summarized by ``metrics.summarize``, so TTFT, ITL = (E2EL - TTFT) /
(OSL - 1), P90 interactivity 1 / P90(ITL) and 1 / P90(E2EL / OSL) mean the same thing on
both sides. The server's prefix-cache hit rate is its own counters' delta
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``) over each run.

The same requests: AIPerf names a request by its conversation (``trace_0291`` or
``trace_0291::sa:agent_002``) and turn index, agentload by ``trace_0291/16`` or
``trace_0291/sa:agent_002/6``; ``aiperf_request_id`` maps one onto the other, and a pair
also needs the same server-counted OSL. Per request and tool, the median over every
measured run; the per-request ratio agentload / AIPerf; its median, with a 95 % interval
that resamples whole sessions (``compare_paired``'s bootstrap).

The scenario refuses a local trace and a run under 900 s unless ``--unsafe-override`` is
passed; with it AIPerf marks its result ``submission_valid=false`` (reason
``unsafe_override``), and this command's output says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import polars as pl

from agentload.replay.bench.agree import (
    SERVER_NICE,
    _target,
    clients_off,
    counters_delta,
    counters_in,
    server_means_ms,
    tokenizer_for,
    worker_cpus,
)
from agentload.replay.errors import ReplayError
from agentload.replay.journal import REQUEST_SCHEMA, REQUESTS_NAME
from agentload.replay.results.compare_paired import MIN_PAIRS, RESAMPLES, _interval
from agentload.replay.results.metrics import summarize, with_request_metrics
from agentload.replay.serve.prometheus import MetricsScrape, parse_metrics, prefix_cache_hit_rate

SCENARIO = "inferencex-agentx-mvp"
AIPERF_LOG = Path("logs") / "aiperf.log"
AIPERF_RECORDS = "profile_export.jsonl"
AIPERF_SUMMARY = "profile_export_aiperf.json"
GRACE_S = 10.0  # AIPerf's --benchmark-grace-period; AGENTLOAD_GRACE the same

# What makes ``agentload replay``'s traffic AIPerf's AgentX traffic: the one place to
# change. Always: steady-state recycling from seeded start points anywhere in a session
# (the scenario's trajectory start ratio 0.0-1.0), measured from the start turn on after
# one max_tokens=1 priming request (AIPerf's warm-up credit). Then ``--aiperf-compatible``
# where this agentload has it (end-to-start pauses, the 10 s system idle cap, the pooled
# session order, the cache-bust marker after the shared prefix, chat with
# max_completion_tokens), else the nearest options; and AIPerf's 10 s grace period
# where ``--grace`` exists.
AGENTLOAD_ALWAYS = ("--recycle", "--start-range", "0:1", "--warmup-turns", "0")
AGENTLOAD_COMPATIBLE = ("--aiperf-compatible",)
AGENTLOAD_NEAREST = ("--api", "chat", "--session-order", "pool", "--pause-cap", "10")
AGENTLOAD_GRACE = ("--grace", "10")

# The figures of each run, in table order: (key, label, format).
ROWS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests measured", "{:.0f}"),
    ("isl_sum", "ISL sum (server)", "{:.0f}"),
    ("osl_sum", "OSL sum (server)", "{:.0f}"),
    ("ttft_p50_ms", "TTFT P50 ms", "{:.1f}"),
    ("ttft_p90_ms", "TTFT P90 ms", "{:.1f}"),
    ("itl_p50_ms", "ITL P50 ms", "{:.2f}"),
    ("itl_p90_ms", "ITL P90 ms", "{:.2f}"),
    ("p90_interactivity_tok_s", "1/P90(ITL) tok/s", "{:.1f}"),
    ("e2e_norm_p90_interactivity_tok_s", "1/P90(E2EL/OSL) tok/s", "{:.1f}"),
    ("prefix_hit_rate", "prefix hits (server)", "{:.1%}"),
)


class PeerRunError(ReplayError):
    """The peer ran and failed: ``log_tail`` is the end of its log, ``kept`` its folder."""

    def __init__(self, message: str, log_tail: str, kept: Path) -> None:
        super().__init__(message)
        self.log_tail = log_tail
        self.kept = kept


def peers_dir() -> Path:
    """Where ``make peers`` puts the peers: $AGENTLOAD_PEERS, else this checkout's
    ``.peers`` (beside ``replay/``), else ``./.peers``."""
    env = os.environ.get("AGENTLOAD_PEERS")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[1] / ".peers"
    return checkout if checkout.is_dir() else Path.cwd() / ".peers"


def aiperf_bin(peers: Path | None = None) -> Path:
    """AIPerf's CLI in its own virtualenv, or ``ReplayError`` naming ``make peers``."""
    venv = (peers or peers_dir()) / "aiperf"
    exe = venv / "bin" / "aiperf"
    if not (venv / ".installed").is_file() or not exe.is_file():
        raise ReplayError(f"AIPerf's virtualenv is missing ({venv}): run `make peers` "
                          "(it installs aiperf 0.13.0 there, apart from agentload's)")
    return exe


def aiperf_argv(exe: Path, *, url: str, model: str, tokenizer: Path, trace: Path,
                users: int, duration_s: float, seed: int, out: Path) -> list[str]:
    """AIPerf's command line for one run of the AgentX scenario on ``trace``."""
    return [str(exe), "profile", "--scenario", SCENARIO, "--unsafe-override",
            "--model", model, "--url", url, "--endpoint-type", "chat",
            "--tokenizer", str(tokenizer.resolve()), "--input-file", str(trace.resolve()),
            "--custom-dataset-type", "weka_trace", "--use-server-token-count",
            "--benchmark-duration", f"{duration_s:g}", "--benchmark-grace-period",
            f"{GRACE_S:g}", "--concurrency", str(users), "--random-seed", str(seed),
            "--artifact-dir", str(out.resolve()), "--ui", "none", "--no-gpu-telemetry",
            "--no-server-metrics"]


def aiperf_env() -> dict[str, str]:
    """AIPerf's environment: ours, less the offline switches (they break its loading of a
    local tokenizer folder)."""
    drop = {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def agentload_traffic_options(replay_help: str) -> tuple[str, ...]:
    """The options of ``agentload replay`` that give AIPerf's traffic, by what its
    ``--help`` (``replay_help``) lists."""
    compatible = AGENTLOAD_COMPATIBLE[0] in replay_help
    return (*AGENTLOAD_ALWAYS, *(AGENTLOAD_COMPATIBLE if compatible else AGENTLOAD_NEAREST),
            *(AGENTLOAD_GRACE if AGENTLOAD_GRACE[0] in replay_help else ()))


def agentload_argv(*, url: str, model: str, trace: Path, users: int, duration_s: float,
                   seed: int, out: Path, options: tuple[str, ...]) -> list[str]:
    """``agentload replay``'s command line for one run."""
    return [sys.executable, "-P", "-m", "agentload", "replay", str(trace), "--format", "weka",
            "--target", url, "--model", model, "--users", str(users),
            "--duration", f"{duration_s:g}", "--seed", str(seed), "--no-report",
            "--headless", "-o", str(out), *options]


def aiperf_request_id(conversation_id: str, turn_index: int) -> str:
    """agentload's request id of AIPerf's (conversation, turn): ``trace_0291::sa:a/3`` is
    ``trace_0291/sa:a/3``, a main-chain ``trace_0291`` turn 16 is ``trace_0291/16``."""
    return f"{conversation_id.replace('::sa:', '/sa:')}/{turn_index}"


def _metric(metrics: dict[str, Any], name: str) -> float | None:
    entry = metrics.get(name)
    value = entry.get("value") if isinstance(entry, dict) else None
    return float(value) if isinstance(value, int | float) else None


def read_aiperf_records(path: Path) -> pl.DataFrame:
    """AIPerf's ``profile_export.jsonl`` as agentload's request table (``REQUEST_SCHEMA``).

    Times become ns since the first request's start: sent = ``request_start_ns``, first
    token = sent + ``time_to_first_token``, last token = sent + ``request_latency``.
    ISL and OSL are the server's counts (``usage_prompt_tokens``,
    ``usage_completion_tokens``, else ``input/output_sequence_length``). Warm-up records
    are phase ``warmup``; a record with an ``error`` is not ``ok``.
    """
    rows: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        meta, metrics = rec.get("metadata", {}), rec.get("metrics", {}) or {}
        sent = int(meta["request_start_ns"])
        ttft, e2el = _metric(metrics, "time_to_first_token"), _metric(metrics,
                                                                       "request_latency")
        isl = _metric(metrics, "usage_prompt_tokens")
        isl = isl if isl is not None else _metric(metrics, "input_sequence_length")
        osl = _metric(metrics, "usage_completion_tokens")
        osl = osl if osl is not None else _metric(metrics, "output_sequence_length")
        cached = _metric(metrics, "usage_prompt_cache_read_tokens")
        error = rec.get("error")
        ok = not error and ttft is not None and e2el is not None
        end = int(meta.get("request_end_ns") or sent)
        rid = aiperf_request_id(str(meta.get("conversation_id")), int(meta["turn_index"]))
        rows.append({
            "request_id": rid, "session_id": str(meta.get("source_trace_id")
                                                 or rid.split("/", 1)[0]),
            "lane": int(meta.get("session_num") or 0),
            "agent_kind": "subagent" if int(meta.get("agent_depth") or 0) else "main",
            "turn": int(meta["turn_index"]),
            "phase": "measure" if meta.get("benchmark_phase") == "profiling" else "warmup",
            "intended_ns": sent, "sent_ns": sent,
            "first_token_ns": sent + round(ttft * 1e6) if ok and ttft is not None else None,
            "last_token_ns": sent + round(e2el * 1e6) if ok and e2el is not None else None,
            "done_ns": end, "isl_requested": int(isl or 0), "osl_requested": int(osl or 0),
            "isl": None if isl is None else int(isl), "osl": None if osl is None else int(osl),
            "osl_source": "server", "cached_tokens": None if cached is None else int(cached),
            "theoretical_cached_tokens": 0,
            "chunks": int(_metric(metrics, "http_req_chunks_received") or 0),
            "ok": ok, "status": None,
            "error": None if not error else json.dumps(error, default=str)[:500],
            "ready_ns": None, "play": 0, "error_kind": None if ok else "peer_error",
        })
    frame = pl.DataFrame(rows, schema=REQUEST_SCHEMA)
    if frame.height:
        t0 = int(frame["sent_ns"].min())  # type: ignore[arg-type]
        frame = frame.with_columns(pl.col(c) - t0 for c in (
            "intended_ns", "sent_ns", "first_token_ns", "last_token_ns", "done_ns"))
    return frame


def run_figures(frame: pl.DataFrame) -> dict[str, float | None]:
    """The table's figures of one run (measured, successful requests), one definition
    for both tools: ``metrics.summarize``'s."""
    s = summarize(frame, gpus=1)

    def ms(key: str) -> float | None:
        v = s.get(key)
        return None if v is None else v * 1e3

    return {"requests": s["requests_completed"], "failed": s["requests_failed"],
            "isl_sum": s.get("input_tokens"), "osl_sum": s.get("output_tokens"),
            "ttft_p50_ms": ms("ttft_p50_s"), "ttft_p90_ms": ms("ttft_p90_s"),
            "itl_p50_ms": ms("itl_p50_s"), "itl_p90_ms": ms("itl_p90_s"),
            "p90_interactivity_tok_s": s.get("p90_interactivity_tok_s"),
            "e2e_norm_p90_interactivity_tok_s": s.get("e2e_norm_p90_interactivity_tok_s")}


def per_request(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """Measured, successful requests of every run of one tool: per (request id, OSL),
    the median TTFT and ITL (s), how often it was measured, and its session."""
    parts = [with_request_metrics(f.filter((pl.col("phase") == "measure") & pl.col("ok")))
             .select("request_id", "session_id", "osl", "ttft_s", "itl_s") for f in frames
             if f.height]
    if not parts:
        return pl.DataFrame(schema={"request_id": pl.String(), "session_id": pl.String(),
                                    "osl": pl.Int64(), "ttft_s": pl.Float64(),
                                    "itl_s": pl.Float64(), "n": pl.UInt32()})
    return (pl.concat(parts).group_by("request_id", "osl")
            .agg(pl.col("session_id").first(), pl.col("ttft_s").median(),
                 pl.col("itl_s").median(), n=pl.len())
            .sort("request_id", "osl"))


def same_requests(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """``per_request`` rows of agentload (``a``) and AIPerf (``b``) that are the same
    request: the same id and the same server-counted OSL (a guard against an id that
    names another request in the other tool). AIPerf's columns end in ``_aiperf``."""
    return a.join(b.select("request_id", "osl", "ttft_s", "itl_s"),
                  on=["request_id", "osl"], suffix="_aiperf").sort("request_id")


def paired_ratios(ours: list[pl.DataFrame], theirs: list[pl.DataFrame],
                  resamples: int = RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """On the requests both tools measured (``same_requests``): per metric the median of
    agentload / AIPerf per request, with a 95 % interval over whole sessions."""
    a, b = per_request(ours), per_request(theirs)
    joined = same_requests(a, b)
    out: dict[str, Any] = {"matched_requests": joined.height,
                           "agentload_requests": a.height, "aiperf_requests": b.height}
    for col, label in (("ttft_s", "TTFT"), ("itl_s", "ITL")):
        both = joined.filter((pl.col(col) > 0) & (pl.col(f"{col}_aiperf") > 0))
        ratio = (both[col] / both[f"{col}_aiperf"]).to_numpy()
        entry: dict[str, Any] = {"label": label, "pairs": len(ratio), "median_ratio": None,
                                 "ci95": None}
        if len(ratio) >= MIN_PAIRS:
            entry["median_ratio"] = float(np.median(ratio))
            entry["ci95"] = _interval(ratio, both["session_id"].to_numpy(), resamples, seed)
        out[col.removesuffix("_s")] = entry
    return out


def scrape_counters(base: str) -> tuple[MetricsScrape, dict[str, float]]:
    """One ``/metrics`` scrape read twice: the prefix-cache counters (a failed scrape is
    ``ok=False``) and the token counters and latency histograms (``agree.counters_in``)."""
    try:
        resp = httpx.get(base + "/metrics", timeout=10.0, trust_env=False)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        return MetricsScrape(values={}, ok=False, error=f"{type(exc).__name__}: {exc}"), {}
    return MetricsScrape(values=parse_metrics(resp.text)), counters_in(resp.text)


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"(no log at {path})"


def aiperf_run(exe: Path, out: Path, *, url: str, model: str, tokenizer: Path, trace: Path,
               users: int, duration_s: float, seed: int,
               timeout_s: float | None = None) -> tuple[pl.DataFrame, dict[str, Any]]:
    """One AIPerf run: its records as a request table, and its summary's metadata.

    ``PeerRunError`` (its log's tail, the folder kept) if it exits non-zero or writes
    no records.
    """
    out.mkdir(parents=True, exist_ok=True)
    console = out / "console.log"
    argv = aiperf_argv(exe, url=url, model=model, tokenizer=tokenizer, trace=trace,
                       users=users, duration_s=duration_s, seed=seed, out=out)
    # Its warm-up, the duration, the grace period and start-up: a hung run is cut off.
    limit = timeout_s or 4 * duration_s + 600
    with console.open("w") as fh:
        try:
            proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=aiperf_env(),
                                  cwd=out, timeout=limit, check=False)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {limit:.0f} s"
    records = out / AIPERF_RECORDS
    if rc != 0 or not records.is_file():
        log = out / AIPERF_LOG
        raise PeerRunError(f"AIPerf exited {rc}", _tail(log if log.is_file() else console),
                           out)
    meta: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        meta = json.loads((out / AIPERF_SUMMARY).read_text()).get("metadata") or {}
    return read_aiperf_records(records), meta


def agentload_run(out: Path, *, url: str, model: str, trace: Path, users: int,
                  duration_s: float, seed: int, options: tuple[str, ...]) -> pl.DataFrame:
    """One ``agentload replay`` run (a child process, as AIPerf is); its request table."""
    argv = agentload_argv(url=url, model=model, trace=trace, users=users,
                          duration_s=duration_s, seed=seed, out=out, options=options)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    with log.open("w") as fh:
        proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT,
                              timeout=4 * duration_s + 600, check=False)
    path = out / REQUESTS_NAME
    if proc.returncode != 0 or not path.is_file():
        raise PeerRunError(f"agentload replay exited {proc.returncode}", _tail(log), out)
    return pl.read_parquet(path)


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def agreement_aiperf(trace: Path, url: str | None = None, *, users: int = 4,
                     duration_s: float = 60.0, runs: int = 1, seed: int = 0,
                     warmup_s: float = 20.0, tokenizer: Path | None = None,
                     workdir: Path | None = None, pin_clients: bool = True,
                     say: Callable[[str], None] = lambda _: None,
                     peers: Path | None = None) -> dict[str, Any]:
    """agentload and AIPerf alternating on ``trace`` against one server (``url``, or the
    embedded CPU one); per tool and run the table's figures, medians, ratios and the
    per-request ratios on the requests both sent.

    ``ReplayError`` before anything runs if AIPerf's virtualenv is missing;
    ``PeerRunError`` if a run fails (its folder is kept, in ``workdir`` or a temporary
    folder the error names).
    """
    from agentload.replay.serve.probe import probe_target

    exe = aiperf_bin(peers)
    if min(users, runs) < 1 or duration_s <= 0 or warmup_s < 0:
        raise ReplayError("--users and --runs must be >= 1, --duration > 0, --warmup >= 0")
    if not trace.is_dir():
        raise ReplayError(f"--trace {trace}: must be a folder of WEKA session files "
                          "(AIPerf's weka_trace input)")
    help_text = subprocess.run([sys.executable, "-P", "-m", "agentload", "replay", "--help"],
                               capture_output=True, text=True, check=False,
                               env={**os.environ, "COLUMNS": "200"}).stdout
    options = agentload_traffic_options(help_text)
    # A failed run's folder outlives this call (the error names it); a passing one's
    # goes unless ``workdir`` was given.
    scratch = workdir is None
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="agentload-agree-aiperf-"))
    workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(_target(url, workdir, say, nice=SERVER_NICE))
        log = workdir / "server.log" if url is None else None
        pinned = (stack.enter_context(clients_off(worker_cpus(log), say))
                  if log is not None and pin_clients else None)
        model, _ = probe_target(base, None, None)
        tokenizer = tokenizer or tokenizer_for(model)
        if warmup_s > 0:
            say(f"warm-up: agentload for {warmup_s:g} s (not measured) ...")
            agentload_run(workdir / "warmup", url=base, model=model, trace=trace,
                          users=users, duration_s=warmup_s, seed=seed, options=options)
        ours: list[dict[str, Any]] = []
        theirs: list[dict[str, Any]] = []
        our_frames: list[pl.DataFrame] = []
        their_frames: list[pl.DataFrame] = []
        aiperf_meta: dict[str, Any] = {}
        for i in range(1, runs + 1):
            say(f"run {i}/{runs}: agentload replay {' '.join(options)} ...")
            (before, counters), t0 = scrape_counters(base), time.monotonic()
            frame = agentload_run(workdir / f"agentload{i}", url=base, model=model,
                                  trace=trace, users=users, duration_s=duration_s, seed=seed,
                                  options=options)
            after, counters_after = scrape_counters(base)
            ours.append(run_figures(frame) | {
                "prefix_hit_rate": prefix_cache_hit_rate(before, after),
                "server_ms": server_means_ms(counters_delta(counters, counters_after)),
                "wall_s": time.monotonic() - t0})
            our_frames.append(frame)
            say(f"run {i}/{runs}: AIPerf {SCENARIO} ...")
            (before, counters), t0 = scrape_counters(base), time.monotonic()
            frame, aiperf_meta = aiperf_run(exe, workdir / f"aiperf{i}", url=base, model=model,
                                            tokenizer=tokenizer, trace=trace, users=users,
                                            duration_s=duration_s, seed=seed)
            after, counters_after = scrape_counters(base)
            theirs.append(run_figures(frame) | {
                "prefix_hit_rate": prefix_cache_hit_rate(before, after),
                "server_ms": server_means_ms(counters_delta(counters, counters_after)),
                "wall_s": time.monotonic() - t0})
            their_frames.append(frame)
    if scratch:
        shutil.rmtree(workdir, ignore_errors=True)
    keys = [k for k, _, _ in ROWS]
    a = {k: _median([r.get(k) for r in ours]) for k in keys}
    b = {k: _median([r.get(k) for r in theirs]) for k in keys}
    ratio = {k: _median([_ratio(o.get(k), t.get(k)) for o, t in zip(ours, theirs,
                                                                    strict=True)])
             for k in keys}
    return {"config": {"trace": str(trace), "model": model, "users": users,
                       "duration_s": duration_s, "grace_s": GRACE_S, "seed": seed,
                       "runs": runs, "warmup_s": warmup_s, "tokenizer": str(tokenizer),
                       "scenario": SCENARIO, "agentload_options": list(options),
                       "client_cpus": sorted(pinned) if pinned is not None else None},
            "aiperf_metadata": aiperf_meta,
            "submission_valid": aiperf_meta.get("submission_valid"),
            "agentload": a, "aiperf": b, "ratio": ratio,
            "agentload_runs": ours, "aiperf_runs": theirs,
            "paired": paired_ratios(our_frames, their_frames)}


def _cell(fmt: str, v: float | None) -> str:
    return "n/a" if v is None else fmt.format(v)


# A figure "agrees" when agentload / AIPerf is within this of 1, or inside the spread of
# AIPerf's own repeat runs (issue 24's rule: a peer that moves more than the gap between
# the tools, run to run, cannot tell them apart).
AGREE_WITHIN = 0.05


def peer_spread(runs: list[dict[str, Any]], key: str) -> float | None:
    """(max - min) / median of one figure over AIPerf's runs; None under 2 runs."""
    vals = [float(v) for v in (x.get(key) for x in runs) if v is not None]
    if len(vals) < 2:
        return None
    mid = float(np.median(vals))
    return (max(vals) - min(vals)) / mid if mid else None


def agrees(ratio: float | None, spread: float | None) -> bool | None:
    """Whether a ratio is within ``AGREE_WITHIN`` of 1 or inside the peer's spread."""
    if ratio is None:
        return None
    return abs(ratio - 1) <= max(AGREE_WITHIN, spread or 0.0)


def agree_aiperf_lines(r: dict[str, Any]) -> list[str]:
    """The side-by-side table, per-run values, paired ratios and the validity note."""
    c = r["config"]
    meta = r.get("aiperf_metadata") or {}
    reasons = ", ".join(meta.get("submission_invalid_reasons") or []) or "unsafe_override"
    lines = [f"agentload vs AIPerf ({c['scenario']}) on {c['trace']}: {c['model']}, "
             f"{c['users']} users, {c['duration_s']:g} s (+{c['grace_s']:g} s grace), seed "
             f"{c['seed']}, median of {c['runs']} run(s) each after a "
             f"{c['warmup_s']:g} s warm-up",
             f"  AIPerf marked these runs submission_valid="
             f"{str(r.get('submission_valid')).lower()} ({reasons}: a local trace and a run "
             f"under 900 s need --unsafe-override); not an AgentX submission",
             f"  agentload replay {' '.join(c['agentload_options'])}",
             f"  {'':<24}{'agentload':>11}{'AIPerf':>11}{'ratio':>8}{'AIPerf spread':>15}"
             "   per run (agentload | AIPerf)"]
    if c.get("client_cpus"):
        lines.insert(3, f"  both clients on CPU {c['client_cpus']}, off the server "
                        "worker's cores")
    for key, label, fmt in ROWS:
        per = (" / ".join(_cell(fmt, x.get(key)) for x in r["agentload_runs"]) + " | "
               + " / ".join(_cell(fmt, x.get(key)) for x in r["aiperf_runs"]))
        ratio = r["ratio"][key]
        spread = peer_spread(r["aiperf_runs"], key)
        # "*": further from 1 than both 5 % and AIPerf's own run-to-run spread
        mark = "*" if agrees(ratio, spread) is False else " "
        lines.append(f"  {label:<24}{_cell(fmt, r['agentload'][key]):>11}"
                     f"{_cell(fmt, r['aiperf'][key]):>11}"
                     f"{_cell('{:.3f}', ratio):>8}{mark}{_cell('{:.1%}', spread):>14}   {per}")
    p = r["paired"]
    lines.append(f"  the same requests (trace id + turn, same OSL): {p['matched_requests']} "
                 f"pairs of {p['agentload_requests']} agentload and {p['aiperf_requests']} "
                 "AIPerf distinct requests, each a median over the runs")
    for key in ("ttft", "itl"):
        e = p[key]
        if e["median_ratio"] is None:
            lines.append(f"    {e['label']}: too few pairs ({e['pairs']} < {MIN_PAIRS})")
            continue
        ci = e["ci95"]
        span = f" (95 % interval {ci[0]:.3f}-{ci[1]:.3f})" if ci else " (no interval)"
        lines.append(f"    {e['label']} agentload / AIPerf per request: median "
                     f"{e['median_ratio']:.3f}{span}, {e['pairs']} pairs")
    # The server's own clock over each tool's run (warm-up and priming requests included):
    # a TTFT gap the server shows too is the workload's, not the clients'.
    runs = [(x.get("server_ms") or {}) for x in (*r["agentload_runs"], *r["aiperf_runs"])]
    if any(runs):
        n = len(r["agentload_runs"])
        lines.append("  the server's own means per run (agentload | AIPerf):")
        for key, label in (("time_to_first_token", "TTFT"), ("request_queue_time", "queue"),
                           ("request_prefill_time", "prefill"),
                           ("inter_token_latency", "ITL")):
            vals = [_cell("{:.1f}", x.get(key)) for x in runs]
            lines.append(f"    {label:<8}{' / '.join(vals[:n])} | {' / '.join(vals[n:])} ms")
    lines.append("  TTFT = first token - sent; ITL = (E2EL - TTFT) / (OSL - 1) per request; "
                 "ratio = median of per-run agentload / AIPerf; AIPerf spread = (max - min) "
                 "/ median of its runs; * = ratio further from 1 than both "
                 f"{AGREE_WITHIN:.0%} and that spread; prefix hits = server's counter delta "
                 "over each tool's run")
    return lines

"""Finalize a run directory: ``requests.parquet``, ``summary.json``, the reports, and
the console table printed after a run (``agentload replay`` and ``agentload report``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from agentload.replay.errors import ReplayError
from agentload.replay.journal import (
    GPU_METRICS_NAME,
    JOURNAL_NAME,
    finalize,
    merge_shards,
    read_journal,
)
from agentload.replay.results.metrics import (
    DEFINITIONS,
    bootstrap_ci,
    by_context_depth,
    per_session,
    per_user,
    steady_state,
    summarize,
    throughput_ci,
    validity,
    with_request_metrics,
)
from agentload.replay.results.report import HEADLINE, fmt, spec_decode, write_reports
from agentload.replay.results.slo import slo_line, slo_summary
from agentload.replay.serve.gpu_telemetry import summarize_gpu
from agentload.replay.serve.profile_window import (
    window_effect,
    window_warning,
)

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    report_md: Path | None
    report_html: Path | None
    interrupted: bool


def write_results(run_dir: Path, report: bool = True,
                  slo: dict[str, float] | None = None) -> RunResult:
    """Finalize a run directory: ``requests.parquet``, ``summary.json`` and the reports.

    Works on any run directory with a journal, including one whose replay was killed
    (``agentload report RUN_DIR``): what completed is kept, the rest is counted as unsent.
    ``slo`` (else the run's own ``--slo``) adds goodput and who met it (``slo.py``).
    """
    run_dir = Path(run_dir)
    if not (run_dir / JOURNAL_NAME).is_file():
        raise ReplayError(f"{run_dir} holds no run journal ({JOURNAL_NAME})")
    merge_shards(run_dir)  # a --workers run whose driver ended before it merged them
    meta, _ = read_journal(run_dir / JOURNAL_NAME)
    run_path = run_dir / "run.json"
    run: dict[str, Any] = (json.loads(run_path.read_text()) if run_path.is_file()
                           else next((m for m in meta if m.get("type") == "run"), {}))
    frame = finalize(run_dir)
    summary = summarize(frame, int(run.get("target", {}).get("gpus", 1)),
                        run.get("server_prefix_cache_hit_rate"))
    outcome = run.get("outcome")
    summary |= {"interrupted": bool(run.get("interrupted", outcome is None)),
                "definitions": DEFINITIONS}
    if outcome is not None:
        summary |= {"requests_sent": outcome["sent"], "requests_not_sent": outcome["skipped"],
                    "stop_reason": outcome["stop_reason"]}
    # Requests cut at --duration + --grace: journaled with phase "cut", never measured.
    summary["requests_cut"] = frame.filter(pl.col("phase") == "cut").height
    summary["cut_reason"] = (outcome or {}).get("cut_reason") or (
        "in flight past --duration + --grace" if summary["requests_cut"] else None)
    summary["traffic"] = traffic_rules(run)
    summary["ci95"] = bootstrap_ci(frame) | throughput_ci(frame, summary)
    summary["steady_state"] = steady_state(frame)
    gpu_path = run_dir / GPU_METRICS_NAME
    summary["gpu_telemetry"] = (
        summarize_gpu(pl.read_parquet(gpu_path).to_dicts()) if gpu_path.is_file()
        else {"available": False, "reason": run.get("gpu_telemetry", "not sampled")})
    summary["speculative_decoding"] = spec_decode(run)
    summary["profile_window"] = window_effect(run.get("profile_window"), frame)
    summary["by_context_depth"] = by_context_depth(frame)
    summary["client"] = run.get("client_diagnostics") or {
        "available": False, "reason": "not recorded (interrupted, or an older run)"}
    summary["workers"] = workers_summary(run.get("workers"), meta)
    summary["validity"] = validity(summary)
    slo = slo if slo is not None else run.get("slo_s")
    summary["slo"] = (slo_summary(with_request_metrics(frame.filter(pl.col("phase")
                                                                      == "measure")),
                                  slo, summary.get("window_s")) if slo else None)
    if summary["slo"]:  # flat too, so comparisons put them side by side
        summary |= {"goodput_req_s": summary["slo"]["goodput_req_s"],
                    "goodput_tok_s": summary["slo"]["goodput_tok_s"],
                    "slo_users_meeting_share": summary["slo"]["users"].get("share_meeting_all"),
                    "slo_sessions_meeting_share":
                        summary["slo"]["sessions"].get("share_meeting_all")}
    users = per_user(frame)
    per_session(frame).write_parquet(run_dir / "per_session.parquet")
    users.write_parquet(run_dir / "per_user.parquet")
    user_p90 = [float(x) for x in users["p90_interactivity_tok_s"].drop_nulls()]
    summary["per_user"] = {
        "users": users.height,
        "worst_user_p90_interactivity_tok_s": min(user_p90) if user_p90 else None,
        "median_user_p90_interactivity_tok_s": statistics.median(user_p90) if user_p90 else None,
    }
    write_json(run_dir / "summary.json", summary)
    md = page = None
    if report:
        md, page = write_reports(run_dir, summary, run, frame)
    return RunResult(run_dir, summary, md, page, bool(summary["interrupted"]))


def workers_summary(workers: dict[str, Any] | None,
                    meta: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How a ``--workers`` run was spread, and every worker it lost with the reason (from
    ``run.json``, else the journal's ``worker_lost`` events); None for one process."""
    lost = [m for m in meta if m.get("type") == "event" and m.get("kind") == "worker_lost"]
    if workers is None and not lost:
        return None
    out = dict(workers or {"count": None})
    if "lost" not in out:
        out["lost"] = [{k: v for k, v in m.items() if k not in ("type", "kind", "t_ns")}
                       for m in lost]
    out["workers_lost"] = len(out["lost"])
    out["requests_lost_in_flight"] = sum(int(x.get("in_flight_at_last_report") or 0)
                                         for x in out["lost"])
    return out


def traffic_rules(run: dict[str, Any]) -> dict[str, Any]:
    """Which pacing, cache-bust and end-of-run rules a run used (from its run.json)."""
    options = run.get("options") or {}
    fit = run.get("fit") or {}
    return {
        "aiperf_compatible": bool(options.get("aiperf_compatible", False)),
        "pauses": fit.get("pause_rule", "trace"),
        "pause_cap_s": fit.get("pause_cap_s"),
        "idle_cap_s": options.get("idle_cap_s"),
        "session_order": options.get("session_order", "pinned"),
        "start_at": options.get("start_at", "turn"),
        "cache_bust": options.get("cache_bust", "head"),
        "grace_s": options.get("grace_s"),
        "api": options.get("api", "completions"),
        "idle_cap_shifts": (run.get("outcome") or {}).get("idle_cap_shifts"),
    }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The console table printed after a run."""
    width = max(len(label) for _, label, _ in HEADLINE)
    lines = []
    verdict = summary.get("validity") or {}
    if verdict.get("verdict") == "invalid":  # first, as the HTML report puts it
        lines.append("  INVALID RUN: " + "; ".join(verdict.get("reasons", [])))
    profiled = window_warning(summary.get("profile_window"))
    if profiled:
        lines.append("  " + profiled)
    lines.append(f"  {'requests completed':<{width}}  {summary.get('requests_completed')} "
                 f"({summary.get('requests_failed')} failed)")
    lines += [f"  {label:<{width}}  {fmt(summary.get(key), unit)}"
              for key, label, unit in HEADLINE]
    slo_text = slo_line(summary.get("slo"))
    if slo_text:
        lines.append("  " + slo_text)
    spec = summary.get("speculative_decoding")
    if spec:
        length = spec.get("mean_acceptance_length")
        lines.append(f"  {'Speculative acceptance':<{width}}  {spec['acceptance_rate']:.1%} of "
                     f"{spec['draft_tokens']:,.0f} drafted tokens"
                     + (f", mean acceptance length {length:.2f}" if length else ""))
    return lines


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")

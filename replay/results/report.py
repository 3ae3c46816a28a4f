"""Reports of one run: ``report.md`` and a self-contained ``report.html``.

Three separate steps: the numbers come from ``metrics`` (frames and a summary dict),
``report_figures`` turns frames into plotly figures, and ``write_reports`` writes files.
The HTML embeds plotly.js once, so it opens offline; every string that came from a
trace, a server or an arm file is escaped. ``compare_report`` builds on the same parts
for several runs side by side.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import polars as pl

from agentload.replay.results import report_figures as figs
from agentload.replay.results.metrics import DEFINITIONS, per_session, per_user
from agentload.replay.results.slo import slo_line
from agentload.replay.serve.profile_window import window_warning
from agentload.replay.serve.prometheus import spec_acceptance

# (summary key, label, unit) of the headline table, in the order the seed asks about.
HEADLINE = (
    ("p90_interactivity_tok_s", "P90 interactivity", "tok/s/user"),
    ("e2e_norm_p90_interactivity_tok_s", "E2E-normalized P90 interactivity", "tok/s/user"),
    ("decode_throughput_tok_s", "Decode throughput (aggregate)", "tok/s"),
    ("ttft_p50_s", "TTFT P50", "s"),
    ("ttft_p90_s", "TTFT P90", "s"),
    ("itl_p50_s", "ITL P50", "ms"),
    ("e2el_p50_s", "Request latency P50", "s"),
    ("e2el_p90_s", "Request latency P90", "s"),
    ("output_throughput_tok_s", "Output throughput", "tok/s"),
    ("throughput_per_gpu_tok_s", "Throughput per GPU", "tok/s/GPU"),
    ("server_prefix_cache_hit_rate", "Prefix-cache hit rate (server)", "%"),
    # The server counts warmup requests too: this is the figure to hold it against.
    ("theoretical_prefix_cache_hit_rate_all", "  theoretical, same traffic", "%"),
    ("theoretical_prefix_cache_hit_rate", "Prefix-cache hit rate (theoretical)", "%"),
    ("usage_cached_tokens_rate", "Cached prompt tokens (usage)", "%"),
    ("osl_exact_fraction", "Requests with exact OSL", "%"),
)
# Shown in comparisons when a run was judged against an SLO (--slo).
SLO_ROWS = (
    ("goodput_req_s", "Goodput (requests meeting the SLO)", "req/s"),
    ("goodput_tok_s", "Goodput (their output tokens)", "tok/s"),
    ("slo_users_meeting_share", "Users whose P90 met the SLO", "%"),
    ("slo_sessions_meeting_share", "Sessions whose P90 met the SLO", "%"),
)
# Which way is better, for the comparison's verdict column.
HIGHER_IS_BETTER = {"goodput_req_s", "goodput_tok_s", "slo_users_meeting_share",
                    "slo_sessions_meeting_share", "p90_interactivity_tok_s",
                    "e2e_norm_p90_interactivity_tok_s",
                    "decode_throughput_tok_s", "output_throughput_tok_s",
                    "throughput_per_gpu_tok_s", "server_prefix_cache_hit_rate",
                    "usage_cached_tokens_rate"}
LOWER_IS_BETTER = {"ttft_p50_s", "ttft_p90_s", "itl_p50_s", "e2el_p50_s", "e2el_p90_s"}
DEFINITIONS_EXTRA = {
    "ttft_p50_s": "P50(TTFT_i), linear interpolation",
    "itl_p50_s": "P50(ITL_i); ITL_i = (E2EL_i - TTFT_i) / (OSL_i - 1)",
    "e2el_p50_s": "P50(E2EL_i): per-request latency, send to last token",
    "e2el_p90_s": "P90(E2EL_i)",
}
MAX_TABLE_ROWS = 200
STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1240px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;
text-align:left}th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
.warn{background:#fff3cd;border:1px solid #e0c36b;padding:8px 12px;margin:1em 0}
.bad{background:#f8d7da;border:1px solid #d9a1a8;padding:8px 12px;margin:1em 0}
.good{color:#1a7f37}.worse{color:#b42318}.muted{color:#777}"""


def fmt(value: Any, unit: str = "") -> str:
    """A number for people: 3 significant digits, thousands grouped; unit "%" for ratios,
    "ms" for a value given in seconds."""
    if value is None:
        return "n/a"
    if unit == "%":
        return f"{value:.1%}"
    if unit == "ms" and isinstance(value, int | float):
        value = float(value) * 1e3
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
        return f"{text} {unit}".strip()
    return f"{value} {unit}".strip()


def fmt_ci(ci: Sequence[float] | None, unit: str) -> str:
    if not ci or len(ci) != 2 or ci[0] is None:
        return ""
    return f"{fmt(ci[0], unit)} to {fmt(ci[1], unit)}"


def md_escape(text: object) -> str:
    """A trace- or server-supplied string made inert in Markdown (and the HTML it becomes)."""
    return html.escape(str(text)).replace("|", "\\|").replace("`", "'")


def definition(key: str) -> str:
    return DEFINITIONS.get(key) or DEFINITIONS_EXTRA.get(key, "")


def headline_rows(summary: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(label, value, 95 % interval, definition) for each headline metric."""
    ci = summary.get("ci95") or {}
    return [(label, fmt(summary.get(key), unit), fmt_ci(ci.get(key), unit), definition(key))
            for key, label, unit in HEADLINE]


def spec_decode(run: dict[str, Any]) -> dict[str, float] | None:
    """Speculative decoding over the run, from the server's counter deltas
    (``prometheus.spec_acceptance``)."""
    return spec_acceptance((run.get("server") or {}).get("metrics_delta") or {})


def warnings(summary: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """What a reader must know before trusting the numbers (plain text, unescaped)."""
    out = []
    verdict = summary.get("validity") or {}
    if verdict.get("verdict") == "invalid":
        out.append("INVALID RUN: " + "; ".join(verdict.get("reasons", [])))
    synthetic = (run.get("arm") or {}).get("synthetic_acceptance")
    if synthetic:
        out.append("SYNTHETIC: " + synthetic)
    if summary.get("interrupted"):
        out.append("PARTIAL: the run was interrupted; only the requests that finished count")
    profiled = window_warning(summary.get("profile_window"))
    if profiled:
        out.append(profiled)
    return out


def run_facts(summary: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """Plain-text lines on what was run (callers escape them)."""
    target = run.get("target", {})
    opts = run.get("options", {})
    arm = run.get("arm") or {}
    devices = (f"{summary.get('gpus')} GPU(s)" if target.get("device") == "gpu"
               else f"{target.get('device')}, counted as {summary.get('gpus')} device for "
                    "throughput per GPU")
    facts = [
        f"target: {target.get('label')} ({target.get('base_url')}, model "
        f"{target.get('model')}), {devices}",
    ]
    if arm:
        facts.append(f"arm: {arm.get('name')} from {arm.get('file')} — "
                     f"{arm.get('settings', {}).get('description', 'no description')}")
    server = run.get("server") or {}
    if server.get("server_version"):
        facts.append(f"server version: {server['server_version']}")
    if server.get("argv"):
        facts.append("server argv: " + " ".join(str(a) for a in server["argv"]))
    facts += [
        f"trace: {run.get('trace', {}).get('path')}, {opts.get('users')} users, "
        f"time scale {opts.get('time_scale')}, duration limit {opts.get('duration_s')}, "
        f"seed {opts.get('seed')}",
        f"requests: {summary.get('requests_completed')} completed, "
        f"{summary.get('requests_failed')} failed, "
        f"{(run.get('outcome') or {}).get('skipped', 0)} not sent "
        f"({(run.get('outcome') or {}).get('stop_reason', '?')}); window "
        f"{fmt(summary.get('window_s'), 's')}",
        f"prompts: {run.get('prompt_mode', 'token-ids')}; outputs: "
        f"{run.get('output_tokens', 'canned')}",
        "percentiles are request-weighted with linear interpolation; 95 % intervals: "
        "percentiles by bootstrap over whole sessions, throughputs by batch means over 10 "
        "equal time slices",
    ]
    spec = spec_decode(run)
    if spec:
        length = spec.get("mean_acceptance_length")
        facts.append(f"speculative decoding: {spec['acceptance_rate']:.1%} of drafted tokens "
                     f"accepted" + (f", mean acceptance length {length:.2f}" if length else ""))
    slo = slo_line(summary.get("slo"))
    if slo:
        facts.append(slo)
    return facts


def _users_table(frame: pl.DataFrame) -> pl.DataFrame:
    return per_user(frame).select(
        "lane", "sessions", "requests", "failed",
        (pl.col("itl_median_s") * 1e3).alias("median ITL (ms)"),
        pl.col("p90_interactivity_tok_s").alias("P90 interactivity (tok/s)"),
        pl.col("ttft_p90_s").alias("TTFT P90 (s)"), "output_tokens")


def render_markdown(summary: dict[str, Any], run: dict[str, Any], frame: pl.DataFrame) -> str:
    lines = [f"# agentload run: {md_escape(run.get('trace', {}).get('name', '?'))} on "
             f"{md_escape(run.get('target', {}).get('label', '?'))}", ""]
    lines += [f"> **{md_escape(w)}**" for w in warnings(summary, run)]
    lines += [f"- {md_escape(f)}" for f in run_facts(summary, run)]
    lines += ["", "| metric | value | 95 % interval | definition |", "|---|---|---|---|"]
    lines += [f"| {label} | {value} | {ci} | {defn} |"
              for label, value, ci, defn in headline_rows(summary)]
    verdict = summary.get("validity") or {}
    lines += ["", f"Validity: **{verdict.get('verdict', '?')}**"
              + "".join(f"; {md_escape(r)}" for r in verdict.get("reasons", []))]
    users = _users_table(frame)
    if users.height:
        lines += ["", "## Users", "", "| " + " | ".join(users.columns) + " |",
                  "|" + "---|" * len(users.columns)]
        lines += ["| " + " | ".join(fmt(v) for v in row) + " |"
                  for row in users.head(MAX_TABLE_ROWS).iter_rows()]
    sessions = per_session(frame)
    if sessions.height:
        lines += ["", "## Sessions", "",
                  "| session | lane | requests | failed | wall time (s) | TTFT P90 (s) "
                  "| median ITL (ms) | output tokens |", "|---|---|---|---|---|---|---|---|"]
        for row in sessions.head(MAX_TABLE_ROWS).iter_rows(named=True):
            itl = row["itl_median_s"]
            lines.append(
                f"| {md_escape(row['session_id'])} | {row['lane']} | {row['requests']} "
                f"| {row['failed']} "
                f"| {fmt(row['wall_s'])} | {fmt(row['ttft_p90_s'])} "
                f"| {fmt(itl * 1e3 if itl is not None else None)} | {row['output_tokens']} |")
    depth = summary.get("by_context_depth") or []
    if depth:
        lines += ["", "## By context depth", "",
                  "| ISL from | to | requests | P90 interactivity | TTFT P90 | cached |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {d['min_isl']} | {d['max_isl'] if d['max_isl'] is not None else '…'} "
                  f"| {d['requests']} | {fmt(d['p90_interactivity_tok_s'], 'tok/s')} "
                  f"| {fmt(d['ttft_p90_s'], 's')} | {fmt(d['cached_fraction'], '%')} |"
                  for d in depth]
    errors = frame.filter(~pl.col("ok"))
    if errors.height:
        lines += ["", "## Failed requests", ""]
        lines += [f"- {md_escape(r['request_id'])}: {md_escape(r['error'])}"
                  for r in errors.head(20).iter_rows(named=True)]
    return "\n".join(lines) + "\n"


def html_table(header: Sequence[str], rows: Sequence[Sequence[object]],
               numeric_from: int = 1) -> str:
    """An escaped HTML table; columns from ``numeric_from`` on are right-aligned."""
    esc = html.escape
    head = "".join(f"<th>{esc(str(h))}</th>" for h in header)
    body = "\n".join(
        "<tr>" + "".join(
            f"<td class=\"num\">{esc(str(c))}</td>" if i >= numeric_from
            else f"<td>{esc(str(c))}</td>" for i, c in enumerate(row)) + "</tr>"
        for row in rows)
    return f"<table><tr>{head}</tr>\n{body}</table>"


def plots_html(figures: Sequence[go.Figure]) -> str:
    """The figures as HTML, plotly.js embedded once (so the page opens offline)."""
    return "\n".join(
        f'<div class="figure">{fig.to_html(full_html=False, include_plotlyjs=(i == 0))}</div>'
        for i, fig in enumerate(figures))


def page(title: str, body: str) -> str:
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}"
            f"</title>\n<style>{STYLE}</style>\n</head><body><h1>{html.escape(title)}</h1>\n"
            f"{body}\n</body></html>\n")


def render_html(summary: dict[str, Any], run: dict[str, Any], frame: pl.DataFrame,
                server: pl.DataFrame | None = None) -> str:
    esc = html.escape
    title = (f"agentload run: {run.get('trace', {}).get('name', '?')} on "
             f"{run.get('target', {}).get('label', '?')}")
    label = str((run.get("arm") or {}).get("name") or run.get("target", {}).get("label", "run"))
    tables = figs.RunTables.of(frame, server if server is not None else pl.DataFrame())
    runs = [(label, tables)]
    parts = [f'<div class="{"bad" if w.startswith("INVALID") else "warn"}">{esc(w)}</div>'
             for w in warnings(summary, run)]
    parts.append("<ul>" + "".join(f"<li>{esc(f)}</li>" for f in run_facts(summary, run))
                 + "</ul>")
    parts.append(html_table(("metric", "value", "95 % interval", "definition"),
                            headline_rows(summary)))
    verdict = summary.get("validity") or {}
    parts.append(f"<p>Validity: <b>{esc(str(verdict.get('verdict', '?')))}</b>"
                 + "".join(f"; {esc(r)}" for r in verdict.get("reasons", [])) + "</p>")
    figures = [figs.user_ecdf(runs), figs.interactivity_histogram(runs),
               figs.latency_over_time(runs), figs.by_context_depth(runs),
               figs.server_over_time(runs), figs.session_timelines(label, tables)]
    parts.append(plots_html(figures))
    users = _users_table(frame)
    if users.height:
        parts.append("<h2>Users</h2>" + html_table(
            users.columns, [[fmt(v) for v in row]
                            for row in users.head(MAX_TABLE_ROWS).iter_rows()]))
    errors = frame.filter(~pl.col("ok"))
    if errors.height:
        parts.append("<h2>Failed requests</h2><ul>" + "".join(
            f"<li>{esc(str(r['request_id']))}: {esc(str(r['error']))}</li>"
            for r in errors.head(20).iter_rows(named=True)) + "</ul>")
    return page(title, "\n".join(parts))


def write_reports(run_dir: Path, summary: dict[str, Any], run: dict[str, Any],
                  frame: pl.DataFrame) -> tuple[Path, Path]:
    md = run_dir / "report.md"
    out = run_dir / "report.html"
    server = figs.read_server_metrics(run_dir)
    md.write_text(render_markdown(summary, run, frame))
    out.write_text(render_html(summary, run, frame, server))
    return md, out

"""Reports of one run: ``report.md`` and a self-contained ``report.html``.

Three separate steps: the numbers come from ``metrics`` (frames and a summary dict),
``figures`` turns frames into plotly figures, and ``write_reports`` writes files.
The HTML embeds plotly.js once, so it opens offline; every string that came from a
trace or a server is escaped.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import polars as pl

from agentload.replay.metrics import DEFINITIONS, per_session, with_request_metrics

HEADLINE = (
    ("p90_interactivity_tok_s", "P90 interactivity", "tok/s/user"),
    ("e2e_norm_p90_interactivity_tok_s", "E2E-normalized P90 interactivity", "tok/s/user"),
    ("ttft_p90_s", "TTFT P90", "s"),
    ("decode_throughput_tok_s", "Decode throughput (aggregate)", "tok/s"),
    ("output_throughput_tok_s", "Output throughput", "tok/s"),
    ("throughput_per_gpu_tok_s", "Throughput per GPU", "tok/s/GPU"),
    ("server_prefix_cache_hit_rate", "Prefix-cache hit rate (server)", "%"),
    ("theoretical_prefix_cache_hit_rate", "Prefix-cache hit rate (theoretical)", "%"),
    ("osl_exact_fraction", "Requests with exact OSL", "%"),
)


def fmt(value: Any, unit: str = "") -> str:
    """A number for people: 3 significant digits, thousands grouped; unit "%" for ratios."""
    if value is None:
        return "n/a"
    if unit == "%":
        return f"{value:.1%}"
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
        return f"{text} {unit}".strip()
    return f"{value} {unit}".strip()


def md_escape(text: object) -> str:
    """A trace- or server-supplied string made inert in Markdown (and the HTML it becomes)."""
    return html.escape(str(text)).replace("|", "\\|").replace("`", "'")


def figures(frame: pl.DataFrame) -> list[go.Figure]:
    """Per-request latency over time, the interactivity distribution, and the lanes."""
    data = with_request_metrics(frame.filter((pl.col("phase") == "measure") & pl.col("ok")))
    sent_s = (data["sent_ns"] / 1e9).to_list()
    latency = go.Figure()
    latency.add_trace(go.Scatter(x=sent_s, y=data["ttft_s"].to_list(), mode="markers",
                                 name="TTFT (s)"))
    latency.add_trace(go.Scatter(x=sent_s, y=(data["itl_s"] * 1e3).to_list(), mode="markers",
                                 name="ITL (ms)", yaxis="y2"))
    latency.update_layout(title="Per-request TTFT and ITL by send time",
                          xaxis_title="send time (s since start)", yaxis_title="TTFT (s)",
                          yaxis2={"title": "ITL (ms)", "overlaying": "y", "side": "right"})

    interactivity = go.Figure(go.Histogram(x=data["interactivity_tok_s"].to_list(),
                                           name="requests"))
    itl90 = data["itl_s"].drop_nulls().quantile(0.9, interpolation="linear")
    if itl90:
        interactivity.add_vline(x=1 / itl90, line_dash="dash",
                                annotation_text="P90 interactivity = 1 / P90(ITL)")
    interactivity.update_layout(title="Per-request interactivity (1 / ITL)",
                                xaxis_title="tokens/s/user", yaxis_title="requests")

    lanes = go.Figure()
    for phase_name, start_col, end_col in (("prefill (queue + TTFT)", "sent_ns", "first_token_ns"),
                                           ("decode", "first_token_ns", "last_token_ns")):
        start = data[start_col] / 1e9
        lanes.add_trace(go.Bar(
            base=start.to_list(), x=((data[end_col] / 1e9) - start).to_list(),
            y=[f"lane {lane}" for lane in data["lane"].to_list()], orientation="h",
            name=phase_name, text=[html.escape(r) for r in data["request_id"].to_list()],
            textposition="none",
            hovertemplate="%{text}<br>%{base:.2f} s + %{x:.2f} s<extra></extra>",
        ))
    lanes.update_layout(title="Session lanes: each request's prefill and decode (gaps are pauses)",
                        barmode="overlay", xaxis_title="time (s since start)")
    return [latency, interactivity, lanes]


def _headline_rows(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(label, fmt(summary.get(key), unit), DEFINITIONS.get(key, ""))
            for key, label, unit in HEADLINE]


def render_markdown(summary: dict[str, Any], run: dict[str, Any], frame: pl.DataFrame) -> str:
    lines = [f"# agentload run: {md_escape(run.get('trace', {}).get('name', '?'))} on "
             f"{md_escape(run.get('target', {}).get('label', '?'))}", ""]
    lines += _run_facts(summary, run)
    lines += ["", "| metric | value | definition |", "|---|---|---|"]
    lines += [f"| {label} | {value} | {definition} |"
              for label, value, definition in _headline_rows(summary)]
    sessions = per_session(frame)
    if sessions.height:
        lines += ["", "## Sessions", "",
                  "| session | lane | requests | failed | wall time (s) | TTFT P90 (s) "
                  "| median ITL (ms) | output tokens |", "|---|---|---|---|---|---|---|---|"]
        for row in sessions.iter_rows(named=True):
            itl = row["itl_median_s"]
            lines.append(
                f"| {md_escape(row['session_id'])} | {row['lane']} | {row['requests']} "
                f"| {row['failed']} "
                f"| {fmt(row['wall_s'])} | {fmt(row['ttft_p90_s'])} "
                f"| {fmt(itl * 1e3 if itl is not None else None)} | {row['output_tokens']} |")
    errors = frame.filter(~pl.col("ok"))
    if errors.height:
        lines += ["", "## Failed requests", ""]
        lines += [f"- {md_escape(r['request_id'])}: {md_escape(r['error'])}"
                  for r in errors.head(20).iter_rows(named=True)]
    return "\n".join(lines) + "\n"


def _run_facts(summary: dict[str, Any], run: dict[str, Any]) -> list[str]:
    target = run.get("target", {})
    opts = run.get("options", {})
    devices = (f"{summary.get('gpus')} GPU(s)" if target.get("device") == "gpu"
               else f"{target.get('device')}, counted as {summary.get('gpus')} device for "
                    "throughput per GPU")
    return [
        f"- target: {target.get('label')} ({target.get('base_url')}, model "
        f"`{target.get('model')}`), {devices}",
        f"- trace: {run.get('trace', {}).get('path')}, {opts.get('users')} users, "
        f"time scale {opts.get('time_scale')}, duration limit {opts.get('duration_s')}",
        f"- requests: {summary.get('requests_completed')} completed, "
        f"{summary.get('requests_failed')} failed, {run.get('outcome', {}).get('skipped', 0)} "
        f"not sent ({run.get('outcome', {}).get('stop_reason', '?')}); window "
        f"{fmt(summary.get('window_s'), 's')}",
        "- output lengths: canned from the trace (max_tokens with ignore_eos); percentiles "
        "are request-weighted with linear interpolation",
    ]


def render_html(summary: dict[str, Any], run: dict[str, Any], frame: pl.DataFrame) -> str:
    esc = html.escape
    title = esc(f"agentload run: {run.get('trace', {}).get('name', '?')} on "
                f"{run.get('target', {}).get('label', '?')}")
    rows = "\n".join(f"<tr><td>{esc(a)}</td><td><b>{esc(b)}</b></td><td>{esc(c)}</td></tr>"
                     for a, b, c in _headline_rows(summary))
    facts = "\n".join(f"<li>{esc(f[2:])}</li>" for f in _run_facts(summary, run))
    figs = figures(frame)
    plots = "\n".join(
        fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figs))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px}}</style>
</head><body><h1>{title}</h1><ul>{facts}</ul>
<table><tr><th>metric</th><th>value</th><th>definition</th></tr>{rows}</table>
{plots}
</body></html>
"""


def write_reports(run_dir: Path, summary: dict[str, Any], run: dict[str, Any],
                  frame: pl.DataFrame) -> tuple[Path, Path]:
    md = run_dir / "report.md"
    page = run_dir / "report.html"
    md.write_text(render_markdown(summary, run, frame))
    page.write_text(render_html(summary, run, frame))
    return md, page

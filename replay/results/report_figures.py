"""The plotly figures of run reports, one function a figure.

Each takes ``runs``: a list of (label, RunTables) so the same figure shows one run or
overlays several in a comparison. Every string that came from a trace, a server or an
arm file is HTML-escaped before it reaches a figure: plotly writes text into the page.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from agentload.replay.journal import SERVER_METRICS_NAME
from agentload.replay.results.metrics import per_user, with_request_metrics

# Beyond this many points a scatter switches to WebGL, which stays responsive.
_GL_POINTS = 5000
MAX_TIMELINE_ROWS = 60
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


@dataclass(frozen=True, slots=True)
class RunTables:
    """The tables of one run directory a report draws from."""

    requests: pl.DataFrame
    server: pl.DataFrame
    # Successful requests of the measured phase, with TTFT/ITL/E2EL columns: what most
    # figures draw, so it is derived once (``of``), not per figure.
    measured: pl.DataFrame

    @classmethod
    def of(cls, requests: pl.DataFrame, server: pl.DataFrame) -> RunTables:
        measured = with_request_metrics(
            requests.filter((pl.col("phase") == "measure") & pl.col("ok")))
        return cls(requests, server, measured)

    @classmethod
    def load(cls, run_dir: Path, requests: pl.DataFrame) -> RunTables:
        return cls.of(requests, read_server_metrics(run_dir))


def read_server_metrics(run_dir: Path) -> pl.DataFrame:
    """A run's ``server_metrics.parquet``, or an empty frame if it has none."""
    path = run_dir / SERVER_METRICS_NAME
    return pl.read_parquet(path) if path.is_file() else pl.DataFrame()


Runs = Sequence[tuple[str, RunTables]]


def _scatter(n: int) -> Any:
    return go.Scattergl if n > _GL_POINTS else go.Scatter


def _color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def user_ecdf(runs: Runs) -> go.Figure:
    """ECDF of each user's P90 interactivity: how many users got at least x tok/s."""
    fig = go.Figure()
    for i, (label, tables) in enumerate(runs):
        users = per_user(tables.requests)
        values = np.sort(users["p90_interactivity_tok_s"].drop_nulls().drop_nans().to_numpy())
        if not len(values):
            continue
        share = np.arange(1, len(values) + 1) / len(values)
        fig.add_trace(go.Scatter(x=values, y=share, mode="lines+markers", line_shape="hv",
                                 name=html.escape(label), line={"color": _color(i)}))
    fig.update_layout(title="Per-user P90 interactivity (ECDF): share of users at or below x",
                      xaxis_title="user's P90 interactivity = 1 / P90 of that user's ITL "
                      "(tok/s/user)", yaxis_title="share of users", yaxis_range=[0, 1.02])
    return fig


def latency_over_time(runs: Runs) -> go.Figure:
    """TTFT and ITL of every request by send time."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("TTFT (s)", "ITL (ms)"))
    for i, (label, tables) in enumerate(runs):
        data = tables.measured
        kind = _scatter(data.height)
        sent_s = (data["sent_ns"] / 1e9).to_numpy()
        fig.add_trace(kind(x=sent_s, y=data["ttft_s"].to_numpy(), mode="markers",
                           name=html.escape(label), legendgroup=str(i),
                           marker={"color": _color(i), "size": 5}), row=1, col=1)
        fig.add_trace(kind(x=sent_s, y=(data["itl_s"] * 1e3).to_numpy(), mode="markers",
                           name=html.escape(label), legendgroup=str(i), showlegend=False,
                           marker={"color": _color(i), "size": 5}), row=2, col=1)
    fig.update_layout(title="Per-request TTFT and ITL by send time", height=560)
    fig.update_xaxes(title_text="send time (s since the run started)", row=2, col=1)
    return fig


def by_context_depth(runs: Runs) -> go.Figure:
    """TTFT and ITL against the prompt length (context depth) of each request."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT (s) vs context depth",
                                                        "ITL (ms) vs context depth"))
    for i, (label, tables) in enumerate(runs):
        data = tables.measured
        kind = _scatter(data.height)
        isl = data["isl"].fill_null(data["isl_requested"]).to_numpy()
        fig.add_trace(kind(x=isl, y=data["ttft_s"].to_numpy(), mode="markers",
                           name=html.escape(label), legendgroup=str(i),
                           marker={"color": _color(i), "size": 5}), row=1, col=1)
        fig.add_trace(kind(x=isl, y=(data["itl_s"] * 1e3).to_numpy(), mode="markers",
                           name=html.escape(label), legendgroup=str(i), showlegend=False,
                           marker={"color": _color(i), "size": 5}), row=1, col=2)
    fig.update_xaxes(title_text="prompt tokens (ISL)")
    fig.update_layout(title="Latency by context depth", height=420)
    return fig


def session_timelines(label: str, tables: RunTables) -> go.Figure:
    """Each played session's requests on its own row: prefill, decode, and the pauses
    between (gaps); subagents get rows of their own under their session."""
    data = with_request_metrics(tables.requests.filter(pl.col("ok")))
    data = data.with_columns(
        row=pl.format("lane {} · play {} · {} · {}", pl.col("lane"), pl.col("play"),
                      pl.col("session_id"), pl.col("agent_kind")))
    rows = data.select("row", "sent_ns").group_by("row").agg(pl.col("sent_ns").min()) \
        .sort("sent_ns")["row"].to_list()
    shown = rows[:MAX_TIMELINE_ROWS]
    data = data.filter(pl.col("row").is_in(shown))
    fig = go.Figure()
    parts = (("prefill (queue + TTFT)", "sent_ns", "first_token_ns", "#ff7f0e"),
             ("decode", "first_token_ns", "last_token_ns", "#1f77b4"))
    for phase in ("warmup", "measure"):
        sub = data.filter(pl.col("phase") == phase)
        if sub.is_empty():
            continue
        for name, start_col, end_col, color in parts:
            start = (sub[start_col] / 1e9).to_numpy()
            fig.add_trace(go.Bar(
                base=start, x=(sub[end_col] / 1e9).to_numpy() - start,
                y=[html.escape(r) for r in sub["row"].to_list()], orientation="h",
                name=f"{name}, {phase}", marker={"color": color,
                                                  "opacity": 0.35 if phase == "warmup" else 1},
                text=[html.escape(r) for r in sub["request_id"].to_list()],
                textposition="none",
                hovertemplate="%{text}<br>%{base:.2f} s + %{x:.2f} s<extra></extra>"))
    hidden = len(rows) - len(shown)
    note = f" (first {len(shown)} of {len(rows)} rows)" if hidden > 0 else ""
    fig.update_layout(
        title=html.escape(f"{label}: session timelines — turns, pauses (gaps) and subagents"
                          f"{note}"),
        barmode="overlay", xaxis_title="time (s since the run started)",
        height=max(320, 22 * len(shown) + 160), yaxis={"autorange": "reversed"})
    return fig


def _rate(server: pl.DataFrame, hits: str, queries: str) -> tuple[np.ndarray, np.ndarray]:
    if hits not in server.columns or queries not in server.columns:
        return np.array([]), np.array([])
    d_hits = server[hits].diff().to_numpy()
    d_queries = server[queries].diff().to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(d_queries > 0, d_hits / d_queries, np.nan)
    return (server["t_ns"] / 1e9).to_numpy(), rate


def server_over_time(runs: Runs) -> go.Figure:
    """The server's own view, scraped each second: prefix-cache hit rate, queue, KV use."""
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07,
                        subplot_titles=("prefix-cache hit rate per second (server counter)",
                                        "requests running (solid) and waiting (dotted)",
                                        "KV cache usage"))
    for i, (label, tables) in enumerate(runs):
        server = tables.server
        if server.is_empty() or "t_ns" not in server.columns:
            continue
        name = html.escape(label)
        t, rate = _rate(server, "vllm:prefix_cache_hits_total",
                        "vllm:prefix_cache_queries_total")
        if len(t):
            fig.add_trace(go.Scatter(x=t, y=rate, mode="lines", name=name, legendgroup=str(i),
                                     line={"color": _color(i)}), row=1, col=1)
        t = (server["t_ns"] / 1e9).to_numpy()
        for col, dash, row in (("vllm:num_requests_running", "solid", 2),
                               ("vllm:num_requests_waiting", "dot", 2),
                               ("vllm:kv_cache_usage_perc", "solid", 3)):
            if col in server.columns:
                fig.add_trace(go.Scatter(x=t, y=server[col].to_numpy(), mode="lines",
                                         name=name, legendgroup=str(i), showlegend=False,
                                         line={"color": _color(i), "dash": dash}),
                              row=row, col=1)
    fig.update_yaxes(tickformat=".0%", row=1, col=1)
    fig.update_yaxes(tickformat=".0%", row=3, col=1)
    fig.update_xaxes(title_text="time (s since the run started)", row=3, col=1)
    fig.update_layout(title="Server metrics over time (Prometheus, 1 s)", height=640)
    return fig


def interactivity_histogram(runs: Runs) -> go.Figure:
    """Per-request interactivity (1 / ITL) with each run's P90 interactivity marked.

    Requests whose tokens all came in one or two chunks have an ITL near zero and an
    interactivity in the hundreds of thousands; the axis stops at the 99th percentile so
    they do not squash everyone else into one bar (the hover text says so).
    """
    fig = go.Figure()
    top = 0.0
    for i, (label, tables) in enumerate(runs):
        data = tables.measured
        values = data["interactivity_tok_s"].drop_nulls().drop_nans().to_numpy()
        values = values[np.isfinite(values)]
        if len(values):
            top = max(top, float(np.percentile(values, 99)))
        fig.add_trace(go.Histogram(x=values, name=html.escape(label), opacity=0.6,
                                   marker={"color": _color(i)}))
        itl90 = data["itl_s"].drop_nulls().quantile(0.9, interpolation="linear")
        if itl90:
            fig.add_vline(x=1 / itl90, line_dash="dash", line_color=_color(i))
    fig.update_layout(title="Per-request interactivity (1 / ITL); dashed: 1 / P90(ITL); "
                      "axis cut at the 99th percentile",
                      barmode="overlay", xaxis_title="tokens/s/user", yaxis_title="requests")
    if top > 0:
        fig.update_xaxes(range=[0, top * 1.1])
    return fig

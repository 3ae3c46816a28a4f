"""A self-contained HTML report of one profile, in the replay reports' style.

Compute, present, write: :func:`figures` turns a :class:`Summary` into plotly figures
and :func:`render_html` into a page with plotly.js embedded once (it opens offline).
Every string that came from the trace (range names, kernel names, paths) is escaped,
in the tables and in the figures' hover text.
"""

from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go
import polars as pl

from agentload.profiler.summary import Summary

DEFINITIONS = (
    ("instances", "executions of the range (or inferred layer)"),
    ("kernels", "kernel ops owned, summed over instances"),
    ("kernel time", "summed GPU duration of those kernels"),
    ("busy", "union of the GPU intervals of all owned ops (streams counted once)"),
    ("span", "last op end - first op start, per instance, summed"),
)


def _us(ns: object) -> str:
    return f"{float(ns) / 1e3:,.1f}" if isinstance(ns, int | float) else "n/a"


def figures(s: Summary) -> list[go.Figure]:
    """Per-layer kernel time per instance, and kernel time of each decode step."""
    esc = html.escape
    layers = s.layers.head(200)
    per = go.Figure()
    for pid in layers["pid"].unique().sort().to_list():
        rows = layers.filter(pl.col("pid") == pid)
        per.add_trace(go.Bar(
            x=[esc(n) for n in rows["name"].to_list()],
            y=(rows["kernel_ns"] / rows["instances"] / 1e3).to_list(),
            name=f"pid {pid}", hovertemplate="%{x}<br>%{y:.1f} µs per instance<extra></extra>"))
    per.update_layout(title="Kernel time per instance, by layer", yaxis_title="µs",
                      barmode="group")
    steps = go.Figure()
    for pid in s.steps["pid"].unique().sort().to_list():
        rows = s.steps.filter(pl.col("pid") == pid)
        steps.add_trace(go.Scatter(
            x=rows["index"].to_list(), y=(rows["kernel_ns"] / 1e3).to_list(), mode="lines+markers",
            name=f"pid {pid}", text=[esc(str(t)) for t in rows["step"].to_list()],
            hovertemplate="step %{x}: %{text}<br>%{y:.1f} µs<extra></extra>"))
    steps.update_layout(title="Summed kernel time per step", xaxis_title="step",
                        yaxis_title="µs")
    return [per, steps]


def _table(frame: pl.DataFrame, cols: list[tuple[str, str]]) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(label)}</th>" for _, label in cols)
    body = []
    for row in frame.iter_rows(named=True):
        cells = []
        for key, _ in cols:
            v = row.get(key)
            cells.append(f"<td>{esc(_us(v) if key.endswith('_ns') else str(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


LAYER_COLS = [("pid", "pid"), ("name", "layer"), ("instances", "instances"),
              ("kernels", "kernels"), ("kernel_ns", "kernel time (µs)"),
              ("busy_ns", "busy (µs)"), ("span_ns", "span (µs)"), ("gap_ns", "gaps (µs)")]
TYPE_COLS = [(k, v if k != "name" else "layer type") for k, v in LAYER_COLS]
TYPE_COLS[1] = ("type", "layer type")


def render_html(s: Summary) -> str:
    esc = html.escape
    title = esc(f"agentload profile: {Path(s.path).name}")
    facts = [f"source: {s.source} ({s.path})", f"level: {s.level}"
             + (" (layers inferred from the repeating kernel sequence)" if s.inferred else ""),
             f"{s.layers.height:,} layers, {s.steps.height:,} steps, "
             f"{int(s.instances['kernels'].sum()):,} kernels"]
    notes = "".join(f"<li>{esc(n)}</li>" for n in (*facts, *s.notes))
    defs = "".join(f"<tr><td>{esc(a)}</td><td>{esc(b)}</td></tr>" for a, b in DEFINITIONS)
    figs = figures(s)
    plots = "\n".join(f.to_html(full_html=False, include_plotlyjs=(i == 0))
                      for i, f in enumerate(figs))
    top = s.top_kernels.head(100)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px}}</style>
</head><body><h1>{title}</h1><ul>{notes}</ul>
<table><tr><th>column</th><th>definition</th></tr>{defs}</table>
<h2>Layers</h2>{_table(s.layers.head(500), LAYER_COLS)}
<h2>Layer types</h2>{_table(s.types, TYPE_COLS)}
<h2>Top kernels</h2>{_table(top, [("pid", "pid"), ("label", "layer"), ("kernel", "kernel"),
                                  ("count", "count"), ("kernel_ns", "kernel time (µs)")])}
{plots}
</body></html>
"""


def write_report(s: Summary, path: Path) -> Path:
    path.write_text(render_html(s))
    return path

"""Reports open in headless Chromium without a network, draw every figure, and keep
trace-supplied text inert (no element or script of a trace's making ever appears)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from agentload.replay.journal import REQUESTS_NAME, request_frame
from agentload.replay.results.compare_report import write_comparison
from agentload.replay.results.metrics import bootstrap_ci, summarize, validity
from agentload.replay.results.report import write_reports
from tests.replay.test_metrics import row
from tests.support.browser import distinct_colors, rendered_dom, screenshot

EVIL = '<img src=x onerror="document.title=\'pwned\'">'


def _run_dir(path: Path, itl_scale: float, evil: bool = False) -> Path:
    rows = []
    for i in range(40):
        r = row(i, sent=i * 0.25, ttft=0.05 + 0.01 * (i % 5), e2el=0.05 + itl_scale * (1 + i % 3),
                osl=51, isl=500 + 100 * i)
        r["lane"], r["play"] = i % 4, 0
        r["session_id"] = f"s{i % 4}" if not evil or i % 4 else EVIL
        rows.append(r)
    frame = request_frame(rows)
    path.mkdir(parents=True)
    frame.write_parquet(path / REQUESTS_NAME)
    pl.DataFrame({"t_ns": [int(t * 1e9) for t in range(10)],
                  "vllm:prefix_cache_hits_total": [float(50 * t) for t in range(10)],
                  "vllm:prefix_cache_queries_total": [float(100 * t) for t in range(10)],
                  "vllm:num_requests_running": [2.0] * 10,
                  "vllm:num_requests_waiting": [0.0] * 10,
                  "vllm:kv_cache_usage_perc": [0.1] * 10}).write_parquet(
        path / "server_metrics.parquet")
    summary = summarize(frame, gpus=1, server_prefix_cache_hit_rate=0.5)
    summary["ci95"] = bootstrap_ci(frame)
    summary["validity"] = validity(summary)
    run = {"trace": {"name": EVIL if evil else "t", "path": "t.jsonl"},
           "target": {"label": "srv", "base_url": "http://h", "model": "m", "device": "gpu",
                      "gpus": 1},
           "arm": {"name": path.name, "file": "arms.toml", "settings": {
               "description": EVIL if evil else "d"}, "synthetic_acceptance": None},
           "options": {"users": 4, "time_scale": 1.0, "duration_s": None}}
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "run.json").write_text(json.dumps(run))
    write_reports(path, summary, run, frame)
    return path


def test_single_run_report_renders_every_figure_offline(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path / "a", 0.5, evil=True)
    page = run_dir / "report.html"
    raw = page.read_text()
    assert "<img src=x" not in raw and "onerror=\"document" not in raw
    dom = rendered_dom(page)
    # Six figures, each drawn by plotly.js into its own SVG root.
    assert dom.count('class="plot-container plotly"') == 6
    assert dom.count('class="main-svg"') >= 6
    assert "<img src=\"x\"" not in dom and "<title>pwned" not in dom
    assert "ECDF" in dom and "session timelines" in dom
    png = screenshot(page, tmp_path / "single.png")
    assert distinct_colors(png) > 200  # figures, not a blank page


def test_comparison_report_renders_side_by_side(tmp_path: Path) -> None:
    a = _run_dir(tmp_path / "fast", 0.5)
    b = _run_dir(tmp_path / "slow", 1.0)
    data_path, md, page = write_comparison(tmp_path / "cmp", [a, b])
    data = json.loads(data_path.read_text())
    itl = next(r for r in data["rows"] if r["metric"] == "itl_p50_s")
    assert itl["runs"][1]["ratio_to_baseline"] > 1.5 and itl["runs"][1]["verdict"] == "worse"
    assert "| ITL P50 |" in md.read_text()
    # The same 40 requests in both: TPOT twice as long each, TTFT the same.
    paired = data["paired"][0]
    assert paired["matched_requests"] == 40 and paired["itl_s"]["verdict"] == "worse"
    assert paired["itl_s"]["median_ratio"] == pytest.approx(2.0, rel=0.05)
    assert paired["ttft_s"]["median_diff_s"] == 0.0
    assert paired["ttft_s"]["verdict"].startswith("within noise")
    dom = rendered_dom(page)
    assert dom.count('class="plot-container plotly"') == 5
    assert "fast (1 GPU)" in dom and "slow (1 GPU) / fast (1 GPU)" in dom
    assert "The same requests, paired" in dom
    assert distinct_colors(screenshot(page, tmp_path / "cmp.png")) > 200

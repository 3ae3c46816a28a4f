"""Reports: numbers formatted for people, trace strings escaped, plotly embedded once."""

from __future__ import annotations

from pathlib import Path

from agentload.replay.journal import request_frame
from agentload.replay.results.metrics import summarize
from agentload.replay.results.report import fmt, write_reports
from tests.replay.test_metrics import row


def test_fmt() -> None:
    assert fmt(0.123, "%") == "12.3%"
    assert fmt(0.0793, "s") == "0.0793 s"
    assert fmt(2487.3, "tok/s") == "2,487 tok/s"
    assert fmt(None, "s") == "n/a"
    assert fmt(0.5) == "0.5"  # a unitless number is not a percentage


def test_reports_are_written_escaped_and_self_contained(tmp_path: Path) -> None:
    rows = [row(i, sent=i * 0.5, ttft=0.1, e2el=1.1, osl=101) for i in range(6)]
    rows[0]["request_id"] = "<script>alert(1)</script>"
    rows.append(row(9, 1.0, 0.1, 0.2, 10, ok=False))
    frame = request_frame(rows)
    summary = summarize(frame, gpus=1, server_prefix_cache_hit_rate=0.5)
    run = {"trace": {"name": "<b>t</b>", "path": "t.jsonl"},
           "target": {"label": "srv", "base_url": "http://h", "model": "m", "device": "gpu"},
           "options": {"users": 2, "time_scale": 1.0, "duration_s": None}}
    md, page = write_reports(tmp_path, summary, run, frame)
    text = md.read_text()
    assert "| P90 interactivity | 100 tok/s/user |" in text
    assert "| Prefix-cache hit rate (server) | 50.0% |" in text
    assert "| s1 | 1 | 4 | 1 |" in text  # the failed request counts in its session
    assert "<b>" not in text and "&lt;script&gt;" not in text  # ids are not in the md table
    assert "TTFT P90 (s)" in text and "| 0.1 |" in text
    assert "- r9: boom" in text
    html = page.read_text()
    assert "<script>alert(1)</script>" not in html and "&lt;b&gt;t&lt;/b&gt;" in html
    # plotly.js is embedded once (offline), not fetched from a CDN.
    assert html.count("plotly.js v") == 1 and len(html) > 1_000_000
    assert "<script src=\"http" not in html

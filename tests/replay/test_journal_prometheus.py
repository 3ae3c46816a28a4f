"""The run journal survives a torn last line; Prometheus text is parsed and diffed."""

from __future__ import annotations

from pathlib import Path

from agentload.replay.journal import Journal, RequestRecord, finalize, read_journal
from agentload.replay.serve.prometheus import MetricsScrape, parse_metrics, prefix_cache_hit_rate


def record(i: int) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}", session_id="s", lane=0, agent_kind="main", turn=i, phase="measure",
        intended_ns=i, sent_ns=i, first_token_ns=i + 5, last_token_ns=i + 9, done_ns=i + 10,
        isl_requested=64, osl_requested=8, isl=64, osl=8, osl_source="server",
        cached_tokens=0, theoretical_cached_tokens=0, chunks=8, ok=True, status=200, error=None,
    )


def test_torn_final_line_loses_nothing_before_it(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    with Journal(path) as journal:
        journal.write_run({"trace": {"name": "t"}})
        for i in range(3):
            journal.write_request(record(i))
    with open(path, "ab") as fh:  # what kill -9 in the middle of a write leaves
        fh.write(b'{"type": "request", "request_id": "r3", "sess')
    meta, rows = read_journal(path)
    assert [r["request_id"] for r in rows] == ["r0", "r1", "r2"]
    assert meta[0]["type"] == "run"
    frame = finalize(tmp_path)
    assert frame.height == 3 and (tmp_path / "requests.parquet").is_file()


METRICS = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1280.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 720.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.79e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 576.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} NaN
vllm:num_requests_running 3
"""


def test_counters_sum_over_engines_and_skip_others() -> None:
    values = parse_metrics(METRICS)
    assert values["vllm:prefix_cache_queries_total"] == 2000.0
    assert values["vllm:prefix_cache_hits_total"] == 576.0
    assert values["vllm:num_requests_running"] == 3.0
    assert "vllm:kv_cache_usage_perc" not in values
    assert "vllm:prefix_cache_queries_created" not in values


def test_hit_rate_is_a_delta_over_the_window() -> None:
    before = MetricsScrape({"vllm:prefix_cache_queries_total": 1000,
                            "vllm:prefix_cache_hits_total": 100})
    after = MetricsScrape({"vllm:prefix_cache_queries_total": 3000,
                           "vllm:prefix_cache_hits_total": 1600})
    assert prefix_cache_hit_rate(before, after) == 0.75
    assert prefix_cache_hit_rate(MetricsScrape({}, ok=False), after) is None
    assert prefix_cache_hit_rate(before, before) is None

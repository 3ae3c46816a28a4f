"""The agreement check: one set of definitions for every tool, and a real run of both."""

from __future__ import annotations

import numpy as np
import pytest

from agentload.replay.agree import agree_lines, agree_trace, agreement, figures, median_of


def test_figures_use_the_same_definitions_for_every_tool() -> None:
    gaps = [np.array([0.01, 0.01, 0.04]), np.array([0.02, 0.02, 0.02])]
    f = figures([0.1, 0.3], gaps, [4, 4])
    assert f["ttft"]["p50_ms"] == pytest.approx(200.0)
    # TPOT per request: 60 ms / 3 = 20 ms for both requests.
    assert f["tpot"]["p50_ms"] == pytest.approx(20.0)
    # Per-chunk gaps pooled: 10, 10, 20, 20, 20, 40 ms.
    assert f["itl"]["p50_ms"] == pytest.approx(20.0)
    assert f["itl"]["p90_ms"] == pytest.approx(30.0)
    runs = [f, figures([0.5], [np.array([0.03])], [2]), figures([0.2], [np.array([0.01])], [2])]
    assert median_of(runs)["ttft"]["p50_ms"] == pytest.approx(200.0)


def test_agree_trace_has_exact_disjoint_prompts() -> None:
    t = agree_trace(5, 64, 16, salt=2)
    assert t.num_requests == 5
    blocks = [r.blocks[0] for r in t.requests()]
    assert len({b.id for b in blocks}) == 5 and all(b.tokens == 64 for b in blocks)


@pytest.mark.vllm
def test_agree_against_the_embedded_server(embedded_server: str) -> None:
    r = agreement(embedded_server, requests=8, concurrency=2, input_len=32, output_len=16,
                  runs=1)
    assert r["agentload_runs"][0]["completed"] == 8
    assert r["vllm_bench_runs"][0]["completed"] == 8
    for m in ("ttft", "tpot"):
        for q in ("p50_ms", "p90_ms"):
            assert r["agentload"][m][q] > 0 and r["vllm_bench"][m][q] > 0
            assert r["ratio"][m][q] is not None
    # Per-chunk gaps can be 0 at the median: a busy server writes several events at once.
    assert r["agentload"]["itl"]["p90_ms"] >= 0 and r["vllm_bench"]["itl"]["p90_ms"] >= 0
    # Same server, same requests: the two tools' TPOT medians are of one magnitude.
    assert 0.5 < r["ratio"]["tpot"]["p50_ms"] < 2.0
    assert any("TTFT P50" in line for line in agree_lines(r))

"""Paired comparison: the same requests in two runs, their differences and intervals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from agentload.replay.journal import request_frame
from agentload.replay.results.compare_paired import (
    MIN_PAIRS,
    matched_requests,
    paired_cells,
    paired_difference,
    paired_lines,
)
from agentload.replay.results.compare_report import LoadedRun, paired_results, paired_rows
from agentload.replay.results.metrics import with_request_metrics
from agentload.replay.results.report_figures import RunTables
from tests.replay.test_metrics import row


def _measured(ttft: np.ndarray, tpot_s: float = 0.01, sessions: int = 6,
              isl: int = 1000) -> pl.DataFrame:
    rows = []
    for i, t in enumerate(ttft):
        r = row(i, sent=i * 1.0, ttft=float(t), e2el=float(t) + tpot_s * 50, osl=51, isl=isl)
        r["session_id"] = f"s{i % sessions}"
        rows.append(r)
    return with_request_metrics(request_frame(rows))


def test_a_common_slowdown_cancels_in_the_pairs_but_not_in_the_ratio_of_medians() -> None:
    rng = np.random.default_rng(1)
    depth = rng.uniform(0.02, 0.2, 60)  # each request's own TTFT, by its context
    base = _measured(depth)
    # The other arm adds 20 ms to every request, and a shared machine adds up to 300 ms
    # to both arms alike, request by request.
    load = rng.uniform(0.0, 0.3, 60)
    slow_base = _measured(depth + load)
    other = _measured(depth + load + 0.02 + rng.normal(0, 0.005, 60))
    # Medians of the two runs: the load swamps 20 ms (x1.1, inside any noise band) ...
    ratio_of_medians = other["ttft_s"].median() / slow_base["ttft_s"].median()
    assert ratio_of_medians < 1.15
    # ... which the pairs take out: +20 ms, an interval clear of 0.
    r = paired_difference(slow_base, other)
    ttft = r["ttft_s"]
    assert r["matched_requests"] == 60 and ttft["pairs"] == 60
    assert ttft["median_diff_s"] == pytest.approx(0.02, abs=0.003)
    lo, hi = ttft["ci95_diff_s"]
    assert 0 < lo < 0.02 < hi and ttft["verdict"] == "worse"
    # TPOT did not move: the interval holds 0.
    assert r["itl_s"]["verdict"].startswith("within noise")
    # And the same runs without the load are also "worse", by the same 20 ms.
    assert paired_difference(base, _measured(depth + 0.02))["ttft_s"]["median_diff_s"] \
        == pytest.approx(0.02, abs=1e-6)
    # Faster is "better"; the lines say what moved, and only that.
    fast = paired_difference(other, slow_base)
    assert fast["ttft_s"]["verdict"] == "better"
    lines = paired_lines("b", "a", r)
    assert len(lines) == 1 and lines[0].startswith("b vs a, the same 60 requests: TTFT +")
    cells = paired_cells(r)
    assert cells[0].startswith("+") and " ms [+" in cells[0] and cells[0].endswith("worse")


def test_only_the_same_requests_are_paired() -> None:
    a = _measured(np.full(20, 0.1))
    # Another trace reusing the ids for other prompts: nothing pairs.
    assert matched_requests(a, _measured(np.full(20, 0.1), isl=2000)).height == 0
    # The other run got through only half the requests.
    r = paired_difference(a, _measured(np.full(10, 0.2)))
    assert r["matched_requests"] == 10 and r["baseline_requests"] == 20
    few = paired_difference(a, _measured(np.full(MIN_PAIRS - 1, 0.2)))
    assert few["ttft_s"]["median_diff_s"] is None
    assert few["ttft_s"]["verdict"].startswith("too few matched requests")
    assert paired_cells(few)[0].startswith("too few")
    one = paired_difference(_measured(np.full(20, 0.1), sessions=1),
                            _measured(np.full(20, 0.2), sessions=1))
    assert one["ttft_s"]["ci95_diff_s"] is None
    assert one["ttft_s"]["verdict"].startswith("no interval")
    assert paired_lines("b", "a", one) == []


def test_recycled_plays_pair_play_by_play() -> None:
    # Two plays of the same 10 requests (--recycle): each pairs with its own play only.
    first, second = _measured(np.full(10, 0.1)), _measured(np.full(10, 0.3))
    base = pl.concat([first.with_columns(play=pl.lit(0)), second.with_columns(play=pl.lit(1))])
    other = base.with_columns(ttft_s=pl.col("ttft_s") + 0.01)
    r = paired_difference(base, other)
    assert r["matched_requests"] == 20 and r["ttft_s"]["pairs"] == 20
    assert r["ttft_s"]["median_diff_s"] == pytest.approx(0.01)


def test_requests_in_a_profile_window_are_left_out_of_the_pairs(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    depth = rng.uniform(0.02, 0.2, 40)
    base = _measured(depth)
    other = _measured(depth + 0.02)
    # The other run's server profiled 10.5-20.5 s: its requests sent then took 2 s more.
    s = 1_000_000_000
    slowed = (other["sent_ns"] >= 10 * s) & (other["sent_ns"] < 21 * s)
    other = other.with_columns(pl.when(slowed).then(pl.col("ttft_s") + 2.0)
                               .otherwise(pl.col("ttft_s")).alias("ttft_s"))
    window = {"events": [{"what": "start_profile", "sent_ns": int(10.5 * s)},
                         {"what": "stop_profile", "answered_ns": int(20.5 * s)}]}

    def loaded(label: str, frame: pl.DataFrame, run: dict[str, Any]) -> LoadedRun:
        return LoadedRun(label, tmp_path, {}, run, RunTables(frame, pl.DataFrame(), frame))

    [r] = paired_results([loaded("a", base, {}), loaded("b", other,
                                                       {"profile_window": window})])
    assert r["profiled_set_aside"] == [0, 11]  # sent 10-20 s, 1 s apart, plus the one before
    assert r["matched_requests"] == 29
    assert r["ttft_s"]["median_diff_s"] == pytest.approx(0.02, abs=1e-6)
    assert "(0 / 11 in a profile window set aside)" in paired_rows([r])[0][1]

"""Metric definitions on hand-made request tables, checked against numpy and by hand."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from agentload.replay.journal import REQUEST_SCHEMA, request_frame
from agentload.replay.results.metrics import decoding_time_s, summarize, with_request_metrics

S = 1_000_000_000  # ns per second


def row(i: int, sent: float, ttft: float, e2el: float, osl: int, isl: int = 1000,
        ok: bool = True, osl_req: int | None = None, theo: int = 500, phase: str = "measure",
        cached: int | None = 400) -> dict[str, object]:
    return {
        "request_id": f"r{i}", "session_id": f"s{i % 2}", "lane": i % 2, "agent_kind": "main",
        "turn": i, "phase": phase, "intended_ns": int(sent * S), "sent_ns": int(sent * S),
        "first_token_ns": int((sent + ttft) * S) if ok else None,
        "last_token_ns": int((sent + e2el) * S) if ok else None,
        "done_ns": int((sent + e2el) * S), "isl_requested": isl,
        "osl_requested": osl if osl_req is None else osl_req, "isl": isl if ok else None,
        "osl": osl if ok else None, "osl_source": "server", "cached_tokens": cached,
        "theoretical_cached_tokens": theo, "chunks": osl, "ok": ok,
        "status": 200, "error": None if ok else "boom",
    }


def test_per_request_definitions() -> None:
    frame = with_request_metrics(request_frame([row(0, 0.0, 0.5, 2.5, 101)]))
    r = frame.row(0, named=True)
    assert r["ttft_s"] == pytest.approx(0.5)
    assert r["e2el_s"] == pytest.approx(2.5)
    assert r["itl_s"] == pytest.approx(2.0 / 100)
    assert r["interactivity_tok_s"] == pytest.approx(50.0)


def test_itl_needs_two_tokens() -> None:
    frame = with_request_metrics(request_frame([row(0, 0.0, 0.5, 0.5, 1)]))
    assert frame["itl_s"][0] is None


def test_summary_matches_numpy_linear_percentiles_and_hand_sums() -> None:
    rng = np.random.default_rng(1)
    rows, itls, e2e_per_tok, ttfts = [], [], [], []
    for i in range(23):
        ttft, osl = float(rng.uniform(0.05, 0.5)), int(rng.integers(2, 300))
        itl = float(rng.uniform(0.002, 0.02))
        e2el = ttft + itl * (osl - 1)
        rows.append(row(i, sent=i * 0.7, ttft=ttft, e2el=e2el, osl=osl))
        itls.append(itl)
        e2e_per_tok.append(e2el / osl)
        ttfts.append(ttft)
    rows.append(row(99, 3.0, 0.1, 0.2, 10, ok=False))
    rows.append(row(98, 0.0, 0.1, 0.2, 10, phase="warmup"))  # excluded from metrics
    s = summarize(request_frame(rows), gpus=2, server_prefix_cache_hit_rate=0.42)
    assert s["requests_completed"] == 23 and s["requests_failed"] == 1
    assert s["p90_interactivity_tok_s"] == pytest.approx(1 / np.percentile(itls, 90), rel=1e-6)
    assert s["e2e_norm_p90_interactivity_tok_s"] == pytest.approx(
        1 / np.percentile(e2e_per_tok, 90), rel=1e-6)
    assert s["ttft_p90_s"] == pytest.approx(np.percentile(ttfts, 90), rel=1e-6)
    ok = [r for r in rows if r["ok"] and r["phase"] == "measure"]
    window = (max(r["last_token_ns"] for r in ok) - min(r["sent_ns"] for r in ok)) / S
    osl_sum = sum(r["osl"] for r in ok)
    assert s["output_throughput_tok_s"] == pytest.approx(osl_sum / window)
    assert s["throughput_per_gpu_tok_s"] == pytest.approx((osl_sum + 1000 * 23) / window / 2)
    assert s["theoretical_prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert s["server_prefix_cache_hit_rate"] == 0.42
    assert s["osl_exact_fraction"] == 1.0
    assert s["gpus"] == 2


def test_decode_throughput_excludes_prefill_and_idle_time() -> None:
    # Two requests decode over [1, 3] and [2, 4]; a third over [10, 11]: 4 s of decoding.
    rows = [row(0, 0.0, 1.0, 3.0, 201), row(1, 1.0, 1.0, 3.0, 201), row(2, 9.0, 1.0, 2.0, 101)]
    s = summarize(request_frame(rows), gpus=1)
    assert s["decoding_time_s"] == pytest.approx(4.0)
    assert s["decode_throughput_tok_s"] == pytest.approx((200 + 200 + 100) / 4.0)


def test_osl_exact_fraction_counts_short_outputs() -> None:
    rows = [row(0, 0, 0.1, 1, 50), row(1, 1, 0.1, 1, 49, osl_req=50)]
    assert summarize(request_frame(rows), gpus=1)["osl_exact_fraction"] == 0.5


def test_union_of_intervals() -> None:
    assert decoding_time_s(np.array([0, 5, 1]), np.array([2, 6, 3])) == pytest.approx(4e-9)
    assert decoding_time_s(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == 0.0


def test_empty_run_summarizes_to_nones() -> None:
    s = summarize(pl.DataFrame(schema=REQUEST_SCHEMA), gpus=1)
    assert s["requests_completed"] == 0
    assert s["p90_interactivity_tok_s"] is None and s["osl_exact_fraction"] is None


def test_schedule_lag_and_pause_error() -> None:
    rows = [row(i, float(i), 0.1, 0.5, 10) for i in range(4)]
    for i, r in enumerate(rows):
        r["sent_ns"] = int(r["intended_ns"]) + i * 10_000_000  # 0, 10, 20, 30 ms late
        r["ready_ns"] = None if i == 0 else int(r["intended_ns"]) - S  # paused 1 s after deps
    summary = summarize(request_frame(rows), 1)
    assert summary["schedule_lag_p99_s"] == pytest.approx(np.percentile([0, .01, .02, .03], 99))
    assert summary["pause_error_p99_s"] == pytest.approx(np.percentile([.01, .02, .03], 99))
    assert summary["pause_error_p50_s"] == pytest.approx(0.02)


def test_per_user_and_per_session_views() -> None:
    from agentload.replay.results.metrics import per_session, per_user

    rows = [row(i, float(i), 0.1, 0.1 + 0.01 * (i + 1) * 9, 10) for i in range(6)]
    users = per_user(request_frame(rows))
    assert users["lane"].to_list() == [0, 1] and users["requests"].to_list() == [3, 3]
    # lane 0 holds requests 0, 2, 4 with ITLs 0.01, 0.03, 0.05.
    assert users["itl_median_s"][0] == pytest.approx(0.03)
    assert users["p90_interactivity_tok_s"][0] == pytest.approx(1 / np.percentile(
        [0.01, 0.03, 0.05], 90))
    sessions = per_session(request_frame(rows))
    assert sessions.height == 2 and set(sessions["session_id"]) == {"s0", "s1"}


def test_bootstrap_interval_brackets_the_estimate_and_validity_names_reasons() -> None:
    from agentload.replay.results.metrics import bootstrap_ci, validity

    rng = np.random.default_rng(3)
    rows = []
    for i in range(200):
        r = row(i, float(i), 0.1, 0.1 + float(rng.uniform(0.002, 0.02)) * 99, 100)
        r["session_id"] = f"s{i % 20}"
        rows.append(r)
    frame = request_frame(rows)
    summary = summarize(frame, 1)
    ci = bootstrap_ci(frame, resamples=300)
    low, high = ci["p90_interactivity_tok_s"]  # type: ignore[misc]
    assert low < summary["p90_interactivity_tok_s"] < high
    assert high - low < 0.5 * summary["p90_interactivity_tok_s"]
    assert validity(summary) == {"verdict": "valid", "reasons": []}
    bad = validity(summary | {"requests_failed": 50, "osl_exact_fraction": 0.9,
                              "requests_sent": 10, "requests_not_sent": 90,
                              "stop_reason": "server died: oom"})
    assert bad["verdict"] == "invalid" and len(bad["reasons"]) == 3


def test_bootstrap_gives_no_interval_where_every_draw_is_undefined() -> None:
    import json
    import warnings

    from agentload.replay.results.metrics import bootstrap_ci

    # Every request's tokens read at once (first token = last token): ITL 0, so the
    # interactivity percentiles (1 / ITL) are undefined in every draw.
    rows = []
    for i in range(40):
        r = row(i, float(i), 0.1, 0.1, 20)
        r["session_id"] = f"s{i % 4}"
        rows.append(r)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's all-NaN warning is gone too
        ci = bootstrap_ci(request_frame(rows), resamples=50)
    assert ci["p90_interactivity_tok_s"] is None and ci["p50_interactivity_tok_s"] is None
    low, high = ci["ttft_p50_s"]  # type: ignore[misc]
    assert low == high == pytest.approx(0.1)
    json.loads(json.dumps(ci), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))


def test_steady_state_cuts_a_warm_up_transient_and_strata_split_by_depth() -> None:
    from agentload.replay.results.metrics import by_context_depth, steady_state, steady_state_start

    rng = np.random.default_rng(0)
    transient = np.linspace(0.2, 0.02, 30)  # slow while caches and batches fill
    settled = rng.normal(0.02, 0.001, 170)
    cut = steady_state_start(np.concatenate([transient, settled]))
    assert 20 <= cut <= 40
    assert steady_state_start(rng.normal(0.02, 0.001, 200)) <= 15  # nothing to cut
    itl = np.concatenate([np.linspace(0.3, 0.02, 30), rng.normal(0.02, 0.001, 170)])
    rows = [row(i, float(i), 0.1, 0.1 + float(itl[i]) * 9, 10, isl=500 if i % 2 else 5000)
            for i in range(200)]
    state = steady_state(request_frame(rows))
    assert state["detected"] and 20 <= state["requests_dropped"] <= 40
    strata = by_context_depth(request_frame(rows))
    assert [(s["min_isl"], s["requests"]) for s in strata] == [(0, 100), (4096, 100)]


def test_throughput_intervals_are_batch_means_around_the_run_value() -> None:
    from agentload.replay.results.metrics import throughput_ci

    steady = request_frame([row(i, sent=i * 1.0, ttft=0.1, e2el=1.1, osl=101)
                            for i in range(40)])
    ci = throughput_ci(steady, summarize(steady, gpus=1))
    value = summarize(steady, gpus=1)["output_throughput_tok_s"]
    lo, hi = ci["output_throughput_tok_s"]
    assert lo < value < hi and (hi - lo) / value < 0.1  # a steady run: a narrow interval
    # Most tokens in one early burst, then a trickle: the slices differ, the interval widens.
    bursty = request_frame([row(i, sent=i * 0.1 if i < 30 else 3 + (i - 29) * 4.0, ttft=0.1,
                                e2el=1.1, osl=101) for i in range(40)])
    lo_b, hi_b = throughput_ci(bursty, summarize(bursty, gpus=1))["output_throughput_tok_s"]
    assert (hi_b - lo_b) > 3 * (hi - lo)
    assert isinstance(lo_b, float)
    short = steady.head(5)
    assert throughput_ci(short, summarize(short, gpus=1))["output_throughput_tok_s"] is None

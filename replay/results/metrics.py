"""Per-request metrics and run aggregates, exactly as docs/metrics.md defines them.

Per request (from ``requests.parquet``; ns since run start):
  TTFT = first token chunk - sent;  E2EL = last token chunk - sent;
  ITL (= TPOT) = (E2EL - TTFT) / (OSL - 1) for OSL >= 2;  interactivity = 1 / ITL.
Aggregates are request-weighted over the measured, successful requests, with linearly
interpolated percentiles (numpy's default, passed explicitly to polars, whose default is
"nearest"):
  P90 interactivity = 1 / P90(ITL)  (the slow tail, AgentX v1.0);
  E2E-normalized P90 interactivity = 1 / P90(E2EL / OSL);
  decode throughput = sum(OSL - 1) / time during which at least one request is decoding;
  output throughput = sum(OSL) / window;  throughput per GPU = (sum ISL + sum OSL) / window / GPUs,
where the window runs from the first send to the last token.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import polars as pl

DEFINITIONS = {
    "ttft_s": "first token chunk (content or reasoning) - sent, seconds",
    "e2el_s": "last token chunk - sent, seconds",
    "itl_s": "(E2EL - TTFT) / (OSL - 1), seconds, for OSL >= 2 (= TPOT)",
    "p90_interactivity_tok_s": "1 / P90(ITL_i), request-weighted, linear interpolation",
    "e2e_norm_p90_interactivity_tok_s": "1 / P90(E2EL_i / OSL_i), request-weighted",
    "ttft_p90_s": "P90(TTFT_i), linear interpolation",
    "decode_throughput_tok_s": "sum(OSL_i - 1) / time with >= 1 request decoding "
                               "(prefill excluded)",
    "output_throughput_tok_s": "sum(OSL_i) / (last token - first send)",
    "throughput_per_gpu_tok_s": "(sum(ISL_i) + sum(OSL_i)) / window / gpus",
    "server_prefix_cache_hit_rate": "delta vllm:prefix_cache_hits / delta "
                                    "vllm:prefix_cache_queries over the run (tokens)",
    "theoretical_prefix_cache_hit_rate": "sum of prompt tokens an infinite prefix cache "
                                         "would hold at send time (leading blocks already "
                                         "sent earlier in the run) / the sum of their "
                                         "requested ISL (the same blocks, so <= 100 %)",
    "theoretical_prefix_cache_hit_rate_all": "the same over every successful request the "
                                             "server saw, warmup included (compare with "
                                             "server_prefix_cache_hit_rate)",
    "usage_cached_tokens_rate": "sum of usage.prompt_tokens_details.cached_tokens / sum(ISL_i)"
                                " over measured requests (compare with theoretical)",
    "isl_exact_fraction": "share of successful requests whose server-reported ISL equals the "
                          "trace's (1.0 in token-id mode; chat mode sends text)",
    "isl_error_p50": "median |ISL_i - trace ISL_i| / trace ISL_i",
    "osl_exact_fraction": "share of successful requests whose server-reported OSL equals "
                          "the requested max_tokens",
    "schedule_lag_p99_s": "P99(sent_i - intended_i): how late requests left against the "
                          "schedule (dependencies done + pause, or arrival)",
    "pause_error_p99_s": "P99((sent_i - ready_i) - (intended_i - ready_i)) over requests "
                         "with dependencies: measured gap minus intended gap",
    "errors_by_kind": "failed requests by cause: refused, connect_timeout, http_4xx, "
                      "http_5xx, stall (no bytes within the stall timeout), timeout (over "
                      "the request timeout), cut (stream closed mid-way), malformed (bad "
                      "SSE), server_error (error event), no_tokens, transport",
}


def with_request_metrics(frame: pl.DataFrame) -> pl.DataFrame:
    """Add ``ttft_s``, ``e2el_s``, ``itl_s`` and ``interactivity_tok_s`` columns."""
    ttft = (pl.col("first_token_ns") - pl.col("sent_ns")) / 1e9
    e2el = (pl.col("last_token_ns") - pl.col("sent_ns")) / 1e9
    return frame.with_columns(
        ttft_s=ttft,
        e2el_s=e2el,
        itl_s=pl.when(pl.col("osl") >= 2).then((e2el - ttft) / (pl.col("osl") - 1)),
    ).with_columns(
        interactivity_tok_s=pl.when(pl.col("itl_s") > 0).then(1.0 / pl.col("itl_s")),
    )


def _quantile(series: pl.Series, q: float) -> float | None:
    values = series.drop_nulls()
    if values.is_empty():
        return None
    result = values.quantile(q, interpolation="linear")
    return None if result is None else float(result)


def _inverse(x: float | None) -> float | None:
    return None if x is None or x <= 0 else 1.0 / x


def decoding_time_s(first_ns: np.ndarray, last_ns: np.ndarray) -> float:
    """Length of the union of the [first token, last token] intervals, in seconds."""
    if len(first_ns) == 0:
        return 0.0
    order = np.argsort(first_ns, kind="stable")
    total = 0
    cur_start, cur_end = int(first_ns[order[0]]), int(last_ns[order[0]])
    for i in order[1:]:
        start, end = int(first_ns[i]), int(last_ns[i])
        if start > cur_end:
            total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    total += cur_end - cur_start
    return total / 1e9


def summarize(
    frame: pl.DataFrame,
    gpus: int,
    server_prefix_cache_hit_rate: float | None = None,
) -> dict[str, Any]:
    """The headline numbers of a run (the keys ``summary.json`` must carry)."""
    measured = with_request_metrics(frame.filter(pl.col("phase") == "measure"))
    ok = measured.filter(pl.col("ok"))
    failed = measured.height - ok.height
    lag_s = (measured["sent_ns"] - measured["intended_ns"]) / 1e9
    dependent = measured.filter(pl.col("ready_ns").is_not_null())
    gap_error_s = ((dependent["sent_ns"] - dependent["ready_ns"])
                   - (dependent["intended_ns"] - dependent["ready_ns"])) / 1e9
    out: dict[str, Any] = {
        "requests_completed": ok.height,
        "requests_failed": failed,
        "gpus": gpus,
        "server_prefix_cache_hit_rate": server_prefix_cache_hit_rate,
        "schedule_lag_p50_s": _quantile(lag_s, 0.5),
        "schedule_lag_p99_s": _quantile(lag_s, 0.99),
        "pause_error_p50_s": _quantile(gap_error_s, 0.5),
        "pause_error_p99_s": _quantile(gap_error_s, 0.99),
        "errors_by_kind": {str(k): int(n) for k, n in measured.filter(~pl.col("ok"))
                           .group_by("error_kind").len().sort("error_kind")
                           .iter_rows()},
    }
    if ok.is_empty():
        return out | {k: None for k in (
            "p90_interactivity_tok_s", "e2e_norm_p90_interactivity_tok_s", "ttft_p90_s",
            "decode_throughput_tok_s", "output_throughput_tok_s", "throughput_per_gpu_tok_s",
            "theoretical_prefix_cache_hit_rate", "osl_exact_fraction", "window_s",
        )}
    osl = ok["osl"].fill_null(0)
    isl = ok["isl"].fill_null(ok["isl_requested"])
    isl_sum, osl_sum = int(isl.sum()), int(osl.sum())
    window_s = (int(ok["last_token_ns"].max()) - int(ok["sent_ns"].min())) / 1e9  # type: ignore[arg-type]
    decoders = ok.filter(pl.col("osl") >= 2)
    decode_s = decoding_time_s(decoders["first_token_ns"].to_numpy(),
                               decoders["last_token_ns"].to_numpy())
    e2e_per_token = (ok["e2el_s"] / ok["osl"]).filter(ok["osl"] > 0)
    out |= {
        "p90_interactivity_tok_s": _inverse(_quantile(ok["itl_s"], 0.9)),
        "p50_interactivity_tok_s": _inverse(_quantile(ok["itl_s"], 0.5)),
        "e2e_norm_p90_interactivity_tok_s": _inverse(_quantile(e2e_per_token, 0.9)),
        "ttft_p50_s": _quantile(ok["ttft_s"], 0.5),
        "ttft_p90_s": _quantile(ok["ttft_s"], 0.9),
        "itl_p50_s": _quantile(ok["itl_s"], 0.5),
        "itl_p90_s": _quantile(ok["itl_s"], 0.9),
        "e2el_p50_s": _quantile(ok["e2el_s"], 0.5),
        "e2el_p90_s": _quantile(ok["e2el_s"], 0.9),
        "decode_throughput_tok_s": (float((decoders["osl"] - 1).sum()) / decode_s
                                    if decode_s > 0 else None),
        "output_throughput_tok_s": osl_sum / window_s if window_s > 0 else None,
        "throughput_per_gpu_tok_s": ((isl_sum + osl_sum) / window_s / gpus
                                     if window_s > 0 and gpus > 0 else None),
        # Theoretical hits are counted in the requested prompt's tokens, so they are a
        # share of the requested ISL (the server's count differs: chat rendering and its
        # template), never more than 100 %.
        "theoretical_prefix_cache_hit_rate": _theoretical(ok),
        # From each response's usage.prompt_tokens_details.cached_tokens, when the server
        # reports it (vLLM with --enable-prompt-tokens-details).
        "usage_cached_tokens_rate": (int(ok["cached_tokens"].sum()) / isl_sum
                                     if isl_sum and ok["cached_tokens"].null_count() < ok.height
                                     else None),
        # Everything the server saw in the window, warmup included: the like-for-like
        # reference for its own counter (server_prefix_cache_hit_rate).
        "theoretical_prefix_cache_hit_rate_all": _all_phases_theoretical(frame),
        "osl_exact_fraction": float((ok["osl"] == ok["osl_requested"]).sum()) / ok.height,
        "isl_exact_fraction": float((ok["isl"] == ok["isl_requested"]).sum()) / ok.height,
        "isl_error_p50": _quantile(((ok["isl"] - ok["isl_requested"]).abs()
                                    / ok["isl_requested"]).drop_nulls(), 0.5),
        "osl_from_client_count": int((ok["osl_source"] == "client").sum()),
        "input_tokens": isl_sum,
        "output_tokens": osl_sum,
        "window_s": window_s,
        "decoding_time_s": decode_s,
    }
    return out


def _theoretical(ok: pl.DataFrame) -> float | None:
    """Theoretical prefix hits over the requested ISL of ``ok``'s requests: both counted
    in the replay's own blocks (dividing by the server's ISL mixed units and gave rates
    over 100 % when the server counted fewer tokens than were requested)."""
    requested = int(ok["isl_requested"].sum())
    return int(ok["theoretical_cached_tokens"].sum()) / requested if requested else None


def _all_phases_theoretical(frame: pl.DataFrame) -> float | None:
    return _theoretical(frame.filter(pl.col("ok")))


def _group_view(frame: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    measured = with_request_metrics(frame.filter(pl.col("phase") == "measure"))
    ok_itl = pl.col("itl_s").filter(pl.col("ok"))
    return (
        measured.group_by(*keys)
        .agg(
            requests=pl.len(),
            failed=(~pl.col("ok")).sum(),
            sessions=pl.col("session_id").n_unique(),
            wall_s=(pl.col("done_ns").max() - pl.col("sent_ns").min()) / 1e9,
            ttft_p90_s=pl.col("ttft_s").filter(pl.col("ok")).quantile(
                0.9, interpolation="linear"),
            itl_median_s=ok_itl.quantile(0.5, interpolation="linear"),
            itl_p90_s=ok_itl.quantile(0.9, interpolation="linear"),
            input_tokens=pl.col("isl").sum(),
            output_tokens=pl.col("osl").sum(),
        )
        .with_columns(
            interactivity_median_tok_s=1.0 / pl.col("itl_median_s"),
            p90_interactivity_tok_s=1.0 / pl.col("itl_p90_s"),
        )
        .sort(*keys)
    )


def per_session(frame: pl.DataFrame) -> pl.DataFrame:
    """One row per played session: requests, wall time including pauses, ITL, TTFT."""
    return _group_view(frame, ["lane", "play", "session_id"])


def per_user(frame: pl.DataFrame) -> pl.DataFrame:
    """One row per user lane: what that user saw over every session it played."""
    return _group_view(frame, ["lane"])


def bootstrap_ci(frame: pl.DataFrame, resamples: int = 1000, seed: int = 0,
                 ) -> dict[str, list[float] | None]:
    """95 % intervals of the headline percentiles, resampling whole sessions.

    Requests of one session are not independent (one user, one growing context, one
    closed loop), so the bootstrap draws sessions with replacement and pools their
    requests, which keeps that dependence inside each resample.
    """
    ok = with_request_metrics(frame.filter((pl.col("phase") == "measure") & pl.col("ok")))
    keys = ("p50_interactivity_tok_s", "p90_interactivity_tok_s", "ttft_p50_s", "ttft_p90_s",
            "e2e_norm_p90_interactivity_tok_s", "e2el_p50_s", "e2el_p90_s")
    groups = [g for _, g in ok.group_by("session_id", maintain_order=True)]
    if len(groups) < 2:
        return dict.fromkeys(keys)
    itl = [g["itl_s"].drop_nulls().to_numpy() for g in groups]
    ttft = [g["ttft_s"].drop_nulls().to_numpy() for g in groups]
    e2e = [(g["e2el_s"] / g["osl"]).filter(g["osl"] > 0).to_numpy() for g in groups]
    e2el = [g["e2el_s"].drop_nulls().to_numpy() for g in groups]
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(resamples):
        pick = rng.integers(0, len(groups), size=len(groups))
        i, t, e, el = (np.concatenate([parts[j] for j in pick])
                       for parts in (itl, ttft, e2e, e2el))
        if len(i) and len(t) and len(e):
            p50, p90 = np.percentile(i, [50, 90])
            draws["p50_interactivity_tok_s"].append(1 / p50 if p50 > 0 else np.nan)
            draws["p90_interactivity_tok_s"].append(1 / p90 if p90 > 0 else np.nan)
            t50, t90 = np.percentile(t, [50, 90])
            draws["ttft_p50_s"].append(float(t50))
            draws["ttft_p90_s"].append(float(t90))
            e90 = float(np.percentile(e, 90))
            draws["e2e_norm_p90_interactivity_tok_s"].append(1 / e90 if e90 > 0 else np.nan)
            l50, l90 = np.percentile(el, [50, 90])
            draws["e2el_p50_s"].append(float(l50))
            draws["e2el_p90_s"].append(float(l90))
    # A draw is NaN where the percentile it inverts was 0 (every chunk of those requests
    # read at once); with no finite draw there is no interval (and no NaN in the JSON).
    out: dict[str, list[float] | None] = {}
    for k, v in draws.items():
        finite = np.asarray(v, dtype=float)
        finite = finite[~np.isnan(finite)]
        out[k] = [float(x) for x in np.percentile(finite, [2.5, 97.5])] if finite.size else None
    return out


# Student's t at 97.5 % for batches - 1 degrees of freedom (10 batches).
_T975 = {4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _spread(start: np.ndarray, end: np.ndarray, amount: np.ndarray,
            edges: np.ndarray) -> np.ndarray:
    """``amount`` of each interval spread evenly over it, summed per slice of ``edges``."""
    out = np.zeros(len(edges) - 1)
    length = np.maximum(end - start, 1.0)
    for i in range(len(edges) - 1):
        overlap = np.clip(np.minimum(end, edges[i + 1]) - np.maximum(start, edges[i]), 0, None)
        out[i] = float((amount * overlap / length).sum())
    return out


def throughput_ci(frame: pl.DataFrame, summary: dict[str, Any], batches: int = 10,
                  ) -> dict[str, list[float] | None]:
    """95 % intervals of the throughputs by batch means over equal time slices.

    A throughput is one figure of the whole run, not a mean of independent requests, so
    it is not bootstrapped: the window is cut into ``batches`` equal slices, each
    request's tokens are spread over the time it spent on them (prompt tokens over
    send..first token, output tokens over first..last token), and the spread of the
    slices' rates gives a t interval around the run's own value, taken from ``summary``
    (the run's ``summarize``, so it is not computed twice).
    """
    gpus = int(summary.get("gpus") or 1)
    keys = ("output_throughput_tok_s", "decode_throughput_tok_s", "throughput_per_gpu_tok_s")
    ok = frame.filter((pl.col("phase") == "measure") & pl.col("ok")
                      & pl.col("first_token_ns").is_not_null())
    if ok.height < 2 * batches or batches - 1 not in _T975:
        return dict.fromkeys(keys)
    sent = ok["sent_ns"].to_numpy().astype(float)
    first = ok["first_token_ns"].to_numpy().astype(float)
    last = ok["last_token_ns"].to_numpy().astype(float)
    osl = ok["osl"].fill_null(0).to_numpy().astype(float)
    isl = ok["isl"].fill_null(ok["isl_requested"]).to_numpy().astype(float)
    edges = np.linspace(sent.min(), last.max(), batches + 1)
    slice_s = (edges[1] - edges[0]) / 1e9
    if slice_s <= 0:
        return dict.fromkeys(keys)
    out_tok = _spread(first, last, osl, edges)
    in_tok = _spread(sent, first, isl, edges)
    decode_tok = _spread(first, last, np.maximum(osl - 1, 0), edges)
    decoding = np.array([decoding_time_s(np.clip(first, lo, hi), np.clip(last, lo, hi))
                         for lo, hi in itertools.pairwise(edges)])
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = {
            "output_throughput_tok_s": out_tok / slice_s,
            "decode_throughput_tok_s": np.where(decoding > 0, decode_tok / decoding, np.nan),
            "throughput_per_gpu_tok_s": (out_tok + in_tok) / slice_s / max(gpus, 1),
        }
    result: dict[str, list[float] | None] = {}
    for key, series in rates.items():
        series = series[np.isfinite(series)]
        value = summary.get(key)
        if len(series) < 3 or value is None:
            result[key] = None
            continue
        half = _T975.get(len(series) - 1, 2.262) * float(np.std(series, ddof=1)) / np.sqrt(
            len(series))
        result[key] = [float(value - half), float(value + half)]
    return result


# AIPerf counts a request's OSL as a mismatch past min(5 % of the request, 50 tokens).
MAX_ERROR_RATE = 0.10
MIN_OSL_EXACT = 0.99
MIN_COVERAGE = 0.5


def validity(summary: dict[str, Any]) -> dict[str, Any]:
    """A verdict like AIPerf's: "valid", or "invalid" with every reason that applies."""
    reasons = []
    done, failed = summary.get("requests_completed") or 0, summary.get("requests_failed") or 0
    if done + failed == 0:
        reasons.append("no request completed")
    elif failed / (done + failed) > MAX_ERROR_RATE:
        reasons.append(f"error rate {failed / (done + failed):.1%} > {MAX_ERROR_RATE:.0%}")
    exact = summary.get("osl_exact_fraction")
    if exact is not None and exact < MIN_OSL_EXACT:
        reasons.append(f"only {exact:.1%} of requests got exactly the requested output "
                       f"length (< {MIN_OSL_EXACT:.0%}): the server ignored max_tokens or "
                       "ignore_eos")
    sent, unsent = summary.get("requests_sent"), summary.get("requests_not_sent")
    stop = summary.get("stop_reason") or ""
    if sent is not None and unsent and not stop.endswith("reached"):
        coverage = sent / (sent + unsent)
        if coverage < MIN_COVERAGE:
            reasons.append(f"only {coverage:.0%} of the trace was sent ({stop})")
    if summary.get("interrupted"):
        reasons.append("the run was interrupted")
    for lost in (summary.get("workers") or {}).get("lost") or ():
        reasons.append(f"worker {lost.get('worker')} (lanes {lost.get('lanes')}) was lost at "
                       f"{lost.get('at_s')} s: {lost.get('reason')}")
    # A client that could not keep up reports itself, not the server (diagnostics.py).
    reasons += (summary.get("client") or {}).get("saturation_reasons") or []
    return {"verdict": "invalid" if reasons else "valid", "reasons": reasons}


def steady_state_start(values: np.ndarray, batch: int = 5) -> int:
    """Where the warm-up transient ends in a series (MSER-5): the index to keep from.

    The series is cut into batches of ``batch``; the start kept is the one that
    minimises the standard error of the remaining batch means, searched over the first
    half only, and kept only if the dropped part differs from the rest by more than
    noise.
    """
    n = len(values) // batch
    if n < 4:
        return 0
    means = values[: n * batch].reshape(n, batch).mean(axis=1)
    best, best_d = float("inf"), 0
    for d in range(n // 2):
        rest = means[d:]
        score = rest.var() / len(rest)  # MSER: spread of what is kept, per sample
        if score < best:
            best, best_d = score, d
    # MSER alone also "finds" a transient in pure noise; keep a cut only if what it drops
    # really differs from what it keeps (more than 3 standard errors).
    if best_d:
        dropped, kept = means[:best_d], means[best_d:]
        if abs(dropped.mean() - kept.mean()) < 3 * kept.std() / np.sqrt(best_d):
            return 0
    return best_d * batch


def steady_state(frame: pl.DataFrame) -> dict[str, Any]:
    """The steady window of a run (MSER-5 over ITL in send order) and its headline numbers."""
    ok = with_request_metrics(frame.filter((pl.col("phase") == "measure") & pl.col("ok")))
    ok = ok.filter(pl.col("itl_s").is_not_null()).sort("sent_ns")
    if ok.height < 20:
        return {"detected": False, "reason": "fewer than 20 decoded requests"}
    cut = steady_state_start(ok["itl_s"].to_numpy())
    kept = ok[cut:]
    p90 = _quantile(kept["itl_s"], 0.9)
    return {
        "detected": True,
        "method": "MSER-5 over per-request ITL in send order",
        "start_s": int(kept["sent_ns"][0]) / 1e9,
        "requests_dropped": cut,
        "requests": kept.height,
        "p90_interactivity_tok_s": _inverse(p90),
        "ttft_p90_s": _quantile(kept["ttft_s"], 0.9),
    }


def by_context_depth(frame: pl.DataFrame,
                     edges: tuple[int, ...] = (0, 1024, 4096, 8192, 16384, 32768, 65536,
                                               131072)) -> list[dict[str, Any]]:
    """Headline numbers per context-depth bucket (ISL), so runs whose request mix drifted
    apart (a faster server gets further into its sessions) compare like with like."""
    ok = with_request_metrics(frame.filter((pl.col("phase") == "measure") & pl.col("ok")))
    rows = []
    bounds = [*edges, None]
    for lo, hi in itertools.pairwise(bounds):
        assert lo is not None
        part = ok.filter(pl.col("isl") >= lo)
        if hi is not None:
            part = part.filter(pl.col("isl") < hi)
        if part.is_empty():
            continue
        rows.append({
            "min_isl": lo, "max_isl": None if hi is None else hi - 1, "requests": part.height,
            "p90_interactivity_tok_s": _inverse(_quantile(part["itl_s"], 0.9)),
            "ttft_p90_s": _quantile(part["ttft_s"], 0.9),
            "cached_fraction": (float(part["cached_tokens"].sum()) / float(part["isl"].sum())
                                if part["cached_tokens"].null_count() < part.height else None),
        })
    return rows

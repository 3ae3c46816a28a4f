"""The same requests in two runs, side by side: paired TTFT and TPOT differences.

Arms of a comparison replay one trace (``agentload compare`` gives every arm the same
seed and cache salt), so request ``s03/5`` of one arm is the request ``s03/5`` of the
other: the same context, the same prompt, the same output length. Pairing them takes out
two things the headline percentiles mix in:

- a faster arm gets deeper into its sessions in the same duration, so its requests are
  longer on average (``depth_rows`` takes that out bucket by bucket; pairing does it
  request by request);
- load that slows both arms alike (a shared machine, a noisy neighbour) adds to both
  sides: it cancels in a difference, where it only shrinks a ratio towards 1.

The result per metric is the median paired difference (other - baseline) with a 95 %
interval that resamples whole sessions, as ``bootstrap_ci`` does (a session's requests
share one user, one growing context and one closed loop), the median paired ratio, and
a verdict: ``worse`` or ``better`` when the interval leaves 0 out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

# (column of ``with_request_metrics``, label); both are better lower.
PAIRED_METRICS = (("ttft_s", "TTFT"), ("itl_s", "TPOT"))
# Fewer matched requests, or sessions, than this give no interval worth printing.
MIN_PAIRS = 8
MIN_SESSIONS = 2
RESAMPLES = 2000


def matched_requests(base: pl.DataFrame, other: pl.DataFrame) -> pl.DataFrame:
    """Requests measured in both runs, as the same request (same id, play and prompt
    length).

    ``base`` and ``other`` are measured requests with ``with_request_metrics`` columns;
    the result has ``session_id``, ``request_id`` and each metric as ``<col>_a`` (base)
    and ``<col>_b`` (other).
    """
    cols = [c for c, _ in PAIRED_METRICS]
    # With --recycle a lane plays a session again: the same id, another play.
    keys = ["request_id"] + (["play"] if "play" in base.columns and "play" in other.columns
                             else [])
    ids = [pl.col(k).fill_null(0) if k == "play" else pl.col(k) for k in keys]
    a = base.select(*ids, "session_id", "isl", *cols)
    b = other.select(*ids, "isl", *cols)
    joined = a.join(b, on=keys, suffix="_b")
    # Another trace, or another salt, can reuse an id for another prompt.
    joined = joined.filter(pl.col("isl") == pl.col("isl_b"))
    return joined.rename({c: f"{c}_a" for c in cols})


def _interval(diff: np.ndarray, sessions: np.ndarray, resamples: int,
              seed: int) -> list[float] | None:
    """95 % interval of the median of ``diff``, drawing whole sessions."""
    keys, index = np.unique(sessions, return_inverse=True)
    if len(keys) < MIN_SESSIONS:
        return None
    groups = [diff[index == k] for k in range(len(keys))]
    rng = np.random.default_rng(seed)
    medians = np.empty(resamples)
    for i in range(resamples):
        pick = rng.integers(0, len(groups), size=len(groups))
        medians[i] = np.median(np.concatenate([groups[j] for j in pick]))
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return [float(lo), float(hi)]


def paired_difference(base: pl.DataFrame, other: pl.DataFrame, resamples: int = RESAMPLES,
                      seed: int = 0) -> dict[str, Any]:
    """Per metric: pairs, median difference (s) and its interval, median ratio, verdict."""
    joined = matched_requests(base, other)
    out: dict[str, Any] = {"matched_requests": joined.height,
                           "baseline_requests": base.height, "other_requests": other.height}
    for col, label in PAIRED_METRICS:
        both = joined.filter(pl.col(f"{col}_a").is_not_null()
                             & pl.col(f"{col}_b").is_not_null())
        a = both[f"{col}_a"].to_numpy()
        b = both[f"{col}_b"].to_numpy()
        entry: dict[str, Any] = {"label": label, "pairs": len(a), "median_diff_s": None,
                                 "ci95_diff_s": None, "median_ratio": None, "verdict": ""}
        if len(a) >= MIN_PAIRS:
            diff = b - a
            entry["median_diff_s"] = float(np.median(diff))
            positive = a > 0
            if positive.any():
                entry["median_ratio"] = float(np.median(b[positive] / a[positive]))
            ci = _interval(diff, both["session_id"].to_numpy(), resamples, seed)
            entry["ci95_diff_s"] = ci
            if ci is None:
                entry["verdict"] = f"no interval (fewer than {MIN_SESSIONS} sessions)"
            elif ci[0] > 0:
                entry["verdict"] = "worse"
            elif ci[1] < 0:
                entry["verdict"] = "better"
            else:
                entry["verdict"] = "within noise (the interval holds 0)"
        else:
            entry["verdict"] = f"too few matched requests ({len(a)} < {MIN_PAIRS})"
        out[col] = entry
    return out


def _ms(x: float) -> str:
    ms = x * 1e3
    return f"{ms:+.2f} ms" if abs(ms) < 10 else f"{ms:+.1f} ms"


def paired_lines(label: str, base_label: str, result: dict[str, Any]) -> list[str]:
    """Plain-language lines, one per metric with a verdict of better or worse."""
    lines = []
    for col, _ in PAIRED_METRICS:
        e = result[col]
        if e["verdict"] not in ("better", "worse"):
            continue
        lo, hi = e["ci95_diff_s"]
        ratio = f", x{e['median_ratio']:.2f}" if e["median_ratio"] is not None else ""
        lines.append(f"{label} vs {base_label}, the same {e['pairs']} requests: {e['label']} "
                     f"{_ms(e['median_diff_s'])} median (95 % interval {_ms(lo)} to "
                     f"{_ms(hi)}{ratio}, {e['verdict']})")
    return lines


def paired_cells(result: dict[str, Any]) -> list[str]:
    """One table cell per metric: difference, interval, ratio and verdict."""
    cells = []
    for col, _ in PAIRED_METRICS:
        e = result[col]
        if e["median_diff_s"] is None:
            cells.append(e["verdict"] or "n/a")
            continue
        ci = e["ci95_diff_s"]
        span = f" [{_ms(ci[0])}, {_ms(ci[1])}]" if ci else ""
        ratio = f" x{e['median_ratio']:.2f}" if e["median_ratio"] is not None else ""
        cells.append(f"{_ms(e['median_diff_s'])}{span}{ratio} {e['verdict']}".strip())
    return cells

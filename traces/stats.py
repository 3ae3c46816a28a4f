"""What a trace holds: counts, token totals, distributions and the cache it could use.

``trace_stats`` returns plain JSON-ready values. Percentiles are linear-interpolated
(numpy's default, the convention DESIGN.md fixes for every aggregate). The theoretical
prefix-cache hit rate assumes a perfect, infinite prefix cache at the trace's block
size and requests sent in file order; a replay computes its own rate in actual send
order.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agentload.traces.files import load_native
from agentload.traces.model import Trace, theoretical_prefix_hits

# Context-depth buckets (input tokens), the lengths where serving behaviour changes.
DEPTH_EDGES = (0, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144)


def distribution(values: Sequence[float]) -> dict[str, float] | None:
    """min / p50 / p90 / p99 / max / mean of ``values`` (None when empty)."""
    if not values:
        return None
    arr = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"min": float(arr.min()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(arr.max()), "mean": float(arr.mean())}


def depth_histogram(input_tokens: Sequence[int]) -> list[dict[str, Any]]:
    """Requests and input tokens per context-depth bucket (empty buckets left out)."""
    edges = [*DEPTH_EDGES, max([DEPTH_EDGES[-1] + 1, *input_tokens]) + 1]
    rows = []
    for lo, hi in itertools.pairwise(edges):
        inside = [n for n in input_tokens if lo <= n < hi]
        if inside:
            last = hi >= edges[-1]
            rows.append({"range": f"{_k(lo)}+" if last else f"{_k(lo)}-{_k(hi)}",
                         "min_tokens": lo, "max_tokens": None if last else hi - 1,
                         "requests": len(inside), "input_tokens": sum(inside)})
    return rows


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


def trace_stats(trace: Trace | str | Path) -> dict[str, Any]:
    """Counts, totals, distributions and the theoretical prefix-cache hit rate.

    ``trace`` may be a path to a native trace file, for convenience.
    """
    if not isinstance(trace, Trace):
        trace = load_native(trace)
    requests = list(trace.requests())
    isl = [r.input_tokens for r in requests]
    total_in = sum(isl)
    by_kind = Counter(r.agent_kind for r in requests)
    arrivals = [r.arrival_s for r in requests if r.arrival_s is not None]
    hits = sum(theoretical_prefix_hits(requests))
    return {
        "name": trace.name,
        "source": trace.source,
        "block_size": trace.block_size,
        "sessions": len(trace.sessions),
        "requests": len(requests),
        "subagent_requests": by_kind["subagent"],
        "aux_requests": by_kind["aux"],
        "subagent_share": by_kind["subagent"] / len(requests) if requests else None,
        "sessions_with_subagents": sum(any(r.agent_kind == "subagent" for r in s.requests)
                                       for s in trace.sessions),
        "agents": len({(r.session_id, r.agent_id) for r in requests}),
        "input_tokens": total_in,
        "output_tokens": sum(r.output_tokens for r in requests),
        "max_input_tokens": max(isl, default=0),
        "theoretical_prefix_cache_hit_rate": hits / total_in if total_in else None,
        "theoretical_prefix_cache_hit_tokens": hits,
        "open_loop_requests": len(arrivals),
        "arrival_span_s": max(arrivals) - min(arrivals) if arrivals else None,
        "pause_s_total": round(sum(r.pause_s for r in requests), 3),
        "isl": distribution(isl),
        "osl": distribution([r.output_tokens for r in requests]),
        "pause_s": distribution([r.pause_s for r in requests if r.depends_on]),
        "requests_per_session": distribution([len(s.requests) for s in trace.sessions]),
        "context_depth": depth_histogram(isl),
        "models": dict(Counter(r.model for r in requests if r.model is not None)),
    }


def format_stats(stats: dict[str, Any]) -> str:
    """The human-readable form ``agentload traces stats`` prints."""
    lines = [f"trace {stats['name']} ({stats['source']}, {stats['block_size']}-token blocks)"]
    share = stats["subagent_share"]
    lines.append(f"  sessions {stats['sessions']:,}   requests {stats['requests']:,}   "
                 f"subagent requests {stats['subagent_requests']:,}"
                 + (f" ({share:.1%})" if share is not None else "")
                 + f"   aux {stats['aux_requests']:,}")
    lines.append(f"  input tokens {stats['input_tokens']:,}   output tokens "
                 f"{stats['output_tokens']:,}")
    rate = stats["theoretical_prefix_cache_hit_rate"]
    if rate is not None:
        lines.append(f"  theoretical prefix-cache hit rate {rate:.1%} (perfect infinite "
                     "cache, file order)")
    if stats["open_loop_requests"]:
        lines.append(f"  open-loop arrivals {stats['open_loop_requests']:,} over "
                     f"{stats['arrival_span_s']:.1f} s")
    lines.append("")
    lines.append(f"  {'':<22}{'min':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for key, label, fmt in (("isl", "ISL (tokens)", ",.0f"), ("osl", "OSL (tokens)", ",.0f"),
                            ("pause_s", "pause (s)", ",.2f"),
                            ("requests_per_session", "requests / session", ",.0f")):
        d = stats[key]
        if d is not None:
            cells = "".join(f"{d[q]:>10{fmt}}" for q in ("min", "p50", "p90", "p99", "max"))
            lines.append(f"  {label:<22}{cells}")
    if stats["context_depth"]:
        lines.append("")
        lines.append("  context depth (input tokens)   requests")
        top = max(row["requests"] for row in stats["context_depth"])
        for row in stats["context_depth"]:
            bar = "#" * max(1, round(30 * row["requests"] / top))
            lines.append(f"  {row['range']:>12}  {row['requests']:>16,}  {bar}")
    if stats["models"]:
        lines.append("")
        lines.append("  models: " + ", ".join(f"{m} ({n})" for m, n in stats["models"].items()))
    return "\n".join(lines)

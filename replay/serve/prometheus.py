"""Scrape a vLLM server's Prometheus ``/metrics`` and take deltas over a run window.

Only what the run reports is kept: counters are summed over their label sets (one
engine or many), so a delta over the window is the server's own count for the run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import httpx

PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
WANTED = (
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


@dataclass(frozen=True, slots=True)
class MetricsScrape:
    """Summed values of the wanted series; ``ok`` is False if the scrape failed."""

    values: dict[str, float]
    ok: bool = True
    error: str | None = None
    text: str = ""
    """The whole exposition as scraped (kept for the run's last scrape)."""


def parse_metrics(text: str, wanted: tuple[str, ...] = WANTED) -> dict[str, float]:
    """Sum each wanted metric over its label sets in Prometheus text format."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name not in wanted:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1] if "}" not in line
                          else line[line.rindex("}") + 1:].split()[0])
        except (IndexError, ValueError):
            continue
        if not math.isnan(value):
            sums[name] = sums.get(name, 0.0) + value
    return sums


async def scrape(client: httpx.AsyncClient, base_url: str) -> MetricsScrape:
    try:
        resp = await client.get(base_url + "/metrics", timeout=10.0)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        return MetricsScrape(values={}, ok=False, error=f"{type(exc).__name__}: {exc}")
    return MetricsScrape(values=parse_metrics(resp.text), text=resp.text)


def prefix_cache_hit_rate(before: MetricsScrape, after: MetricsScrape) -> float | None:
    """Δhits / Δqueries (token-based) over the window, or None if unavailable."""
    if not (before.ok and after.ok):
        return None
    try:
        queries = after.values[PREFIX_CACHE_QUERIES] - before.values[PREFIX_CACHE_QUERIES]
        hits = after.values[PREFIX_CACHE_HITS] - before.values[PREFIX_CACHE_HITS]
    except KeyError:
        return None
    return hits / queries if queries > 0 else None


SPEC_COUNTERS = ("vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_drafts_total")


def spec_acceptance(delta: dict[str, float | None]) -> dict[str, float] | None:
    """Speculative decoding from counter deltas: acceptance rate (accepted / drafted
    tokens) and mean acceptance length (1 + accepted / drafts); None if nothing drafted."""
    accepted, drafted, drafts = (delta.get(name) for name in SPEC_COUNTERS)
    if not drafted or accepted is None:
        return None
    out = {"acceptance_rate": accepted / drafted, "draft_tokens": drafted,
           "accepted_tokens": accepted}
    if drafts:
        out["drafts"] = drafts
        out["mean_acceptance_length"] = 1 + accepted / drafts
    return out


def counter_delta(before: MetricsScrape, after: MetricsScrape, name: str) -> float | None:
    if not (before.ok and after.ok) or name not in after.values:
        return None
    return after.values[name] - before.values.get(name, 0.0)


CACHE_CONFIG_INFO = "vllm:cache_config_info"


def info_labels(text: str, metric: str = CACHE_CONFIG_INFO) -> dict[str, str]:
    """The labels of an ``*_info`` gauge (its first series), e.g. vLLM's cache config."""
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            body = line[len(metric) + 1: line.rindex("}")]
            return dict(_LABEL.findall(body))
    return {}


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def kv_block_size(text: str) -> int | None:
    """The server's KV cache block size in tokens, from ``vllm:cache_config_info``."""
    value = info_labels(text).get("block_size", "")
    return int(value) if value.isdigit() else None

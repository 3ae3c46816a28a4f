"""Several runs side by side: ``comparison.json``, ``report.md`` and ``report.html``.

The first run is the baseline; every other run's headline numbers are shown with their
ratio to it, a verdict (better / worse, or "within noise" where the 95 % intervals
overlap) and both GPU counts, so a comparison that changed the GPU count says so on
every row. Runs of one trace are also compared request by request (``compare_paired``):
the median paired TTFT and TPOT difference, with its interval.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from agentload.replay.errors import ReplayError
from agentload.replay.journal import REQUESTS_NAME
from agentload.replay.results import report_figures as figs
from agentload.replay.results.compare_paired import (
    PAIRED_METRICS,
    paired_cells,
    paired_difference,
    paired_lines,
)
from agentload.replay.results.report import (
    HEADLINE,
    HIGHER_IS_BETTER,
    LOWER_IS_BETTER,
    SLO_ROWS,
    fmt,
    fmt_ci,
    html_table,
    md_escape,
    page,
    plots_html,
    warnings,
)
from agentload.replay.serve.profile_window import unprofiled

# Metrics without a bootstrap interval (throughputs, ITL P50) are called equal within this.
NO_INTERVAL_BAND = 0.05


@dataclass(frozen=True, slots=True)
class LoadedRun:
    """A finished run directory, read back."""

    label: str
    run_dir: Path
    summary: dict[str, Any]
    run: dict[str, Any]
    tables: figs.RunTables

    @property
    def gpus(self) -> int:
        return int(self.summary.get("gpus") or 1)

    @property
    def device(self) -> str:
        return str(self.run.get("target", {}).get("device", "gpu"))


def load_run(run_dir: Path) -> LoadedRun:
    """Read a run directory that ``agentload replay`` (or ``report``) has finalized."""
    run_dir = Path(run_dir)
    missing = [n for n in ("summary.json", REQUESTS_NAME) if not (run_dir / n).is_file()]
    if missing:
        raise ReplayError(f"{run_dir} is not a finished run (no {', '.join(missing)}); "
                          f"run `agentload report {run_dir}` first if it holds a journal")
    summary = json.loads((run_dir / "summary.json").read_text())
    run_path = run_dir / "run.json"
    run = json.loads(run_path.read_text()) if run_path.is_file() else {}
    requests = pl.read_parquet(run_dir / REQUESTS_NAME)
    label = str((run.get("arm") or {}).get("name") or run_dir.name)
    return LoadedRun(label, run_dir, summary, run, figs.RunTables.load(run_dir, requests))


def _verdict(key: str, base: LoadedRun, other: LoadedRun) -> tuple[float | None, str]:
    a, b = base.summary.get(key), other.summary.get(key)
    if a is None or b is None or not a:
        return None, ""
    ratio = b / a
    ci_a = (base.summary.get("ci95") or {}).get(key)
    ci_b = (other.summary.get("ci95") or {}).get(key)
    if ci_a and ci_b and None not in ci_a and None not in ci_b \
            and ci_a[0] <= ci_b[1] and ci_b[0] <= ci_a[1]:
        return ratio, "within noise (95 % intervals overlap)"
    if not (ci_a and ci_b) and abs(ratio - 1) <= NO_INTERVAL_BAND:
        return ratio, f"within {NO_INTERVAL_BAND:.0%} (no interval for this metric)"
    if key in HIGHER_IS_BETTER:
        return ratio, "better" if ratio > 1 else "worse" if ratio < 1 else "same"
    if key in LOWER_IS_BETTER:
        return ratio, "better" if ratio < 1 else "worse" if ratio > 1 else "same"
    return ratio, ""


def comparison_rows(runs: Sequence[LoadedRun]) -> list[dict[str, Any]]:
    """One row per headline metric: each run's value and interval, ratios to the first."""
    base = runs[0]
    rows = []
    slo_rows = [row for row in SLO_ROWS
                if any(run.summary.get(row[0]) is not None for run in runs)]
    for key, label, unit in (*HEADLINE, *slo_rows):
        row: dict[str, Any] = {"metric": key, "label": label, "unit": unit, "runs": []}
        for run in runs:
            ratio, verdict = _verdict(key, base, run) if run is not base else (None, "")
            row["runs"].append({
                "label": run.label, "gpus": run.gpus, "value": run.summary.get(key),
                "ci95": (run.summary.get("ci95") or {}).get(key),
                "ratio_to_baseline": ratio, "verdict": verdict})
        rows.append(row)
    return rows


def paired_results(runs: Sequence[LoadedRun]) -> list[dict[str, Any]]:
    """Every other run against the first, request by request (``compare_paired``).

    Requests in flight while either run's server profiler ran are set aside (the
    profiler slows the server): ``profiled_set_aside`` counts them per run."""
    base = runs[0]

    def clean(run: LoadedRun) -> tuple[pl.DataFrame, int]:
        measured = run.tables.measured
        kept = unprofiled(measured, run.run.get("profile_window"))
        return kept, measured.height - kept.height

    base_kept, base_aside = clean(base)
    out = []
    for other in runs[1:]:
        kept, aside = clean(other)
        out.append({"label": other.label, **paired_difference(base_kept, kept),
                    "profiled_set_aside": [base_aside, aside]})
    return out


def paired_rows(paired: list[dict[str, Any]]) -> list[list[str]]:
    def matched(p: dict[str, Any]) -> str:
        cell = f"{p['matched_requests']} of {p['baseline_requests']} / {p['other_requests']}"
        aside = p.get("profiled_set_aside") or [0, 0]
        if any(aside):
            cell += f" ({aside[0]} / {aside[1]} in a profile window set aside)"
        return cell

    return [[p["label"], matched(p), *paired_cells(p)] for p in paired]


PAIRED_HEADER = ["run vs the baseline", "matched requests",
                 *(f"{label} difference [95 %], ratio" for _, label in PAIRED_METRICS)]


def _explain(runs: Sequence[LoadedRun],
             paired: list[dict[str, Any]] | None = None) -> list[str]:
    """Plain-language reading of the biggest differences, from the numbers themselves."""
    base = runs[0]
    out = []
    for p in paired or ():
        out += paired_lines(p["label"], base.label, p)
    for other in runs[1:]:
        for key, label, _unit in HEADLINE:
            ratio, verdict = _verdict(key, base, other)
            if ratio is None or verdict not in ("better", "worse") or 0.8 < ratio < 1.25:
                continue
            out.append(f"{other.label} vs {base.label}: {label} x{ratio:.2f} ({verdict})")
        hit_a, hit_b = _cached_share(base), _cached_share(other)
        if hit_a is not None and hit_b is not None and abs(hit_a - hit_b) > 0.2:
            out.append(f"the share of prompt tokens served from the prefix cache went from "
                       f"{hit_a:.0%} ({base.label}) to {hit_b:.0%} ({other.label}): tokens "
                       "that are not cached are prefilled again, and that time shows in TTFT")
    return out


def depth_rows(runs: Sequence[LoadedRun]) -> list[list[str]]:
    """TTFT P90 and P90 interactivity per context-depth bucket, each run beside the first.

    A faster arm gets further into its sessions in the same duration, so its requests
    are deeper on average; comparing bucket by bucket takes that drift out.
    """
    buckets: dict[tuple[int, Any], dict[str, dict[str, Any]]] = {}
    for run in runs:
        for d in run.summary.get("by_context_depth") or []:
            buckets.setdefault((d["min_isl"], d["max_isl"]), {})[run.label] = d
    rows = []
    for (lo, hi), per_run in sorted(buckets.items(), key=lambda kv: kv[0][0]):
        base = per_run.get(runs[0].label)
        cells = [f"{lo} to {hi if hi is not None else '…'}"]
        for run in runs:
            d = per_run.get(run.label)
            cells.append("n/a" if d is None else
                         f"{d['requests']} req, TTFT P90 {fmt(d['ttft_p90_s'], 's')}, "
                         f"P90 int. {fmt(d['p90_interactivity_tok_s'], 'tok/s')}")
        for run in runs[1:]:
            d = per_run.get(run.label)
            if base and d and base["ttft_p90_s"] and d["ttft_p90_s"] is not None:
                cells.append(f"TTFT x{d['ttft_p90_s'] / base['ttft_p90_s']:.2f}")
            else:
                cells.append("n/a")
        rows.append(cells)
    return rows


def _cached_share(run: LoadedRun) -> float | None:
    """Share of prompt tokens the server reports as cached (its counter, else usage)."""
    value = run.summary.get("server_prefix_cache_hit_rate")
    if value is None:
        value = run.summary.get("usage_cached_tokens_rate")
    return float(value) if value is not None else None


def _gpu_note(runs: Sequence[LoadedRun]) -> str | None:
    counts = {r.gpus for r in runs}
    if len(counts) == 1:
        return None
    return ("GPU COUNT CHANGED between runs (" + ", ".join(f"{r.label}: {r.gpus}"
                                                          for r in runs)
            + "): differences mix implementation and hardware; throughput per GPU is the "
            "fairer row")


def render_markdown(runs: Sequence[LoadedRun], rows: list[dict[str, Any]],
                    paired: list[dict[str, Any]] | None = None) -> str:
    labels = [f"{md_escape(r.label)} ({r.gpus} {'GPU' if r.device == 'gpu' else r.device})"
              for r in runs]
    lines = ["# agentload comparison: " + " vs ".join(md_escape(r.label) for r in runs), ""]
    note = _gpu_note(runs)
    if note:
        lines += [f"> **{md_escape(note)}**", ""]
    for run in runs:
        lines += [f"> **{md_escape(run.label)}: {md_escape(w)}**"
                  for w in warnings(run.summary, run.run)]
        lines.append(f"- {md_escape(run.label)}: {md_escape(run.run_dir)}, "
                     f"{run.summary.get('requests_completed')} requests, validity "
                     f"{(run.summary.get('validity') or {}).get('verdict', '?')}")
    header = ["metric", *labels] + [f"{lab} / {labels[0]}" for lab in labels[1:]]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        values = [fmt(r["value"], row["unit"]) for r in row["runs"]]
        ratios = [(f"x{r['ratio_to_baseline']:.3f} {r['verdict']}".strip()
                   if r["ratio_to_baseline"] is not None else "n/a") for r in row["runs"][1:]]
        lines.append("| " + " | ".join([row["label"], *values, *ratios]) + " |")
    depth = depth_rows(runs)
    if depth:
        head = ["prompt tokens", *labels] + [f"{lab} / {labels[0]}" for lab in labels[1:]]
        lines += ["", "## By context depth", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(md_escape(c) for c in row) + " |" for row in depth]
    if paired:
        lines += ["", "## The same requests, paired", "",
                  "Requests measured in both runs (same id, same prompt length): the median "
                  "of each request's difference from the baseline, with a 95 % interval "
                  "that resamples sessions. Load that slowed both runs alike cancels here.",
                  "", "| " + " | ".join(PAIRED_HEADER) + " |",
                  "|" + "---|" * len(PAIRED_HEADER)]
        lines += ["| " + " | ".join(md_escape(c) for c in row) + " |"
                  for row in paired_rows(paired)]
    reading = _explain(runs, paired)
    if reading:
        lines += ["", "## Reading", ""] + [f"- {md_escape(x)}" for x in reading]
    return "\n".join(lines) + "\n"


def render_html(runs: Sequence[LoadedRun], rows: list[dict[str, Any]],
                paired: list[dict[str, Any]] | None = None) -> str:
    esc = html.escape
    labels = [f"{r.label} ({r.gpus} {'GPU' if r.device == 'gpu' else r.device})" for r in runs]
    parts = []
    note = _gpu_note(runs)
    if note:
        parts.append(f'<div class="bad">{esc(note)}</div>')
    for run in runs:
        parts += [f'<div class="warn">{esc(run.label)}: {esc(w)}</div>'
                  for w in warnings(run.summary, run.run)]
    parts.append("<ul>" + "".join(
        f"<li>{esc(run.label)}: <a href=\"{esc(str(run.run_dir.resolve() / 'report.html'))}\">"
        f"{esc(str(run.run_dir))}</a>, {esc(str(run.summary.get('requests_completed')))} "
        f"requests, validity {esc(str((run.summary.get('validity') or {}).get('verdict')))}"
        "</li>" for run in runs) + "</ul>")
    header = ["metric", *labels] + [f"{lab} / {labels[0]}" for lab in labels[1:]]
    table_rows = []
    for row in rows:
        cells = [row["label"]]
        cells += [fmt(r["value"], row["unit"])
                  + (f" [{fmt_ci(r['ci95'], row['unit'])}]" if r["ci95"] else "")
                  for r in row["runs"]]
        cells += [(f"x{r['ratio_to_baseline']:.3f} {r['verdict']}".strip()
                   if r["ratio_to_baseline"] is not None else "n/a") for r in row["runs"][1:]]
        table_rows.append(cells)
    parts.append(html_table(header, table_rows))
    depth = depth_rows(runs)
    if depth:
        parts.append("<h2>By context depth</h2>" + html_table(
            ["prompt tokens", *labels] + [f"{lab} / {labels[0]}" for lab in labels[1:]],
            depth))
    if paired:
        parts.append("<h2>The same requests, paired</h2>" + html_table(
            PAIRED_HEADER, paired_rows(paired)))
    reading = _explain(runs, paired)
    if reading:
        parts.append("<h2>Reading</h2><ul>" + "".join(f"<li>{esc(x)}</li>" for x in reading)
                     + "</ul>")
    pairs = [(run.label, run.tables) for run in runs]
    figures = [figs.user_ecdf(pairs), figs.interactivity_histogram(pairs),
               figs.by_context_depth(pairs), figs.latency_over_time(pairs),
               figs.server_over_time(pairs)]
    parts.append(plots_html(figures))
    return page("agentload comparison: " + " vs ".join(r.label for r in runs),
                "\n".join(parts))


def write_comparison(out_dir: Path, run_dirs: Sequence[Path]) -> tuple[Path, Path, Path]:
    """Compare finished runs (the first is the baseline) into ``out_dir``."""
    if len(run_dirs) < 2:
        raise ReplayError("a comparison needs at least two run directories")
    runs = [load_run(d) for d in run_dirs]
    seen: dict[str, int] = {}
    for i, run in enumerate(runs):  # two runs of one arm still need two names
        if run.label in seen:
            runs[i] = LoadedRun(f"{run.label} ({run.run_dir.name})", run.run_dir, run.summary,
                                run.run, run.tables)
        seen[run.label] = i
    rows = comparison_rows(runs)
    paired = paired_results(runs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"baseline": runs[0].label,
            "runs": [{"label": r.label, "run_dir": str(r.run_dir), "gpus": r.gpus,
                      "device": r.device, "validity": r.summary.get("validity")}
                     for r in runs],
            "gpu_count_changed": _gpu_note(runs) is not None,
            "rows": rows, "paired": paired, "reading": _explain(runs, paired)}
    js = out_dir / "comparison.json"
    js.write_text(json.dumps(data, indent=2, default=str) + "\n")
    md = out_dir / "report.md"
    md.write_text(render_markdown(runs, rows, paired))
    out = out_dir / "report.html"
    out.write_text(render_html(runs, rows, paired))
    return js, md, out

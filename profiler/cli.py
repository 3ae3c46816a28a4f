"""The profiler room's commands: ``agentload profile layers|steps|diff|report|capture``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import orjson
import polars as pl
import typer

from agentload.profiler.attribute import attribute
from agentload.profiler.capture import capture
from agentload.profiler.diff import render_diff
from agentload.profiler.load import (
    DEFAULT_DOMAIN,
    NO_CATEGORY,
    keep_categories,
    keep_domains,
    load_profiles,
)
from agentload.profiler.memory import retain_freed_memory
from agentload.profiler.report import write_report
from agentload.profiler.summary import Level, Summary, summarize

app = typer.Typer(no_args_is_help=True,
                  help="Per-layer GPU kernel attribution from Nsight Systems exports "
                       "(.sqlite, Parquet/Arrow directories) and PyTorch (Kineto) traces.")

FilesArg = Annotated[list[Path], typer.Argument(
    metavar="FILE", help="Profiles, one per rank (nsys SQLite exports, nsys parquetdir/"
                            "arrowdir exports, Kineto .json[.gz], in any mix), merged into "
                            "one; layers are aligned across ranks in the ranks table.")]
LevelOpt = Annotated[str, typer.Option(
    "--level", help="innermost: group by the innermost range (vLLM: module path); layer: by "
                    "the enclosing layers.<i> range, inferred from the kernel sequence when "
                    "there is none.")]
StepOpt = Annotated[str | None, typer.Option(
    "--step", help="Regex naming the step ranges (default: each op's outermost range; graph "
                   "replays are steps of their own).")]
DomainOpt = Annotated[list[str] | None, typer.Option(
    "--domain", help=f"Keep only ranges of this NVTX domain (repeatable; {DEFAULT_DOMAIN!r}: "
                     "NVTX's default domain, which torch.cuda.nvtx and vLLM use), e.g. so "
                     "NCCL's or a library's own ranges do not own the kernels they wrap.")]
CategoryOpt = Annotated[list[str] | None, typer.Option(
    "--category", help=f"Keep only ranges of this NVTX category (repeatable; its name, or its "
                       f"number where it was never named; {NO_CATEGORY!r}: ranges without "
                       "one), e.g. so a framework's layer ranges own the kernels.")]
InferOpt = Annotated[bool | None, typer.Option(
    "--infer/--no-infer", help="Force or forbid inferring layers from the repeating kernel "
                               "sequence (default: only at --level layer without layer ranges).")]


def _summary(paths: Path | list[Path], level: str, step: str | None, infer: bool | None,
             domains: list[str] | None = None,
             categories: list[str] | None = None) -> Summary:
    if level not in ("innermost", "layer"):
        raise typer.BadParameter("--level is innermost or layer")
    lvl: Level = "layer" if level == "layer" else "innermost"
    retain_freed_memory()  # a one-shot process: freed arrays are reused, not refaulted
    profile = keep_categories(keep_domains(
        load_profiles([paths] if isinstance(paths, Path) else paths), domains or []),
        categories or [])
    return summarize(attribute(profile), level=lvl, step_pattern=step, infer=infer)


def _rank(pid: int, proc: int, shared: bool) -> str:
    """A rank's name: its pid, and when merged ranks share that pid the hw byte of its
    process key, which tells them apart (``661~1``: the second file's pid 661)."""
    return f"{pid}~{proc >> 56}" if shared else str(pid)


def _us(ns: float) -> str:
    return f"{ns / 1e3:,.1f}"


def layers_json(s: Summary) -> dict[str, list[Any]]:
    """The fixed ``--json`` shape of ``profile layers``; ``warnings`` (strings) only when
    the recorder reported losing events."""
    out: dict[str, list[Any]] = {"layers": [
        {"name": r["name"], "pid": r["pid"], "instances": r["instances"],
         "kernels": r["kernels"], "kernel_ns": r["kernel_ns"], "busy_ns": r["busy_ns"],
         "span_ns": r["span_ns"]}
        for r in s.layers.iter_rows(named=True)]}
    if s.warnings:
        out["warnings"] = list(s.warnings)
    return out


def render_layers(s: Summary, limit: int = 60) -> str:
    lines = [f"{s.path} ({s.source}), level {s.level}"
             + (", layers INFERRED from the repeating kernel sequence" if s.inferred else "")]
    header = (f"{'pid':>7}  {'layer':<44} {'inst':>6} {'k/inst':>7} {'µs/inst':>9} "
              f"{'busy µs':>10} {'span µs':>10} {'gaps µs':>9}")
    for title, frame, key in (("per layer", s.layers, "name"), ("per layer type", s.types, "type")):
        lines += ["", title, header]
        for r in frame.head(limit).iter_rows(named=True):
            n = max(r["instances"], 1)
            name = str(r[key])
            name = name if len(name) <= 44 else name[:41] + "..."
            lines.append(f"{r['pid']:>7}  {name:<44} {r['instances']:>6} "
                         f"{r['kernels'] / n:>7.1f} {_us(r['kernel_ns'] / n):>9} "
                         f"{_us(r['busy_ns']):>10} {_us(r['span_ns']):>10} {_us(r['gap_ns']):>9}")
        if frame.height > limit:
            lines.append(f"  ... {frame.height - limit:,} more (use --json or --parquet)")
    multi = s.ranks.filter(pl.col("ranks") > 1)
    if multi.height:
        lines += ["", "across ranks (per-instance kernel time by pid, skew = max - min)"]
        for r in multi.head(limit).iter_rows(named=True):
            per = ", ".join(f"{_rank(p, q, r['pids'].count(p) > 1)}: {_us(v)}" for p, q, v in
                            zip(r["pids"], r["procs"], r["kernel_ns_per_inst"], strict=True))
            lines.append(f"  {r['name']}: {per} µs; skew {_us(r['skew_ns'])} µs")
    tops = s.top_kernels.filter(pl.col("rank") == 0).head(min(limit, 20))
    if tops.height:
        procs = tops.select("pid", "proc").unique()
        shared = set(procs.filter(pl.col("pid").is_duplicated())["pid"].to_list())
        several = procs.height > 1
        lines += ["", "top kernel per layer"]
        for r in tops.iter_rows(named=True):
            who = _rank(r["pid"], r["proc"], r["pid"] in shared) + " " if several else ""
            lines.append(f"  {who}{r['label']}: {r['kernel']} x{r['count']} "
                         f"({_us(r['kernel_ns'])} µs)")
    lines += [f"note: {n}" for n in s.notes]
    lines += [f"warning: {w}" for w in s.warnings]
    return "\n".join(lines)


@app.command("layers")
def layers_command(
    files: FilesArg,
    json_out: Annotated[bool, typer.Option("--json", help="Print the layers as JSON.")] = False,
    parquet: Annotated[Path | None, typer.Option(
        "--parquet", help="Write the per-layer table as Parquet (instances beside it).")] = None,
    html_out: Annotated[Path | None, typer.Option("--html", help="Write an HTML report.")] = None,
    level: LevelOpt = "innermost", step: StepOpt = None, infer: InferOpt = None,
    domain: DomainOpt = None, category: CategoryOpt = None,
) -> None:
    """Per layer: instances, kernels, summed kernel time, busy (union) time, span, gaps."""
    s = _summary(files, level, step, infer, domain, category)
    if parquet is not None:
        s.layers.write_parquet(parquet)
        s.instances.write_parquet(parquet.with_name(parquet.stem + ".instances.parquet"))
    if html_out is not None:
        write_report(s, html_out)
    if json_out:
        typer.echo(orjson.dumps(layers_json(s)).decode())
    elif parquet is None:
        typer.echo(render_layers(s))


@app.command("steps")
def steps_command(
    files: FilesArg,
    json_out: Annotated[bool, typer.Option("--json", help="Print the steps as JSON.")] = False,
    level: LevelOpt = "layer", step: StepOpt = None, infer: InferOpt = None,
    domain: DomainOpt = None, category: CategoryOpt = None,
) -> None:
    """Decode-step breakdown: per step its kernels, kernel time, busy time, span, layers."""
    s = _summary(files, level, step, infer, domain, category)
    cols = ["pid", "index", "step", "kernels", "memops", "kernel_ns", "busy_ns", "span_ns",
            "layers"]
    if json_out:
        typer.echo(orjson.dumps({"steps": s.steps.select(cols).to_dicts()}).decode())
        return
    typer.echo(f"{'pid':>7} {'step':>5}  {'name':<34} {'kernels':>8} {'kernel µs':>10} "
               f"{'busy µs':>10} {'span µs':>10} {'layers':>6}")
    for r in s.steps.iter_rows(named=True):
        name = str(r["step"])[:34]
        typer.echo(f"{r['pid']:>7} {r['index']:>5}  {name:<34} {r['kernels']:>8} "
                   f"{_us(r['kernel_ns']):>10} {_us(r['busy_ns']):>10} "
                   f"{_us(r['span_ns']):>10} {r['layers']:>6}")
    for n in s.notes:
        typer.echo(f"note: {n}")
    for w in s.warnings:
        typer.echo(f"warning: {w}")


@app.command("diff")
def diff_command(
    a: Annotated[str, typer.Argument(
        help="Profile of arm A; one per rank: FILE,FILE,... (merged, as for layers).")],
    b: Annotated[str, typer.Argument(help="Profile of arm B, likewise.")],
    level: LevelOpt = "layer", step: StepOpt = None, infer: InferOpt = None,
    domain: DomainOpt = None, category: CategoryOpt = None,
) -> None:
    """Per layer type: "layers.*: 13 k / 69 µs vs 23 k / 130 µs", sequences aligned."""
    arms = [[Path(f) for f in arm.split(",") if f] for arm in (a, b)]
    for arm, text in zip(arms, (a, b), strict=True):
        if not arm:
            raise typer.BadParameter(f"no file in {text!r}")
    sa = _summary(arms[0], level, step, infer, domain, category)
    sb = _summary(arms[1], level, step, infer, domain, category)
    typer.echo(render_diff(sa, sb, (_arm_name(arms[0]), _arm_name(arms[1]))))


def _arm_name(files: list[Path]) -> str:
    return files[0].name if len(files) == 1 else f"{files[0].name} (+{len(files) - 1} ranks)"


@app.command("report")
def report_command(
    files: FilesArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="HTML file to write.")],
    level: LevelOpt = "layer", step: StepOpt = None, infer: InferOpt = None,
    domain: DomainOpt = None, category: CategoryOpt = None,
) -> None:
    """A self-contained HTML report (plotly embedded, opens offline)."""
    write_report(_summary(files, level, step, infer, domain, category), output)
    typer.echo(f"wrote {output}")


@app.command("capture", context_settings={"allow_extra_args": True,
                                          "ignore_unknown_options": True})
def capture_command(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", help="Directory for the profile.")] = Path(
        "profile"),
    tool: Annotated[str, typer.Option("--tool", help="auto (nsys when on the PATH, else "
                                                     "the PyTorch profiler), nsys or torch.")]
    = "auto",
    level: LevelOpt = "layer",
) -> None:
    """Run CMD (after --) under nsys or the PyTorch profiler, then print its layers."""
    path = capture(list(ctx.args), out, tool)
    typer.echo(f"profile: {path}")
    typer.echo(render_layers(_summary(path, level, None, None)))

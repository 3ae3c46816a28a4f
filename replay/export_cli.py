"""``agentload traces export FORMAT TRACE -o OUT``: a trace as another tool replays it.

The command reads any trace ``replay`` reads, shrinks it with the same ``fit_trace``
replay runs (``--scale-tokens``, ``--max-context``), and writes it with
``agentload.traces.formats.export``. It lives in the replay room because fitting does
(``traces`` never imports ``replay``); ``agentload/cli.py`` mounts it under ``traces``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentload.replay.cli import MaxContext, ScaleTokens
from agentload.replay.engine.fit import FitOptions, FitReport, fit_trace
from agentload.traces.formats import AUTO, FORMATS, load_any
from agentload.traces.formats.export import EXPORTS, check_output, export_trace

EXPORT_HELP = (
    "Write TRACE (any trace replay reads) in a foreign format, shrunk exactly as "
    "`agentload replay` would replay it with the same --scale-tokens / --max-context, "
    "so another tool (AIPerf, kv-cache-tester) sends the same requests. OUT must not "
    "exist unless --force; it is written beside itself and renamed into place, so a "
    "failed export leaves nothing behind.\n\n"
    # The mappings are wrapped for reading in the source; the help wraps them itself.
    + "\n\n".join(f"{f.name}: {f.summary}. {' '.join(f.mapping.split())}"
                  for f in EXPORTS.values())
)


def export_command(
    fmt: Annotated[str, typer.Argument(
        metavar="FORMAT", help=f"Format to write: {', '.join(EXPORTS)}.",
        show_default=False)],
    trace: Annotated[Path, typer.Argument(
        metavar="TRACE", help="A trace file, or a directory of them.", show_default=False)],
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="File to write (a folder for weka).")],
    scale_tokens: ScaleTokens = 1.0,
    max_context: MaxContext = None,
    source_format: Annotated[str, typer.Option(
        "--from", help="TRACE's format: auto (native, or recognised from the first "
        f"record), native, {', '.join(FORMATS)}.")] = AUTO,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
) -> None:
    check_output(fmt, output, force=force)  # unknown format or taken OUT: before any work
    loaded = load_any(trace, source_format)
    fitted, report = fit_trace(loaded.trace, FitOptions(scale_tokens=scale_tokens,
                                                        max_context=max_context))
    result = export_trace(fitted, fmt, output, force=force)
    typer.echo(result.summary())
    if fitted_line := _fit_line(report):
        typer.echo(f"  {fitted_line}")
    for note in result.notes:
        typer.echo(f"  note: {note}")


def _fit_line(report: FitReport) -> str:
    """What fitting changed, as replay's run.json counts it ("" when nothing was asked)."""
    if report.scale_tokens == 1.0 and report.max_context is None:
        return ""
    return (f"fitted: x{report.scale_tokens:g} tokens"
            + (f", max context {report.max_context:,}" if report.max_context else "")
            + f": {report.input_tokens_before:,} -> {report.input_tokens_after:,} input "
            f"tokens, {report.requests_truncated:,} prompts cut, "
            f"{report.outputs_capped:,} outputs capped")


def register(traces_app: typer.Typer) -> None:
    """Mount ``export`` under ``agentload traces``."""
    traces_app.command(
        "export", help=EXPORT_HELP, no_args_is_help=True,
        short_help="Write a trace as WEKA, Mooncake or AIPerf JSONL, fitted as replay "
                   "fits it.")(export_command)

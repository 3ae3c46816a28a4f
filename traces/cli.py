"""The traces room's commands: ``agentload traces import|validate|stats|synth``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from agentload.traces.files import save_trace
from agentload.traces.formats import AUTO, FORMATS, ImportOptions, import_trace, load_any
from agentload.traces.stats import format_stats, trace_stats
from agentload.traces.synth_cli import synth
from agentload.traces.validate import validate_path

app = typer.Typer(no_args_is_help=True, help="Import, check, inspect and make traces.")
import_app = typer.Typer(
    no_args_is_help=True,
    help="Convert a foreign trace (a file or a directory of files) into agentload's native "
         "format: `agentload traces import FORMAT SRC -o OUT` (OUT .jsonl or .parquet). "
         "Each format's --help says exactly what it maps and what it drops.",
)
app.add_typer(import_app, name="import")

FORMAT_NAMES = ", ".join(FORMATS)
FormatOpt = Annotated[str, typer.Option(
    "--format", "-f",
    help=f"Input format: auto (native, or recognised from the first record), native, "
         f"{FORMAT_NAMES}.")]
BlockSizeOpt = Annotated[int | None, typer.Option(
    "--block-size", min=1, help="Tokens per hash block, when the source does not say "
    "(mooncake/dynamo default 512, openai-messages 64).")]
TokenizerOpt = Annotated[Path | None, typer.Option(
    "--tokenizer", help="openai-messages: a tokenizer.json (or a model directory holding "
    "one) to count tokens exactly.")]
CharsOpt = Annotated[float | None, typer.Option(
    "--chars-per-token", help="openai-messages: estimate tokens at this many characters "
    "each (default 4.0 when no --tokenizer).")]
OutOpt = Annotated[Path, typer.Option("--output", "-o",
                                      help="Native trace to write (.jsonl or .parquet).")]
NameOpt = Annotated[str | None, typer.Option("--name", help="Trace name (default: from SRC).")]
SrcArg = Annotated[Path, typer.Argument(help="A trace file, or a directory of them.")]


def _import(fmt: str, src: Path, output: Path, options: ImportOptions) -> None:
    started = time.perf_counter()
    result = import_trace(fmt, src, options)
    save_trace(result.trace, output)
    trace = result.trace
    subagent = sum(r.agent_kind == "subagent" for r in trace.requests())
    typer.echo(f"imported {trace.num_requests:,} requests ({subagent:,} subagent) in "
               f"{len(trace.sessions):,} sessions from {src} as {fmt} in "
               f"{time.perf_counter() - started:.2f} s -> {output}")
    for note in result.notes:
        typer.echo(f"  note: {note}")


def flowed(text: str) -> str:
    """Source-wrapped help text as paragraphs the terminal wraps itself (each paragraph's
    line breaks become spaces; blank lines between paragraphs stay)."""
    return "\n\n".join(" ".join(part.split()) for part in text.split("\n\n"))


def _register_import_commands() -> None:
    weka, mooncake, dynamo, messages = (FORMATS[n] for n in
                                        ("weka", "mooncake", "dynamo", "openai-messages"))

    @import_app.command("weka", help=f"{weka.summary}.\n\n{flowed(weka.mapping)}")
    def import_weka(src: SrcArg, output: OutOpt, name: NameOpt = None) -> None:
        _import("weka", src, output, ImportOptions(name=name))

    @import_app.command("mooncake", help=f"{mooncake.summary}.\n\n{flowed(mooncake.mapping)}")
    def import_mooncake(src: SrcArg, output: OutOpt, block_size: BlockSizeOpt = None,
                        name: NameOpt = None) -> None:
        _import("mooncake", src, output, ImportOptions(block_size=block_size, name=name))

    @import_app.command("dynamo", help=f"{dynamo.summary}.\n\n{flowed(dynamo.mapping)}")
    def import_dynamo(src: SrcArg, output: OutOpt, block_size: BlockSizeOpt = None,
                      name: NameOpt = None) -> None:
        _import("dynamo", src, output, ImportOptions(block_size=block_size, name=name))

    @import_app.command("openai-messages",
                        help=f"{messages.summary}.\n\n{flowed(messages.mapping)}")
    def import_messages(
        src: SrcArg, output: OutOpt, tokenizer: TokenizerOpt = None,
        chars_per_token: CharsOpt = None, block_size: BlockSizeOpt = None,
        pause: Annotated[float, typer.Option(
            "--pause", min=0.0, help="Seconds between a reply and the next turn.")] = 0.0,
        keep_content: Annotated[bool, typer.Option(
            "--keep-content", help="Keep the messages' text in the trace (default: only "
            "token counts and block hashes).")] = False,
        name: NameOpt = None,
    ) -> None:
        _import("openai-messages", src, output, ImportOptions(
            block_size=block_size, tokenizer=tokenizer, chars_per_token=chars_per_token,
            pause_s=pause, keep_content=keep_content, name=name))


_register_import_commands()


@app.command()
def stats(
    trace: SrcArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    fmt: FormatOpt = AUTO,
    block_size: BlockSizeOpt = None,
    tokenizer: TokenizerOpt = None,
    chars_per_token: CharsOpt = None,
) -> None:
    """Sessions, requests, subagent share, token totals, ISL / OSL / pause distributions,
    the context-depth histogram and the theoretical prefix-cache hit rate."""
    result = load_any(trace, fmt, ImportOptions(block_size=block_size, tokenizer=tokenizer,
                                                chars_per_token=chars_per_token))
    numbers = trace_stats(result.trace)
    if as_json:
        typer.echo(json.dumps(numbers, indent=2))
        return
    typer.echo(format_stats(numbers))
    for note in result.notes:
        typer.echo(f"  note: {note}")


@app.command()
def validate(
    trace: SrcArg,
    fmt: FormatOpt = AUTO,
    block_size: BlockSizeOpt = None,
    tokenizer: TokenizerOpt = None,
    chars_per_token: CharsOpt = None,
) -> None:
    """List every problem (session, request, field and line of each); exit 2 on errors.

    Checks: fields and types, duplicate ids, dangling dependencies, dependency cycles,
    dependencies listed after their dependants, negative pauses, zero outputs, block ids
    reused with a different length, blocks longer than the block size, and (warnings)
    partial blocks in mid-prompt.
    """
    report = validate_path(trace, fmt, ImportOptions(block_size=block_size,
                                                     tokenizer=tokenizer,
                                                     chars_per_token=chars_per_token))
    for problem in report.problems:
        # Importer and header errors already name the file; located problems do not.
        located = problem.session is not None or problem.line is not None
        typer.echo(problem.describe(report.path if located else None))
    for note in report.notes:
        typer.echo(f"note: {note}")
    what = (f"{report.sessions:,} sessions, {report.requests:,} requests ({report.format})")
    if report.errors:
        typer.echo(f"{report.path}: {report.errors} error(s), {report.warnings} warning(s) "
                   f"in {what}", err=True)
        raise typer.Exit(2)
    typer.echo(f"{report.path}: ok, {what}"
               + (f", {report.warnings} warning(s)" if report.warnings else ""))


app.command()(synth)

"""The traces room's commands: ``agentload traces stats`` and ``agentload traces synth``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from agentload.traces.model import theoretical_prefix_hits
from agentload.traces.native import read_trace
from agentload.traces.synth_cli import synth

app = typer.Typer(no_args_is_help=True, help="Inspect and make traces.")


def trace_stats(path: Path) -> dict[str, object]:
    """Counts and token totals of a trace, and its order-based theoretical cache hit rate."""
    trace = read_trace(path)
    requests = list(trace.requests())
    isl = sum(r.input_tokens for r in requests)
    return {
        "name": trace.name,
        "sessions": len(trace.sessions),
        "requests": len(requests),
        "subagent_requests": sum(r.agent_kind == "subagent" for r in requests),
        "input_tokens": isl,
        "output_tokens": sum(r.output_tokens for r in requests),
        "max_input_tokens": max((r.input_tokens for r in requests), default=0),
        "pause_s_total": round(sum(r.pause_s for r in requests), 3),
        "block_size": trace.block_size,
        "theoretical_prefix_cache_hit_rate": (sum(theoretical_prefix_hits(requests)) / isl
                                              if isl else None),
    }


@app.command()
def stats(
    trace: Annotated[Path, typer.Argument(help="Trace file (agentload JSONL).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Sessions, requests, subagent share, token totals and the theoretical hit rate."""
    result = trace_stats(trace)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        typer.echo(f"{key:<36} {value:.3f}" if isinstance(value, float)
                   else f"{key:<36} {value}")


app.command()(synth)

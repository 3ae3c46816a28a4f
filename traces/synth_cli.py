"""``agentload traces synth``: write a synthesized trace."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentload.traces.files import save_trace
from agentload.traces.synth import SynthConfig, synthesize


def synth(
    output: Annotated[Path, typer.Option("--output", "-o", help="Trace file to write.")],
    sessions: Annotated[int, typer.Option(min=1, help="Number of sessions.")] = 8,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 7,
) -> None:
    """Write a seeded AgentX-style trace (the bundled demo trace is the default one)."""
    save_trace(synthesize(SynthConfig(sessions=sessions, seed=seed)), output)
    typer.echo(f"wrote {output}")

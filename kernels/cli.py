"""The kernels room's commands, mounted under ``agentload bench``: ``ceilings`` and ``kernels``.

Both are thin: they call :func:`agentload.kernels.ceilings.measure` and
:func:`agentload.kernels.bench.run`, which work from Python too (``python -m
agentload.kernels.bench`` runs them where typer is not installed, e.g. a bare GPU box).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentload.kernels.errors import KernelsError


def ceilings_command(
    out: Annotated[Path | None, typer.Option(
        "--out", help="JSON path (default ~/.cache/agentload/ceilings-<gpu>.json)")] = None,
) -> None:
    """Measure this GPU's copy bandwidth and bf16 matmul rate; write them for the benchmarks."""
    from agentload.kernels import ceilings

    c = ceilings.measure()
    path = ceilings.save(c, out)
    typer.echo(f"{c.gpu}: copy {c.copy_gbps:.0f} GB/s (read + write), bf16 matmul "
               f"{c.bf16_tflops:.0f} TFLOP/s (n={c.matmul_n}); wrote {path}")


def kernels_command(
    batches: Annotated[str, typer.Option(help="Comma-separated decode batch sizes.")] = "1,8,64",
    ceilings_file: Annotated[Path | None, typer.Option(
        "--ceilings", help="Ceilings JSON (measured now if missing).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write all numbers as JSON here.")] = None,
    trace_dir: Annotated[Path | None, typer.Option(
        "--trace-dir", help="Capture Kineto traces here; print the per-layer table.")] = None,
    depth: Annotated[int, typer.Option(help="Distinct layers stacked per timed step.")] = 4,
    compile_: Annotated[bool, typer.Option(
        "--compile/--no-compile", help="Also time the standard path under torch.compile.")
    ] = True,
    ops_only: Annotated[bool, typer.Option("--ops-only", help="Per-op table only.")] = False,
    layers_only: Annotated[bool, typer.Option(
        "--layers-only", help="Per-layer table only.")] = False,
) -> None:
    """Per-op and per-layer decode timings (batch 1/8/64) against the measured ceilings."""
    try:
        sizes = [int(b) for b in batches.split(",") if b.strip()]
    except ValueError as exc:
        raise KernelsError(f"--batches must be integers, got {batches!r}") from exc
    from agentload.kernels import bench

    bench.run(batches=sizes, ceilings_path=ceilings_file, out=out, trace_dir=trace_dir,
              depth=depth, do_compile=compile_, ops_only=ops_only, layers_only=layers_only)

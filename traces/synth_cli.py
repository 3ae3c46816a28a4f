"""``agentload traces synth``: write a synthesized trace (a thin layer over ``synth``)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from agentload.traces.files import save_trace
from agentload.traces.synth import make_config, synthesize


class Preset(StrEnum):
    """The ``--preset`` choices (``agentload.traces.synth.PRESETS``)."""

    demo = "demo"
    agentx_coding = "agentx-coding"
    fixed = "fixed"


def synth(
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Trace file to write: .parquet for Parquet, else JSONL.")],
    preset: Annotated[Preset | None, typer.Option(
        help="Base shape (default: the config file's 'preset' key, else demo).",
        show_default=False)] = None,
    sessions: Annotated[int | None, typer.Option(
        help="Sessions to make (default: demo 8, agentx-coding 32).", show_default=False)] = None,
    seed: Annotated[int | None, typer.Option(
        help="Random seed (default 7).", show_default=False)] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", metavar="FILE.toml",
        help="TOML file overriding any setting; keys are SynthConfig field names "
             "(FixedConfig's for fixed). Values: a number, \\[low, high], or "
             "{dist = \"lognormal\", median = .., sigma = .., min = .., max = ..}.",
        show_default=False)] = None,
    scale_context: Annotated[float | None, typer.Option(
        metavar="F", help="Multiply every prompt length by F, 0 < F <= 1 (at least one "
                          "block each), to fit a small model (default 1).",
        show_default=False)] = None,
    max_context: Annotated[int | None, typer.Option(
        metavar="TOKENS", help="Context window: a session ends before a request's input "
                               "plus output would exceed it (default: demo none, "
                               "agentx-coding 200000).", show_default=False)] = None,
    isl: Annotated[int | None, typer.Option(
        help="fixed: input tokens per request, exact (default 1).", show_default=False)] = None,
    osl: Annotated[int | None, typer.Option(
        help="fixed: output tokens per request (default 1000).", show_default=False)] = None,
    requests: Annotated[int | None, typer.Option(
        help="fixed: number of requests, each its own session (default 10).",
        show_default=False)] = None,
    block_size: Annotated[int | None, typer.Option(
        help="Tokens per block (default 64); preset prompt lengths keep their token sizes.",
        show_default=False)] = None,
) -> None:
    """Write a seeded synthetic trace (prints what it wrote).

    Presets:

    demo: the bundled demo trace. 8 sessions, a 512-token shared prefix,
    4-7 turns, 24-120 output tokens, 1-4 s pauses, a 2-3 request subagent
    now and then; prompts stay under about 3k tokens (the tiny model).

    agentx-coding: Claude Code traffic fitted to the WEKA / SemiAnalysis
    traces. A 15k-token prefix shared by all sessions, a first message of
    median 9.6k tokens (tail to 100k), median 6 turns growing by tool
    results, OSL median 284 (tail to 4k), pauses median 16 s (up to 600 s);
    a quarter of the sessions fan out into 1-2 parallel Explore subagents
    (9k-token prefix, 5-7 requests, a 50k-token first read, a 2-2.7k token
    report joined into the parent). 32 sessions, 200k-token window.

    fixed: fixed-length decode benchmarks (--isl, --osl, --requests; by
    default ISL 1, OSL 1000, 10 requests). One-request sessions with unique
    blocks, so nothing hits the prefix cache; replay them with one user to
    re-run the batch-1 numbers vendors publish.

    Precedence: preset < --config file < flags. For the embedded tiny model:
    --preset agentx-coding --scale-context 0.1 --max-context 8192
    """
    cfg = make_config(preset.value if preset else None, config, sessions=sessions, seed=seed,
                      scale_context=scale_context, max_context=max_context, isl=isl, osl=osl,
                      requests=requests, block_size=block_size)
    trace = synthesize(cfg)
    save_trace(trace, output)
    reqs = list(trace.requests())
    subagent = sum(r.agent_kind == "subagent" for r in reqs)
    typer.echo(f"wrote {output}: {trace.name}, {len(trace.sessions)} sessions, {len(reqs)} "
               f"requests ({subagent} subagent), "
               f"{sum(r.input_tokens for r in reqs):,} input tokens, "
               f"{sum(r.output_tokens for r in reqs):,} output tokens")

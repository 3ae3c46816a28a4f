"""Named methodologies: ``--preset agentx`` sets what SemiAnalysis' AgentX v1.0 fixes.

AgentX (InferenceX's agentic benchmark, run with NVIDIA AIPerf) measures a steady state:
users replay coding-agent trajectories for an hour, each starting part-way into its
trajectory after unmeasured warm-up, recycling trajectories from one shared pool, with
long recorded idle gaps capped; its headline is E2E-normalized P90 interactivity. A
preset only fills in what the user left at its default; flags given explicitly win.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentload.replay.errors import ReplayError


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    recycle: bool
    start_range: str
    warmup_turns: int
    pause_cap_s: float
    duration_s: float
    session_order: str
    headline: str
    source: str


AGENTX = Preset(
    name="agentx", recycle=True, start_range="0.25:0.75", warmup_turns=1, pause_cap_s=300.0,
    duration_s=3600.0, session_order="pool", headline="e2e_norm_p90_interactivity_tok_s",
    source="SemiAnalysis InferenceX AgentX v1.0 (AIPerf scenario inferencex-agentx): "
           "recycling users from a shared trajectory pool, trajectory start ratio 0.25-0.75, "
           "warm-up requests per user unmeasured, recorded idle gaps capped at 300 s, a "
           "one-hour window, E2E-normalized P90 interactivity as the headline")
PRESETS = {AGENTX.name: AGENTX}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ReplayError(f"--preset must be one of {', '.join(PRESETS)}; got {name!r}") from None


def headline_line(summary: dict[str, object], chosen: Preset) -> str:
    """The preset's headline figure, printed before the table."""
    value = summary.get(chosen.headline)
    shown = f"{value:.3g} tok/s/user" if isinstance(value, float) else "n/a"
    return f"{chosen.name} headline, E2E-normalized P90 interactivity: {shown}"

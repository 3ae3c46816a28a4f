"""Seeded trace synthesizer: agent-shaped sessions, fixed-length benchmarks, the demo trace.

Agent presets (``demo``, ``agentx-coding``) build coding-agent conversations: a system
and tool prefix shared by every session, a first user message, then main turns that
each resend the whole context so far plus the previous answer and a new tool result,
after a think/tool pause. After one main turn a session may fan out into subagents:
chains of their own (their own shared prefix, fresh context) that run beside each other
and are joined before the parent's next turn, which can carry their reports back.
Optional aux requests (side calls nobody waits for) hang off main turns. Prompt lengths
are whole blocks, so a prefix cache with the same block size matches exactly what the
trace says it should.

The ``fixed`` preset builds the fixed-length decode benchmarks vendors publish (say ISL 1,
OSL 1000 at batch 1): one-request sessions with unique blocks, so nothing is a cache hit,
and the exact ISL, the last block partial when it must be.

Every random parameter is a distribution (``Constant``, ``Uniform``, ``LogNormal``)
sampled from one seeded ``random.Random``, so the same config always gives the same
trace. The module holds the generator; the distributions are in ``_synth_dists``, the
configs, presets and ``make_config`` in ``_synth_config``, re-exported here.
"""

from __future__ import annotations

import random
from importlib import resources
from pathlib import Path

from agentload.traces._synth_config import (
    PRESET_BLOCK_SIZE,
    PRESETS,
    FixedConfig,
    SynthConfig,
    SynthConfigError,
    agentx_coding,
    demo,
    fixed,
    make_config,
    preset,
    rescale_prompts,
)
from agentload.traces._synth_dists import Constant, Dist, LogNormal, Uniform, parse_dist
from agentload.traces.errors import TraceError
from agentload.traces.model import Block, Request, Session, Trace

DEMO_TRACE_NAME = "demo_agentx.jsonl"



__all__ = [
    "DEMO_TRACE_NAME", "PRESETS", "PRESET_BLOCK_SIZE", "Constant", "Dist", "FixedConfig",
    "LogNormal", "SynthConfig", "SynthConfigError", "Uniform", "agentx_coding", "demo",
    "demo_trace_path", "fixed", "make_config", "parse_dist", "preset", "rescale_prompts",
    "synthesize",
]


# ---------------------------------------------------------------------------------------
# Synthesis


def synthesize(config: SynthConfig | FixedConfig = SynthConfig()) -> Trace:
    """Build the trace ``config`` describes (the same config always gives the same trace)."""
    if isinstance(config, FixedConfig):
        return _fixed_trace(config)
    return _AgentSynth(config).trace()


def _fixed_trace(config: FixedConfig) -> Trace:
    bs = config.block_size
    full, rest = divmod(config.isl, bs)
    sizes = [bs] * full + ([rest] if rest else [])
    sessions = []
    for i in range(config.requests):
        sid = f"s{i:02d}"
        first = 1 + i * len(sizes)
        blocks = tuple(Block(first + k, n) for k, n in enumerate(sizes))
        sessions.append(Session(id=sid, requests=(Request(
            id=f"{sid}/0", session_id=sid, blocks=blocks, output_tokens=config.osl),)))
    return Trace(name=config.name or f"fixed-isl{config.isl}-osl{config.osl}",
                 sessions=tuple(sessions), block_size=bs, source="synth",
                 meta={"preset": "fixed", "isl": str(config.isl), "osl": str(config.osl)})


def _count(rng: random.Random, dist: Dist) -> int:
    # Validation keeps constants and ranges >= 1; an unclamped log-normal can round to 0.
    return max(1, dist.sample_int(rng))


def _seconds(rng: random.Random, dist: Dist) -> float:
    return round(dist.sample(rng), 2)


class _AgentSynth:
    """One synthesis run: the RNG, the block-id counter and the shared prefixes.

    The order of RNG calls is part of the output: the bundled demo trace is this code's
    output for ``SynthConfig()``, so draws happen in the order the demo always made them
    (including the tool result drawn after a chain's last request, which nothing uses).
    """

    def __init__(self, config: SynthConfig) -> None:
        self.cfg = (rescale_prompts(config, config.scale_context)
                    if config.scale_context != 1 else config)
        self.rng = random.Random(config.seed)
        self.bs = config.block_size
        self.next_id = 1
        self.system = self.fresh(self.cfg.system_blocks)
        self.subagent_system = self.fresh(self.cfg.subagent_system_blocks)
        # Drawn only when used, so traces without aux calls keep the demo's block ids.
        self.aux_system = (self.fresh(self.cfg.aux_system_blocks)
                           if self.cfg.aux_probability > 0 else [])

    def fresh(self, n: int) -> list[Block]:
        blocks = [Block(id=self.next_id + i, tokens=self.bs) for i in range(n)]
        self.next_id += n
        return blocks

    def answer(self, output_tokens: int) -> list[Block]:
        # The previous answer comes back as context, rounded up to whole blocks.
        return self.fresh(-(-output_tokens // self.bs))

    def fits(self, context: list[Block], output_tokens: int) -> bool:
        window = self.cfg.max_context
        return window is None or len(context) * self.bs + output_tokens <= window

    def trace(self) -> Trace:
        sessions = tuple(self.session(f"s{s:02d}") for s in range(self.cfg.sessions))
        meta = {"seed": str(self.cfg.seed), "scale_context": f"{self.cfg.scale_context:g}"}
        if self.cfg.max_context is not None:
            meta["max_context"] = str(self.cfg.max_context)
        return Trace(name=self.cfg.name, sessions=sessions, block_size=self.bs,
                     source="synth", meta=meta)

    def session(self, sid: str) -> Session:
        cfg, rng = self.cfg, self.rng
        requests: list[Request] = []
        context = self.system + self.fresh(_count(rng, cfg.first_message_blocks))
        n_turns = _count(rng, cfg.turns)
        spawn_after = (rng.randrange(0, n_turns - 1)
                       if n_turns > 1 and rng.random() < cfg.subagent_probability else None)
        waits_on: list[str] = []  # what the next main turn waits for
        n_agents = 0
        for turn in range(n_turns):
            out = _count(rng, cfg.output_tokens)
            pause = _seconds(rng, cfg.pause_s) if turn else 0.0
            if turn == 0:
                context, out = self.fit_first(sid, context, out)
            elif not self.fits(context, out):
                break  # the agent would have to compact: the session ends here
            rid = f"{sid}/{turn}"
            requests.append(Request(id=rid, session_id=sid, blocks=tuple(context),
                                    output_tokens=out, depends_on=tuple(waits_on),
                                    pause_s=pause))
            waits_on = [rid]
            reports: list[int] = []  # output tokens of each joined subagent
            if turn == spawn_after:
                for _ in range(_count(rng, cfg.subagent_fanout)):
                    joined = self.subagent(sid, n_agents, rid, requests)
                    n_agents += 1
                    if joined is not None:
                        waits_on.append(joined[0])
                        reports.append(joined[1])
            if cfg.aux_probability > 0 and rng.random() < cfg.aux_probability:
                self.aux(sid, turn, rid, requests)
            context = context + self.answer(out)
            if cfg.subagent_result_in_parent:
                # The reports are the tool results of the call that spawned the subagents.
                for report in reports:
                    context += self.answer(report)
            context += self.fresh(_count(rng, cfg.tool_result_blocks))
        return Session(id=sid, requests=tuple(requests))

    def fit_first(self, sid: str, context: list[Block], out: int) -> tuple[list[Block], int]:
        """Make a session's first request fit the window: cut the first message (as an
        agent compacts a resumed conversation), then the answer (as ``max_tokens``
        would); an error only if the shared prefix leaves no room at all."""
        if self.fits(context, out):
            return context, out
        window = self.cfg.max_context
        assert window is not None
        prefix = len(self.system)
        keep = max(1, (window - out) // self.bs - prefix)
        out = min(out, window - (prefix + keep) * self.bs)
        if out < 1:
            raise TraceError(
                f"a max_context of {window} tokens leaves no room in session {sid!r}: the "
                f"shared prefix alone is {prefix * self.bs} tokens; raise --max-context or "
                "lower --scale-context")
        return context[:prefix + keep], out

    def subagent(self, sid: str, index: int, parent: str,
                 requests: list[Request]) -> tuple[str, int] | None:
        """Append a subagent chain spawned after ``parent``; return its last request id
        and output tokens, or None if not even its first request fits the window."""
        cfg, rng = self.cfg, self.rng
        agent = f"{sid}-sa{index}"
        context = self.subagent_system + self.fresh(_count(rng, cfg.subagent_first_message_blocks))
        n = _count(rng, cfg.subagent_turns)
        last: tuple[str, int] | None = None
        for k in range(n):
            out = _count(rng, cfg.subagent_final_output_tokens if k == n - 1
                         else cfg.subagent_output_tokens)
            pause = _seconds(rng, cfg.subagent_pause_s)
            if not self.fits(context, out):
                break
            rid = f"{sid}/sa{index}/{k}"
            requests.append(Request(
                id=rid, session_id=sid, blocks=tuple(context), output_tokens=out,
                depends_on=(last[0] if last else parent,), pause_s=pause,
                agent_id=agent, agent_kind="subagent",
            ))
            last = (rid, out)
            grow = (cfg.subagent_first_tool_result_blocks if k == 0
                    else cfg.subagent_tool_result_blocks)
            context = context + self.answer(out) + self.fresh(_count(rng, grow))
        return last

    def aux(self, sid: str, turn: int, parent: str, requests: list[Request]) -> None:
        cfg, rng = self.cfg, self.rng
        blocks = self.aux_system + self.fresh(_count(rng, cfg.aux_prompt_blocks))
        out = _count(rng, cfg.aux_output_tokens)
        if self.fits(blocks, out):
            requests.append(Request(id=f"{sid}/aux{turn}", session_id=sid,
                                    blocks=tuple(blocks), output_tokens=out,
                                    depends_on=(parent,), agent_id=f"{sid}-aux",
                                    agent_kind="aux"))


def demo_trace_path() -> Path:
    """The bundled demo trace (``SynthConfig()`` written as native JSONL)."""
    return Path(str(resources.files("agentload.traces") / "data" / DEMO_TRACE_NAME))

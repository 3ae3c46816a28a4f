"""Seeded AgentX-style trace synthesizer (and the generator of the bundled demo trace).

Each session is a coding agent's conversation: a system prompt shared by every session
(the agent's tools and instructions), a first user message, then turns that each
resend the whole context so far plus the previous answer and a new tool result, after
a think/tool pause of a few seconds. Some sessions spawn a subagent after one turn: a
short chain of its own (its own system prompt, fresh context) that runs beside the
parent, which waits for it before its next turn. All lengths are whole blocks, so a
prefix cache with the same block size can match exactly what the trace says it should.

The same ``SynthConfig`` always gives the same trace.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from agentload.traces.model import Block, Request, Session, Trace

DEMO_TRACE_NAME = "demo_agentx.jsonl"
BlockSource = Callable[[int], list[Block]]


@dataclass(frozen=True, slots=True)
class SynthConfig:
    """Shape of a synthesized trace; token counts are in blocks of ``block_size``."""

    name: str = "demo-agentx"
    sessions: int = 8
    turns: tuple[int, int] = (4, 7)
    block_size: int = 64
    system_blocks: int = 8
    first_message_blocks: tuple[int, int] = (3, 8)
    tool_result_blocks: tuple[int, int] = (1, 6)
    output_tokens: tuple[int, int] = (24, 120)
    pause_s: tuple[float, float] = (1.0, 4.0)
    subagent_probability: float = 0.35
    subagent_turns: tuple[int, int] = (2, 3)
    subagent_system_blocks: int = 4
    seed: int = 7


def synthesize(config: SynthConfig = SynthConfig()) -> Trace:
    """Build the trace ``config`` describes."""
    rng = random.Random(config.seed)
    bs = config.block_size
    next_id = 1

    def fresh(n: int) -> list[Block]:
        nonlocal next_id
        blocks = [Block(id=next_id + i, tokens=bs) for i in range(n)]
        next_id += n
        return blocks

    system = fresh(config.system_blocks)
    subagent_system = fresh(config.subagent_system_blocks)

    def answer_blocks(output_tokens: int) -> list[Block]:
        # The previous answer comes back as context, rounded up to whole blocks.
        return fresh(-(-output_tokens // bs))

    sessions = []
    for s in range(config.sessions):
        sid = f"s{s:02d}"
        requests: list[Request] = []
        context = system + fresh(rng.randint(*config.first_message_blocks))
        n_turns = rng.randint(*config.turns)
        spawn_after = (rng.randrange(0, n_turns - 1)
                       if n_turns > 1 and rng.random() < config.subagent_probability else None)
        waits_on: list[str] = []  # what the next main turn waits for
        for turn in range(n_turns):
            out = rng.randint(*config.output_tokens)
            rid = f"{sid}/{turn}"
            requests.append(Request(
                id=rid, session_id=sid, blocks=tuple(context), output_tokens=out,
                depends_on=tuple(waits_on),
                pause_s=round(rng.uniform(*config.pause_s), 2) if turn else 0.0,
            ))
            waits_on = [rid]
            if turn == spawn_after:
                waits_on.append(_subagent(rng, config, sid, rid, subagent_system, fresh,
                                          answer_blocks, requests))
            context = context + answer_blocks(out) + fresh(rng.randint(*config.tool_result_blocks))
        sessions.append(Session(id=sid, requests=tuple(requests)))
    return Trace(name=config.name, sessions=tuple(sessions), block_size=bs, source="synth")


def _subagent(rng: random.Random, config: SynthConfig, sid: str, parent: str,
              system: list[Block], fresh: BlockSource, answer_blocks: BlockSource,
              requests: list[Request]) -> str:
    """Append a subagent chain spawned after ``parent``; return its last request id."""
    agent = f"{sid}-sa0"
    context = system + fresh(rng.randint(*config.first_message_blocks))
    last = parent
    for k in range(rng.randint(*config.subagent_turns)):
        out = rng.randint(*config.output_tokens)
        rid = f"{sid}/sa0/{k}"
        requests.append(Request(
            id=rid, session_id=sid, blocks=tuple(context), output_tokens=out,
            depends_on=(last,), pause_s=round(rng.uniform(*config.pause_s) / 2, 2),
            agent_id=agent, agent_kind="subagent",
        ))
        last = rid
        context = context + answer_blocks(out) + fresh(rng.randint(*config.tool_result_blocks))
    return last


def demo_trace_path() -> Path:
    """The bundled demo trace (``SynthConfig()`` written as native JSONL)."""
    return Path(str(resources.files("agentload.traces") / "data" / DEMO_TRACE_NAME))

"""The trace records: a Trace holds Sessions, a Session is a DAG of Requests.

A request's prompt is a list of blocks. A block is an id and a token length; two
blocks with the same id (within one trace) hold the same tokens, so a prompt that
repeats the previous turn's blocks reuses its context exactly, the way a prefix cache
sees it. Requests depend on earlier requests of the same session and start
``pause_s`` seconds after the last of them finishes (think or tool time).

These are plain frozen, slotted dataclasses: built once at load time, read on the hot
path of a replay without further validation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from agentload.traces.errors import TraceError

AgentKind = Literal["main", "subagent", "aux"]
AGENT_KINDS: tuple[AgentKind, ...] = ("main", "subagent", "aux")


@dataclass(frozen=True, slots=True)
class Block:
    """A run of prompt tokens with a content id; equal ids mean equal tokens."""

    id: int
    tokens: int


@dataclass(frozen=True, slots=True)
class RecordedTiming:
    """What the source recorded about a request, in seconds (any may be missing)."""

    t: float | None = None
    api_time: float | None = None
    ttft: float | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """One model call of an agent: prompt blocks in, ``output_tokens`` out."""

    id: str
    session_id: str
    blocks: tuple[Block, ...]
    output_tokens: int
    depends_on: tuple[str, ...] = ()
    pause_s: float = 0.0
    agent_id: str = "main"
    agent_kind: AgentKind = "main"
    model: str | None = None
    recorded: RecordedTiming | None = None

    @property
    def input_tokens(self) -> int:
        return sum(b.tokens for b in self.blocks)


@dataclass(frozen=True, slots=True)
class Session:
    """One agent conversation: its requests, listed so dependencies come first."""

    id: str
    requests: tuple[Request, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for req in self.requests:
            if req.session_id != self.id:
                raise TraceError(
                    f"session {self.id!r}: request {req.id!r} says session {req.session_id!r}"
                )
            if req.id in seen:
                raise TraceError(f"session {self.id!r}: request id {req.id!r} appears twice")
            for dep in req.depends_on:
                if dep not in seen:
                    raise TraceError(
                        f"session {self.id!r}: request {req.id!r} depends on {dep!r}, "
                        "which is not an earlier request of the session"
                    )
            if req.pause_s < 0:
                raise TraceError(
                    f"session {self.id!r}: request {req.id!r} has negative pause_s {req.pause_s}"
                )
            if req.output_tokens < 1:
                raise TraceError(
                    f"session {self.id!r}: request {req.id!r} asks for "
                    f"{req.output_tokens} output tokens (at least 1)"
                )
            seen.add(req.id)


@dataclass(frozen=True, slots=True)
class Trace:
    """A named set of sessions whose full blocks hold ``block_size`` tokens."""

    name: str
    sessions: tuple[Session, ...]
    block_size: int = 64
    source: str = "agentload"
    meta: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def requests(self) -> Iterator[Request]:
        for session in self.sessions:
            yield from session.requests

    @property
    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions)


def prefix_hit_tokens(blocks: tuple[Block, ...], seen: set[int]) -> int:
    """Tokens of a prompt a perfect prefix cache holding the ``seen`` block ids would serve.

    A block counts only while every block before it counted too (prefix caches match
    prefixes), and a prompt cached to its very end gives its last block back, because
    the server must recompute at least one token to produce logits.
    """
    hit = 0
    for block in blocks:
        if block.id not in seen:
            return hit
        hit += block.tokens
    return hit - blocks[-1].tokens if blocks else 0


def theoretical_prefix_hits(requests: list[Request]) -> list[int]:
    """``prefix_hit_tokens`` of each request, sending them in list order."""
    seen: set[int] = set()
    hits: list[int] = []
    for req in requests:
        hits.append(prefix_hit_tokens(req.blocks, seen))
        seen.update(b.id for b in req.blocks)
    return hits

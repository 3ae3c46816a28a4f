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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from agentload.traces.checks import Problem, first_error, is_seconds, structure_problems
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
class Message:
    """One chat message as the source recorded it (kept only when content is wanted)."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Request:
    """One model call of an agent: prompt blocks in, ``output_tokens`` out.

    ``pause_s`` is the think or tool time between the last dependency finishing and
    this request being sent. ``arrival_s`` (open-loop traces such as Mooncake) is the
    earliest send time in seconds from the start of the trace; closed-loop traces
    leave it unset. ``messages`` holds the recorded conversation when a source had it
    and the user asked to keep content; block ids alone define the prompt's tokens.
    """

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
    arrival_s: float | None = None
    messages: tuple[Message, ...] | None = None

    @property
    def input_tokens(self) -> int:
        return sum(b.tokens for b in self.blocks)


@dataclass(frozen=True, slots=True)
class Session:
    """One agent conversation: its requests, listed so dependencies come first."""

    id: str
    requests: tuple[Request, ...]

    def __post_init__(self) -> None:
        problem = first_error(session_problems(self.id, self.requests))
        if problem is not None:
            raise TraceError(problem.describe())


def session_problems(session_id: str, requests: Sequence[Request]) -> list[Problem]:
    """Everything structurally wrong with a session (see ``checks.structure_problems``)."""
    problems = structure_problems(session_id, requests)
    for req in requests:
        if req.session_id != session_id:
            problems.append(Problem(f"says it belongs to session {req.session_id!r}",
                                    session_id, req.id, "session"))
        if not is_seconds(req.pause_s):
            problems.append(Problem(f"pause must be finite and >= 0 s, got {req.pause_s}",
                                    session_id, req.id, "pause_s"))
        if req.arrival_s is not None and not is_seconds(req.arrival_s):
            problems.append(Problem(f"arrival must be finite and >= 0 s, got {req.arrival_s}",
                                    session_id, req.id, "arrival_s"))
        if req.output_tokens < 1:
            problems.append(Problem(f"asks for {req.output_tokens} output tokens (at least 1)",
                                    session_id, req.id, "out"))
        if not req.blocks:
            problems.append(Problem("has an empty prompt (no blocks)",
                                    session_id, req.id, "blocks"))
    return problems


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

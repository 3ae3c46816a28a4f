"""Turning proxied calls into a native trace: block ids, sessions, dependencies, the file.

This is the recording proxy's bookkeeping, with no networking in it (``record_proxy``
feeds it one finished ``Call`` at a time, in completion order):

- **Blocks.** A prompt's token ids are cut into ``block_size`` pieces; each piece's id
  comes from a chained hash (BLAKE2b of the previous piece's digest and this piece's
  tokens), numbered 1, 2, ... in order of first appearance. A block id therefore stands
  for the whole prefix up to and including it, which is what a prefix cache matches on:
  equal ids mean equal tokens, and a trailing partial piece gets an id keyed by its
  content (so equal partial content shares an id and has the same length).
- **Sessions.** A call carrying the session header joins the session named by it.
  Otherwise it continues the header-less session whose most recent request's full
  blocks are a prefix of its prompt (the longest such match), or starts a new one
  (``rec-0001``, ...).
- **Dependencies.** A request depends on the request of its session that completed
  last before it was sent, and its pause is the gap between the two.
- **The file.** ``Recorder.save`` rewrites the whole trace atomically (a temporary file,
  then ``os.replace``), so the output is a complete, valid trace at every moment.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agentload.traces.files import save_trace
from agentload.traces.model import Block, Message, RecordedTiming, Request, Session, Trace

# Prompt lengths: exact (token ids sent), tokenize (the upstream's /tokenize), usage (the
# server's count, with 4-character pieces as block content), estimate (4 characters a token).
IslSource = Literal["exact", "tokenize", "usage", "estimate"]
# Output lengths: usage (the server's count), tokenize (the generated text re-tokenized),
# chunks (content events counted), estimate (4 characters a token).
OslSource = Literal["usage", "tokenize", "chunks", "estimate"]
ESTIMATED_ISL: frozenset[str] = frozenset({"estimate"})
ESTIMATED_OSL: frozenset[str] = frozenset({"chunks", "estimate"})

CHARS_PER_TOKEN = 4
# Pseudo-tokens (4-character pieces of text that could not be tokenized) live above any
# real vocabulary, so they never hash like real token ids.
_PSEUDO_BASE = 1 << 62
_MAX_TOKEN_ID = (1 << 63) - 1


def pseudo_tokens(text: str) -> list[int]:
    """Stand-in token ids for ``text``: one per 4-character piece, equal pieces equal ids."""
    return [
        _PSEUDO_BASE | int.from_bytes(hashlib.blake2b(
            text[i: i + CHARS_PER_TOKEN].encode("utf-8", "surrogatepass"),
            digest_size=7).digest())
        for i in range(0, len(text), CHARS_PER_TOKEN)
    ]


def estimate_tokens(text: str) -> int:
    """The 4-characters-a-token estimate used when the upstream cannot tokenize."""
    return -(-len(text) // CHARS_PER_TOKEN)


def fit_tokens(tokens: Sequence[int], count: int) -> list[int]:
    """``tokens`` cut or padded to ``count`` (the server's own count wins over ours).

    Padding continues from the tokens' own content, so two prompts padded alike still
    hash alike and different ones do not collide.
    """
    if len(tokens) >= count:
        return list(tokens[:count])
    seed = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8).hexdigest()
    return [*tokens, *pseudo_tokens(seed * (count - len(tokens)))][:count]


def valid_token_ids(value: object) -> bool:
    """A list of non-negative ints (not bools) that fit the hash's 64-bit packing."""
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_TOKEN_ID
        for t in value)


class BlockIds:
    """Chained-hash block ids of one recording, numbered from 1 by first appearance."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block size must be at least 1")
        self.block_size = block_size
        self._ids: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def blocks(self, tokens: Sequence[int]) -> tuple[Block, ...]:
        out: list[Block] = []
        digest = b""
        size = self.block_size
        for start in range(0, len(tokens), size):
            piece = tokens[start: start + size]
            digest = hashlib.blake2b(digest + array("q", piece).tobytes(),
                                     digest_size=16).digest()
            block_id = self._ids.setdefault(digest, len(self._ids) + 1)
            out.append(Block(id=block_id, tokens=len(piece)))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class Call:
    """One finished, successful model call as the proxy saw it (times: perf_counter_ns).

    ``tokens`` are the prompt's token ids (pseudo-tokens when ``isl_source`` is
    ``estimate`` or ``usage``); ``session_key`` is the session header's value, if the
    call had one.
    """

    tokens: tuple[int, ...]
    isl_source: IslSource
    output_tokens: int
    osl_source: OslSource
    sent_ns: int
    done_ns: int
    first_token_ns: int | None = None
    session_key: str | None = None
    model: str | None = None
    messages: tuple[Message, ...] | None = None


@dataclass(frozen=True, slots=True)
class Recorded:
    """What the recorder made of a call: its request id, session and lengths."""

    request_id: str
    session_id: str
    isl: int
    osl: int
    estimated: bool
    new_session: bool


@dataclass(slots=True)
class _Entry:
    id: str
    blocks: tuple[Block, ...]
    output_tokens: int
    sent_ns: int
    done_ns: int
    first_token_ns: int | None
    dep: str | None
    pause_s: float
    model: str | None
    messages: tuple[Message, ...] | None


@dataclass(slots=True)
class _SessionState:
    id: str
    by_header: bool
    entries: list[_Entry] = field(default_factory=list)
    # Where the prefix index points at this session (header-less sessions only).
    full_key: int | None = None
    short_key: tuple[int, ...] | None = None

    def last_done_before(self, sent_ns: int) -> _Entry | None:
        best: _Entry | None = None
        for entry in self.entries:
            if entry.done_ns <= sent_ns and (best is None or entry.done_ns > best.done_ns):
                best = entry
        return best


class Recorder:
    """Accumulates calls into sessions and writes them as a native trace to ``path``."""

    def __init__(self, path: str | Path, block_size: int = 64, name: str | None = None) -> None:
        self.path = Path(path)
        self.name = name or self.path.stem
        self.block_ids = BlockIds(block_size)
        self.counts: Counter[str] = Counter()
        self._sessions: dict[str, _SessionState] = {}
        self._by_key: dict[str, _SessionState] = {}  # session header value -> session
        # Prefix continuity: the chained id of a session's last request's last full
        # block -> that session (one id stands for the whole prefix), and, for a last
        # request shorter than one block, its tokens -> the session.
        self._by_full: dict[int, _SessionState] = {}
        self._by_short: dict[tuple[int, ...], _SessionState] = {}
        self._next_session = 1

    @property
    def block_size(self) -> int:
        return self.block_ids.block_size

    @property
    def num_requests(self) -> int:
        return sum(len(s.entries) for s in self._sessions.values())

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def add(self, call: Call) -> Recorded:
        """Record ``call`` (calls must arrive in the order they completed)."""
        blocks = self.block_ids.blocks(call.tokens)
        session, new = self._session_for(call, blocks)
        dep = session.last_done_before(call.sent_ns)
        pause = 0.0 if dep is None else max(0.0, (call.sent_ns - dep.done_ns) / 1e9)
        entry = _Entry(
            id=f"{session.id}/{len(session.entries)}", blocks=blocks,
            output_tokens=max(1, call.output_tokens), sent_ns=call.sent_ns,
            done_ns=max(call.done_ns, call.sent_ns), first_token_ns=call.first_token_ns,
            dep=None if dep is None else dep.id, pause_s=pause, model=call.model,
            messages=call.messages)
        session.entries.append(entry)
        if not session.by_header:
            self._index(session, call.tokens, blocks)
        self.counts["requests"] += 1
        self.counts[f"isl_{call.isl_source}"] += 1
        self.counts[f"osl_{call.osl_source}"] += 1
        if call.output_tokens < 1:
            self.counts["osl_raised_to_1"] += 1
        return Recorded(entry.id, session.id, len(call.tokens), entry.output_tokens,
                        call.isl_source in ESTIMATED_ISL or call.osl_source in ESTIMATED_OSL,
                        new)

    def _session_for(self, call: Call, blocks: tuple[Block, ...]) -> tuple[_SessionState, bool]:
        if call.session_key is not None:
            found = self._by_key.get(call.session_key)
            if found is not None:
                return found, False
            # A header value that an earlier session already took as its id (say, a
            # client sending "rec-0001") gets an id of its own.
            key = call.session_key
            sid = key if key not in self._sessions else self._fresh_id()
            state = self._by_key[key] = self._new_session(sid, by_header=True)
            return state, True
        found = self._continued(call.tokens, blocks)
        if found is not None:
            return found, False
        return self._new_session(self._fresh_id(), by_header=False), True

    def _continued(self, tokens: tuple[int, ...],
                   blocks: tuple[Block, ...]) -> _SessionState | None:
        size = self.block_size
        full = [b.id for b in blocks if b.tokens == size]
        for block_id in reversed(full):  # longest match first
            found = self._by_full.get(block_id)
            if found is not None:
                return found
        for length in range(min(len(tokens), size - 1), 0, -1):
            found = self._by_short.get(tokens[:length])
            if found is not None:
                return found
        return None

    def _index(self, session: _SessionState, tokens: tuple[int, ...],
               blocks: tuple[Block, ...]) -> None:
        if session.full_key is not None and self._by_full.get(session.full_key) is session:
            del self._by_full[session.full_key]
        if session.short_key is not None and self._by_short.get(session.short_key) is session:
            del self._by_short[session.short_key]
        session.full_key = session.short_key = None
        full = [b.id for b in blocks if b.tokens == self.block_size]
        if full:
            session.full_key = full[-1]
            self._by_full[full[-1]] = session
        elif tokens:
            session.short_key = tokens
            self._by_short[tokens] = session

    def _new_session(self, sid: str, by_header: bool) -> _SessionState:
        state = _SessionState(id=sid, by_header=by_header)
        self._sessions[sid] = state
        return state

    def _fresh_id(self) -> str:
        while True:
            sid = f"rec-{self._next_session:04d}"
            self._next_session += 1
            if sid not in self._sessions:
                return sid

    def trace(self) -> Trace:
        """Everything recorded so far, as a native trace."""
        sessions = []
        for state in self._sessions.values():
            t0 = min(e.sent_ns for e in state.entries)
            requests = tuple(
                Request(
                    id=e.id, session_id=state.id, blocks=e.blocks,
                    output_tokens=e.output_tokens,
                    depends_on=() if e.dep is None else (e.dep,), pause_s=e.pause_s,
                    model=e.model, messages=e.messages,
                    recorded=RecordedTiming(
                        t=(e.sent_ns - t0) / 1e9, api_time=(e.done_ns - e.sent_ns) / 1e9,
                        ttft=None if e.first_token_ns is None
                        else max(0, e.first_token_ns - e.sent_ns) / 1e9),
                )
                for e in state.entries)
            sessions.append(Session(id=state.id, requests=requests))
        return Trace(name=self.name, sessions=tuple(sessions), block_size=self.block_size,
                     source="record")

    def save(self) -> None:
        """Rewrite ``path`` with everything recorded so far, atomically."""
        save_trace_atomically(self.trace(), self.path)


def save_trace_atomically(trace: Trace, path: Path) -> None:
    """Write ``trace`` next to ``path`` and rename it over ``path`` (a reader, or a kill
    at any instant, sees the old complete file or the new one, never half of one)."""
    # The temporary name keeps the suffix, which is how save_trace picks the format.
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        save_trace(trace, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()

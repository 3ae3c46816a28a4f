"""OpenAI-messages conversations (vLLM's multi-turn benchmark input, ShareGPT).

A file holds conversations: a JSON list, an object with a ``conversations`` list, or
one conversation a line (JSONL). A conversation is ``{"id", "messages": [{role,
content}]}`` or ShareGPT's ``{"id", "conversations": [{"from", "value"}]}``.
``MAPPING`` is what ``--help`` shows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentload.traces.errors import TraceError
from agentload.traces.formats._common import (
    BlockIds,
    FieldReader,
    ImportOptions,
    ImportResult,
    Notes,
    TraceFormat,
    json_lines,
    load_json,
)
from agentload.traces.model import Block, Message, Request, Session, Trace

DEFAULT_BLOCK_SIZE = 64
DEFAULT_CHARS_PER_TOKEN = 4.0
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "bard": "assistant", "model": "assistant",
         "system": "system", "tool": "tool", "function": "tool", "developer": "system"}

MAPPING = """\
Each conversation is a session; each assistant message is one request, whose prompt is
every message before it and whose output length is the assistant message's length, so
turn k+1's prompt starts with turn k's prompt and answer, as in vLLM's multi-turn
benchmark (the recorded answer is carried forward, not the model's). Turns wait for
the previous one, then --pause seconds. Token counts: message contents tokenized with
--tokenizer (a tokenizer.json, or a model directory holding one; no chat template, no
special tokens), or estimated at --chars-per-token (default 4.0) when no tokenizer is
given. Prompts are cut into --block-size blocks (default 64) identified by a chained
hash of their content, so equal leading content (a shared system prompt) is a cache
hit across conversations too. Roles: human/user, gpt/assistant, system, tool. Content
lists keep their text parts. Dropped: content unless --keep-content, images and other
non-text parts, tool call structure, names; a trailing user message with no answer;
conversations with no assistant message."""

Tokenize = Callable[[str], Sequence[int | str]]


def load_openai_messages(paths: list[Path], options: ImportOptions) -> ImportResult:
    """Import conversations from one file or a directory of .json / .jsonl files."""
    block_size = options.block_size or DEFAULT_BLOCK_SIZE
    tokenize, how = _tokenizer(options)
    notes = Notes()
    notes.say(f"token counts {how}")
    ids = BlockIds()
    sessions: list[Session] = []
    seen: set[str] = set()
    for path in paths:
        for where, conv, index in _conversations(path):
            reader = FieldReader(where, conv)
            sid = reader.text("id") or reader.text("conversation_id") or f"{path.stem}:{index}"
            if sid in seen:
                sid = f"{sid}#{index}"
            seen.add(sid)
            messages = _messages(reader)
            session = _session(sid, messages, tokenize, ids, block_size, options, notes)
            if session is None:
                notes.add("{n} conversations had no assistant message and were skipped")
            else:
                sessions.append(session)
    if not sessions:
        raise TraceError(f"{paths[0]}: no conversation has an assistant message")
    name = options.name or (paths[0].parent.name if len(paths) > 1 else paths[0].stem)
    return ImportResult(Trace(name=name, sessions=tuple(sessions), block_size=block_size,
                              source="openai-messages"), notes.lines())


def _tokenizer(options: ImportOptions) -> tuple[Tokenize, str]:
    if options.tokenizer is not None and options.chars_per_token is not None:
        raise TraceError("give --tokenizer or --chars-per-token, not both")
    if options.tokenizer is not None:
        path = options.tokenizer
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TraceError(f"tokenizer not found: {path} (give a tokenizer.json or a "
                             "model directory holding one)")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TraceError("--tokenizer needs the `tokenizers` package "
                             "(pip install tokenizers), or use --chars-per-token") from None
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own untyped exceptions
            raise TraceError(f"{path}: not a tokenizer.json ({exc})") from None

        def encode(text: str) -> Sequence[int]:
            ids: list[int] = tok.encode(text, add_special_tokens=False).ids
            return ids

        return encode, f"from the tokenizer {path}"
    cpt = options.chars_per_token or DEFAULT_CHARS_PER_TOKEN
    if not cpt > 0:
        raise TraceError(f"--chars-per-token must be positive, got {cpt}")
    step = max(1, round(cpt))

    def pieces(text: str) -> Sequence[str]:
        # Fixed-width character pieces stand in for tokens: the count is the estimate,
        # and equal text still gives equal pieces, hence equal block hashes.
        width = len(text) / cpt
        n = max(1, round(width)) if text else 0
        return [text[i * step:(i + 1) * step] for i in range(n)]

    return pieces, f"estimated at {cpt:g} characters per token (no tokenizer given)"


def _conversations(path: Path) -> list[tuple[str, Any, int]]:
    if path.name.lower().removesuffix(".gz").endswith(".jsonl"):
        return [(f"{path}:{lineno}", obj, lineno) for lineno, obj in json_lines(path)]
    data = load_json(path)
    if isinstance(data, dict):
        inner = data.get("conversations")
        wrapper = (isinstance(inner, list) and bool(inner) and isinstance(inner[0], dict)
                   and ("messages" in inner[0] or "conversations" in inner[0]))
        data = inner if wrapper else [data]  # a wrapper of conversations, or just one
    if not isinstance(data, list):
        raise TraceError(f"{path}: expected a list of conversations")
    return [(f"{path}: [{i}]", conv, i) for i, conv in enumerate(data)]


def _messages(reader: FieldReader) -> list[Message]:
    raw = reader.row.get("messages")
    sharegpt = raw is None
    if sharegpt:
        raw = reader.row.get("conversations")
    if not isinstance(raw, list):
        raise reader.fail("messages", "must be a list of {role, content} "
                                      "(or ShareGPT's conversations of {from, value})")
    out = []
    for j, m in enumerate(raw):
        name = f"{'conversations' if sharegpt else 'messages'}[{j}]"
        if not isinstance(m, dict):
            raise reader.fail(name, "must be an object")
        role = m.get("from" if sharegpt else "role")
        content = m.get("value" if sharegpt else "content")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise reader.fail(name, f"has an unknown role {role!r} "
                                    f"(known: {', '.join(sorted(set(ROLES)))})")
        out.append(Message(ROLES[role.lower()], _text(content, reader, name)))
    return out


def _text(content: Any, reader: FieldReader, name: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") if isinstance(p, dict) else p for p in content]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise reader.fail(name, "content must be a string or a list of text parts")


def _session(sid: str, messages: list[Message], tokenize: Tokenize, ids: BlockIds,
             block_size: int, options: ImportOptions, notes: Notes) -> Session | None:
    tokens: list[int | str] = []
    digests: list[bytes] = []  # chained hash of each full block so far
    requests: list[Request] = []
    for k, message in enumerate(messages):
        piece = list(tokenize(message.content))
        if message.role == "assistant" and tokens:
            rid = f"{sid}/{len(requests)}"
            if not piece:
                notes.add("{n} empty assistant messages ask for 1 output token")
            requests.append(Request(
                id=rid, session_id=sid, blocks=_blocks(tokens, digests, ids, block_size),
                output_tokens=max(1, len(piece)),
                depends_on=(requests[-1].id,) if requests else (),
                pause_s=options.pause_s if requests else 0.0,
                messages=tuple(messages[:k]) if options.keep_content else None,
            ))
        tokens.extend(piece)
    if messages and messages[-1].role != "assistant" and requests:
        notes.add("{n} conversations ended with an unanswered message (dropped)")
    return Session(id=sid, requests=tuple(requests)) if requests else None


def _blocks(tokens: list[int | str], digests: list[bytes], ids: BlockIds,
            block_size: int) -> tuple[Block, ...]:
    """Blocks of ``tokens``; ``digests`` caches full blocks' chained hashes between turns."""
    full = len(tokens) // block_size
    while len(digests) < full:
        i = len(digests)
        digests.append(_digest(digests[-1] if digests else b"",
                               tokens[i * block_size:(i + 1) * block_size]))
    blocks = [Block(ids.get(d), block_size) for d in digests[:full]]
    rest = tokens[full * block_size:]
    if rest:
        blocks.append(Block(ids.get(_digest(digests[full - 1] if full else b"", rest)),
                            len(rest)))
    return tuple(blocks)


def _digest(previous: bytes, chunk: Sequence[int | str]) -> bytes:
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(repr(list(chunk)).encode())
    return h.digest()


OPENAI_MESSAGES = TraceFormat(
    name="openai-messages",
    summary="OpenAI-messages / ShareGPT conversations (vLLM multi-turn benchmark input)",
    mapping=MAPPING,
    suffixes=(".json", ".jsonl"),
    load=load_openai_messages,
)

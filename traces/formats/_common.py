"""What every importer shares: options, results, source files, block-id mapping, JSON reading."""

from __future__ import annotations

import gzip
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from agentload.traces.checks import is_count, is_seconds
from agentload.traces.errors import TraceError
from agentload.traces.model import Block, Trace


@dataclass(frozen=True, slots=True)
class ImportOptions:
    """Knobs an importer may use; each importer's help says which it reads."""

    block_size: int | None = None
    tokenizer: Path | None = None
    chars_per_token: float | None = None
    pause_s: float = 0.0
    keep_content: bool = False
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ImportResult:
    """The imported trace and what the importer had to approximate or drop, counted."""

    trace: Trace
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TraceFormat:
    """A foreign trace format: its name, what it maps and drops, and its loader."""

    name: str
    summary: str
    mapping: str
    suffixes: tuple[str, ...]
    load: Callable[[list[Path], ImportOptions], ImportResult]


class BlockIds:
    """Source block keys -> the trace's block ids (1, 2, ... in first-seen order).

    A key carries the source's namespace (a file, for traces whose hash ids are local
    to one file), so ids from two files never collide, and ``fresh`` hands out ids for
    content the source left unhashed (a prompt's tail past its last full block).
    """

    def __init__(self) -> None:
        self._ids: dict[Hashable, int] = {}
        self._tables: dict[Hashable, dict[Hashable, int]] = {}
        self._next = 1

    def get(self, key: Hashable) -> int:
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = self.fresh()
        return found

    def table(self, namespace: Hashable) -> dict[Hashable, int]:
        """The key -> id dict of one namespace, for hot loops (fill misses with fresh)."""
        return self._tables.setdefault(namespace, {})

    def fresh(self) -> int:
        self._next += 1
        return self._next - 1


@dataclass(slots=True)
class Notes:
    """Counts of approximations, turned into sentences at the end of an import."""

    counts: dict[str, int] = field(default_factory=dict)
    said: list[str] = field(default_factory=list)

    def say(self, sentence: str) -> None:
        """A fact about the whole import, reported once."""
        self.said.append(sentence)

    def add(self, sentence: str, n: int = 1) -> None:
        """Count one more case of ``sentence`` (which contains ``{n}``)."""
        self.counts[sentence] = self.counts.get(sentence, 0) + n

    def lines(self) -> tuple[str, ...]:
        return (*self.said, *(s.format(n=n) for s, n in self.counts.items() if n))


def source_files(src: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """``src`` itself, or the files in directory ``src`` with one of ``suffixes`` (sorted)."""
    if src.is_file():
        return [src]
    if src.is_dir():
        files = sorted(p for p in src.iterdir() if p.is_file() and _has_suffix(p, suffixes))
        if not files:
            raise TraceError(f"{src}: no {' / '.join(suffixes)} files in this directory")
        return files
    raise TraceError(f"trace source not found: {src}")


def _has_suffix(path: Path, suffixes: tuple[str, ...]) -> bool:
    name = path.name.lower().removesuffix(".gz")
    return any(name.endswith(s) for s in suffixes)


def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped when it ends in ``.gz``."""
    try:
        data = path.read_bytes()
        return gzip.decompress(data) if path.suffix.lower() == ".gz" else data
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise TraceError(f"{path}: cannot read ({exc})") from None


def load_json(path: Path) -> Any:
    try:
        return orjson.loads(read_bytes(path))
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{path}: not JSON ({exc})") from None


def json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each non-empty line of a JSONL file."""
    for lineno, line in enumerate(read_bytes(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise TraceError(f"{path}:{lineno}: not JSON ({exc})") from None


class FieldReader:
    """Typed field access on one source record; every error names the record and field."""

    def __init__(self, where: str, row: Any) -> None:
        if not isinstance(row, dict):
            raise TraceError(f"{where}: must be a JSON object, got {type(row).__name__}")
        self.where = where
        self.row: dict[str, Any] = row

    def fail(self, name: str, message: str) -> TraceError:
        return TraceError(f"{self.where} field {name}: {message}")

    def has(self, name: str) -> bool:
        return self.row.get(name) is not None

    def count(self, name: str, default: int | None = None) -> int:
        value = self.row.get(name, default)
        if value is None:
            raise self.fail(name, "is missing (an integer token count is required)")
        if not is_count(value) or value < 0:
            raise self.fail(name, f"must be a non-negative integer, got {value!r}")
        return int(value)

    def seconds(self, name: str, scale: float = 1.0) -> float | None:
        """A non-negative number (times ``scale``), or None when absent."""
        value = self.row.get(name)
        if value is None:
            return None
        if not is_seconds(value):
            raise self.fail(name, f"must be a finite non-negative number, got {value!r}")
        return float(value) * scale

    def text(self, name: str) -> str | None:
        value = self.row.get(name)
        if value is None:
            return None
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise self.fail(name, f"must be a string, got {value!r}")
        return str(value)

    def ids(self, name: str) -> list[int] | None:
        value = self.row.get(name)
        if value is None:
            return None
        # ``type(x) is int`` (not isinstance) also refuses bools, and is fast on long lists.
        if not isinstance(value, list) or not all(type(x) is int for x in value):
            raise self.fail(name, "must be a list of integer block hashes")
        return value

    def strings(self, name: str) -> list[str]:
        value = self.row.get(name)
        if value is None:
            return []
        if not isinstance(value, list) or not all(
                isinstance(x, str | int) and not isinstance(x, bool) for x in value):
            raise self.fail(name, "must be a list of request ids")
        return [str(x) for x in value]


def hashed_blocks(ids: BlockIds, namespace: Hashable, hash_ids: list[int], input_tokens: int,
                  block_size: int, reader: FieldReader, *, partial_last: bool) -> list[Block]:
    """Blocks for a prompt of ``input_tokens`` described by per-block source hashes.

    Each hash covers ``block_size`` tokens. The last hash may cover fewer
    (``len(hash_ids) == ceil(input / block_size)``), and its id is then keyed by its
    length too, since it is not the same content as a full block of that hash. With
    ``partial_last`` (Mooncake, Dynamo) that is the only rule; without it (WEKA) hashes
    may also cover full blocks only (``floor``, as the published traces do) and the
    tokens past them get fresh ids that nothing else shares. Scaled WEKA files use the
    ``ceil`` rule, which AIPerf accepts too.
    """
    n = len(hash_ids)
    hashed = block_size * n
    too_many_tokens = partial_last and bool(n) and input_tokens > hashed
    if (n and input_tokens <= block_size * (n - 1)) or too_many_tokens:
        raise reader.fail("hash_ids", f"{n} blocks of {block_size} tokens disagree with "
                                      f"the prompt's {input_tokens} input tokens")
    table = ids.table(namespace)
    blocks = []
    for j, h in enumerate(hash_ids):
        tokens = block_size if j < n - 1 else min(block_size, input_tokens - block_size * j)
        key: Hashable = h if tokens == block_size else (h, tokens)
        found = table.get(key)
        if found is None:
            found = table[key] = ids.fresh()
        blocks.append(Block(found, tokens))
    blocks.extend(fresh_blocks(ids, max(0, input_tokens - hashed), block_size))
    return blocks


def fresh_blocks(ids: BlockIds, tokens: int, block_size: int) -> list[Block]:
    """``tokens`` of unshared content as full blocks and a partial last one."""
    full, rest = divmod(tokens, block_size)
    blocks = [Block(ids.fresh(), block_size) for _ in range(full)]
    if rest:
        blocks.append(Block(ids.fresh(), rest))
    return blocks


def length_row_blocks(row: FieldReader, ids: BlockIds, namespace: Hashable, block_size: int,
                      notes: Notes, *, note_missing_hashes: bool = True,
                      ) -> tuple[list[Block], int]:
    """Prompt blocks and output length of a Mooncake-style row.

    The row has ``input_length``, ``output_length`` and optional 512-token-style
    ``hash_ids``; an output of 0 asks for 1 token, and a row without hashes gets
    blocks nothing shares.
    """
    isl = row.count("input_length")
    if isl < 1:
        raise row.fail("input_length", "must be at least 1 token")
    out = row.count("output_length")
    if out < 1:
        notes.add("{n} rows had output_length 0; they ask for 1 token")
        out = 1
    hash_ids = row.ids("hash_ids")
    if hash_ids is None:
        if note_missing_hashes:
            notes.add("{n} rows had no hash_ids; their prompts share nothing")
        return fresh_blocks(ids, isl, block_size), out
    return hashed_blocks(ids, namespace, hash_ids, isl, block_size, row,
                         partial_last=True), out

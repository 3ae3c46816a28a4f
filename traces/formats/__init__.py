"""Foreign trace formats, their importers, and reading any trace file by name.

``FORMATS`` maps each format name to its importer and to the text that says what it
maps and what it drops. ``load_any`` is what ``replay``, ``traces stats`` and
``traces validate`` use: a native file (JSONL or Parquet) is read as is; a foreign file
is imported on the fly, either as the format the user named or as the one recognised
from its first record.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from agentload.traces.errors import TraceError
from agentload.traces.files import is_parquet, load_native
from agentload.traces.formats._common import (
    ImportOptions,
    ImportResult,
    TraceFormat,
    read_bytes,
    source_files,
)
from agentload.traces.formats.dynamo import DYNAMO
from agentload.traces.formats.mooncake import MOONCAKE
from agentload.traces.formats.openai_messages import OPENAI_MESSAGES
from agentload.traces.formats.weka import WEKA

FORMATS: dict[str, TraceFormat] = {f.name: f for f in (WEKA, MOONCAKE, DYNAMO, OPENAI_MESSAGES)}
NATIVE = "native"
AUTO = "auto"


def import_trace(fmt: str, src: str | Path, options: ImportOptions | None = None) -> ImportResult:
    """Import ``src`` (a file, or a directory of files) written in foreign format ``fmt``."""
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
    spec = FORMATS[fmt]
    return spec.load(source_files(Path(src), spec.suffixes), options or ImportOptions())


def load_any(src: str | Path, fmt: str = AUTO,
             options: ImportOptions | None = None) -> ImportResult:
    """Read a native trace or import a foreign one; ``fmt`` is a format name or "auto"."""
    path = Path(src)
    if fmt == AUTO:
        fmt = detect_format(path)
    if fmt == NATIVE:
        return ImportResult(load_native(path))
    return import_trace(fmt, path, options)


def detect_format(src: Path) -> str:
    """"native" or the name of the foreign format ``src`` (a file or directory) is in."""
    if src.is_dir():
        files = sorted(p for p in src.iterdir() if p.is_file()
                       and p.name.lower().removesuffix(".gz").endswith((".json", ".jsonl")))
        if not files:
            raise TraceError(f"{src}: no .json or .jsonl trace files in this directory")
        return detect_format(files[0])
    if not src.is_file():
        raise TraceError(f"trace file not found: {src}")
    if is_parquet(src):
        return NATIVE
    data = read_bytes(src)
    first_line = data.split(b"\n", 1)[0]
    try:
        first = orjson.loads(first_line)
    except orjson.JSONDecodeError:
        try:
            first = orjson.loads(data)  # one JSON document over many lines
        except orjson.JSONDecodeError:
            raise TraceError(f"{src}: neither JSON nor JSON lines; cannot tell its "
                             "format") from None
    found = _format_of(first[0] if isinstance(first, list) and first else first)
    if found is None:
        raise TraceError(f"{src}: cannot tell the trace format from its first record; "
                         f"pass --format ({', '.join(FORMATS)})")
    return found


def _format_of(record: object) -> str | None:
    if not isinstance(record, dict):
        return None
    keys = set(record)
    if "agentload_trace" in keys:
        return NATIVE
    if keys & {"schema", "request_id", "wait_for", "dependencies", "tool_wait_ms"}:
        return DYNAMO.name
    if "requests" in keys:
        return WEKA.name
    if keys & {"messages", "conversations"} and not keys & {"input_length", "timestamp"}:
        return OPENAI_MESSAGES.name
    if keys & {"input_length", "hash_ids", "timestamp"}:
        return MOONCAKE.name
    return None


__all__ = ["AUTO", "FORMATS", "NATIVE", "ImportOptions", "ImportResult", "TraceFormat",
           "detect_format", "import_trace", "load_any"]

"""Reading and writing native trace files, JSONL or Parquet, chosen by the file name.

``.parquet`` is the one-request-a-row form; anything else is the JSONL form (one
session a line). Foreign formats go through ``agentload.traces.formats`` instead.
"""

from __future__ import annotations

from pathlib import Path

from agentload.traces.model import Trace
from agentload.traces.native import read_trace, write_trace
from agentload.traces.parquet import read_parquet_trace, write_parquet_trace


def is_parquet(path: str | Path) -> bool:
    return Path(path).suffix.lower() in (".parquet", ".pq")


def load_native(path: str | Path) -> Trace:
    """Read a native trace file in either form."""
    return read_parquet_trace(path) if is_parquet(path) else read_trace(path)


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` natively: Parquet for a ``.parquet`` name, JSONL otherwise."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if is_parquet(path):
        write_parquet_trace(trace, path)
    else:
        write_trace(trace, path)

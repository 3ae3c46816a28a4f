"""Writing a trace back out in a foreign format: the registry and safe writes.

``EXPORTS`` maps each format name to its writer and to the text that says what the
format keeps and what it cannot hold (``agentload traces export --help`` shows it).
``export_trace`` writes to a temporary path beside the output and renames it into place
only when the whole trace is written, so a failed export leaves nothing behind. The
trace is written as given: fitting it to a target (``--scale-tokens``,
``--max-context``) is the caller's step, the same one replay takes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from agentload.traces.errors import TraceError
from agentload.traces.formats._common import Notes
from agentload.traces.formats._export import ExportFormat
from agentload.traces.formats.export_rows import AIPERF_JSONL, MOONCAKE_ROWS
from agentload.traces.formats.export_weka import WEKA_FILES
from agentload.traces.model import Trace

EXPORTS: dict[str, ExportFormat] = {f.name: f for f in (WEKA_FILES, MOONCAKE_ROWS,
                                                       AIPERF_JSONL)}


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What was written: where, how much, and what the format could not hold."""

    path: Path
    format: str
    sessions: int
    requests: int
    input_tokens: int
    output_tokens: int
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line for the console."""
        return (f"exported {self.sessions:,} sessions, {self.requests:,} requests "
                f"({self.input_tokens:,} input, {self.output_tokens:,} output tokens) as "
                f"{self.format} -> {self.path}")


def export_trace(trace: Trace, fmt: str, out: Path, *, force: bool = False) -> ExportResult:
    """Write ``trace`` to ``out`` in format ``fmt``; refuse to replace ``out`` unless ``force``."""
    spec = _format(fmt)
    check_output(fmt, out, force=force)
    if not trace.sessions:
        raise TraceError(f"{trace.name}: the trace has no sessions to export")
    notes = Notes()
    temp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove(temp)
        if spec.directory:
            temp.mkdir()
        spec.write(trace, temp, notes)
        _move_into_place(temp, out)
    except OSError as exc:
        _remove(temp)
        raise TraceError(f"cannot write {out}: {exc.strerror or exc}") from None
    except BaseException:
        _remove(temp)  # Ctrl-C or a bug: still leave nothing half-written behind
        raise
    requests = list(trace.requests())
    return ExportResult(out, fmt, len(trace.sessions), len(requests),
                        sum(r.input_tokens for r in requests),
                        sum(r.output_tokens for r in requests), notes.lines())


def check_output(fmt: str, out: Path, *, force: bool) -> None:
    """Refuse, before any work, an output path that exists (without ``force``) or cannot be."""
    spec = _format(fmt)
    if not out.exists() and not out.is_symlink():
        return
    what = "a directory" if spec.directory else "a file"
    if out.is_dir() != spec.directory or out.is_symlink():
        raise TraceError(f"{out} exists and is not {what}; {fmt} writes {what}")
    if not force:
        raise TraceError(f"{out} exists; pass --force to replace it")
    if spec.directory and any(not (p.is_file() and p.suffix == ".json")
                              for p in out.iterdir()):
        raise TraceError(f"{out} holds more than .json files; not replacing it, even with "
                         "--force")


def _format(fmt: str) -> ExportFormat:
    if fmt not in EXPORTS:
        raise TraceError(f"unknown export format {fmt!r} (known: {', '.join(EXPORTS)})")
    return EXPORTS[fmt]


def _move_into_place(temp: Path, out: Path) -> None:
    if temp.is_dir() and out.exists():
        # A directory cannot be renamed over another: move the old one aside first.
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        _remove(old)
        out.rename(old)
        temp.rename(out)
        _remove(old)
    else:
        os.replace(temp, out)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)

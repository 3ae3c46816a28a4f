"""agentload.traces: the trace model, its native files, and trace synthesis."""

from __future__ import annotations

from agentload.traces.errors import TraceError
from agentload.traces.model import Block, Message, RecordedTiming, Request, Session, Trace
from agentload.traces.native import iter_sessions, read_trace, write_trace
from agentload.traces.synth import SynthConfig, demo_trace_path, synthesize

__all__ = [
    "Block",
    "Message",
    "RecordedTiming",
    "Request",
    "Session",
    "SynthConfig",
    "Trace",
    "TraceError",
    "demo_trace_path",
    "iter_sessions",
    "read_trace",
    "synthesize",
    "write_trace",
]

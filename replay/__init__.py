"""agentload.replay: serve targets, replay traces against them, and measure every request."""

from __future__ import annotations

from agentload.replay.engine.core import ProgressSnapshot, ReplayEngine, ReplayOptions, Target
from agentload.replay.errors import ReplayError, ServerError
from agentload.replay.results.finalize import RunResult
from agentload.replay.results.metrics import summarize, with_request_metrics
from agentload.replay.run import run_replay
from agentload.replay.serve.server import ManagedServer, ServerSpec, embedded_server_spec
from agentload.replay.serve.tiny_model import TinyModelSpec, ensure_tiny_model

__all__ = [
    "ManagedServer",
    "ProgressSnapshot",
    "ReplayEngine",
    "ReplayError",
    "ReplayOptions",
    "RunResult",
    "ServerError",
    "ServerSpec",
    "Target",
    "TinyModelSpec",
    "embedded_server_spec",
    "ensure_tiny_model",
    "run_replay",
    "summarize",
    "with_request_metrics",
]

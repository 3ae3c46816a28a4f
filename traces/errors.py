"""The traces room's error: a trace file that is missing, malformed or inconsistent."""

from __future__ import annotations

from agentload import AgentloadError


class TraceError(AgentloadError):
    """A trace cannot be read or does not make sense; the message names where."""

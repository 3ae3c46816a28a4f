"""The replay room's errors: bad run options, unreachable targets, servers that fail."""

from __future__ import annotations

from agentload import AgentloadError


class ReplayError(AgentloadError):
    """A replay, demo or comparison cannot go on (bad option, unreachable target, ...)."""


class ServerError(ReplayError):
    """A server agentload was asked to start did not start, or died."""

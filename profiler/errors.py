"""The profiler room's error: a profile that is missing, corrupt, foreign or unusable."""

from __future__ import annotations

from agentload import AgentloadError


class ProfileError(AgentloadError):
    """A profile cannot be read or attributed; the message names the file and the cause."""

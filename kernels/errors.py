"""The kernels room's error: bad shapes or dtypes, a missing GPU, compiler or compiled kernel."""

from __future__ import annotations

from agentload import AgentloadError


class KernelsError(AgentloadError):
    """A kernel cannot run as asked (shape, dtype, device, or no compiled variant)."""

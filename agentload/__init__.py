"""agentload: replay agentic LLM traffic against vLLM and measure what each user experiences.

This package is the front door only: the version, the shared error base and the CLI tree.
The work lives in the rooms, installed as subpackages: ``agentload.traces``,
``agentload.replay``, ``agentload.profiler``, ``agentload.kernels`` and ``agentload.tui``.
"""

from __future__ import annotations

from agentload._errors import AgentloadError

__version__ = "0.1.0"

__all__ = ["AgentloadError", "__version__"]

"""agentload test suite (unit, CLI, packaging, and integration against real vLLM on CPU)."""

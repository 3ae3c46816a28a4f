"""HTTP headers shared by agentload's replayer (which sends them) and its recorder.

They live in the traces room because both sides need them and the dependency runs
traces <- replay: the recording proxy (``agentload record``) groups requests into
sessions by ``SESSION_HEADER`` and leaves requests carrying ``PROBE_HEADER`` (the
replayer's vocabulary probes) out of the recording.
"""

from __future__ import annotations

SESSION_HEADER = "X-Session-ID"
PROBE_HEADER = "X-Agentload-Probe"

"""agentload.profiler: per-layer GPU kernel attribution from Nsight Systems and Kineto traces.

Ingest (:func:`load_profile`: Nsight SQLite, Nsight Parquet/Arrow directories, Kineto
JSON) -> :func:`attribute` (each GPU op -> its launch -> the innermost range on the
launching thread, graphs mapped back to capture time) -> :func:`summarize` (per layer,
per layer type, per step, per rank) -> text, JSON, Parquet, HTML and two-arm diffs.
:mod:`agentload.profiler.nvtx` annotates agentload's own phases across ``await``.
"""

from __future__ import annotations

from agentload.profiler.attribute import Attribution, attribute
from agentload.profiler.diff import diff_table, render_diff
from agentload.profiler.errors import ProfileError
from agentload.profiler.load import load_profile
from agentload.profiler.model import Profile
from agentload.profiler.summary import Summary, summarize

__all__ = ["Attribution", "Profile", "ProfileError", "Summary", "attribute", "diff_table",
           "load_profile", "render_diff", "summarize"]

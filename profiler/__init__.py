"""agentload.profiler: NVTX helpers, Nsight/Kineto ingest and per-layer attribution.

Not built yet; its commands arrive with the profiler issue.
"""

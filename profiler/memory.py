"""Keep freed memory in the process for reuse, for the ``profile`` commands.

At 10 M kernels the load, the attribution and the tables each allocate and free dozens
of 80 MB arrays. glibc serves every allocation over its mmap threshold (at most 32 MB)
with a fresh mapping and unmaps it on free, so each new array faults its pages in again,
4 KiB at a time: 130-200 k page faults and 0.2-0.4 s of system time per ``summarize``
at that size. With the thresholds raised, freed blocks stay in the heap and the next
array reuses pages that are already mapped.

This is process-wide, so only the ``agentload profile`` commands (one-shot processes)
and the profiler benchmark's timed child call it; a library user's process keeps
glibc's defaults unless it asks. Without glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30      # allocations under 1 GiB come from the heap
_TRIM_THRESHOLD = (1 << 31) - 1  # the largest int: free heap memory stays in the process

_done: list[bool] = []


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once; whether it took effect."""
    if _done:
        return _done[0]
    ok = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
                mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    _done.append(ok)
    return ok

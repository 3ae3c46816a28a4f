"""The host's CPU load from Linux's ``/proc/stat`` (one reader for every bench): busy,
stolen and total ticks, and what a run's before/after samples say about them.

``vllm bench serve``'s side of ``bench agree`` samples the same first line from inside
its own process (``vllm_bench_shim.py``) and hands the two lines back as text.
"""

from __future__ import annotations

import os


def host_ticks(line: str | None = None) -> tuple[int, int, int] | None:
    """(busy, steal, all) CPU ticks of the whole host since boot (Linux /proc/stat's
    first line, or ``line`` read from it)."""
    try:
        if line is None:
            with open("/proc/stat") as fh:
                line = fh.readline()
        fields = [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    steal = fields[7] if len(fields) > 7 else 0
    return sum(fields) - idle - steal, steal, sum(fields)


def host_share(before: tuple[int, int, int] | None,
               after: tuple[int, int, int] | None) -> dict[str, float | None]:
    """Over a run: the host's busy cores (every tenant) and the share the hypervisor
    stole, the two things besides the client that move a CPU server's speed."""
    if before is None or after is None or after[2] <= before[2]:
        return {"busy_cores": None, "steal_share": None}
    total = after[2] - before[2]
    cores = os.cpu_count() or 1
    return {"busy_cores": (after[0] - before[0]) / total * cores,
            "steal_share": (after[1] - before[1]) / total}


def host_busy() -> tuple[int, int]:
    """(busy, total) ticks of the whole host, stolen time counted busy (0, 0 off Linux)."""
    ticks = host_ticks()
    return (ticks[0] + ticks[1], ticks[2]) if ticks is not None else (0, 0)


def busy_cores(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """Cores the whole host kept busy between two ``host_busy`` samples."""
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return None
    return busy / total * (os.cpu_count() or 1)

"""Ask polars' allocator for transparent huge pages, before polars is first imported.

Imported for its effect, first thing, by the ``agentload`` command (and set the same way
for the profiler benchmark's timed child). polars allocates through its own jemalloc,
which reads its options once, when polars is imported; polars' own switch
``POLARS_THP=1`` adds ``thp:always`` to them. By default memory comes in 4 KiB pages,
so every fresh 80 MB column of a 10 M-row frame faults in 20,000 pages one by one: an
``&`` over 100 M integers took 0.31 s that way and 0.19 s with huge pages (jemalloc
then advises the kernel to back its memory with 2 MiB pages; whether it does is the
system's ``transparent_hugepage`` setting, which ``madvise``, the common default,
honours). numpy already advises the same for its own big arrays.

The switch is set only while polars loads, and the environment is put back as it was
afterwards (polars itself writes its allocator options to ``_RJEM_MALLOC_CONF``, huge
pages included), so programs this process starts (vLLM servers, a profiled command) do
not inherit either. A value the user set, ``POLARS_THP=0`` included, is left alone, and
a process that imported polars before agentload keeps polars' defaults.
"""

from __future__ import annotations

import os
import sys

POLARS_THP = "POLARS_THP"
"""polars' switch for huge pages in its allocator (read when polars is imported)."""
JEMALLOC_CONF = "_RJEM_MALLOC_CONF"
"""Where polars writes the options it gives its jemalloc (read when jemalloc starts)."""


def polars_huge_pages() -> bool:
    """Import polars with its allocator asking for huge pages; whether it was set here."""
    if "polars" in sys.modules or POLARS_THP in os.environ:
        return False
    before = os.environ.get(JEMALLOC_CONF)
    os.environ[POLARS_THP] = "1"
    try:
        import polars  # noqa: F401  (its allocator's options are fixed here)
    finally:
        del os.environ[POLARS_THP]
        if before is None:
            os.environ.pop(JEMALLOC_CONF, None)
        else:
            os.environ[JEMALLOC_CONF] = before
    return True


polars_huge_pages()

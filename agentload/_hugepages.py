"""Ask polars' allocator for transparent huge pages, before polars is first imported.

Imported for its effect, first thing, by the ``agentload`` command (and set the same way
for the profiler benchmark's timed child). polars allocates through its own jemalloc,
which reads its options once, when it starts, from ``_RJEM_MALLOC_CONF``. By default
it maps memory in 4 KiB pages, so every fresh 80 MB column of a 10 M-row frame faults
in 20,000 pages one by one: an ``&`` over 100 M integers took 0.31 s that way and 0.19 s
with ``thp:always`` (jemalloc then advises the kernel to back its memory with 2 MiB
pages; whether it does is the system's ``transparent_hugepage`` setting, which
``madvise``, the common default, honours). numpy already advises the same for its own
big arrays.

The variable is set only while polars loads and then removed again, so programs this
process starts (vLLM servers, a profiled command) do not inherit it. A value the user
set is left alone, and a process that imported polars before agentload keeps polars'
defaults.
"""

from __future__ import annotations

import os
import sys

JEMALLOC_CONF = "_RJEM_MALLOC_CONF"
"""The environment variable polars' jemalloc (built with the ``_rjem_`` prefix) reads."""
HUGE_PAGES = "thp:always"


def polars_huge_pages() -> bool:
    """Import polars with jemalloc asking for huge pages; whether it was set here."""
    if "polars" in sys.modules or JEMALLOC_CONF in os.environ:
        return False
    os.environ[JEMALLOC_CONF] = HUGE_PAGES
    try:
        import polars  # noqa: F401  (jemalloc starts, and reads the variable, here)
    finally:
        del os.environ[JEMALLOC_CONF]
    return True


polars_huge_pages()

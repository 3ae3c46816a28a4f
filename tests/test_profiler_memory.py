"""retain_freed_memory: a freed large block is reused, so writing the next one faults
no pages in (glibc), where glibc's defaults map and fault it again."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a child, so this process keeps glibc's defaults: malloc 80 MB, write it, free it,
# then count the page faults of doing it again.
CHILD = """
import ctypes, ctypes.util, resource, sys
from agentload.profiler.memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 80 << 20
def once():
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
once()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True,
                         text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_block_is_reused_without_page_faults() -> None:
    default, retained = _faults("default"), _faults("retain")
    # 80 MB in 4 KiB pages is 20,480 faults when the block is mapped afresh.
    assert default > 10_000, default
    assert retained < 1_000, retained


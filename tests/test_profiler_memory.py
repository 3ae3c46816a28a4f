"""retain_freed_memory: a freed large block is reused, so writing the next one faults
no pages in (glibc), where glibc's defaults map and fault it again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli

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



def test_the_profiler_bench_runs_small_and_agrees_with_sql(tmp_path: Path) -> None:
    """`agentload bench profiler` end to end on 10 k kernels: every kernel attributed as
    built, the SQL join's owners equal ours, and the malloc-defaults run is reported."""
    proc = run_cli("bench", "profiler", "--ranges", "2000", "--workdir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.count("0 kernels misattributed") == 4, out  # SQLite twice: native, driver
    assert "SQLite through the driver:" in out
    assert "SQL and agentload owners: same" in out
    assert "Parquet dir, malloc defaults:" in out and "10,101 kernels" in out
    ratios = [line for line in out.splitlines() if line.startswith("ratio SQL / agentload")]
    assert len(ratios) == 2 and all("(SQLite file)" in line for line in ratios), out

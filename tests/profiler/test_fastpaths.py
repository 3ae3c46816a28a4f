"""The profiler's fast paths against its general ones, on the same data.

Attribution and the tables take shortcuts when a profile is laid out the usual way (a
process's events in long runs, points in time order, each group's ops contiguous and
non-overlapping). These tests force the general code (many runs, tiny chunks, shuffled
ops) and require the very same owners and table numbers, so a shortcut that is wrong
for some layout fails here.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from agentload.profiler import attribute, load_profile, summarize
from agentload.profiler.synthetic import SyntheticExport

US = 1_000
att_mod = importlib.import_module("agentload.profiler.attribute")
sum_mod = importlib.import_module("agentload.profiler.summary")


def build(path: Path, seed: int) -> Path:
    """Two processes, two threads each, random nesting, kernels on two streams."""
    rng = random.Random(seed)
    x = SyntheticExport()
    for pid in (100, 200):
        x.process(pid, f"p{pid}")
        for tid in (pid + 1, pid + 2):
            th = x.thread(pid, tid)
            t = 0
            for step in range(6):
                s0 = t
                x.push(th, s0, s0 + 400 * US, f"step{step}")
                for layer in range(3):
                    l0 = s0 + 10 * US + layer * 120 * US
                    x.push(th, l0, l0 + 110 * US, f"model.layers.{layer}")
                    x.push(th, l0 + 5 * US, l0 + 50 * US, f"model.layers.{layer}.attn")
                    for k in range(rng.randint(0, 3)):
                        x.launch_kernel(th, l0 + (6 + 10 * k) * US, l0 + (60 + 3 * k) * US,
                                        f"attn{k}", api_ns=2 * US, gpu_ns=rng.randint(1, 9) * US,
                                        stream=rng.choice((7, 9)))
                    x.launch_kernel(th, l0 + 55 * US, l0 + 90 * US, "after_attn",
                                    api_ns=2 * US, gpu_ns=4 * US)
                x.launch_kernel(th, s0 + 380 * US, s0 + 390 * US, "tail", api_ns=2 * US)
                t += 500 * US
    return x.write(path)


def snapshot(path: Path) -> tuple[list[int | None], pl.DataFrame, pl.DataFrame]:
    att = attribute(load_profile(path))
    s = summarize(att, level="layer")
    cols = ["pid", "name", "instances", "kernels", "memops", "kernel_ns", "busy_ns",
            "span_ns", "gap_ns"]
    key = ["proc", "correlation", "start"]
    owner = att.ops.sort(key)["range"].to_list()
    return owner, s.layers.select(cols).sort("pid", "name"), s.steps.select(
        "pid", "step", "kernels", "kernel_ns", "busy_ns", "span_ns").sort("pid", "step", "span_ns")


def _named(att_ranges: pl.DataFrame, owner: list[int | None]) -> list[tuple[str, int] | None]:
    """Owners as (name, start): range row numbers change when the ranges are reordered."""
    rows = att_ranges.select("name", "start").rows()
    return [None if o is None else rows[o] for o in owner]


@pytest.mark.parametrize("seed", range(3))
def test_general_paths_give_the_same_answers(tmp_path: Path, seed: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash join instead of the correlation-id table, and ranges out of order (the
    sorting path of the range index): same owners, same tables."""
    path = build(tmp_path / "x.sqlite", seed)
    fast = snapshot(path)
    assert sum(o is None for o in fast[0]) == 0  # every kernel has an owner
    monkeypatch.setattr(att_mod, "DENSE_SLACK", -10**9)  # always the hash join
    general = snapshot(path)
    assert general[0] == fast[0]
    assert general[1].equals(fast[1]) and general[2].equals(fast[2])
    prof = load_profile(path)
    perm = np.random.default_rng(seed).permutation(prof.ranges.height)
    att = attribute(dataclasses.replace(prof, ranges=prof.ranges[perm]))
    owner = att.ops.sort("proc", "correlation", "start")["range"].to_list()
    want_att = attribute(prof)
    want = want_att.ops.sort("proc", "correlation", "start")["range"].to_list()
    assert _named(att.ranges, owner) == _named(want_att.ranges, want)
    layers = summarize(att, level="layer").layers.select(fast[1].columns).sort("pid", "name")
    assert layers.equals(fast[1])


def test_lookups_split_in_two_halves_give_the_same_owners(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Big profiles look ops up in two halves on two threads, each half with its own
    cursors: same owners as one pass, whatever the halves' seam cuts through (a thread's
    run, a range, with and without ops that have no launch)."""
    path = build(tmp_path / "x.sqlite", 7)
    prof = load_profile(path)
    want = attribute(prof).ops["range"].to_list()
    for n in (1, 2, prof.ops.height // 3):
        monkeypatch.setattr(att_mod, "SPLIT_LOOKUPS_FROM", n)
        assert attribute(prof).ops["range"].to_list() == want
    # Some ops without a launch (the mask path): the split keeps the mask aligned.
    cut = dataclasses.replace(prof, launches=prof.launches[::2])
    monkeypatch.setattr(att_mod, "SPLIT_LOOKUPS_FROM", 10**9)
    whole = attribute(cut).ops["range"].to_list()
    monkeypatch.setattr(att_mod, "SPLIT_LOOKUPS_FROM", 3)
    halves = attribute(cut).ops["range"].to_list()
    assert halves == whole and whole.count(None) > 0 and any(o is not None for o in whole)


def test_shuffled_ops_take_the_sorting_paths(tmp_path: Path) -> None:
    """Ops in random order: the needles and groups must be sorted, same answers."""
    path = build(tmp_path / "x.sqlite", 5)
    prof = load_profile(path)
    want = snapshot(path)
    perm = np.random.default_rng(0).permutation(prof.ops.height)
    shuffled = dataclasses.replace(prof, ops=prof.ops[perm])
    att = attribute(shuffled)
    owner = att.ops.sort("proc", "correlation", "start")["range"].to_list()
    assert owner == want[0]
    s = summarize(att, level="layer")
    layers = s.layers.select(want[1].columns).sort("pid", "name")
    assert layers.equals(want[1])


def test_known_numbers_of_one_layer(tmp_path: Path) -> None:
    """busy = union even when two streams overlap inside an instance (fast path off)."""
    x = SyntheticExport()
    x.process(7, "p")
    t = x.thread(7, 8)
    x.push(t, 0, 100 * US, "model.layers.0")
    x.launch_kernel(t, 1 * US, 10 * US, "a", api_ns=1 * US, gpu_ns=10 * US)
    x.launch_kernel(t, 3 * US, 15 * US, "b", api_ns=1 * US, gpu_ns=10 * US, stream=9)
    x.launch_kernel(t, 5 * US, 40 * US, "c", api_ns=1 * US, gpu_ns=5 * US)
    x.launch_kernel(t, 6 * US, 50 * US, "d", api_ns=1 * US, gpu_ns=5 * US)
    s = summarize(attribute(load_profile(x.write(tmp_path / "u.sqlite"))), level="layer")
    row = s.layers.row(0, named=True)
    # a 10..20 and b 15..25 overlap; c 40..45, d 50..55
    assert (row["kernels"], row["kernel_ns"], row["busy_ns"]) == (4, 30 * US, 25 * US)
    assert row["span_ns"] == 45 * US


def test_busy_union_ignores_ops_that_end_before_they_start() -> None:
    """A damaged op (end < start) adds nothing to the union, even past the others."""
    from agentload.profiler import compiled

    gid = np.zeros(3, np.int64)
    start = np.array([15, 27, 37], np.int64)
    end = np.array([25, 30, 36], np.int64)
    first, kernels, _, busy, last_end, _, ordered, _ = compiled.run_groups(
        gid, start, end, np.ones(3, bool), False)
    assert first.tolist() == [0] and kernels.tolist() == [3] and ordered
    assert busy.tolist() == [13] and last_end.tolist() == [36]


@pytest.mark.parametrize("runs", [1, 3, 200])
def test_correlation_bounds_per_run_equal_the_loop(runs: int) -> None:
    """Bounds from numpy's min and max per run of one process (few runs) equal the
    compiled per-launch loop's, negative ids skipped, a process with none of its own."""
    from agentload.profiler import compiled

    rng = np.random.default_rng(runs)
    n = 6_000
    proc = np.repeat(rng.choice(np.array([7, 3, 11, 1 << 63], np.uint64), runs),
                     n // runs).astype(np.uint64)
    corr = rng.integers(-50, 100_000, len(proc)).astype(np.int64)
    corr[proc == 11] = -1  # process 11 launched nothing with a correlation id
    procs, lo, hi = att_mod._correlation_bounds(proc, corr)
    assert procs.tolist() == sorted(set(proc.tolist()))
    want_lo, want_hi = compiled.correlation_bounds(proc, corr, procs)
    assert lo.tolist() == want_lo.tolist() and hi.tolist() == want_hi.tolist()
    if 11 in procs.tolist():
        k = procs.tolist().index(11)
        assert lo[k] > hi[k]


WRAP_CHILD = """
import importlib, polars as pl
A = importlib.import_module("agentload.profiler.attribute")
top = (1 << 63) - 1
S = {"proc": pl.UInt64, "correlation": pl.Int64, "tid": pl.UInt64, "start": pl.Int64,
     "end": pl.Int64}
launches = pl.DataFrame({"proc": [7, 7, 7] + [8] * 100,
                         "correlation": [0, 1 << 40, top] + list(range(100)),
                         "tid": [1] * 103, "start": list(range(103)), "end": [200] * 103},
                        schema=S)
ops = pl.DataFrame({"proc": [8, 7, 7], "correlation": [5, top, 3]},
                   schema={"proc": pl.UInt64, "correlation": pl.Int64})
got = A._launches_of(ops, launches)
print(got.rows.tolist(), got.missing)
"""


def test_correlation_ids_up_to_the_int64_limit_take_the_hash_join() -> None:
    """Ids 0 and 2^63 - 1 in one process: their span does not fit a table (it wrapped
    int64 to a table of size 0 and the fill wrote past it: SIGSEGV), so the join is
    hashed, with the same answers."""
    out = subprocess.run([sys.executable, "-c", WRAP_CHILD], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("]")[0] + "]" == "[8, 2, -1]" and out.stdout.split()[-1] == "1"


def test_a_range_without_a_start_is_not_usable() -> None:
    """A null start or end makes a range unusable (no depth, owns nothing), whether or
    not the rest pass the usable filter's shortcut."""
    from agentload.profiler.model import RANGES_SCHEMA

    raw = pl.DataFrame({"proc": [1, 1, 1], "tid": [1, 1, 1], "start": [0, 10, None],
                        "end": [100, 20, 50], "name": ["a", "b", "c"],
                        "style": ["pushpop"] * 3, "range_id": [0, 1, 2], "domain": [None] * 3,
                        "category": [None] * 3},
                       schema=RANGES_SCHEMA)
    side = att_mod._index_all_ranges(raw)
    assert side.depth.tolist() == [1, 2, 0] and side.parent.tolist() == [-1, 0, -1]

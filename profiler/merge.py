"""Several profiles (one per tensor-parallel rank) as one :class:`Profile`.

Tensor-parallel ranks are separate processes, and the PyTorch profiler (and often
nsys, one report per rank) writes one file per process. Attribution and the summary
already work per process (``proc``), and the summary's ``ranks`` table aligns layers
across processes; what is missing is a single profile holding every rank. Merging is
a concatenation of the tables once the per-file keys cannot clash:

- ``strings`` ids are per file: each file's ids (``strings.id`` and the columns that
  point at them, ``ops.name_id`` and ``launches.name_id``; thread names and range
  names are already text) are shifted past the previous files' largest id.
  ``ranges.range_id`` is shifted the same way so it stays unique.
- ``proc``/``tid`` are ``globalPid``/``globalTid`` keys (``<hw:8><vm:8><pid:24><tid:24>``).
  Two files can hold the same key: two containers that both run as pid 1, two hosts,
  or the same trace given twice. Then the later file's keys, in every table, get a
  distinct top (hw) byte (XOR, so distinct keys stay distinct); ``pid_of`` still gives
  the OS pid, and the file's processes stay apart from the earlier ones.
- Device ids (``ops.device``, ``devices.device``) are kept unless they collide with an
  earlier file's (every rank sees its GPU as ``cuda:0`` under ``CUDA_VISIBLE_DEVICES``);
  then the file's devices are renumbered past the largest one so far, and a note says so.
- Correlation ids, graph node ids and graph ids are per process: with ``proc`` kept
  distinct they need nothing.

Timelines are not aligned: each file keeps its own clock (all ranks of one host share
the host clock, which is what both Nsight and Kineto record).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from agentload.profiler.errors import ProfileError
from agentload.profiler.model import PID_MASK, Profile, as_int

HW_SHIFT = 56
"""The hw byte of a ``globalPid``/``globalTid``: bits 56-63."""

STRING_ID_COLUMNS: dict[str, tuple[str, ...]] = {
    "ops": ("name_id",), "launches": ("name_id",), "strings": ("id",)}
"""Per table, the columns that hold ``strings`` ids."""

PROC_COLUMNS: dict[str, tuple[str, ...]] = {
    "ops": ("proc",), "launches": ("proc", "tid"), "ranges": ("proc", "tid"),
    "graph_nodes": ("proc", "tid"), "processes": ("proc",), "threads": ("tid",)}
"""Per table, the columns that hold ``globalPid``/``globalTid`` keys."""

TABLES = ("ops", "launches", "ranges", "strings", "graph_nodes", "processes", "threads",
          "devices")


def _labels(profiles: list[Profile]) -> list[str]:
    """What names each file in notes: its file name, or the whole path when two share one."""
    names = [Path(p.path).name or p.path for p in profiles]
    return [p.path if names.count(n) > 1 else n for p, n in zip(profiles, names, strict=True)]


def _procs(p: Profile) -> set[int]:
    """Every process key the profile uses, in any table."""
    keys: set[int] = set()
    for frame in (p.ops, p.launches, p.ranges, p.graph_nodes, p.processes):
        keys.update(v for v in frame["proc"].unique().to_list() if v is not None)
    keys.update(v & PID_MASK for v in p.threads["tid"].unique().to_list() if v is not None)
    return keys


def _devices(p: Profile) -> set[int]:
    return {v for s in (p.ops["device"], p.devices["device"]) for v in s.unique().to_list()
            if v is not None}


def _hw_flip(keys: set[int], used: set[int]) -> int:
    """The smallest hw byte value ``h`` (1-255) such that ``keys`` XOR ``h << 56`` miss ``used``."""
    for h in range(1, 256):
        flip = h << HW_SHIFT
        if not any((k ^ flip) in used for k in keys):
            return h
    raise ProfileError("too many profiles with the same process ids to merge (255 at most)")


def merge_profiles(profiles: list[Profile]) -> Profile:
    """One profile holding every table of ``profiles``; keys kept apart as the module says.

    One profile is returned as it is."""
    if not profiles:
        raise ProfileError("no profiles to merge")
    if len(profiles) == 1:
        return profiles[0]
    labels = _labels(profiles)
    parts: dict[str, list[pl.DataFrame]] = {t: [] for t in TABLES}
    notes: list[str] = []
    warnings: list[str] = []
    used_procs: set[int] = set()
    used_devices: set[int] = set()
    next_string = 0
    next_range = 0
    for label, p in zip(labels, profiles, strict=True):
        tables = {t: getattr(p, t) for t in TABLES}
        # strings: shift this file's ids past every earlier file's.
        if next_string:
            for table, cols in STRING_ID_COLUMNS.items():
                tables[table] = tables[table].with_columns(
                    pl.col(c) + next_string for c in cols)
        next_string = max(next_string, as_int(tables["strings"]["id"].max(), -1) + 1)
        if next_range:
            tables["ranges"] = tables["ranges"].with_columns(pl.col("range_id") + next_range)
        next_range = max(next_range, as_int(tables["ranges"]["range_id"].max(), -1) + 1)
        # proc/tid: a distinct hw byte for a file whose process keys were already used.
        procs = _procs(p)
        clash = procs & used_procs
        if clash:
            h = _hw_flip(procs, used_procs)
            flip = pl.lit(h << HW_SHIFT, pl.UInt64)
            for table, cols in PROC_COLUMNS.items():
                tables[table] = tables[table].with_columns(
                    pl.col(c).cast(pl.UInt64).xor(flip) for c in cols)
            procs = {k ^ (h << HW_SHIFT) for k in procs}
            shared = sorted({(k >> 24) % (1 << 24) for k in clash})
            notes.append(f"{label}: its process ids (pid {', '.join(map(str, shared[:8]))}"
                         f"{', ...' if len(shared) > 8 else ''}) were also used by an earlier "
                         f"file; its processes are told apart by hw byte {h} of their keys")
        used_procs |= procs
        # devices: renumbered past the earlier files' when they collide.
        devices = _devices(p)
        if devices & used_devices:
            offset = max(used_devices) + 1 - min(devices)
            for table in ("ops", "devices"):
                tables[table] = tables[table].with_columns(pl.col("device") + offset)
            notes.append(f"{label}: device ids {', '.join(map(str, sorted(devices)))} were "
                         f"also used by an earlier file; renumbered to "
                         f"{', '.join(str(d + offset) for d in sorted(devices))}")
            devices = {d + offset for d in devices}
        used_devices |= devices
        for t in TABLES:
            parts[t].append(tables[t])
        notes += [f"{label}: {n}" for n in p.notes]
        warnings += [f"{label}: {w}" for w in p.warnings]
    merged = {t: pl.concat(frames, how="vertical") for t, frames in parts.items()}
    return Profile(source="merged", path=", ".join(p.path for p in profiles),
                   ops=merged["ops"], launches=merged["launches"], ranges=merged["ranges"],
                   strings=merged["strings"], graph_nodes=merged["graph_nodes"],
                   processes=merged["processes"], threads=merged["threads"],
                   devices=merged["devices"],
                   notes=tuple(notes),
                   graph_node_tracing=any(p.graph_node_tracing for p in profiles),
                   warnings=tuple(warnings))

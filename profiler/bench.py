"""``agentload bench profiler``: attribute a 10 M-kernel / 2 M-range export, against SQL.

It builds one export twice (the same rows): as an Nsight Parquet directory
(``nsys export --type parquetdir``'s layout, the input the research recommends for
columnar tools) and as an Nsight SQLite file. The data is a decode trace of two TP
ranks (separate processes; correlation ids restart per process), each step a range
holding 32 ``model.layers.<i>`` ranges, each holding ``self_attn`` and ``mlp`` ranges,
with kernels in every level; 97 ranges and 481 kernels a step.

Then, each timed from a fresh child process (so the peak RSS is attribution's alone):

1. ``agentload.profiler`` on the Parquet directory: ingest + attribute + the per-layer
   tables (``summarize(level="layer")``), wall time and peak RSS; the innermost range of
   every kernel is checked against the construction's ground truth. The child sets up
   the allocators as the ``agentload`` command does: freed memory kept for reuse
   (:mod:`.memory`), polars' jemalloc asking for huge pages (:mod:`agentload._hugepages`);
   the same run with the allocators' defaults follows, to show what that saves;
2. the same on the Arrow directory and on the SQLite file (read by
   :mod:`.sqlitefile`, straight from SQLite's pages; kernel rows at the documented
   40-column width, as real exports write them);
3. the straightforward SQL join (the docs' "innermost enclosing range" query: kernel
   JOIN runtime ON correlationId and the globalPid mask, correlated subquery over
   NVTX_EVENTS with ``ORDER BY start DESC LIMIT 1``, after creating the two indexes it
   needs) run inside SQLite, summed there so no Python fetch is charged to it; its
   checksum must equal ours. ``--sql-kernels N`` runs it on the first N kernels only and
   scales the time linearly (said so in the output).

Each agentload run is repeated (``--repeat``, 3 by default) and the median run by
load + attribute is reported, with the spread: a shared machine's noise moves single
runs of about a second by 20% and more, while the 17 s SQL join averages it out.

Two ratios are printed for each path: like for like (load + attribute, which yield
each kernel's innermost range, as the SQL does) and with the per-layer tables added. Each child
first imports numba and loads the compiled loops' cached code on a small export, not
timed, as the imports are not (the first run on a machine compiles them: about 3 s).
"""

from __future__ import annotations

import json
import os
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import numpy.typing as npt
import polars as pl
import typer

from agentload._hugepages import POLARS_THP
from agentload.profiler.nsight import SQLITE_READER_ENV
from agentload.profiler.synthetic import (
    LAUNCH_KERNEL,
    SCHEMA,
    global_pid,
    global_tid,
)

LAYERS = 32
ATTN_K = 7
MLP_K = 7
SLOT = 1_000  # ns: one launch slot on the CPU timeline
KERNEL_NAMES = ["rmsnorm_kernel", "qkv_gemm", "rope_kernel", "flash_attn_decode",
                "o_proj_gemm", "allreduce_kernel", "residual_add", "gate_up_gemm",
                "silu_mul_kernel", "down_gemm", "allreduce_kernel_2", "residual_add_2",
                "moe_router", "topk_softmax", "lm_head_gemm"]


def _step_template() -> tuple[list[tuple[int, int, str]], list[tuple[int, int]]]:
    """Ranges (start slot, end slot, name) and kernels (slot, owner range) of one step."""
    ranges: list[tuple[int, int, str]] = []
    kernels: list[tuple[int, int]] = []
    total = 2 + LAYERS * 20 + 1
    ranges.append((0, total, "decode_step"))
    for layer in range(LAYERS):
        base = 1 + layer * 20
        li = len(ranges)
        ranges.append((base, base + 19, f"model.layers.{layer}"))
        ai = len(ranges)
        ranges.append((base + 1, base + 9, f"model.layers.{layer}.self_attn"))
        kernels += [(base + 2 + k, ai) for k in range(ATTN_K)]
        mi = len(ranges)
        ranges.append((base + 10, base + 18, f"model.layers.{layer}.mlp"))
        kernels += [(base + 11 + k, mi) for k in range(MLP_K)]
        kernels.append((base + 18, li))  # in the layer, after its mlp
    kernels.append((1 + LAYERS * 20, 0))  # in the step, outside every layer
    return ranges, kernels


def _kernel_launch_columns(names: npt.NDArray[np.int64], corr: npt.NDArray[np.int64]
                           ) -> dict[str, Any]:
    """The rest of a kernel row as CUPTI fills it (launch configuration, resources, grid
    id), per kernel name: real rows carry about 40 values, and the export is read at
    that width, not as a narrow table that would flatter any reader."""
    n = len(names)
    k = names % 5
    return {
        "launchType": np.zeros(n, np.int64), "cacheConfig": np.ones(n, np.int64),
        "registersPerThread": 32 + 24 * k, "gridX": 132 * (1 + k), "gridY": np.ones(n, np.int64),
        "gridZ": np.ones(n, np.int64), "blockX": 128 * (1 + k % 2), "blockY": np.ones(n, np.int64),
        "blockZ": np.ones(n, np.int64), "staticSharedMemory": 16_384 * (k % 2),
        "dynamicSharedMemory": 98_304 * (k % 3 == 0).astype(np.int64),
        "localMemoryPerThread": np.zeros(n, np.int64), "localMemoryTotal": np.full(n, 127_401_984),
        "gridId": 1_000_000 + corr, "sharedMemoryExecuted": np.full(n, 102_400),
        "sharedMemoryLimitConfig": np.ones(n, np.int64),
        "qmdBulkReleaseDone": pl.Series([None] * n, dtype=pl.Int64),
        "qmdPreexitDone": pl.Series([None] * n, dtype=pl.Int64),
        "qmdLastCtaDone": pl.Series([None] * n, dtype=pl.Int64),
        "graphId": pl.Series([None] * n, dtype=pl.Int64), "clusterX": np.ones(n, np.int64),
        "clusterY": np.ones(n, np.int64), "clusterZ": np.ones(n, np.int64),
        "clusterSchedulingPolicy": np.zeros(n, np.int64),
        "maxPotentialClusterSize": np.full(n, 8), "maxActiveClusters": np.full(n, 16),
        "sharedMemoryRequestedPercentage": pl.Series([None] * n, dtype=pl.Int64),
        "tensorSizeMinusOneElements": pl.Series([None] * n, dtype=pl.Int64),
    }


def build(workdir: Path, target_ranges: int) -> dict[str, Any]:
    """Write ``export.sqlite``, ``export_pq/`` and ``export_arrow/`` into ``workdir``."""
    r_tpl, k_tpl = _step_template()
    steps = max(2, -(-target_ranges // len(r_tpl)))
    step_slots = r_tpl[0][1] + 3
    per_rank = [steps // 2, steps - steps // 2]
    r_start_t = np.array([r[0] for r in r_tpl], np.int64)
    r_end_t = np.array([r[1] for r in r_tpl], np.int64)
    r_name_t = np.array([r[2] for r in r_tpl], dtype=object)
    k_slot_t = np.array([k[0] for k in k_tpl], np.int64)
    k_owner_t = np.array([k[1] for k in k_tpl], np.int64)
    k_name_t = np.arange(len(k_tpl), dtype=np.int64) % len(KERNEL_NAMES) + 1
    strings = {n: i + 1 for i, n in enumerate(KERNEL_NAMES)}
    strings[LAUNCH_KERNEL] = len(strings) + 1
    frames: dict[str, list[pl.DataFrame]] = {"K": [], "R": [], "N": []}
    event_base = 0
    truth: list[npt.NDArray[np.int64]] = []
    for rank, n_steps in enumerate(per_rank):
        pid = 4000 + rank
        gpid = global_pid(pid)
        gtid = global_tid(pid, pid + 1)
        s = np.arange(n_steps, dtype=np.int64)
        r_start = (s[:, None] * step_slots + r_start_t[None, :]).ravel() * SLOT
        r_end = (s[:, None] * step_slots + r_end_t[None, :]).ravel() * SLOT
        event_id = event_base + 1 + np.arange(len(r_start), dtype=np.int64)
        api = ((s[:, None] * step_slots + k_slot_t[None, :]).ravel() * SLOT) + 100
        owner = (event_base + 1 + s[:, None] * len(r_tpl) + k_owner_t[None, :]).ravel()
        n_k = len(api)
        corr = np.arange(1, n_k + 1, dtype=np.int64)
        truth.append(owner)
        frames["N"].append(pl.DataFrame({
            "start": r_start, "end": r_end, "eventType": np.full(len(r_start), 59),
            "rangeId": pl.Series([None] * len(r_start), dtype=pl.Int64),
            "text": np.tile(r_name_t, n_steps).tolist(),
            "globalTid": np.full(len(r_start), gtid), "endGlobalTid": pl.Series(
                [None] * len(r_start), dtype=pl.Int64),
            "textId": pl.Series([None] * len(r_start), dtype=pl.Int64),
            "domainId": np.zeros(len(r_start), np.int64), "eventId": event_id}))
        frames["R"].append(pl.DataFrame({
            "start": api, "end": api + 500, "eventClass": np.zeros(n_k, np.int64),
            "globalTid": np.full(n_k, gtid), "correlationId": corr,
            "nameId": np.full(n_k, strings[LAUNCH_KERNEL]), "returnValue": np.zeros(n_k)}
        ).with_columns(pl.col("returnValue").cast(pl.Int64)))
        names = np.tile(k_name_t, n_steps)
        frames["K"].append(pl.DataFrame({
            "start": api + 5_000, "end": api + 5_800, "deviceId": np.full(n_k, rank),
            "contextId": np.ones(n_k, np.int64), "streamId": np.full(n_k, 7),
            "correlationId": corr, "globalPid": np.full(n_k, gpid),
            "demangledName": names, "shortName": names, "mangledName": names,
            "graphNodeId": pl.Series([None] * n_k, dtype=pl.Int64),
            **_kernel_launch_columns(names, corr)}))
        event_base = int(event_id[-1])
    tables = {"CUPTI_ACTIVITY_KIND_KERNEL": pl.concat(frames["K"]),
              "CUPTI_ACTIVITY_KIND_RUNTIME": pl.concat(frames["R"]),
              "NVTX_EVENTS": pl.concat(frames["N"])}
    string_frame = pl.DataFrame({"id": list(strings.values()), "value": list(strings)})
    pq = workdir / "export_pq"
    pq.mkdir(exist_ok=True)
    for name, frame in tables.items():
        frame.write_parquet(pq / f"{name}.parquet")
    string_frame.write_parquet(pq / "StringIds.parquet")
    _write_arrowdir(workdir)
    np.save(workdir / "truth.npy", np.concatenate(truth))
    _write_sqlite(workdir / "export.sqlite", tables, strings)
    return {"kernels": tables["CUPTI_ACTIVITY_KIND_KERNEL"].height,
            "runtime": tables["CUPTI_ACTIVITY_KIND_RUNTIME"].height,
            "ranges": tables["NVTX_EVENTS"].height, "steps": steps, "ranks": 2}


def _write_arrowdir(work: Path) -> None:
    """``export_arrow/``: the same tables as ``nsys export --type arrowdir`` writes them
    (one uncompressed Arrow IPC file per table), made from the Parquet directory, so a
    reused workdir gains it in seconds. Read memory-mapped: no decompression, no copy."""
    out = work / "export_arrow"
    out.mkdir(exist_ok=True)
    for f in sorted((work / "export_pq").glob("*.parquet")):
        pl.read_parquet(f).write_ipc(out / f"{f.stem}.arrow", compression="uncompressed")


def _counts(work: Path) -> dict[str, Any]:
    def rows(table: str) -> int:
        return int(pl.scan_parquet(work / "export_pq" / f"{table}.parquet").select(
            pl.len()).collect().item())

    ranges = rows("NVTX_EVENTS")
    return {"kernels": rows("CUPTI_ACTIVITY_KIND_KERNEL"),
            "runtime": rows("CUPTI_ACTIVITY_KIND_RUNTIME"), "ranges": ranges,
            "steps": ranges // len(_step_template()[0]), "ranks": 2}


def _write_sqlite(path: Path, tables: dict[str, pl.DataFrame], strings: dict[str, int]) -> None:
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    for stmt in SCHEMA.split(";"):
        stmt = stmt.strip()
        if stmt and stmt.split()[2] in {*tables, "StringIds"}:
            con.execute(stmt)
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(i, s) for s, i in strings.items()])
    for name, frame in tables.items():
        cols = frame.columns  # the frames hold the schema's columns only
        marks = ", ".join("?" * len(cols))
        for chunk in frame.select(cols).iter_slices(500_000):
            con.executemany(f"INSERT INTO {name} ({', '.join(cols)}) VALUES ({marks})",
                            chunk.iter_rows())
    con.commit()
    con.close()


WARM_UP_STEPS = 1_200
"""Steps of the warm-up export: enough rows that reading it takes every path the timed
read takes (a kernel table of interior pages, cut into parts; a window of NVTX rows
that grows the string pool's hash table), so every loop's code is loaded before."""


def _warm_up() -> float:
    """Import numba and load the compiled loops' cached machine code by attributing a
    small export, outside the timing (like the other imports; a first run on a machine
    also compiles them, about 3 s). Returns the seconds it took."""
    from agentload.profiler import attribute, load_profile, summarize
    from agentload.profiler.synthetic import SyntheticExport

    t0 = time.perf_counter()
    x = SyntheticExport()
    x.process(1, "warm-up")
    th = x.thread(1, 2)
    for step in range(WARM_UP_STEPS):
        s0 = step * 1_000_000
        x.push(th, s0, s0 + 900_000, "decode_step")
        for layer in range(2):
            l0 = s0 + 1_000 + layer * 100_000
            x.push(th, l0, l0 + 90_000, f"model.layers.{layer}")
            x.push(th, l0 + 1_000, l0 + 50_000, f"model.layers.{layer}.mlp")
            for k in range(3):
                x.launch_kernel(th, l0 + 2_000 + 10_000 * k, l0 + 60_000, f"k{k}",
                                api_ns=1_000, gpu_ns=1_000)
        x.launch_kernel(th, s0 + 800_000, s0 + 850_000, "tail", api_ns=1_000, gpu_ns=1_000)
    with tempfile.TemporaryDirectory(prefix="agentload-warm-") as tmp:
        summarize(attribute(load_profile(x.write(Path(tmp) / "w.sqlite"))), level="layer")
    return time.perf_counter() - t0


def _peak_rss_bytes() -> int:
    """This process's peak resident memory: ``VmHWM``, the high-water mark of its own
    address space. Not ``ru_maxrss``: Linux carries that across fork and exec, so a
    child of the benchmark (which holds the 10 M-row frames it just built) would report
    its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(path: str, truth: str, retain: bool = True) -> None:
    """Timed in a fresh process: load, attribute, per-layer tables; check ownership."""
    from agentload.profiler import attribute, load_profile, summarize
    from agentload.profiler.memory import retain_freed_memory

    if retain:
        retain_freed_memory()  # as the `profile` commands do
    warm = _warm_up()
    start = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = start.ru_utime + start.ru_stime  # imports and warm-up excluded
    t0 = time.perf_counter()
    profile = load_profile(Path(path))
    t1 = time.perf_counter()
    att = attribute(profile)
    t2 = time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    attr_cpu = usage.ru_utime + usage.ru_stime - cpu0
    s = summarize(att, level="layer")
    t3 = time.perf_counter()
    owner = att.ranges["range_id"].gather(att.ops["range"].fill_null(0)).to_numpy()
    want = np.load(truth)
    wrong = int((owner != want).sum()) + int(att.ops["range"].null_count())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    rss = _peak_rss_bytes()
    print(json.dumps({"load_s": t1 - t0, "attribute_s": t2 - t1, "tables_s": t3 - t2,
                      "total_s": t3 - t0, "peak_rss_bytes": rss, "wrong": wrong,
                      "cpu_s": usage.ru_utime + usage.ru_stime - cpu0,
                      "attribution_cpu_s": attr_cpu, "warm_up_s": warm,
                      "layers": s.layers.height, "checksum": int(owner.sum())}))


def _run_child(path: Path, truth: Path, retain: bool = True,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """One timed child. ``retain``: the allocators set up as the ``agentload`` command
    sets them (freed memory kept, polars' jemalloc asking for huge pages); else their
    defaults."""
    flag = "--child" if retain else "--child-malloc-defaults"
    child_env = dict(os.environ)
    if retain:
        child_env.setdefault(POLARS_THP, "1")
    out = subprocess.run([sys.executable, "-P", "-m", "agentload.profiler.bench", flag,
                          str(path), str(truth)], capture_output=True, text=True, check=False,
                         env={**child_env, **(env or {})})
    if out.returncode:
        raise RuntimeError(f"benchmark child failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


SQL_JOIN = """
SELECT count(*), sum(owner) FROM (
  SELECT (SELECT n.eventId FROM NVTX_EVENTS n
           WHERE n.eventType = 59 AND n.globalTid = r.globalTid
             AND n.start <= r.start AND n.end >= r.end
           ORDER BY n.start DESC LIMIT 1) AS owner
  FROM CUPTI_ACTIVITY_KIND_KERNEL k
  JOIN CUPTI_ACTIVITY_KIND_RUNTIME r
    ON r.correlationId = k.correlationId
   AND (r.globalTid & -16777216) = k.globalPid   -- & 0xFFFFFFFFFF000000 as signed
  WHERE k.rowid <= ?)
"""


def _attribution_s(r: dict[str, Any]) -> float:
    """A child's load + attribute: what the SQL join computes, each kernel's owner."""
    return float(r["load_s"] + r["attribute_s"])


def _median_run(path: Path, truth: Path, repeat: int,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """``repeat`` timed children; the median one by load + attribute, with ``spread``:
    the fastest and slowest load + attribute."""
    runs = sorted((_run_child(path, truth, env=env) for _ in range(max(repeat, 1))),
                  key=_attribution_s)
    middle = dict(runs[len(runs) // 2])
    middle["spread"] = (_attribution_s(runs[0]), _attribution_s(runs[-1]), len(runs))
    return middle


def _spread(r: dict[str, Any]) -> str:
    low, high, n = r["spread"]
    return f"; median of {n}, load + attribute {low:.2f}-{high:.2f} s" if n > 1 else ""


def _host_check() -> float:
    """Seconds to copy and sort 8 M int64 (memory-bound, like the loads): the same on
    a host from run to run unless neighbours compete for its memory and caches, which
    the load average (this machine's own queue) does not show."""
    values = np.random.default_rng(0).integers(0, 1 << 62, 8_000_000)
    t0 = time.perf_counter()
    np.sort(values.copy())
    return time.perf_counter() - t0


def sql_join(path: Path, limit: int) -> dict[str, Any]:
    """The straightforward SQL attribution, indexes included, on a copy of the file."""
    work = path.with_name("sql_copy.sqlite")
    work.write_bytes(path.read_bytes())
    con = sqlite3.connect(work)
    c0 = time.process_time()
    t0 = time.perf_counter()
    con.execute("CREATE INDEX nvtx_tid_start ON NVTX_EVENTS(globalTid, start)")
    con.execute("CREATE INDEX rt_corr ON CUPTI_ACTIVITY_KIND_RUNTIME(correlationId)")
    t1 = time.perf_counter()
    c1 = time.process_time()
    count, total = con.execute(SQL_JOIN, (limit,)).fetchone()
    t2 = time.perf_counter()
    c2 = time.process_time()
    con.close()
    work.unlink()
    return {"index_s": t1 - t0, "query_s": t2 - t1, "rows": count, "checksum": total,
            "index_cpu_s": c1 - c0, "query_cpu_s": c2 - c1}


def profiler_speed(
    ranges: Annotated[int, typer.Option(
        "--ranges", help="NVTX ranges to build (kernels follow: about 5 per range).")]
    = 2_000_000,
    sql_kernels: Annotated[int | None, typer.Option(
        "--sql-kernels", help="Run the SQL join on the first N kernels only and scale its "
                              "time linearly (default: all).")] = None,
    sqlite_ingest: Annotated[bool, typer.Option(
        "--sqlite-ingest/--no-sqlite-ingest", help="Also time agentload on the SQLite file "
                                                   "(Python's sqlite3 fetch dominates).")]
    = True,
    no_index_kernels: Annotated[int, typer.Option(
        "--no-index-kernels", help="Also time the same SQL on the file as nsys writes it (no "
                                   "indexes) for N and 5N kernels; the marginal cost per "
                                   "kernel is scaled to all (0: skip).")] = 0,
    reuse: Annotated[bool, typer.Option(
        "--reuse", help="Reuse the exports already in --workdir instead of building.")]
    = False,
    workdir: Annotated[Path | None, typer.Option(
        "--workdir", help="Where to build the exports (default: a temporary directory).")]
    = None,
    repeat: Annotated[int, typer.Option(
        "--repeat", min=1, help="Time each agentload run this many times; the median run "
                                "is reported, with the spread.")] = 3,
) -> None:
    """Attribute a 10 M-kernel / 2 M-range export; compare with a plain SQL join."""
    with tempfile.TemporaryDirectory(prefix="agentload-bench-profiler-") as tmp:
        work = workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        ready = all((work / f).exists() for f in ("export.sqlite", "export_pq", "truth.npy"))
        counts = (_counts(work) if reuse and ready else build(work, ranges))
        verb = "reused" if reuse and ready else "built"
        if not (work / "export_arrow").exists():
            _write_arrowdir(work)
        check0 = _host_check()
        typer.echo(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
                   f"host check (copy + sort 8 M int64): {check0 * 1e3:.0f} ms")
        typer.echo(f"{verb} {counts['kernels']:,} kernels, {counts['runtime']:,} runtime calls, "
                   f"{counts['ranges']:,} ranges ({counts['steps']:,} steps, 2 ranks) in "
                   f"{time.perf_counter() - t0:.1f} s; {os.cpu_count()} CPUs")
        truth = work / "truth.npy"
        pq = _median_run(work / "export_pq", truth, repeat)
        typer.echo(f"agentload.profiler, Parquet dir: {pq['total_s']:.2f} s "
                   f"(load {pq['load_s']:.2f}, attribute {pq['attribute_s']:.2f}, tables "
                   f"{pq['tables_s']:.2f}), peak RSS {pq['peak_rss_bytes'] / 2**30:.2f} GiB, "
                   f"{pq['wrong']} kernels misattributed; CPU time {pq['cpu_s']:.2f} s; warm-up "
                   f"{pq['warm_up_s']:.2f} s, not counted{_spread(pq)}")
        # The same Parquet run with the allocators' defaults: what retaining freed memory
        # (profiler/memory.py) and huge pages for polars (agentload/_hugepages.py) save.
        plain = _run_child(work / "export_pq", truth, retain=False)
        typer.echo(f"  Parquet dir, allocator defaults: {plain['total_s']:.2f} s "
                   f"(load {plain['load_s']:.2f}, attribute {plain['attribute_s']:.2f}, tables "
                   f"{plain['tables_s']:.2f}); kept memory and huge pages save "
                   f"{plain['total_s'] - pq['total_s']:+.2f} s")
        arrow = _median_run(work / "export_arrow", truth, repeat)
        typer.echo(f"agentload.profiler, Arrow dir:   {arrow['total_s']:.2f} s "
                   f"(load {arrow['load_s']:.2f}, attribute {arrow['attribute_s']:.2f}, tables "
                   f"{arrow['tables_s']:.2f}), peak RSS {arrow['peak_rss_bytes'] / 2**30:.2f} "
                   f"GiB, {arrow['wrong']} kernels misattributed; CPU time "
                   f"{arrow['cpu_s']:.2f} s; warm-up {arrow['warm_up_s']:.2f} s, not counted"
                   f"{_spread(arrow)}")
        lite = _median_run(work / "export.sqlite", truth, repeat) if sqlite_ingest else None
        if lite is not None:
            typer.echo(f"agentload.profiler, SQLite:      {lite['total_s']:.2f} s "
                       f"(load {lite['load_s']:.2f}, attribute {lite['attribute_s']:.2f}, "
                       f"tables {lite['tables_s']:.2f}), peak RSS "
                       f"{lite['peak_rss_bytes'] / 2**30:.2f} GiB, "
                       f"{lite['wrong']} kernels misattributed; CPU time {lite['cpu_s']:.2f} s"
                       f"{_spread(lite)}")
            # The same file through the SQLite driver (ADBC, else sqlite3): what the
            # native page reader (profiler/sqlitefile.py) saves, side by side.
            driver = _run_child(work / "export.sqlite", truth,
                                env={SQLITE_READER_ENV: "driver"})
            typer.echo(f"  SQLite through the driver:     {driver['total_s']:.2f} s (load "
                       f"{driver['load_s']:.2f}: the native reader is "
                       f"{driver['load_s'] / lite['load_s']:.1f}x faster), "
                       f"{driver['wrong']} kernels misattributed")
        limit = sql_kernels or counts["kernels"]
        sql = sql_join(work / "export.sqlite", limit)
        scale = counts["kernels"] / max(sql["rows"], 1)
        sql_total = sql["index_s"] + sql["query_s"] * scale
        # Only the query is scaled: the indexes are built over the whole file either way.
        sql_cpu = sql["index_cpu_s"] + sql["query_cpu_s"] * scale
        scaled = " (query time scaled from the first {:,} kernels)".format(sql["rows"]) \
            if sql["rows"] < counts["kernels"] else ""
        typer.echo(f"SQL join in SQLite:              {sql_total:.2f} s (indexes "
                   f"{sql['index_s']:.2f}, query {sql['query_s'] * scale:.2f}){scaled}; "
                   f"CPU time {sql_cpu:.2f} s (indexes {sql['index_cpu_s']:.2f})")
        if sql["rows"] == counts["kernels"]:
            same = "same" if sql["checksum"] == pq["checksum"] else "DIFFERENT"
            typer.echo(f"SQL and agentload owners: {same} (checksum over all kernels)")
        runs = [("SQLite file", lite), ("Parquet dir", pq), ("Arrow dir", arrow)]
        runs = [(name, r) for name, r in runs if r is not None]

        def ratios(of: Any) -> str:
            return ", ".join(f"{of(r):.1f}x ({name})" for name, r in runs)

        # Like for like: the SQL yields each kernel's innermost range, as load + attribute
        # do; the per-layer tables are extra work the SQL does not do.
        typer.echo("ratio SQL / agentload, attribution (load + attribute: each kernel's "
                   "innermost range, what the SQL computes): "
                   + ratios(lambda r: sql_total / _attribution_s(r))
                   + "; by CPU time " + ratios(lambda r: sql_cpu / r["attribution_cpu_s"]))
        typer.echo("ratio SQL / agentload, attribution + per-layer tables: "
                   + ratios(lambda r: sql_total / r["total_s"])
                   + "; by CPU time " + ratios(lambda r: sql_cpu / r["cpu_s"]))
        # Without the index build: as if the indexes were already in the file (nsys does
        # not write them, so the ratios above are the ones a user meets).
        query = sql["query_s"] * scale
        typer.echo("ratio SQL query alone (indexes not counted) / agentload attribution: "
                   + ratios(lambda r: query / _attribution_s(r)))
        if no_index_kernels:
            con = sqlite3.connect(f"file:{work / 'export.sqlite'}?mode=ro", uri=True)
            cpu = []
            for k in (no_index_kernels, 5 * no_index_kernels):
                c0 = time.process_time()
                con.execute(SQL_JOIN, (k,)).fetchone()
                cpu.append(time.process_time() - c0)
            con.close()
            per = (cpu[1] - cpu[0]) / (4 * no_index_kernels)
            typer.echo(f"SQL join without indexes (as exported): {per * 1e3:.1f} ms CPU per "
                       f"kernel (from {no_index_kernels} and {5 * no_index_kernels} kernels), "
                       f"about {per * counts['kernels'] / 3600:,.0f} CPU hours for all; "
                       f"{per * counts['kernels'] / pq['cpu_s']:,.0f}x agentload by CPU time")
        load1 = os.getloadavg()[0]
        busy = load1 > (os.cpu_count() or 1)
        typer.echo(f"note: load average {load1:.1f} on {os.cpu_count()} CPUs" + (
            ": wall times include waiting for the CPU; compare CPU times" if busy
            else ": no queue for the CPU"))
        # Neighbours on a shared host slow memory-bound work without showing in the load
        # average: the same check at start and end, to compare runs with each other.
        typer.echo(f"host check (copy + sort 8 M int64): {check0 * 1e3:.0f} ms at start, "
                   f"{_host_check() * 1e3:.0f} ms at the end; the same work on a quiet "
                   "host is the baseline to compare runs against")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] in ("--child", "--child-malloc-defaults"):
        _child(sys.argv[2], sys.argv[3], retain=sys.argv[1] == "--child")

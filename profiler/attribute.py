"""GPU op -> launch -> innermost enclosing range on the launching thread.

The rule is nsys's own (``nvtx_kern_sum``, the docs' "rename kernels with NVTX"): a
range owns a GPU op when the op's *launch call* lies inside the range on the same
thread (``range.start <= api.start`` and ``api.end <= range.end``); the kernel may run
after the range closed. Of the ranges that own an op, the innermost is kept, and the
chain of parents gives the range path.

It is computed without an interval join. Per thread, ranges sorted by start nest like
a stack, so at any instant the open ranges form a chain with one range per depth, and
the open one at depth ``d`` is simply the *last range of depth d started so far*. Hence:

1. each range's depth = starts so far - ends so far on its thread (two ``searchsorted``);
2. its parent = the last range one level up started before it (one ``searchsorted`` per
   depth level, among that level's ranges);
3. a launch's innermost range = the last range started before it at depth
   ``open(t)`` (the same lookup), then verified to contain the whole call.

Everything is numpy over packed 63-bit keys, no Python loop per event. Per-op work runs
in cache-sized chunks, and a chunk's lookups are a merge when its launches are in time
order (they are, per thread): O(N + M log N) with sequential memory access.
Ranges that overlap without nesting (async start/end ranges) cannot fool the result into
a range that does not contain the call (step 3's check walks up the parents), but the
innermost may then be missed; that case is counted and said. Push/pop and start/end
ranges are swept separately and the inner of the two answers wins, so they may interleave.

CUDA graphs: with node tracing, a replayed kernel's ``graphNodeId`` leads (through the
node it was cloned from) to the node's creation during stream capture, and that event's
thread and time stand in for the launch, so replays inherit the capture-time ranges.
Without node ids, replayed kernels are owned by the range around the replay call.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl

from agentload.profiler import compiled
from agentload.profiler.errors import ProfileError
from agentload.profiler.model import OP_KINDS, Profile, as_int, keep_rows
from agentload.profiler.vllm import parse_range_names

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
NO_ROWS = np.zeros(0, np.int64)
NO_MASK = np.zeros(0, bool)
"""An empty ``got`` mask: every point is valid."""
VIA = pl.Enum(["launch", "graph-node", "graph-launch", "none"])
SPLIT_LOOKUPS_FROM = 1_000_000
"""Ops from which the innermost-range lookups run as two halves on two threads."""


@dataclass(frozen=True, slots=True)
class Attribution:
    """The result: ``ops`` gains ``tid``, ``launch_start``, ``launch_end``, ``range``
    (row index into ``ranges``, null when no range owns the op) and ``via`` (``launch``,
    ``graph-node``: through the capture-time node, ``graph-launch``: a replayed kernel
    owned by the range around its replay, ``none``: no launch found). ``ranges`` gains
    ``idx``, ``parent`` (null at the root), ``depth`` (1 = outermost) and the parsed
    ``module``, ``layer``, ``label``, ``is_output`` columns."""

    profile: Profile
    ops: pl.DataFrame
    ranges: pl.DataFrame
    notes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SweepResult:
    """Per point the owning range (-1: none); per range its parent (-1) and depth."""

    owner: I64
    parent: I64
    depth: I64
    not_nested: int


def _bits(n: int) -> int:
    return max(1, int(n).bit_length())


@dataclass(frozen=True, slots=True)
class RangeIndex:
    """One thread-set's ranges, sorted by (thread, start), ready for point lookups."""

    order: I64
    s_start: I64
    s_end: I64
    parent_s: I64
    thr_first_s: I64
    n_thr: int
    identity: bool

    def owners(self, tid: U64, got: npt.NDArray[np.bool_], threads: U64, t0: I64, t1: I64,
               base: int) -> I64:
        """Innermost range (input index, -1: none) holding each ``[t0, t1]`` on thread
        ``tid`` (looked up in ``threads``, whose index is the thread code; ``got`` empty:
        every point valid). When ranges nest, the innermost range holding a call is the
        last range started on the thread at or before it, or one of its ancestors (a
        range open at ``t0`` started before it and is still open, so it encloses it)."""
        # uint64 on both sides: numba compares uint64 with int64 as float64.
        tid, threads = tid.astype(np.uint64, copy=False), threads.astype(np.uint64, copy=False)
        n = len(t0)
        out = np.empty(n, np.int64)

        def lookup(lo: int, hi: int) -> None:
            compiled.innermost(tid[lo:hi], got[lo:hi] if len(got) else got, threads,
                               self.n_thr, t0[lo:hi], t1[lo:hi], base, self.thr_first_s,
                               self.s_start, self.s_end, self.parent_s, self.order,
                               self.identity, out[lo:hi])

        # Two halves on two threads (each keeps its own cursors, so the answers are the
        # same): by now the ranges' side is done and the second core is free.
        if n < SPLIT_LOOKUPS_FROM:
            lookup(0, n)
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="agentload-owners") as pool:
                other = pool.submit(lookup, n // 2, n)
                lookup(0, n // 2)
                other.result()
        return out


def index_ranges(r_thr: I64, r_start: I64, r_end: I64) -> tuple[RangeIndex, SweepResult]:
    """Sort and index ranges (dense thread codes >= 0, times >= 0, ``end > start``);
    also each range's parent and depth. Only the ranges' (thread, time) keys are packed
    into 63 bits, so only their timeline is bounded; points are looked up unpacked."""
    m = len(r_start)
    n_thr = int(r_thr.max()) + 1
    top_time = int(r_end.max())
    thr_bits = _bits(n_thr + 1)  # code n_thr: "a thread without ranges"
    time_bits = 63 - thr_bits
    if top_time >= 1 << time_bits:
        raise ProfileError("profile too long to attribute: its timeline needs "
                           f"{_bits(top_time)} bits next to {thr_bits} bits of threads")
    # Exports list ranges in start order per thread: when the (thread, start) keys
    # already strictly increase, that is the order and the sort is skipped.
    key0 = (r_thr << time_bits) | r_start
    identity = m < 2 or bool((key0[1:] > key0[:-1]).all())
    order = np.arange(m, dtype=np.int64) if identity else np.lexsort(
        (np.arange(m), -r_end, r_start, r_thr))
    if identity:
        s_thr, s_start, s_end, skey = r_thr, r_start, r_end, key0
    else:
        s_thr, s_start, s_end = r_thr[order], r_start[order], r_end[order]
        skey = (s_thr << time_bits) | s_start
    del key0
    ekey = np.sort((r_thr << time_bits) | r_end)
    # Where each thread's starts and ends begin: one lookup per thread, not per event.
    thr_keys = np.arange(n_thr + 1, dtype=np.int64) << time_bits
    thr_first_s = np.searchsorted(skey, thr_keys, "left")
    thr_first_e = np.searchsorted(ekey, thr_keys, "left")
    depth, parent_s = np.empty(m, np.int64), np.empty(m, np.int64)
    not_nested = compiled.nesting(s_thr, skey, ekey, thr_first_s, thr_first_e, s_end, depth,
                                  parent_s)
    del ekey
    if identity:
        parent, depth_out = parent_s, depth
    else:
        parent = np.full(m, -1, np.int64)
        parent[order] = np.where(parent_s >= 0, order[np.maximum(parent_s, 0)], -1)
        depth_out = np.empty(m, np.int64)
        depth_out[order] = depth
    index = RangeIndex(order, s_start, s_end, parent_s, thr_first_s, n_thr, identity)
    return index, SweepResult(np.zeros(0, np.int64), parent, depth_out, not_nested)


def sweep(r_thr: I64, r_start: I64, r_end: I64, p_thr: I64, p_t0: I64, p_t1: I64) -> SweepResult:
    """Innermost range containing each point interval ``[p_t0, p_t1]`` on its thread.

    Thread codes are dense ints >= 0 (a point with a code no range has, or -1, gets -1);
    times are >= 0 and ranges have ``end > start``. Indices refer to the input range order.
    """
    n = len(p_t0)
    if not len(r_start):
        return SweepResult(np.full(n, -1, np.int64), np.zeros(0, np.int64),
                           np.zeros(0, np.int64), 0)
    index, res = index_ranges(r_thr, r_start, r_end)
    # Thread codes are their own keys; -1 (no thread) wraps to a code no range has.
    codes = np.arange(index.n_thr, dtype=np.uint64)
    owner = index.owners(p_thr.astype(np.uint64), NO_MASK, codes, p_t0, p_t1, 0)
    return SweepResult(owner, res.parent, res.depth, res.not_nested)


def _graph_points(profile: Profile, ops: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """For node-traced graph kernels: the capture-time creation event of each node.

    Follows ``original`` (instantiation clones nodes) up to the node created during
    capture; returns ``(graph_node, g_tid, g_start, g_end)`` and how many nodes had no
    creation event in the capture window.
    """
    nodes = profile.graph_nodes
    wanted = ops.filter(pl.col("graph_node").is_not_null()).select(
        "proc", node="graph_node").unique()
    if not wanted.height:
        return pl.DataFrame(schema={"proc": pl.UInt64, "graph_node": pl.Int64,
                                    "g_tid": pl.UInt64, "g_start": pl.Int64,
                                    "g_end": pl.Int64}), 0
    links = nodes.select("proc", "node", "original").unique(["proc", "node"], keep="first")
    cur = wanted.with_columns(root=pl.col("node"))
    for _ in range(8):  # clone chains are short: capture -> instantiate (-> update)
        step = cur.join(links.rename({"node": "root", "original": "up"}),
                        on=["proc", "root"], how="left")
        moved = step["up"].is_not_null().any()
        cur = step.select("proc", "node", root=pl.coalesce("up", "root"))
        if not moved:
            break
    created = nodes.select("proc", root="node", g_tid="tid", g_start="start", g_end="end") \
        .unique(["proc", "root"], keep="first")
    out = cur.join(created, on=["proc", "root"], how="left")
    missing = int(out["g_tid"].is_null().sum())
    out = out.filter(pl.col("g_tid").is_not_null()).select(
        "proc", "g_tid", "g_start", "g_end", graph_node="node")
    return out, missing


def ints(series: pl.Series, fill: int = -1) -> I64:
    """A column as int64 numpy (nulls -> ``fill``), without a copy when it has none."""
    if series.null_count():
        series = series.fill_null(fill)
    return series.to_numpy().astype(np.int64, copy=False)


def _runs(values: npt.NDArray[Any]) -> tuple[I64, npt.NDArray[Any]]:
    """Start index and value of each run of equal values: profiles list one process's
    (or thread's) events in long runs, so per-run work replaces per-event work."""
    if not len(values):
        return np.zeros(0, np.int64), values[:0]
    starts = np.concatenate(([0], np.flatnonzero(values[1:] != values[:-1]) + 1))
    return starts, values[starts]


def codes_in(values: npt.NDArray[Any], keys: npt.NDArray[Any]) -> I64:
    """Per value its index in the sorted, distinct ``keys``; -1 when absent. Looked up
    once per run of equal values, then repeated."""
    starts, heads = _runs(values)
    if not len(keys):
        return np.full(len(values), -1, np.int64)
    pos = np.minimum(np.searchsorted(keys, heads), len(keys) - 1)
    code = np.where(keys[pos] == heads, pos, -1).astype(np.int64, copy=False)
    if len(code) == 1:
        return np.full(len(values), code[0], np.int64)
    return np.repeat(code, np.diff(np.append(starts, len(values))))


def distinct(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Sorted distinct values, sorting only the run heads."""
    return np.unique(_runs(values)[1])


DENSE_SLACK = 1_000_000
"""Correlation-id tables up to 4x the launches plus this many slots are direct-address;
sparser keys are hash-joined."""


FEW_RUNS = 64
"""Up to this many runs of one process, correlation bounds are taken per run with
numpy's vectorized min and max; more, with the compiled per-launch loop."""


def _correlation_bounds(proc: U64, corr: I64) -> tuple[U64, I64, I64]:
    """The distinct processes (sorted) and per process the lowest and highest
    non-negative correlation id (``lo > hi``: none). Launches come in long runs of one
    process (one per rank), so usually a min and a max per run do it."""
    starts, heads = _runs(proc)
    procs = np.unique(heads)
    if len(starts) > FEW_RUNS:
        lo, hi = compiled.correlation_bounds(proc, corr, procs)
        return procs, lo, hi
    lo = np.full(len(procs), np.iinfo(np.int64).max, np.int64)
    hi = np.full(len(procs), -1, np.int64)
    ends = np.append(starts[1:], len(proc))
    for a, b, p in zip(starts.tolist(), ends.tolist(), np.searchsorted(procs, heads).tolist(),
                       strict=True):
        run = corr[a:b]
        low = int(run.min())
        if low < 0:  # negative ids are no correlation: skip them
            run = run[run >= 0]
            if not len(run):
                continue
            low = int(run.min())
        lo[p] = min(int(lo[p]), low)
        hi[p] = max(int(hi[p]), int(run.max()))
    return procs, lo, hi


@dataclass(frozen=True, slots=True)
class _Launched:
    """Per op its launch row (-1: none) and that launch's thread, start and end (0
    without one); how many ops have none and how many launches repeat a key."""

    rows: I64
    tid: U64
    t0: I64
    t1: I64
    missing: int
    repeated: int


def _launches_of(ops: pl.DataFrame, launches: pl.DataFrame) -> _Launched:
    """Each op's launch on (process, correlationId), and what attribution needs of it.

    CUPTI correlation ids are small consecutive integers per process, so the join is a
    direct-address table (scatter, then gather): O(N), no hashing or sorting. Keys too
    sparse for that fall back to a hash join.
    """
    n = ops.height
    tid, t0, t1 = np.empty(n, np.uint64), np.empty(n, np.int64), np.empty(n, np.int64)
    if not launches.height or not n:
        tid[:], t0[:], t1[:] = 0, 0, 0
        return _Launched(np.full(n, -1, np.int64), tid, t0, t1, n, 0)
    # uint64 everywhere: numba compares uint64 with int64 as float64.
    l_proc = launches["proc"].fill_null(0).to_numpy().astype(np.uint64, copy=False)
    l_corr = ints(launches["correlation"])
    procs, lo, hi = _correlation_bounds(l_proc, l_corr)
    # In Python ints: ids up to 2^63 - 1 would wrap int64's hi - lo + 1 and its sum.
    spans = [max(int(h) - int(low) + 1, 0) for low, h in zip(lo, hi, strict=True)]
    total = sum(spans)
    l_tid = launches["tid"].fill_null(0).to_numpy()
    l_start, l_end = ints(launches["start"], 0), ints(launches["end"], 0)
    if total > 4 * launches.height + DENSE_SLACK:
        keyed = launches.select(pl.col("proc"), pl.col("correlation")).with_row_index("row")
        first = keyed.unique(["proc", "correlation"], keep="first")
        hit = ops.select("proc", "correlation").with_row_index("op").join(
            first, on=["proc", "correlation"], how="inner")
        rows = np.full(n, -1, np.int64)
        rows[hit["op"].to_numpy()] = hit["row"].to_numpy()
        missing = compiled.gather_launches(rows, l_tid, l_start, l_end, tid, t0, t1)
        return _Launched(rows, tid, t0, t1, missing, keyed.height - first.height)
    size = np.array(spans, np.int64)  # each and their sum are now small: no wrap
    base = np.cumsum(size) - size
    table = np.zeros(total, np.int64)  # row + 1; fresh zeroed pages need no fill
    dup = compiled.fill_launch_table(l_proc, l_corr, procs, lo, size, base, table)
    del l_proc, l_corr
    rows = np.empty(n, np.int64)
    missing = compiled.launch_rows(
        ops["proc"].fill_null(0).to_numpy().astype(np.uint64, copy=False),
        ints(ops["correlation"]), procs, lo, size, base, table, l_tid, l_start, l_end,
        rows, tid, t0, t1)
    return _Launched(rows, tid, t0, t1, missing, dup)


def _nullable(values: npt.NDArray[Any], valid: npt.NDArray[np.bool_] | None) -> pl.Series:
    """A Series of ``values`` (no copy), null where ``valid`` is False."""
    s = pl.Series(values)
    if valid is None:
        return s
    return pl.select(pl.when(pl.Series(valid)).then(s)).to_series()


VIA_CODES = {name: i for i, name in enumerate(VIA.categories.to_list())}
VIA_LEVELS = pl.Series(VIA.categories, dtype=VIA)


def _via_column(via: npt.NDArray[np.uint8]) -> pl.Series | pl.Expr:
    """``via`` codes as the Enum column; one value throughout (the usual case: every op
    through its launch) as a constant, not a 10 M-row gather (20 ms)."""
    if len(via) and via.min() == via.max():
        return pl.lit(VIA.categories[int(via[0])], dtype=VIA)
    return VIA_LEVELS.gather(pl.Series(via))


@dataclass(frozen=True, slots=True)
class _RangeSide:
    """Everything attribution needs from the ranges alone: parsed names, the per-style
    indexes (with each one's row map, None when it holds every range), the tree."""

    ranges: pl.DataFrame
    parts: list[tuple[RangeIndex, I64 | None]]
    parent: I64
    depth: I64
    not_nested: int
    threads: U64
    base: int


def _index_all_ranges(raw: pl.DataFrame) -> _RangeSide:
    ranges = parse_range_names(raw.with_row_index("idx").with_columns(
        pl.col("idx").cast(pl.Int64)))
    # Filters copy every column; usually every range is usable and of one style. (A
    # range without a start or end is dropped, as filter drops it.)
    usable = keep_rows(ranges, ~pl.col("is_output") & (pl.col("end") > pl.col("start")))
    parent = np.full(ranges.height, -1, np.int64)
    depth = np.zeros(ranges.height, np.int64)
    parts: list[tuple[RangeIndex, I64 | None]] = []
    if not usable.height:
        return _RangeSide(ranges, parts, parent, depth, 0, np.zeros(0, np.uint64), 0)
    threads = distinct(usable["tid"].fill_null(0).to_numpy())
    base = as_int(usable["start"].min())
    not_nested = 0
    # Push/pop and start/end ranges are indexed apart (they may interleave).
    for style in ("pushpop", "startend"):
        part = keep_rows(usable, pl.col("style") == style)
        if not part.height:
            continue
        r_idx = part["idx"].to_numpy()
        index, res = index_ranges(codes_in(part["tid"].fill_null(0).to_numpy(), threads),
                                  ints(part["start"]) - base, ints(part["end"]) - base)
        identity = len(r_idx) == ranges.height  # every range usable: idx is arange
        parent[r_idx] = res.parent if identity else np.where(
            res.parent >= 0, r_idx[np.maximum(res.parent, 0)], -1)
        depth[r_idx] = res.depth
        not_nested += res.not_nested
        parts.append((index, None if identity else r_idx))
    return _RangeSide(ranges, parts, parent, depth, not_nested, threads, base)


def attribute(profile: Profile) -> Attribution:
    """Attribute every GPU op of ``profile`` to its innermost owning range."""
    notes = list(profile.notes)
    # The ranges are indexed on another thread meanwhile: the two sides share nothing
    # until the lookup, and the compiled loops, numpy and polars release the GIL.
    with ThreadPoolExecutor(1, thread_name_prefix="agentload-ranges") as pool:
        range_side = pool.submit(_index_all_ranges, profile.ranges)
        return _attribute_ops(profile, notes, range_side)


def _attribute_ops(profile: Profile, notes: list[str], range_side: Future[_RangeSide]
                   ) -> Attribution:
    ops, launches = profile.ops, profile.launches
    n = ops.height
    launched = _launches_of(ops, launches)
    if launched.repeated:
        notes.append(f"{launched.repeated:,} runtime calls repeat a (process, correlationId) "
                     "pair; the first is used")
    idx, tid, t0, t1 = launched.rows, launched.tid, launched.t0, launched.t1
    all_got = not launched.missing
    got = idx >= 0
    via = np.where(got, VIA_CODES["launch"], VIA_CODES["none"]).astype(np.uint8) \
        if not all_got else np.zeros(n, np.uint8)
    graph_launch_ids = profile.strings.filter(
        pl.col("value").str.contains("GraphLaunch"))["id"].to_numpy()
    if len(graph_launch_ids) and launches.height:
        replay = np.isin(ints(launches["name_id"]), graph_launch_ids)[np.maximum(idx, 0)] & got
        if replay.any():
            kind = ops["kind"].to_physical().to_numpy()
            replay &= kind != OP_KINDS.index("graph")
            via[replay] = VIA_CODES["graph-launch"]
        del replay
    gn = np.zeros(0, np.int64)
    if n and ops["graph_node"].null_count() < n:
        graph_pts, missing_nodes = _graph_points(profile, ops)
        if missing_nodes:
            notes.append(f"{missing_nodes:,} CUDA-graph nodes had no creation event in the "
                         "capture window (graph captured before profiling began): their "
                         "replayed kernels are owned by the range around the replay, not by "
                         "capture-time layers")
        if graph_pts.height:
            hit = ops.select("proc", "graph_node").with_row_index("op").join(
                graph_pts, on=["proc", "graph_node"], how="inner")
            gn = hit["op"].to_numpy().astype(np.int64)
            tid[gn] = hit["g_tid"].to_numpy()
            t0[gn] = hit["g_start"].to_numpy()
            t1[gn] = hit["g_end"].to_numpy()
            via[gn] = VIA_CODES["graph-node"]
            got[gn] = True
            all_got = bool(got.all())
    replayed = int((via == VIA_CODES["graph-launch"]).sum())
    if replayed:
        notes.append(f"{replayed:,} kernels were replayed from CUDA graphs without graph node "
                     "ids: each is owned by the range around its replay call, not by the "
                     "capture-time layer")
    unlaunched = int(n - np.count_nonzero(got))
    if unlaunched:
        notes.append(f"{unlaunched:,} GPU ops have no matching runtime call (launch outside "
                     "the capture, or CUDA API tracing off) and are unattributed")

    side = range_side.result()
    ranges, parent, depth, not_nested = side.ranges, side.parent, side.depth, side.not_nested
    parts, threads, base = side.parts, side.threads, side.base
    owner: I64 | None = None
    if parts and n and launches.height:
        all_start = ints(ranges["start"], 0) if len(parts) > 1 else NO_ROWS

        def r_start_of(rows: I64) -> I64:
            out: I64 = all_start[np.maximum(rows, 0)]
            return out

        mask = NO_MASK if all_got else got
        for index, part_idx in parts:
            got_r = index.owners(tid, mask, threads, t0, t1, base)
            if part_idx is not None:
                got_r = np.where(got_r >= 0, part_idx[np.maximum(got_r, 0)], -1)
            if owner is None:
                owner = got_r
                continue
            # Inner of the two styles' answers: the one that started later.
            own_start = np.where(got_r >= 0, r_start_of(got_r), -1)
            better = (got_r >= 0) & (own_start > np.where(owner >= 0, r_start_of(owner), -1))
            owner = np.where(better, got_r, owner)
    if not_nested:
        notes.append(f"{not_nested:,} ranges overlap their enclosing range without nesting "
                     "(async start/end ranges): ops inside them go to a range that contains "
                     "their launch, not always the innermost")
    if owner is None:
        owner = np.full(n, -1, np.int64)
    valid = None if all_got else got
    owned = owner >= 0
    ops = ops.with_columns(
        tid=_nullable(tid, valid), launch_start=_nullable(t0, valid),
        launch_end=_nullable(t1, valid), via=_via_column(via),
        range=_nullable(owner, None if bool(owned.all()) else owned))
    up = pl.Series(parent)
    ranges = ranges.with_columns(parent=pl.when(up >= 0).then(up), depth=pl.Series(depth))
    return Attribution(profile=profile, ops=ops, ranges=ranges, notes=tuple(notes))

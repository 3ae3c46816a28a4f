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
2. its parent = the last range one level up started before it (one ``searchsorted`` in
   ranges keyed ``(thread, depth, position)``);
3. a launch's innermost range = the last range started before it at depth
   ``open(t)`` (the same lookup), then verified to contain the whole call.

Everything is numpy over packed 63-bit keys: O((N + M) log M), no Python loop per event.
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

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import polars as pl

from agentload.profiler.errors import ProfileError
from agentload.profiler.model import Profile, as_int
from agentload.profiler.vllm import parse_range_names

I64 = npt.NDArray[np.int64]
POINT_CHUNK = 1 << 21
"""Launch points looked up per chunk (bounds the sweep's temporaries)."""
VIA = pl.Enum(["launch", "graph-node", "graph-launch", "none"])


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


def sweep(r_thr: I64, r_start: I64, r_end: I64, p_thr: I64, p_t0: I64, p_t1: I64) -> SweepResult:
    """Innermost range containing each point interval ``[p_t0, p_t1]`` on its thread.

    Thread codes are dense ints >= 0 (a point with a code no range has gets -1); times
    are >= 0 and ranges have ``end > start``. Indices refer to the input range order.
    """
    m = len(r_start)
    n = len(p_t0)
    if m == 0:
        return SweepResult(np.full(n, -1, np.int64), np.zeros(0, np.int64),
                           np.zeros(0, np.int64), 0)
    top_time = int(max(r_end.max(), p_t1.max() if n else 0))
    thr_bits = _bits(int(max(r_thr.max(), p_thr.max() if n else 0)) + 1)
    time_bits = 63 - thr_bits
    if top_time >= 1 << time_bits:
        raise ProfileError("profile too long to attribute: its timeline needs "
                           f"{_bits(top_time)} bits next to {thr_bits} bits of threads")
    # Exports list ranges in start order per thread: when the (thread, start) keys
    # already strictly increase, that is the order and the sort is skipped.
    key0 = (r_thr << time_bits) | r_start
    if m < 2 or bool((key0[1:] > key0[:-1]).all()):
        order = np.arange(m, dtype=np.int64)
    else:
        order = np.lexsort((np.arange(m), -r_end, r_start, r_thr))
    del key0
    s_thr, s_start, s_end = r_thr[order], r_start[order], r_end[order]
    skey = (s_thr << time_bits) | s_start
    ekey = np.sort((r_thr << time_bits) | r_end)
    pos = np.arange(m, dtype=np.int64)
    # Where each thread's starts and ends begin: one lookup per thread, not per event.
    n_thr = int(max(r_thr.max(), p_thr.max() if n else 0)) + 1
    thr_keys = np.arange(n_thr, dtype=np.int64) << time_bits
    thr_first_s = np.searchsorted(skey, thr_keys, "left")
    thr_first_e = np.searchsorted(ekey, thr_keys, "left")
    first_s = thr_first_s[s_thr]
    first_e = thr_first_e[s_thr]
    depth = (pos - first_s + 1) - (np.searchsorted(ekey, skey, "right") - first_e)
    depth = np.maximum(depth, 1)

    depth_bits = _bits(int(depth.max()) + 1)
    pos_bits = 63 - thr_bits - depth_bits
    if m >= 1 << pos_bits:
        raise ProfileError(f"too many ranges ({m:,}) for {thr_bits + depth_bits} bits of "
                           "thread and depth")
    lvl_shift = pos_bits
    thr_shift = pos_bits + depth_bits

    def level_key(thr: I64, d: I64, p: I64) -> I64:
        return (thr << thr_shift) | (d << lvl_shift) | p

    key2 = level_key(s_thr, depth, pos)
    perm = np.argsort(key2, kind="stable")
    k2 = key2[perm]

    def last_at(thr: I64, d: I64, p: I64) -> I64:
        """Sorted-range index of the last range at (thr, d) with position <= p, or -1."""
        j = np.searchsorted(k2, level_key(thr, d, p), "right") - 1
        jc = np.maximum(j, 0)
        ok = (j >= 0) & ((k2[jc] >> lvl_shift) == ((thr << depth_bits) | d))
        return np.where(ok, perm[jc], -1)

    parent_s = np.full(m, -1, np.int64)
    inner = depth > 1
    parent_s[inner] = last_at(s_thr[inner], depth[inner] - 1, pos[inner] - 1)
    pc = np.maximum(parent_s, 0)
    not_nested = int(((parent_s >= 0) & (s_end[pc] < s_end)).sum())

    owner_s = np.full(n, -1, np.int64)
    # Points are independent once the ranges are indexed: take them in chunks so the
    # temporaries stay a few hundred MB however many kernels the profile holds.
    for lo_ in range(0, n, POINT_CHUNK):
        hi_ = min(n, lo_ + POINT_CHUNK)
        c_thr, c_t0, c_t1 = p_thr[lo_:hi_], p_t0[lo_:hi_], p_t1[lo_:hi_]
        known = c_thr >= 0
        pthr = np.where(known, c_thr, 0)
        pkey = (pthr << time_bits) | c_t0
        # The last range started on the thread at or before the call: when ranges nest,
        # the innermost range holding the call is it or one of its ancestors (a range
        # open at t0 started before it and is still open, so it encloses it).
        last = np.searchsorted(skey, pkey, "right") - 1
        idx = np.flatnonzero(known & (last >= thr_first_s[pthr]))
        cand = last[idx]
        # Verify containment; walk up while the candidate does not hold the whole call
        # (only the failing ones are revisited, so the common case is one pass).
        t0, t1 = c_t0[idx], c_t1[idx]
        todo = np.arange(len(idx))
        for _ in range(int(depth.max()) + 1):
            cc = cand[todo]
            bad = (s_end[cc] < t1[todo]) | (s_start[cc] > t0[todo])
            todo = todo[bad]
            if not len(todo):
                break
            up = parent_s[cand[todo]]
            cand[todo] = up
            todo = todo[up >= 0]
        owner_s[lo_ + idx] = cand
    owner = np.where(owner_s >= 0, order[np.maximum(owner_s, 0)], -1)
    parent = np.full(m, -1, np.int64)
    parent[order] = np.where(parent_s >= 0, order[np.maximum(parent_s, 0)], -1)
    depth_out = np.empty(m, np.int64)
    depth_out[order] = depth
    return SweepResult(owner, parent, depth_out, not_nested)


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


def _join_launches(ops: pl.DataFrame, launches: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """Each op's launch on (process, correlationId): ``tid``, ``launch_start``,
    ``launch_end``, ``launch_name`` (null when none); and how many launches repeat a key.

    CUPTI correlation ids are small consecutive integers per process, so the join is a
    direct-address table (scatter, then gather): O(N), no hashing or sorting. Keys too
    sparse for that fall back to a hash join.
    """
    n = ops.height
    procs = launches["proc"].unique().sort().to_numpy()
    l_proc = np.searchsorted(procs, launches["proc"].to_numpy()).astype(np.int64, copy=False)
    l_corr = launches["correlation"].fill_null(-1).to_numpy().astype(np.int64, copy=False)
    idx = np.full(n, -1, np.int64)
    dup = 0
    if launches.height:
        valid = l_corr >= 0
        # Per process correlation range (a handful of processes: a group_by, not ufunc.at).
        bounds = pl.DataFrame({"p": l_proc[valid], "c": l_corr[valid]}).group_by("p").agg(
            lo=pl.col("c").min(), hi=pl.col("c").max())
        lo = np.full(len(procs), np.iinfo(np.int64).max, np.int64)
        hi = np.full(len(procs), -1, np.int64)
        lo[bounds["p"].to_numpy()] = bounds["lo"].to_numpy()
        hi[bounds["p"].to_numpy()] = bounds["hi"].to_numpy()
        size = np.maximum(hi - lo + 1, 0)
        base = np.cumsum(size) - size
        total = int(size.sum())
        if total <= 4 * launches.height + 1_000_000:
            table = np.full(total, -1, np.int64)
            pos = base[l_proc[valid]] + l_corr[valid] - lo[l_proc[valid]]
            rows = np.flatnonzero(valid)
            table[pos[::-1]] = rows[::-1]  # reversed: the first of repeated keys wins
            dup = int(len(pos) - np.count_nonzero(table >= 0))
            del pos, rows, valid, l_proc, l_corr
            proc_col, corr_col = ops["proc"], ops["correlation"]
            for a in range(0, n, POINT_CHUNK):  # chunks bound the temporaries
                b = min(n, a + POINT_CHUNK)
                o_raw = proc_col[a:b].to_numpy()
                o_proc = np.searchsorted(procs, o_raw).astype(np.int64, copy=False)
                pc = np.minimum(o_proc, len(procs) - 1)
                o_known = (o_proc < len(procs)) & (procs[pc] == o_raw)
                o_corr = corr_col[a:b].fill_null(-1).to_numpy().astype(np.int64, copy=False)
                ok = o_known & (o_corr >= lo[pc]) & (o_corr <= hi[pc])
                opos = base[pc] + o_corr - lo[pc]
                idx[a:b][ok] = table[opos[ok]]
            del table
        else:
            keyed = launches.select(pl.col("proc"), pl.col("correlation")).with_row_index("row")
            first = keyed.unique(["proc", "correlation"], keep="first")
            dup = keyed.height - first.height
            hit = ops.select("proc", "correlation").with_row_index("op").join(
                first, on=["proc", "correlation"], how="inner")
            idx[hit["op"].to_numpy()] = hit["row"].to_numpy()
    got = idx >= 0
    take = np.maximum(idx, 0)

    def pick(col: str, dtype: pl.DataType) -> pl.Series:
        values = (launches[col].fill_null(0 if col == "tid" else -1).to_numpy()[take]
                  if launches.height else np.zeros(n, np.int64))
        return pl.Series(values).cast(dtype).scatter(np.flatnonzero(~got), None) \
            if (~got).any() else pl.Series(values).cast(dtype)

    out = ops.with_columns(
        tid=pick("tid", pl.UInt64()), launch_start=pick("start", pl.Int64()),
        launch_end=pick("end", pl.Int64()), launch_name=pick("name_id", pl.Int64()))
    return out, dup


def attribute(profile: Profile) -> Attribution:
    """Attribute every GPU op of ``profile`` to its innermost owning range."""
    notes = list(profile.notes)
    ranges = parse_range_names(profile.ranges.with_row_index("idx").with_columns(
        pl.col("idx").cast(pl.Int64)))
    ops, dup = _join_launches(profile.ops, profile.launches)
    if dup:
        notes.append(f"{dup:,} runtime calls repeat a (process, correlationId) pair; the "
                     "first is used")
    graph_pts, missing_nodes = _graph_points(profile, ops)
    if graph_pts.height:
        ops = ops.join(graph_pts, on=["proc", "graph_node"], how="left", maintain_order="left")
    else:
        ops = ops.with_columns(g_tid=pl.lit(None, pl.UInt64), g_start=pl.lit(None, pl.Int64),
                               g_end=pl.lit(None, pl.Int64))
    if missing_nodes:
        notes.append(f"{missing_nodes:,} CUDA-graph nodes had no creation event in the capture "
                     "window (graph captured before profiling began): their replayed kernels "
                     "are owned by the range around the replay, not by capture-time layers")
    graph_launch_ids = profile.strings.filter(
        pl.col("value").str.contains("GraphLaunch"))["id"].implode()
    ops = ops.with_columns(
        via=pl.when(pl.col("g_tid").is_not_null()).then(pl.lit("graph-node"))
        .when(pl.col("tid").is_null()).then(pl.lit("none"))
        .when((pl.col("kind") != "graph") & pl.col("launch_name").is_in(graph_launch_ids))
        .then(pl.lit("graph-launch")).otherwise(pl.lit("launch")).cast(VIA),
        tid=pl.coalesce("g_tid", "tid"),
        launch_start=pl.coalesce("g_start", "launch_start"),
        launch_end=pl.coalesce("g_end", "launch_end"),
    ).drop("g_tid", "g_start", "g_end", "launch_name")
    replayed = int((ops["via"] == "graph-launch").sum())
    if replayed:
        notes.append(f"{replayed:,} kernels were replayed from CUDA graphs without graph node "
                     "ids: each is owned by the range around its replay call, not by the "
                     "capture-time layer")
    unlaunched = int((ops["via"] == "none").sum())
    if unlaunched:
        notes.append(f"{unlaunched:,} GPU ops have no matching runtime call (launch outside "
                     "the capture, or CUDA API tracing off) and are unattributed")

    usable = ranges.filter(~pl.col("is_output") & (pl.col("end") > pl.col("start")))
    owner = np.full(ops.height, -1, np.int64)
    parent = np.full(ranges.height, -1, np.int64)
    depth = np.zeros(ranges.height, np.int64)
    not_nested = 0
    if usable.height and ops.height:
        base = min(as_int(usable["start"].min()), as_int(ops["launch_start"].min()))
        threads = np.unique(usable["tid"].to_numpy())
        p_tid = ops["tid"].fill_null(0).to_numpy()
        code = np.searchsorted(threads, p_tid).astype(np.int64, copy=False)
        code_c = np.minimum(code, len(threads) - 1)
        p_thr = np.where((threads[code_c] == p_tid) & ops["tid"].is_not_null().to_numpy(),
                         code_c, -1).astype(np.int64, copy=False)
        del p_tid, code, code_c
        p_t0 = (ops["launch_start"].fill_null(base).to_numpy() - base).astype(np.int64, copy=False)
        p_t1 = (ops["launch_end"].fill_null(base).to_numpy() - base).astype(np.int64, copy=False)
        best = np.full(ops.height, -1, np.int64)
        best_start = np.full(ops.height, -1, np.int64)
        for style in ("pushpop", "startend"):
            part = usable.filter(pl.col("style") == style)
            if not part.height:
                continue
            r_idx = part["idx"].to_numpy()
            r_thr = np.searchsorted(threads, part["tid"].to_numpy()).astype(np.int64, copy=False)
            r_start = (part["start"].to_numpy() - base).astype(np.int64, copy=False)
            r_end = (part["end"].to_numpy() - base).astype(np.int64, copy=False)
            res = sweep(r_thr, r_start, r_end, p_thr, np.maximum(p_t0, 0), np.maximum(p_t1, 0))
            got = res.owner >= 0
            own_start = np.where(got, r_start[np.maximum(res.owner, 0)], -1)
            # Inner of the two styles' answers: the one that started later.
            take = got & (own_start > best_start)
            best = np.where(take, r_idx[np.maximum(res.owner, 0)], best)
            best_start = np.where(take, own_start, best_start)
            parent[r_idx] = np.where(res.parent >= 0, r_idx[np.maximum(res.parent, 0)], -1)
            depth[r_idx] = res.depth
            not_nested += res.not_nested
        owner = best
    if not_nested:
        notes.append(f"{not_nested:,} ranges overlap their enclosing range without nesting "
                     "(async start/end ranges): ops inside them go to a range that contains "
                     "their launch, not always the innermost")
    own, up = pl.Series(owner), pl.Series(parent)
    ops = ops.with_columns(range=pl.when(own >= 0).then(own))
    ranges = ranges.with_columns(parent=pl.when(up >= 0).then(up), depth=pl.Series(depth))
    return Attribution(profile=profile, ops=ops, ranges=ranges, notes=tuple(notes))

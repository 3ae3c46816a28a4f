"""Per-layer, per-layer-type, per-step and per-rank tables from an :class:`Attribution`.

Definitions (every table uses them; the reports repeat them):

- an *instance* is one execution of a range: one range occurrence, or, for kernels
  replayed from a CUDA graph and mapped back to the capture, one (capture range, replay);
- ``kernels``: kernel ops owned by the instance (memcpy/memset count in ``memops``; an
  opaque whole-graph execution counts as one kernel);
- ``kernel_ns``: summed GPU duration of those kernels;
- ``busy_ns``: the union of all its GPU ops' intervals (concurrent streams counted once);
- ``span_ns``: last op end - first op start (nsys's "projected duration");
- ``gap_ns``: ``span_ns - busy_ns``, GPU idle time inside the instance (launch gaps).

Levels: ``innermost`` groups by the innermost owning range's name (the module path for
vLLM's layerwise text); ``layer`` groups by the enclosing decoder layer range
(``...layers.<i>``), and when no such range exists splits each step by the repeating
kernel sequence (:mod:`agentload.profiler.infer`) and says so.
"""

from __future__ import annotations

import itertools
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import polars as pl

from agentload.profiler import compiled
from agentload.profiler.attribute import VIA_CODES, Attribution, ints
from agentload.profiler.infer import block_labels, find_period, identity_ids
from agentload.profiler.kineto import MODULE_PREFIX as TORCH_MODULE_PREFIX
from agentload.profiler.model import OP_KINDS, pid_of
from agentload.profiler.vllm import layer_type

Level = Literal["innermost", "layer"]
UNATTRIBUTED = "(no range)"


@dataclass(frozen=True, slots=True)
class Summary:
    """The tables of one profile; ``notes`` says what was assumed or inferred."""

    instances: pl.DataFrame
    layers: pl.DataFrame
    types: pl.DataFrame
    steps: pl.DataFrame
    ranks: pl.DataFrame
    top_kernels: pl.DataFrame
    sequences: pl.DataFrame
    notes: tuple[str, ...]
    inferred: bool
    level: str
    source: str
    path: str
    warnings: tuple[str, ...] = ()
    """The recorder's own loss reports (:attr:`Profile.warnings`)."""


def _skip_enable_if(text: str) -> str:
    """Drop a ``std::enable_if<...>::type`` return type (vLLM's fused add + RMSNorm kernel
    has one; its condition holds ``>`` inside parentheses, so brackets are counted outside
    them only)."""
    prefix = "std::enable_if<"
    if not text.startswith(prefix):
        return text
    angle, paren = 1, 0
    for i in range(len(prefix), len(text)):
        ch = text[i]
        paren += (ch == "(") - (ch == ")")
        if paren == 0:
            angle += (ch == "<") - (ch == ">")
        if angle == 0:
            rest = text[i + 1:]
            return rest[len("::type"):].lstrip() if rest.startswith("::type") else text
    return text


def short_kernel_name(name: str) -> str:
    """``void ns::gemm<float, 128>(Params)`` -> ``ns::gemm``: what people call a kernel."""
    # "(anonymous namespace)::" is a scope, not the argument list that ends a name.
    text = _skip_enable_if(name.strip().replace("(anonymous namespace)::", ""))
    text = re.sub(r"^(void|[\w:]+\s*\*?)\s+(?=[\w:~]+[<(])", "", text)
    depth = 0
    for i, ch in enumerate(text):
        if ch in "<(" and depth == 0 and i > 0:
            return text[:i]
        depth += ch == "<"
        depth -= ch == ">"
    return text


def _ancestor(flag: npt.NDArray[np.bool_], parent: npt.NDArray[np.int64],
              depth: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Per range: itself if flagged, else its nearest flagged ancestor, else -1."""
    return compiled.nearest_flagged(flag, parent, depth)


def _root(parent: npt.NDArray[np.int64], depth: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    return _ancestor(depth == 1, parent, depth)


NO_REPLAY = np.zeros(0, np.int64)
Cols = dict[str, npt.NDArray[Any]]
"""Per-op columns as numpy arrays (10 M ops: no per-op polars frames are built)."""


def summarize(att: Attribution, level: Level = "innermost", step_pattern: str | None = None,
              infer: bool | None = None) -> Summary:
    """Build every table. ``step_pattern``: a regex naming step ranges (default: each
    op's outermost range); ``infer``: force (True) or forbid (False) inferred layers."""
    notes = list(att.notes)
    ranges = att.ranges
    parent = ints(ranges["parent"])
    depth = ints(ranges["depth"], 0)
    is_layer = ranges["is_layer"].fill_null(False).to_numpy().astype(bool)
    if step_pattern:
        step_flag = ranges["label"].str.contains(step_pattern).fill_null(False).to_numpy()
        step_of = _ancestor(step_flag.astype(bool), parent, depth)
    else:
        # A top-level module forward (vLLM's sampler runs after its step range closes)
        # is part of a step, not a step of its own.
        module = ranges["label"].str.starts_with(TORCH_MODULE_PREFIX).fill_null(False)
        step_of = _ancestor((depth == 1) & ~module.to_numpy(), parent, depth)
    ops = att.ops
    n = ops.height
    rng = ints(ops["range"])
    layer_anc = _ancestor(is_layer, parent, depth)
    if len(step_of):
        # One pass: every per-op value that comes from the op's range.
        step, step_key, layer_inst, owned_layer_any = compiled.range_lookups(
            rng, step_of, layer_anc)
    else:  # no ranges: nothing is owned
        step = step_key = layer_inst = np.full(n, -1, np.int64)
        owned_layer_any = False
    do_infer = infer if infer is not None else (level == "layer" and not owned_layer_any)
    inst = layer_inst if level == "layer" and not do_infer else rng
    via = ops["via"].to_physical().to_numpy()
    kind = ops["kind"].to_physical().to_numpy()
    kernel_codes = [OP_KINDS.index(k) for k in IS_KERNEL_KINDS]
    cols: Cols = {
        "proc": ops["proc"].fill_null(0).to_numpy(), "start": ints(ops["start"], 0),
        "end": ints(ops["end"], 0), "name_id": ints(ops["name_id"]),
        "stream": ints(ops["stream"], -1),
        "launch_start": ints(ops["launch_start"], 0), "inst": inst,
        "kernel": _any_equal(kind, kernel_codes)}
    graph_node, graph_launch = VIA_CODES["graph-node"], VIA_CODES["graph-launch"]
    if bool(((via == graph_node) | (via == graph_launch)).any()):
        # Replayed graph kernels mapped to capture-time ranges: each replay is its own
        # instance and its own step, keyed by the replay's correlation id.
        replay = ints(ops["correlation"])
        node_mapped = via == graph_node
        graph_replay = node_mapped | (via == graph_launch)
        cols.update(
            replay=np.where(node_mapped, replay, -1),
            # Each replay is split (inferred) on its own, keyed by its correlation id ...
            step_key=np.where(graph_replay, replay * 2 + 1, step_key),
            step_range=step, graph_step=graph_replay,
            # ... and then joins the step range around its launch (one row per decode
            # step: the replay and the eager kernels around it), where that range holds
            # this one replay alone.
            in_step=_sole_replays(via == graph_launch, step, replay))
    else:  # the common case: no graph replays, nothing per op to compute
        cols.update(replay=NO_REPLAY, step_key=step_key, step_range=step,
                    graph_step=np.zeros(n, bool))
    inferred = False
    # vLLM's FULL CUDA graphs: decode steps are graph replays with no layer ranges while
    # prefill steps run eagerly inside theirs; only the replays are split by inference.
    only = (_rangeless_replays(cols, np.where(rng >= 0, layer_anc[np.maximum(rng, 0)], -1))
            if infer is None and level == "layer" and not do_infer and len(layer_anc) else None)
    if do_infer or (only is not None and only.any()):
        string_of = dict(att.profile.strings.select("id", "value").iter_rows())
        cols, inote = _infer_layers(cols, string_of, only)
        inferred = inote is not None and inote.startswith("layers inferred")
        if inote:
            notes.append(inote)
    if "in_step" in cols:
        joins = cols.pop("in_step")
        cols["step_key"] = np.where(joins, 2 * cols["step_range"], cols["step_key"])
    # The step groups only read the per-op columns: built on another thread meanwhile
    # (the compiled loops and polars release the GIL).
    with ThreadPoolExecutor(1, thread_name_prefix="agentload-steps") as pool:
        step_groups = pool.submit(_step_groups, cols)
        instances = _instances(cols, ranges)
        layers = _layers(instances)
        types = _types(instances)
        steps = _steps(step_groups.result(), instances, ranges)
    ranks = _ranks(layers)
    names = att.profile.strings.select(pl.col("id").alias("name_id"), kernel="value")
    top = _top_kernels(cols, instances, layers, names)
    sequences = _sequences(cols, instances, names)
    return Summary(instances=instances, layers=layers, types=types, steps=steps, ranks=ranks,
                   top_kernels=top, sequences=sequences, notes=tuple(notes),
                   inferred=inferred, level=level, source=att.profile.source,
                   path=att.profile.path, warnings=att.profile.warnings)


def _sole_replays(launched: npt.NDArray[np.bool_], step: npt.NDArray[np.int64],
                  replay: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Per op: a replayed kernel whose step range holds no other replay."""
    rows = launched & (step >= 0)
    if not rows.any():
        return rows
    pairs = np.unique(np.stack([step[rows], replay[rows]]), axis=1)
    ranges, per_range = np.unique(pairs[0], return_counts=True)
    return rows & np.isin(step, ranges[per_range == 1])


NOT_INFERRED = -2
"""``block`` of an op left to its own range (a step with layer ranges, or with no
repeating kernel sequence, in a profile where only graph replays are inferred)."""


def _rangeless_replays(cols: Cols, layer_of: npt.NDArray[np.int64]
                       ) -> npt.NDArray[np.bool_] | None:
    """Per op: in a graph replay none of whose ops lies in a decoder-layer range
    (``layer_of``: the op's layer range, -1: none); None when nothing is replayed."""
    replayed = cols["graph_step"]
    if not replayed.any():
        return None
    keys = cols["step_key"]
    ranged = np.unique(keys[replayed & (layer_of >= 0)])
    return replayed & (layer_of < 0) & ~np.isin(keys, ranged)


def _infer_layers(cols: Cols, names: dict[int, str],
                  only: npt.NDArray[np.bool_] | None = None) -> tuple[Cols, str | None]:
    """Split each step (step range, or graph replay) into inferred layers; with ``only``,
    just the steps of those ops, the rest keeping their ranges."""
    if only is not None:
        cols = {**cols, "only": only}
    frame = pl.DataFrame({k: pl.Series(_column(cols, k)) for k in cols}).sort(
        "proc", "step_key", "launch_start", "start")
    cols = {k: frame[k].to_numpy() for k in frame.columns}
    chosen = cols.pop("only", None)
    seq_ids = identity_ids(cols["name_id"], names)
    bounds = np.flatnonzero(np.concatenate(
        ([True], (cols["proc"][1:] != cols["proc"][:-1])
         | (cols["step_key"][1:] != cols["step_key"][:-1]), [True])))
    block = np.zeros(frame.height, np.int64)
    cache: dict[bytes, tuple[np.ndarray, int, int]] = {}
    periods: list[tuple[int, int]] = []
    streams = cols["stream"]
    for a, b in itertools.pairwise(bounds):
        if chosen is not None and not chosen[a:b].all():
            periods.append((0, 0))  # not searched: left to its ranges below
            continue
        # The period is searched on the step's busiest stream alone: work a model puts on
        # a side stream (vLLM's shared experts) overlaps the main stream's, and lands
        # among its kernels in a different order each step.
        if b > len(streams):  # no ops at all: bounds are [0, 1] for an empty frame
            periods.append((0, 0))
            continue
        values, counts = np.unique(streams[a:b], return_counts=True)
        main = streams[a:b] == values[np.argmax(counts)]
        seq = seq_ids[a:b][main]
        h = seq.tobytes()
        if h not in cache:  # identical steps (graph replays) are searched once
            per = find_period(seq)
            cache[h] = (block_labels(len(seq), per), per.period if per else 0,
                        per.reps if per else 0)
        labels, period, reps = cache[h]
        if main.all():
            block[a:b] = labels
        else:  # a side-stream op joins the block of the main-stream op started before it
            starts = cols["start"][a:b]
            before = np.searchsorted(starts[main], starts, side="right") - 1
            block[a:b] = labels[np.clip(before, 0, len(labels) - 1)]
        periods.append((period, reps))
    found = [p for p in periods if p[0]]
    if not found:
        if chosen is not None:
            return cols, ("graph replays have no layer ranges and no repeating kernel "
                          "sequence: their kernels stay with the range around the replay")
        return cols, ("no layer ranges, and no repeating kernel sequence was found in any "
                      "step: layers could not be inferred")
    # Block index == reps is the postlude; a step with no repeat is one inferred block.
    reps_col = np.zeros(frame.height, np.int64)
    for (a, b), (period, reps) in zip(itertools.pairwise(bounds), periods, strict=True):
        reps_col[a:b] = reps
        if chosen is not None and not period:  # a chosen step that does not repeat
            block[a:b] = NOT_INFERRED
    common = max(set(found), key=found.count)
    shape = (f"most often {common[1]} layers of {common[0]} kernels on the step's busiest "
             "stream); names are inferred.prelude, inferred.layers.<i>, inferred.postlude")
    if chosen is None:
        cols.update(block=block, reps=reps_col, inst=cols["step_key"] * 65_536 + block + 1,
                    replay=np.full(frame.height, -1, np.int64))
        return cols, (f"layers inferred: no layer ranges, so each of {len(periods):,} steps "
                      f"was split by its repeating kernel sequence ({len(found):,} steps "
                      f"repeat; {shape}")
    # Graph replays (step_key > 0) get negative instance keys: range indices are >= 0.
    split = block != NOT_INFERRED
    cols.update(block=block, reps=reps_col,
                inst=np.where(split, -(cols["step_key"] * 65_536 + block + 3), cols["inst"]),
                replay=np.where(split, -1, _column(cols, "replay")))
    return cols, (f"layers inferred for graph replays only: {len(found):,} replays had no "
                  "layer ranges and were split by their repeating kernel sequence (steps "
                  f"with layer ranges keep them; {shape}")


IS_KERNEL_KINDS = ("kernel", "graph")


def _any_equal(values: npt.NDArray[Any], codes: list[int]) -> npt.NDArray[np.bool_]:
    """``isin`` for a few codes (numpy's ``isin`` sorts 10 M values)."""
    out: npt.NDArray[np.bool_] = values == codes[0]
    for c in codes[1:]:
        out |= values == c
    return out


def _column(cols: Cols, name: str, rows: npt.NDArray[np.int64] | None = None
            ) -> npt.NDArray[Any]:
    """``cols[name]`` per row, or at ``rows``; ``replay`` is kept empty when no op is a
    graph replay (an 80 MB array of -1 saved) and is filled here for the code that
    needs it, only as long as asked."""
    values = cols[name]
    if name == "replay" and not len(values):
        return np.full(len(cols["start"]) if rows is None else len(rows), -1, np.int64)
    return values if rows is None else values[rows]


def _group_ids(cols: Cols, keys: list[str]) -> npt.NDArray[np.int64]:
    """One int64 per row, equal exactly when the ``keys`` are equal (not dense).

    The common case needs no hashing: ``inst``/``step`` values are global range indices,
    unique across processes, so only rows without one (or keyed by a per-process
    correlation id) need the process folded in, by a dense rank over those rows alone.
    """
    if keys == ["proc", "inst", "replay"]:
        key = cols["inst"]
        # inferred instances: keys built from step ids, always folded with the process
        if "block" not in cols and not compiled.count_unkeyed(key, cols["replay"], False):
            return key
        simple = (_column(cols, "replay") < 0) & (key >= 0) & ("block" not in cols)
    else:
        key = cols["step_key"]
        if not compiled.count_unkeyed(key, NO_REPLAY, True):
            return key
        simple = (key >= 0) & ((key & 1) == 0)  # a step range, not a graph replay
    out = key.copy()
    rest = np.flatnonzero(~simple)
    sub = pl.DataFrame({k: _column(cols, k, rest) for k in keys})
    ranks = sub.select(pl.struct(keys).rank("dense")).to_series().to_numpy()
    top = int(key[simple].max(initial=-1)) + 1
    out[rest] = top + ranks.astype(np.int64, copy=False)
    return out


def _grouped(cols: Cols, keys: list[str], want_g: bool = True
             ) -> tuple[npt.NDArray[np.int64], dict[str, Any]]:
    """Per row its dense group id ``g``, and per group: the first row (original index),
    op counts and times (one compiled pass, no per-group Python).

    Profiles list a group's ops together and in time order (one layer's kernels follow
    each other), so the groups are usually the runs of equal keys: then nothing is
    sorted and groups are numbered in order of appearance. Otherwise the rows are sorted
    by (group, start) and groups are numbered in key order.
    """
    n = len(cols["start"])
    if not n:
        zero = np.zeros(0, np.int64)
        return zero, {"first": zero, "kernels": zero, "memops": zero, "kernel_ns": zero,
                      "busy_ns": zero, "start": zero, "span_ns": zero}
    gid = _group_ids(cols, keys)
    start, end, kernel = cols["start"], cols["end"], cols["kernel"]
    first, kernels, kernel_ns, busy, gmax, g, ordered, rising = compiled.run_groups(
        gid, start, end, kernel, want_g)
    if not (ordered and (rising or not compiled.repeats_a_key(gid[first]))):
        # Two stable sorts (start, then group): both inputs are made of long presorted
        # runs, which timsort merges in near-linear time.
        by_start = np.argsort(start, kind="stable")
        order = by_start[np.argsort(gid[by_start], kind="stable")]
        del by_start
        start = start[order]
        first, kernels, kernel_ns, busy, gmax, g, _, _ = compiled.run_groups(
            gid[order], start, end[order], kernel[order], want_g)
        if want_g:
            g_orig = np.empty(n, np.int64)
            g_orig[order] = g
            g = g_orig
        first_orig = order[first]
    else:
        first_orig = first
    gmin = start[first]
    return g, {
        "first": first_orig, "kernels": kernels,
        "memops": np.diff(np.append(first, n)) - kernels, "kernel_ns": kernel_ns,
        "busy_ns": busy, "start": gmin, "span_ns": gmax - gmin}


def _heads(cols: Cols, names: list[str], rows: npt.NDArray[np.int64]) -> pl.DataFrame:
    """The ``names`` columns at ``rows`` (one row per group)."""
    return pl.DataFrame({k: pl.Series(k, _column(cols, k, rows)) for k in names})


def _by_index(ranges: pl.DataFrame, column: str, rows: pl.Series) -> pl.Series:
    """``ranges[column]`` at range indices ``rows`` (null where null or < 0): a gather,
    since range indices are row numbers, not a join."""
    ok = rows.is_not_null() & (rows >= 0)
    got = ranges[column].gather(rows.fill_null(0).clip(0, max(ranges.height - 1, 0))) \
        if ranges.height else pl.repeat(None, len(rows), dtype=ranges[column].dtype, eager=True)
    if bool(ok.all()):
        return got
    return pl.select(pl.when(ok).then(got)).to_series()


def _step_names(frame: pl.DataFrame, ranges: pl.DataFrame) -> pl.Series:
    """Each group's step label (the ``step_range``'s label; graph replays marked)."""
    step = _by_index(ranges, "label", frame["step_range"]).fill_null(UNATTRIBUTED)
    if not bool(frame["graph_step"].any()):
        return step.alias("step")
    raw = _by_index(ranges, "label", frame["step_range"])
    return frame.select(pl.when(pl.col("graph_step")).then(
        pl.coalesce(raw, pl.lit("")) + pl.lit(" [graph replay]")).otherwise(step)
        .alias("step")).to_series()


def _with_types(out: pl.DataFrame) -> pl.DataFrame:
    """``type`` from ``name``, computed once per distinct name."""
    names = out.select(pl.col("name").unique())
    types = names.with_columns(type=layer_type(pl.col("name")))
    return out.join(types, on="name", how="left")


def _instances(cols: Cols, ranges: pl.DataFrame) -> pl.DataFrame:
    keys = ["proc", "inst", "replay"]
    g, agg = _grouped(cols, keys)
    cols["g"] = g
    carry = [*keys, "step_key", "step_range", "graph_step"]
    if "block" in cols:
        carry += ["block", "reps"]
    head = _heads(cols, carry, agg.pop("first"))
    out = head.with_columns(**{k: pl.Series(v) for k, v in agg.items()}).with_row_index("g")
    out = out.with_columns(pl.col("g").cast(pl.Int64))
    if "block" in out.columns:
        block = pl.col("block")
        out = out.with_columns(
            name=pl.when(block == NOT_INFERRED).then(_by_index(ranges, "label", out["inst"]))
            .when(block < 0).then(pl.lit("inferred.prelude"))
            .when((block >= pl.col("reps")) & (pl.col("reps") > 0))
            .then(pl.lit("inferred.postlude"))
            .when(pl.col("reps") == 0).then(pl.lit("inferred.step"))
            .otherwise(pl.format("inferred.layers.{}", block)),
            layer=pl.when(block == NOT_INFERRED).then(_by_index(ranges, "layer", out["inst"]))
            .when((block >= 0) & (block < pl.col("reps")))
            .then(block)).drop("block", "reps")
    else:
        out = out.with_columns(name=_by_index(ranges, "label", out["inst"]),
                               layer=_by_index(ranges, "layer", out["inst"]))
    out = out.with_columns(name=pl.col("name").fill_null(UNATTRIBUTED),
                           step=_step_names(out, ranges), pid=pid_of(pl.col("proc")))
    out = _with_types(out.with_columns(gap_ns=pl.col("span_ns") - pl.col("busy_ns")))
    return out.sort("proc", "start")


def _agg(by: list[str]) -> list[pl.Expr]:
    n = pl.len().cast(pl.Int64)
    return [n.alias("instances"), pl.col("kernels").sum(), pl.col("memops").sum(),
            pl.col("kernel_ns").sum(), pl.col("busy_ns").sum(), pl.col("span_ns").sum(),
            pl.col("gap_ns").sum(), pl.col("start").min().alias("first_start"),
            pl.col("kernel_ns").median().alias("kernel_ns_median"),
            pl.col("kernel_ns").quantile(0.9, interpolation="linear").alias("kernel_ns_p90")]


def _layers(instances: pl.DataFrame) -> pl.DataFrame:
    out = instances.group_by("proc", "pid", "name").agg(
        *_agg([]), layer=pl.col("layer").first(), type=pl.col("type").first())
    return out.sort("pid", "first_start").drop("first_start")


def _types(instances: pl.DataFrame) -> pl.DataFrame:
    out = instances.group_by("proc", "pid", "type").agg(*_agg([]))
    return out.sort("pid", "first_start").drop("first_start")


STEP_KEYS = ["proc", "step_key"]


def _step_groups(cols: Cols) -> pl.DataFrame:
    """One row per step: its keys and sums (:func:`_grouped`)."""
    _, agg = _grouped(cols, STEP_KEYS, want_g=False)
    head = _heads(cols, [*STEP_KEYS, "step_range", "graph_step"], agg.pop("first"))
    if cols["graph_step"].any():  # a step holding a replay is marked, whatever runs first
        replayed = np.unique(cols["step_key"][cols["graph_step"]])
        head = head.with_columns(graph_step=pl.Series(np.isin(head["step_key"], replayed)))
    return head.with_columns(**{k: pl.Series(v) for k, v in agg.items()})


def _steps(per: pl.DataFrame, instances: pl.DataFrame, ranges: pl.DataFrame) -> pl.DataFrame:
    keys = STEP_KEYS
    counts = instances.group_by(keys).agg(
        layers=pl.col("layer").drop_nulls().n_unique().cast(pl.Int64),
        instances=pl.len().cast(pl.Int64))
    per = per.join(counts, on=keys, how="left")
    per = per.with_columns(
        pid=pid_of(pl.col("proc")), step=_step_names(per, ranges),
        layers=pl.col("layers").fill_null(0), instances=pl.col("instances").fill_null(0))
    return per.sort("pid", "start").with_columns(
        index=pl.int_range(pl.len()).over("pid")).select(
        "pid", "index", "step", "start", "span_ns", "kernels", "memops", "kernel_ns",
        "busy_ns", "layers", "instances", "proc", "step_key")


def _ranks(layers: pl.DataFrame) -> pl.DataFrame:
    """Layers aligned across ranks (processes): per-instance kernel time per rank, skew."""
    per = layers.with_columns(per_inst=pl.col("kernel_ns") / pl.col("instances"))
    # A rank is a process (``proc``): merged per-rank files may share an OS pid.
    by = ["pid", "proc"]
    return per.group_by("name").agg(
        ranks=pl.col("proc").n_unique(), pids=pl.col("pid").sort_by(by),
        procs=pl.col("proc").sort_by(by),
        kernels_per_inst=(pl.col("kernels") / pl.col("instances")).sort_by(by),
        kernel_ns_per_inst=pl.col("per_inst").sort_by(by),
        skew_ns=pl.col("per_inst").max() - pl.col("per_inst").min(),
        first=pl.col("pid").min()).sort("name").drop("first")


DENSE_KEYS = 1 << 24
"""Up to this many (label, kernel name) pairs are counted in a dense table (bincount)."""


def _top_kernels(cols: Cols, instances: pl.DataFrame, layers: pl.DataFrame,
                 names: pl.DataFrame) -> pl.DataFrame:
    """Per (pid, layer name): the five kernels with the most summed time."""
    # Each group g belongs to one row of ``layers`` (its code): g -> code by a scatter.
    codes = layers.select("proc", "pid", "name").with_row_index("code").with_columns(
        pl.col("code").cast(pl.Int64))
    coded = instances.select("g", "proc", "name").join(
        codes.select("code", "proc", "name"), on=["proc", "name"], how="left")
    code_of_g = np.zeros(instances.height, np.int64)
    code_of_g[coded["g"].to_numpy()] = coded["code"].to_numpy()
    name = cols["name_id"]
    width = int(name.max(initial=0)) + 2
    n_codes = layers.height
    if n_codes * width <= DENSE_KEYS:
        # A dense table: one pass, no hashing of 10 M keys.
        count, total = compiled.kernel_totals(cols["g"], code_of_g, name, cols["start"],
                                              cols["end"], cols["kernel"], width,
                                              n_codes * width)
        hit = np.flatnonzero(count)
        top = pl.DataFrame({"key": hit, "count": count[hit].astype(np.uint32),
                            "kernel_ns": total[hit]})
    else:
        kernel = cols["kernel"]
        key = code_of_g[cols["g"][kernel]] * width + name[kernel] + 1
        dur = (cols["end"] - cols["start"])[kernel]
        top = pl.DataFrame({"key": key, "dur": dur}).group_by("key").agg(
            count=pl.len(), kernel_ns=pl.col("dur").sum())
    top = top.with_columns(code=pl.col("key") // width,
                           name_id=pl.col("key") % width - 1).join(
        codes.rename({"name": "label"}), on="code", how="left")
    top = top.join(names, on="name_id", how="left").with_columns(
        kernel=pl.col("kernel").fill_null("?").map_elements(
            short_kernel_name, return_dtype=pl.String))
    # name_id last: ties in kernel time rank the same way every run
    return top.sort(["pid", "proc", "label", "kernel_ns", "name_id"],
                    descending=[False, False, False, True, False]).with_columns(
        rank=pl.int_range(pl.len()).over("proc", "label")).filter(pl.col("rank") < 5).select(
        "pid", "proc", "label", "name_id", "count", "kernel_ns", "kernel", "rank")


SEQUENCE_SAMPLE = 64
"""Instances per layer type whose kernel sequences are compared (the most common wins)."""


def _sequences(cols: Cols, instances: pl.DataFrame, names: pl.DataFrame) -> pl.DataFrame:
    """Per rank (``proc``, with its ``pid``) and layer type: the most common kernel
    sequence of one instance, among the first instances of that type."""
    # instances are sorted by (proc, start): the head of each group is its earliest.
    keys = ["proc", "pid", "type"]
    sample = instances.group_by(keys, maintain_order=True).head(
        SEQUENCE_SAMPLE).select("g", *keys)
    mask = np.zeros(instances.height, bool)
    mask[sample["g"].to_numpy()] = True
    rows = np.flatnonzero(mask[cols["g"]])
    ops = _heads(cols, ["g", "name_id", "launch_start", "start"], rows).join(sample, on="g")
    seq = ops.sort("g", "launch_start", "start").group_by(
        *keys, "g", maintain_order=True).agg(seq=pl.col("name_id"))
    common = seq.group_by(*keys, "seq").agg(n=pl.len()).sort(
        [*keys, "n"], descending=[False, False, False, True]).unique(
        keys, keep="first", maintain_order=True)
    lookup = dict(zip(names["name_id"].to_list(), names["kernel"].to_list(), strict=True))
    short: dict[int, str] = {}

    def name(i: int) -> str:
        if i not in short:
            short[i] = short_kernel_name(lookup.get(i) or "memcpy/memset")
        return short[i]

    return common.with_columns(kernels=pl.col("seq").map_elements(
        lambda s: [name(int(i)) for i in s], return_dtype=pl.List(pl.String))).drop("seq")

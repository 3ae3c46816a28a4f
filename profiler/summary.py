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
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import polars as pl

from agentload.profiler.attribute import Attribution
from agentload.profiler.infer import block_labels, find_period
from agentload.profiler.model import pid_of
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


def short_kernel_name(name: str) -> str:
    """``void ns::gemm<float, 128>(Params)`` -> ``ns::gemm``: what people call a kernel."""
    text = re.sub(r"^(void|[\w:]+\s*\*?)\s+(?=[\w:~]+[<(])", "", name.strip())
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
    out = np.full(len(flag), -1, np.int64)
    if not len(flag):
        return out
    for d in range(1, int(depth.max()) + 1):
        sel = np.flatnonzero(depth == d)
        up = parent[sel]
        inherited = np.where(up >= 0, out[np.maximum(up, 0)], -1)
        out[sel] = np.where(flag[sel], sel, inherited)
    return out


def _root(parent: npt.NDArray[np.int64], depth: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    return _ancestor(depth == 1, parent, depth)


def summarize(att: Attribution, level: Level = "innermost", step_pattern: str | None = None,
              infer: bool | None = None) -> Summary:
    """Build every table. ``step_pattern``: a regex naming step ranges (default: each
    op's outermost range); ``infer``: force (True) or forbid (False) inferred layers."""
    notes = list(att.notes)
    ranges = att.ranges
    parent = ranges["parent"].fill_null(-1).to_numpy().astype(np.int64, copy=False)
    depth = ranges["depth"].to_numpy().astype(np.int64, copy=False)
    is_layer = ranges["is_layer"].to_numpy().astype(bool)
    if step_pattern:
        step_flag = ranges["label"].str.contains(step_pattern).fill_null(False).to_numpy()
        step_of = _ancestor(step_flag.astype(bool), parent, depth)
    else:
        step_of = _root(parent, depth)
    ops = att.ops
    rng = ops["range"].fill_null(-1).to_numpy().astype(np.int64, copy=False)
    has = rng >= 0
    rc = np.maximum(rng, 0)
    step = np.where(has, step_of[rc] if len(step_of) else -1, -1)
    layer_anc = _ancestor(is_layer, parent, depth) if len(is_layer) else np.zeros(0, np.int64)
    owned_layer = has & (layer_anc[rc] >= 0) if len(layer_anc) else np.zeros(len(rng), bool)
    do_infer = infer if infer is not None else (level == "layer" and not owned_layer.any())
    if level == "layer" and not do_infer:
        inst = np.where(owned_layer, layer_anc[rc] if len(layer_anc) else -1, rng)
    else:
        inst = rng
    # Replayed graph kernels mapped to capture-time ranges: each replay is its own
    # instance and its own step, keyed by the replay's correlation id.
    replay = ops["correlation"].fill_null(-1).to_numpy().astype(np.int64, copy=False)
    node_mapped = (ops["via"] == "graph-node").to_numpy()
    graph_replay = node_mapped | (ops["via"] == "graph-launch").to_numpy()
    step_range = np.where(graph_replay, -1, step)
    # Graph replays are steps of their own when no step range encloses the replay call.
    step_key = np.where(graph_replay, replay * 2 + 1, step * 2)
    frame = ops.select("proc", "kind", "start", "end", "name_id", "launch_start").with_columns(
        inst=pl.Series(inst), replay=pl.Series(np.where(node_mapped, replay, -1)),
        step_key=pl.Series(step_key), step_range=pl.Series(np.where(graph_replay, step,
                                                                     step_range)),
        graph_step=pl.Series(graph_replay))
    inferred = False
    if do_infer:
        frame, inote = _infer_layers(frame)
        inferred = inote is not None and inote.startswith("layers inferred")
        if inote:
            notes.append(inote)
    frame, instances = _instances(frame, ranges)
    layers = _layers(instances)
    types = _types(instances)
    steps = _steps(frame, instances, ranges)
    ranks = _ranks(layers)
    names = att.profile.strings.select(pl.col("id").alias("name_id"), kernel="value")
    top = _top_kernels(frame, instances, names)
    sequences = _sequences(frame, instances, names)
    return Summary(instances=instances, layers=layers, types=types, steps=steps, ranks=ranks,
                   top_kernels=top, sequences=sequences, notes=tuple(notes),
                   inferred=inferred, level=level, source=att.profile.source,
                   path=att.profile.path, warnings=att.profile.warnings)


def _infer_layers(frame: pl.DataFrame) -> tuple[pl.DataFrame, str | None]:
    """Split each step (step range, or graph replay) into inferred layers."""
    frame = frame.sort("proc", "step_key", "launch_start", "start")
    seq_ids = frame["name_id"].fill_null(-1).to_numpy().astype(np.int64, copy=False)
    keys = frame.select("proc", "step_key")
    bounds = np.flatnonzero(np.concatenate(
        ([True], (keys["proc"].to_numpy()[1:] != keys["proc"].to_numpy()[:-1])
         | (keys["step_key"].to_numpy()[1:] != keys["step_key"].to_numpy()[:-1]), [True])))
    block = np.zeros(frame.height, np.int64)
    cache: dict[bytes, tuple[np.ndarray, int, int]] = {}
    periods: list[tuple[int, int]] = []
    for a, b in itertools.pairwise(bounds):
        seq = seq_ids[a:b]
        h = seq.tobytes()
        if h not in cache:  # identical steps (graph replays) are searched once
            per = find_period(seq)
            cache[h] = (block_labels(len(seq), per), per.period if per else 0,
                        per.reps if per else 0)
        labels, period, reps = cache[h]
        block[a:b] = labels
        periods.append((period, reps))
    found = [p for p in periods if p[0]]
    if not found:
        return frame, ("no layer ranges, and no repeating kernel sequence was found in any "
                       "step: layers could not be inferred")
    # Block index == reps is the postlude; a step with no repeat is one inferred block.
    reps_col = np.zeros(frame.height, np.int64)
    for (a, b), (_, reps) in zip(itertools.pairwise(bounds), periods, strict=True):
        reps_col[a:b] = reps
    frame = frame.with_columns(
        block=pl.Series(block), reps=pl.Series(reps_col),
        inst=pl.col("step_key") * 65_536 + pl.Series(block) + 1,
        replay=pl.lit(-1, pl.Int64))
    common = max(set(found), key=found.count)
    return frame, (f"layers inferred: no layer ranges, so each of {len(periods):,} steps was "
                   f"split by its repeating kernel sequence ({len(found):,} steps repeat; most "
                   f"often {common[1]} layers of {common[0]} kernels); names are "
                   "inferred.layers.<i>")


IS_KERNEL_KINDS = ("kernel", "graph")


def _group_ids(frame: pl.DataFrame, keys: list[str]) -> npt.NDArray[np.int64]:
    """One int64 per row, equal exactly when the ``keys`` are equal (not dense).

    The common case needs no hashing: ``inst``/``step`` values are global range indices,
    unique across processes, so only rows without one (or keyed by a per-process
    correlation id) need the process folded in, by a dense rank over those rows alone.
    """
    procs = frame["proc"].unique().sort().to_numpy()
    pcode = np.searchsorted(procs, frame["proc"].to_numpy()).astype(np.int64, copy=False)
    n_p = len(procs)
    if keys == ["proc", "inst", "replay"]:
        key = frame["inst"].to_numpy().astype(np.int64, copy=False)
        simple = (frame["replay"].to_numpy() < 0) & (key >= 0)
        if "block" in frame.columns:  # inferred instances: keys built from step ids
            simple[:] = False
    else:
        key = frame["step_key"].to_numpy().astype(np.int64, copy=False)
        simple = (key >= 0) & (key % 2 == 0)  # a step range, not a graph replay
    out = np.where(simple, key + n_p, pcode)
    rest = np.flatnonzero(~simple)
    if len(rest):
        sub = frame[rest].select(keys)
        ranks = sub.select(pl.struct(keys).rank("dense")).to_series().to_numpy()
        top = int(key[simple].max(initial=-1)) + n_p + 1
        out[rest] = top + ranks.astype(np.int64, copy=False)
    return out


def _grouped(frame: pl.DataFrame, keys: list[str]) -> tuple[npt.NDArray[np.int64],
                                                           dict[str, Any]]:
    """Per row its dense group id ``g`` (groups ordered by key), and per group: the
    first row (original index), op counts and times (numpy, no per-group Python).

    Busy (union) time: each group's ops are shifted into a private window of the
    number line (``offset``), so one running maximum over all groups acts per group.
    """
    n = frame.height
    if not n:
        zero = np.zeros(0, np.int64)
        return zero, {"first": zero, "kernels": zero, "memops": zero, "kernel_ns": zero,
                      "busy_ns": zero, "start": zero, "span_ns": zero}
    gid = _group_ids(frame, keys)
    start0 = frame["start"].to_numpy()
    # Two stable sorts (start, then group) instead of one two-key sort: both inputs are
    # made of long presorted runs (ops come in time order per device, a group's ops are
    # adjacent), which timsort merges in near-linear time. Temporaries are dropped as
    # soon as they are used: at 10 M ops each is 80 MB.
    by_start = np.argsort(start0, kind="stable")
    tmp = gid[by_start]
    order = by_start[np.argsort(tmp, kind="stable")]
    del tmp, by_start
    gs = gid[order]
    del gid
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(gs[1:], gs[:-1], out=new[1:])
    del gs
    first = np.flatnonzero(new)
    g_sorted = np.cumsum(new) - 1
    del new
    g = np.empty(n, np.int64)
    g[order] = g_sorted
    start = start0[order]
    end = frame["end"].to_numpy()[order]
    kernel = frame["kind"].is_in(IS_KERNEL_KINDS).to_numpy()[order]
    first_orig = order[first]
    del order
    gmin = start[first]
    gmax = np.maximum.reduceat(end, first)
    dur = end - start
    dur[~kernel] = 0
    kernel_ns = np.add.reduceat(dur, first)
    del dur
    kernels = np.add.reduceat(kernel.astype(np.int64), first)
    del kernel
    # Busy time: shift each group into its own window of the number line, so that one
    # running maximum of ends, over all groups at once, acts within each group.
    width = np.maximum(gmax, gmin) - gmin + 1
    shift = (np.cumsum(width) - width - gmin)[g_sorted]
    del g_sorted
    start += shift
    end += shift
    del shift
    prev = np.empty(n, np.int64)
    prev[0] = -1
    np.maximum.accumulate(end[:-1], out=prev[1:])
    np.maximum(start, prev, out=prev)
    del start
    np.subtract(end, prev, out=end)
    np.clip(end, 0, None, out=end)
    del prev
    return g, {
        "first": first_orig, "kernels": kernels,
        "memops": np.diff(np.append(first, n)) - kernels, "kernel_ns": kernel_ns,
        "busy_ns": np.add.reduceat(end, first), "start": gmin, "span_ns": gmax - gmin}


def _instances(frame: pl.DataFrame, ranges: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    keys = ["proc", "inst", "replay"]
    g, agg = _grouped(frame, keys)
    carry = [*keys, "step_key", "step_range", "graph_step"]
    if "block" in frame.columns:
        carry += ["block", "reps"]
    head: pl.DataFrame = frame.select(carry)[agg.pop("first")]
    out = head.with_columns(**{k: pl.Series(v) for k, v in agg.items()}).with_row_index("g")
    out = out.with_columns(pl.col("g").cast(pl.Int64))
    data = frame.with_columns(g=pl.Series(g))
    labels = ranges.select(pl.col("idx").alias("inst"), name="label", layer="layer")
    out = out.join(labels, on="inst", how="left")
    if "block" in out.columns:
        out = out.with_columns(
            name=pl.when(pl.col("block") < 0).then(pl.lit("inferred.prelude"))
            .when((pl.col("block") >= pl.col("reps")) & (pl.col("reps") > 0))
            .then(pl.lit("inferred.postlude"))
            .when(pl.col("reps") == 0).then(pl.lit("inferred.step"))
            .otherwise(pl.format("inferred.layers.{}", pl.col("block"))),
            layer=pl.when((pl.col("block") >= 0) & (pl.col("block") < pl.col("reps")))
            .then(pl.col("block"))).drop("block", "reps")
    steps = ranges.select(pl.col("idx").alias("step_range"), step="label")
    out = out.join(steps, on="step_range", how="left").with_columns(
        name=pl.col("name").fill_null(UNATTRIBUTED),
        step=pl.when(pl.col("graph_step"))
        .then(pl.coalesce(pl.col("step"), pl.lit("")) + pl.lit(" [graph replay]"))
        .otherwise(pl.col("step").fill_null(UNATTRIBUTED)),
        pid=pid_of(pl.col("proc")))
    out = out.with_columns(gap_ns=pl.col("span_ns") - pl.col("busy_ns"),
                           type=layer_type(pl.col("name"))).sort("proc", "start")
    return data, out


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


def _steps(frame: pl.DataFrame, instances: pl.DataFrame, ranges: pl.DataFrame) -> pl.DataFrame:
    keys = ["proc", "step_key"]
    _, agg = _grouped(frame, keys)
    head: pl.DataFrame = frame.select(*keys, "step_range", "graph_step")[agg.pop("first")]
    per = head.with_columns(**{k: pl.Series(v) for k, v in agg.items()})
    counts = instances.group_by(keys).agg(
        layers=pl.col("layer").drop_nulls().n_unique().cast(pl.Int64),
        instances=pl.len().cast(pl.Int64))
    names = ranges.select(pl.col("idx").alias("step_range"), step="label")
    per = per.join(counts, on=keys, how="left").join(names, on="step_range", how="left")
    per = per.with_columns(
        pid=pid_of(pl.col("proc")),
        step=pl.when(pl.col("graph_step"))
        .then(pl.coalesce(pl.col("step"), pl.lit("")) + pl.lit(" [graph replay]"))
        .otherwise(pl.col("step").fill_null(UNATTRIBUTED)),
        layers=pl.col("layers").fill_null(0), instances=pl.col("instances").fill_null(0))
    return per.sort("pid", "start").with_columns(
        index=pl.int_range(pl.len()).over("pid")).select(
        "pid", "index", "step", "start", "span_ns", "kernels", "memops", "kernel_ns",
        "busy_ns", "layers", "instances", "proc", "step_key")


def _ranks(layers: pl.DataFrame) -> pl.DataFrame:
    """Layers aligned across ranks (processes): per-instance kernel time per rank, skew."""
    per = layers.with_columns(per_inst=pl.col("kernel_ns") / pl.col("instances"))
    return per.group_by("name").agg(
        ranks=pl.col("pid").n_unique(), pids=pl.col("pid").sort(),
        kernels_per_inst=(pl.col("kernels") / pl.col("instances")).sort_by("pid"),
        kernel_ns_per_inst=pl.col("per_inst").sort_by("pid"),
        skew_ns=pl.col("per_inst").max() - pl.col("per_inst").min(),
        first=pl.col("pid").min()).sort("name").drop("first")


def _top_kernels(frame: pl.DataFrame, instances: pl.DataFrame,
                 names: pl.DataFrame) -> pl.DataFrame:
    """Per (pid, layer name): the five kernels with the most summed time."""
    # instances is sorted differently from the group ids: map g -> (pid, name) code.
    inst = instances.select("g", "pid", "name").with_columns(
        code=pl.struct("pid", "name").rank("dense").cast(pl.Int64) - 1).sort("g")
    code = inst["code"].to_numpy()[frame["g"].to_numpy()]
    kernel = frame["kind"].is_in(IS_KERNEL_KINDS).to_numpy()
    name = frame["name_id"].fill_null(-1).to_numpy().astype(np.int64, copy=False)
    width = int(name.max(initial=0)) + 2
    key = code[kernel] * width + name[kernel] + 1
    dur = (frame["end"].to_numpy() - frame["start"].to_numpy())[kernel]
    top = pl.DataFrame({"key": key, "dur": dur}).group_by("key").agg(
        count=pl.len(), kernel_ns=pl.col("dur").sum())
    top = top.with_columns(code=pl.col("key") // width,
                           name_id=pl.col("key") % width - 1).join(
        inst.select("code", "pid", label="name").unique("code"), on="code", how="left")
    top = top.join(names, on="name_id", how="left").with_columns(
        kernel=pl.col("kernel").fill_null("?").map_elements(
            short_kernel_name, return_dtype=pl.String))
    return top.sort(["pid", "label", "kernel_ns"], descending=[False, False, True]).with_columns(
        rank=pl.int_range(pl.len()).over("pid", "label")).filter(pl.col("rank") < 5).select(
        "pid", "label", "name_id", "count", "kernel_ns", "kernel", "rank")


SEQUENCE_SAMPLE = 64
"""Instances per layer type whose kernel sequences are compared (the most common wins)."""


def _sequences(frame: pl.DataFrame, instances: pl.DataFrame,
               names: pl.DataFrame) -> pl.DataFrame:
    """Per (pid, layer type): the most common kernel sequence of one instance."""
    sample = instances.sort("start").group_by("pid", "type", maintain_order=True).head(
        SEQUENCE_SAMPLE).select("g", "pid", "type")
    mask = np.zeros(instances.height, bool)
    mask[sample["g"].to_numpy()] = True
    ops = frame.filter(pl.Series(mask[frame["g"].to_numpy()])).join(sample, on="g")
    seq = ops.sort("g", "launch_start", "start").group_by(
        "pid", "type", "g", maintain_order=True).agg(
        seq=pl.col("name_id").fill_null(-1))
    common = seq.group_by("pid", "type", "seq").agg(n=pl.len()).sort(
        ["pid", "type", "n"], descending=[False, False, True]).unique(
        ["pid", "type"], keep="first", maintain_order=True)
    lookup = dict(zip(names["name_id"].to_list(), names["kernel"].to_list(), strict=True))
    short: dict[int, str] = {}

    def name(i: int) -> str:
        if i not in short:
            short[i] = short_kernel_name(lookup.get(i) or "memcpy/memset")
        return short[i]

    return common.with_columns(kernels=pl.col("seq").map_elements(
        lambda s: [name(int(i)) for i in s], return_dtype=pl.List(pl.String))).drop("seq")

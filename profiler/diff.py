"""Two arms side by side, per layer type: "layers.*: 13 k / 69 µs vs 23 k / 130 µs".

Types are matched by name after one canonical step: any decoder-layer type
(``model.layers.*``, ``inferred.layers.*``, ``nn.Module: <Class>DecoderLayer_*``) is the
same row, so a vLLM layerwise trace
can be set against an inferred split of a specialized path. Kernel sequences (the most
common sequence of one instance, short names) are aligned with ``difflib``'s matcher.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

import polars as pl

from agentload.profiler.summary import Summary
from agentload.profiler.vllm import DECODER_CLASS_RE

LAYER_KEY = "layers.*"


@dataclass(frozen=True, slots=True)
class Alignment:
    """One aligned step: ``=`` both, ``-`` only in A, ``+`` only in B, ``~`` replaced."""

    op: str
    a: tuple[str, ...]
    b: tuple[str, ...]


_TORCH_LAYER = re.compile(r"^nn\.Module: [A-Za-z_]\w*?" + DECODER_CLASS_RE[:-1] + r"_\*$")
_GLUED_LAYER = re.compile(r"^layer\*\.\w+$")  # ``layer3.fused``: a layer range named by its path


def canonical_type(t: str) -> str:
    """Decoder-layer types of every source are one row: ``model.layers.*`` (vLLM's layerwise
    NVTX), ``inferred.layers.*`` (a graph replay) and ``nn.Module: LlamaDecoderLayer_*``
    (the PyTorch profiler's module ranges in eager mode), and ``layer*.fused`` /
    ``layer*.standard`` (the kernels room's per-path ranges)."""
    if (t == LAYER_KEY or t.endswith("." + LAYER_KEY) or _TORCH_LAYER.match(t)
            or _GLUED_LAYER.match(t)):
        return LAYER_KEY
    return t


def _per_type(s: Summary) -> pl.DataFrame:
    return s.types.with_columns(key=pl.col("type").map_elements(
        canonical_type, return_dtype=pl.String)).group_by("key").agg(
        instances=pl.col("instances").sum(), kernels=pl.col("kernels").sum(),
        kernel_ns=pl.col("kernel_ns").sum(), busy_ns=pl.col("busy_ns").sum(),
        first=pl.col("type").first())


def diff_table(a: Summary, b: Summary) -> pl.DataFrame:
    """Per canonical type: per-instance kernels and kernel time in A and in B."""
    def side(s: Summary, tag: str) -> pl.DataFrame:
        return _per_type(s).select(
            "key", pl.col("instances").alias(f"{tag}_instances"),
            (pl.col("kernels") / pl.col("instances")).alias(f"{tag}_kernels"),
            (pl.col("kernel_ns") / pl.col("instances")).alias(f"{tag}_kernel_ns"),
            (pl.col("busy_ns") / pl.col("instances")).alias(f"{tag}_busy_ns"))

    out = side(a, "a").join(side(b, "b"), on="key", how="full", coalesce=True)
    return out.sort(pl.col("key") != LAYER_KEY, pl.col("key"))


def sequence(s: Summary, key: str) -> list[str]:
    rows = s.sequences.with_columns(key=pl.col("type").map_elements(
        canonical_type, return_dtype=pl.String)).filter(pl.col("key") == key)
    return list(rows["kernels"][0]) if rows.height else []


def align(a: list[str], b: list[str]) -> list[Alignment]:
    """Kernel sequences aligned: shared runs, and what each side has instead."""
    out: list[Alignment] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        op = {"equal": "=", "delete": "-", "insert": "+", "replace": "~"}[tag]
        out.append(Alignment(op, tuple(a[i1:i2]), tuple(b[j1:j2])))
    return out


def _fmt(kernels: float | None, ns: float | None) -> str:
    if kernels is None or ns is None:
        return "absent"
    k = f"{kernels:.0f}" if abs(kernels - round(kernels)) < 0.05 else f"{kernels:.1f}"
    return f"{k} k / {ns / 1e3:.0f} µs" if ns >= 10_000 else f"{k} k / {ns / 1e3:.1f} µs"


def render_diff(a: Summary, b: Summary, names: tuple[str, str] = ("A", "B")) -> str:
    """The seed-style text: one line per layer type, then the aligned layer sequence."""
    table = diff_table(a, b)
    lines = [f"per instance: kernels (k) / summed kernel time; {names[0]} vs {names[1]}"]
    for row in table.iter_rows(named=True):
        lines.append(f"{row['key']}: {_fmt(row['a_kernels'], row['a_kernel_ns'])} vs "
                     f"{_fmt(row['b_kernels'], row['b_kernel_ns'])}")
    for key in [k for k in table["key"].to_list() if k == LAYER_KEY][:1] or \
            table["key"].to_list()[:1]:
        sa, sb = sequence(a, key), sequence(b, key)
        if not (sa or sb):
            continue
        lines.append("")
        lines.append(f"kernel sequence of one {key} instance ({len(sa)} vs {len(sb)} kernels):")
        for step in align(sa, sb):
            if step.op == "=":
                lines += [f"  = {k}" for k in step.a]
            else:
                lines += [f"  - {k}" for k in step.a] + [f"  + {k}" for k in step.b]
    for tag, s in zip(names, (a, b), strict=True):
        lines += [f"note ({tag}): {n}" for n in s.notes]
    return "\n".join(lines)

"""Several profiles, one per tensor-parallel rank, merged into one before attribution.

Ranks are separate processes that each write their own file; in containers they often
share a pid, and their string ids, correlation ids and device ids all restart per file.
The synthetic exports here are built so that a wrong merge shows: both use pid 1 (the
same ``globalPid``), their ``StringIds`` are numbered in different orders and overlap,
and their layers launch different kernels, so a name looked up with the other file's
ids, or two processes folded into one, gives other numbers.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from agentload.cli import app, main
from agentload.profiler import attribute, load_profile, summarize
from agentload.profiler.load import load_profiles
from agentload.profiler.merge import merge_profiles
from agentload.profiler.model import pid_of
from agentload.profiler.summary import Summary
from agentload.profiler.synthetic import SyntheticExport, global_pid
from tests.support import run_cli

DATA = Path(__file__).parents[1] / "data" / "profiler"
MOE = DATA / "moe4_capture_b1.json.gz"
US = 1_000
HW1 = 1 << 56

A_KERNELS = ["void norm_kernel<float>(Params)", "void gemm_kernel<128>(Params)",
             "void gemm_kernel<128>(Params)"]
B_KERNELS = ["void gemm_kernel<128>(Params)", "ncclDevKernel_AllReduce_Sum_bf16(Args)",
             "void norm_kernel<float>(Params)", "void gemm_kernel<128>(Params)"]
SHORT = {"void norm_kernel<float>(Params)": "norm_kernel",
         "void gemm_kernel<128>(Params)": "gemm_kernel",
         "ncclDevKernel_AllReduce_Sum_bf16(Args)": "ncclDevKernel_AllReduce_Sum_bf16"}


def rank_export(path: Path, pid: int, kernels: list[str], gpu_ns: int,
                padding: tuple[str, ...] = ()) -> Path:
    """2 steps x 2 layers (``model.layers.<i>`` inside ``step``), each layer launching
    ``kernels`` of ``gpu_ns`` each; ``padding`` strings take the first ids."""
    x = SyntheticExport()
    for s in padding:
        x.sid(s)
    x.process(pid, f"rank pid {pid}")
    t = x.thread(pid, pid + 1, "main")
    x.gpu(0)
    for step in range(2):
        base = step * 10_000 * US
        x.push(t, base, base + 9_000 * US, "step")
        for layer in range(2):
            lb = base + layer * 4_000 * US
            x.push(t, lb + 10 * US, lb + 3_000 * US, f"model.layers.{layer}")
            for i, name in enumerate(kernels):
                clock = lb + (20 + i * 100) * US
                x.launch_kernel(t, clock, clock + 50 * US, name, api_ns=US, gpu_ns=gpu_ns)
    return x.write(path)


@pytest.fixture
def ranks_same_pid(tmp_path: Path) -> tuple[Path, Path]:
    a = rank_export(tmp_path / "rank0.sqlite", 1, A_KERNELS, 5 * US)
    # Other string order: B's ids for the shared names differ from A's, and B's ids
    # overlap A's range, so ids read without an offset name the wrong kernels.
    b = rank_export(tmp_path / "rank1.sqlite", 1, B_KERNELS, 7 * US,
                    padding=("ncclDevKernel_AllReduce_Sum_bf16(Args)", "unused string"))
    return a, b


def summary(paths: list[Path]) -> Summary:
    return summarize(attribute(load_profiles(paths)), level="layer")


def layer_rows(s: Summary) -> dict[tuple[int, str], dict[str, int]]:
    """(proc, layer name) -> instances, kernels, kernel_ns, pid."""
    return {(r["proc"], r["name"]): {k: r[k] for k in ("instances", "kernels", "kernel_ns",
                                                        "pid")}
            for r in s.layers.filter(pl.col("name").str.starts_with("model.layers."))
            .iter_rows(named=True)}


def kernel_names_by_proc(paths: list[Path]) -> dict[int, Counter[str]]:
    """Per proc, how often each kernel name (looked up through ``strings``) ran."""
    p = load_profiles(paths)
    names = p.strings.select(pl.col("id").alias("name_id"), kernel="value")
    ops = p.ops.filter(pl.col("kind") == "kernel").join(names, on="name_id", how="left")
    out: dict[int, Counter[str]] = {}
    for proc, kernel in ops.select("proc", "kernel").iter_rows():
        out.setdefault(proc, Counter())[kernel] += 1
    return out


def test_same_pid_ranks_keep_their_own_rows_and_numbers(
        ranks_same_pid: tuple[Path, Path]) -> None:
    a, b = ranks_same_pid
    proc = global_pid(1)
    sa, sb, merged = summary([a]), summary([b]), summary([a, b])
    ra, rb, rm = layer_rows(sa), layer_rows(sb), layer_rows(merged)
    # By construction: 2 instances per layer; A 3 kernels of 5 µs, B 4 kernels of 7 µs.
    for layer in ("model.layers.0", "model.layers.1"):
        assert ra[(proc, layer)] == {"instances": 2, "kernels": 6, "kernel_ns": 30 * US,
                                     "pid": 1}
        assert rb[(proc, layer)] == {"instances": 2, "kernels": 8, "kernel_ns": 56 * US,
                                     "pid": 1}
        # The later file's processes get hw byte 1; the OS pid is still 1.
        assert rm[(proc, layer)] == ra[(proc, layer)]
        assert rm[(proc | HW1, layer)] == rb[(proc, layer)]
        rows = merged.layers.filter(pl.col("name") == layer)
        assert rows.height == 2 and rows["pid"].to_list() == [1, 1]
        assert rows["kernels"].sum() == 6 + 8 == (
            sa.layers.filter(pl.col("name") == layer)["kernels"].sum()
            + sb.layers.filter(pl.col("name") == layer)["kernels"].sum())
    assert set(rm) == {(proc, f"model.layers.{i}") for i in range(2)} | {
        (proc | HW1, f"model.layers.{i}") for i in range(2)}
    merged_profile = load_profiles([a, b])
    assert merged_profile.ops.select(pid_of(pl.col("proc"))).to_series().unique().to_list() \
        == [1]
    assert any("rank1.sqlite: its process ids (pid 1) were also used by an earlier file"
               in n and "hw byte 1" in n for n in merged.notes)
    assert any(n == "rank1.sqlite: device ids 0 were also used by an earlier file; "
                    "renumbered to 1" for n in merged.notes)
    assert sorted(merged_profile.ops["device"].unique().to_list()) == [0, 1]
    assert merged_profile.devices["device"].to_list() == [0, 1]
    assert merged.source == "merged" and merged.path == f"{a}, {b}"


def test_same_pid_strings_map_to_each_files_names(ranks_same_pid: tuple[Path, Path]) -> None:
    a, b = ranks_same_pid
    proc = global_pid(1)
    per_kernel = {name: 4 * n for name, n in Counter(A_KERNELS).items()}  # 2 steps x 2 layers
    per_kernel_b = {name: 4 * n for name, n in Counter(B_KERNELS).items()}
    assert kernel_names_by_proc([a]) == {proc: Counter(per_kernel)}
    assert kernel_names_by_proc([a, b]) == {proc: Counter(per_kernel),
                                            proc | HW1: Counter(per_kernel_b)}
    # Top kernels are keyed by pid (both files are pid 1 here): per layer, the counts by
    # kernel name are the two files' together, every name resolved through its own file.
    top = summary([a, b]).top_kernels.filter(pl.col("label") == "model.layers.0")
    counts: Counter[str] = Counter()
    for kernel, count in top.select("kernel", "count").iter_rows():
        counts[kernel] += count
    assert counts == Counter({"gemm_kernel": 4 + 4, "norm_kernel": 2 + 2,
                              "ncclDevKernel_AllReduce_Sum_bf16": 2})
    # Every layer instance shows up in the ranks row, once per file.
    ranks = summary([a, b]).ranks.filter(pl.col("name") == "model.layers.0").row(0, named=True)
    assert ranks["pids"] == [1, 1]
    assert sorted(ranks["kernels_per_inst"]) == [3.0, 4.0]
    assert sorted(ranks["kernel_ns_per_inst"]) == [15.0 * US, 28.0 * US]


def test_same_pid_ranks_table_counts_two_ranks(ranks_same_pid: tuple[Path, Path]) -> None:
    s = summary(list(ranks_same_pid))
    for layer in ("model.layers.0", "model.layers.1"):
        assert s.ranks.filter(pl.col("name") == layer)["ranks"].to_list() == [2]


def test_distinct_pids_ranks_table_top_kernels_and_sequences(tmp_path: Path) -> None:
    a = rank_export(tmp_path / "r0.sqlite", 1, A_KERNELS, 5 * US)
    b = rank_export(tmp_path / "r1.sqlite", 2, B_KERNELS, 7 * US, padding=("x", "y", "z"))
    s = summary([a, b])
    for layer in ("model.layers.0", "model.layers.1"):
        row = s.ranks.filter(pl.col("name") == layer).row(0, named=True)
        assert row["ranks"] == 2 and row["pids"] == [1, 2]
        assert row["kernels_per_inst"] == [3.0, 4.0]
        assert row["kernel_ns_per_inst"] == [15.0 * US, 28.0 * US]
        assert row["skew_ns"] == 13.0 * US
    assert not any("were also used" in n and "process" in n for n in s.notes)

    def top(pid: int) -> dict[str, int]:
        t = s.top_kernels.filter((pl.col("pid") == pid) & (pl.col("label") == "model.layers.1"))
        return dict(t.select("kernel", "count").iter_rows())

    assert top(1) == {"gemm_kernel": 4, "norm_kernel": 2}
    assert top(2) == {"gemm_kernel": 4, "ncclDevKernel_AllReduce_Sum_bf16": 2,
                      "norm_kernel": 2}
    seq = {r["pid"]: r["kernels"] for r in s.sequences.filter(
        pl.col("type") == "model.layers.*").iter_rows(named=True)}
    assert seq == {1: [SHORT[k] for k in A_KERNELS], 2: [SHORT[k] for k in B_KERNELS]}
    text = CliRunner().invoke(app, ["profile", "layers", str(a), str(b), "--level", "layer"])
    assert text.exit_code == 0, text.output
    assert "  model.layers.0: 1: 15.0, 2: 28.0 µs; skew 13.0 µs" in text.output


def test_kineto_fixture_as_two_ranks() -> None:
    """The real H200 Kineto capture given twice: same pid (661), same device 0, the same
    string ids; the merge keeps two processes with the single file's numbers each."""
    one = summarize(attribute(load_profile(MOE)), level="layer")
    two = summary([MOE, MOE])
    proc = one.layers["proc"][0]
    assert one.layers["pid"].unique().to_list() == [661]
    single = {r["name"]: (r["instances"], r["kernels"], r["kernel_ns"])
              for r in one.layers.iter_rows(named=True)}
    assert single["layer0.standard"][:2] == (4, 4 * 56)  # its own layer ranges, not inferred
    for r in two.layers.iter_rows(named=True):
        assert r["proc"] in (proc, proc | HW1) and r["pid"] == 661
        assert (r["instances"], r["kernels"], r["kernel_ns"]) == single[r["name"]]
    assert two.layers.height == 2 * one.layers.height
    assert two.layers["kernels"].sum() == 2 * one.layers["kernels"].sum()
    for name in single:
        row = two.ranks.filter(pl.col("name") == name).row(0, named=True)
        assert row["pids"] == [661, 661]
    names = kernel_names_by_proc([MOE, MOE])
    assert set(names) == {proc, proc | HW1}
    assert names[proc] == names[proc | HW1] == kernel_names_by_proc([MOE])[proc]
    assert sum(names[proc].values()) == 896 == load_profile(MOE).ops.filter(
        pl.col("kind") == "kernel").height  # 16 steps x 56 kernels


def test_mixed_formats_kineto_and_nsight_same_pid(tmp_path: Path) -> None:
    """A Kineto trace (string ids from 0) and an nsys export (ids from 1), both pid 661."""
    db = rank_export(tmp_path / "rank1.sqlite", 661, B_KERNELS, 7 * US)
    merged = load_profiles([MOE, db])
    kineto_proc = 661 << 24
    assert set(merged.ops["proc"].unique().to_list()) == {kineto_proc, kineto_proc | HW1}
    assert merged.strings["id"].n_unique() == merged.strings.height
    names = kernel_names_by_proc([MOE, db])
    assert names[kineto_proc] == kernel_names_by_proc([MOE])[kineto_proc]
    assert names[kineto_proc | HW1] == Counter({k: 4 * n for k, n in Counter(B_KERNELS).items()})
    s = summarize(attribute(merged), level="layer")
    top = s.top_kernels.filter(pl.col("label") == "model.layers.0")
    assert dict(top.select("kernel", "count").iter_rows()) == {
        "gemm_kernel": 4, "ncclDevKernel_AllReduce_Sum_bf16": 2, "norm_kernel": 2}


def test_one_file_is_load_profile_unchanged(ranks_same_pid: tuple[Path, Path]) -> None:
    a, _ = ranks_same_pid
    p, q = load_profile(a), load_profiles([a])
    assert q.source == p.source == "nsight-sqlite" and q.path == p.path and q.notes == p.notes
    for table in ("ops", "launches", "ranges", "strings", "processes", "threads", "devices"):
        assert getattr(q, table).equals(getattr(p, table)), table
    assert merge_profiles([p]) is p


def test_cli_layers_json_two_files(ranks_same_pid: tuple[Path, Path]) -> None:
    a, b = ranks_same_pid
    result = CliRunner().invoke(app, ["profile", "layers", str(a), str(b), "--json",
                                      "--level", "layer"])
    assert result.exit_code == 0, result.output
    rows = [r for r in json.loads(result.output)["layers"]
            if r["name"].startswith("model.layers.")]
    got = sorted((r["name"], r["pid"], r["instances"], r["kernels"], r["kernel_ns"])
                 for r in rows)
    assert got == [("model.layers.0", 1, 2, 6, 30 * US), ("model.layers.0", 1, 2, 8, 56 * US),
                   ("model.layers.1", 1, 2, 6, 30 * US), ("model.layers.1", 1, 2, 8, 56 * US)]
    steps = CliRunner().invoke(app, ["profile", "steps", str(a), str(b), "--json"])
    assert steps.exit_code == 0, steps.output
    per = sorted((s["step"], s["kernels"]) for s in json.loads(steps.output)["steps"])
    assert per == [("step", 6), ("step", 6), ("step", 8), ("step", 8)]  # 2 layers a step


def test_cli_report_two_files(ranks_same_pid: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "ranks.html"
    result = CliRunner().invoke(app, ["profile", "report", *map(str, ranks_same_pid),
                                      "-o", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert "merged" in page and "rank1.sqlite" in page


def test_cli_broken_second_file_is_one_line_exit_2(ranks_same_pid: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    a, _ = ranks_same_pid
    bad = tmp_path / "rank1.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel"')
    with pytest.raises(SystemExit) as exc:
        main(["profile", "layers", str(a), str(bad)])
    assert exc.value.code == 2
    done = run_cli("profile", "layers", str(a), str(bad), "--json", timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"agentload: error: {bad}: not valid JSON"), lines[0]
    missing = run_cli("profile", "steps", str(a), str(tmp_path / "nope.sqlite"), timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip() == (
        f"agentload: error: {tmp_path / 'nope.sqlite'}: no such file or directory")


def test_text_output_tells_same_pid_ranks_apart(ranks_same_pid: tuple[Path, Path]) -> None:
    from agentload.profiler.cli import render_layers

    text = render_layers(summary(list(ranks_same_pid)))
    across = [ln for ln in text.splitlines() if ln.startswith("  model.layers.0: ")]
    assert len(across) == 1 and "1~0: " in across[0] and "1~1: " in across[0], text
    tops = [ln for ln in text.splitlines() if "model.layers.0:" in ln and " x" in ln]
    assert sorted(ln.split()[0] for ln in tops) == ["1~0", "1~1"], text

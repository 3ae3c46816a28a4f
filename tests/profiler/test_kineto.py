"""Real Kineto traces from an H200: a graph-replay capture and our own decoder capture.

``tests/data/profiler/decoder4_kineto.json.gz`` was captured by
``tests/gpu/capture_h200_fixture.py`` on an NVIDIA H200 (torch 2.11.0+cu130): 3 eager
decode steps of a 4-layer model whose modules run inside ``record_function`` ranges
named with vLLM's layerwise text, then 2 CUDA-graph replays. ``decoder4_truth.json``
holds what each layer launches, measured apart from that trace (each layer profiled
alone, GPU events read from the profiler's Python event list). Those lists include
Kineto's ``gpu_user_annotation`` projections (names starting with ``{'Module'``), which
are not kernels and are left out here.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from agentload.profiler import attribute, load_profile, summarize
from agentload.profiler.summary import short_kernel_name

DATA = Path(__file__).parents[1] / "data" / "profiler"
TRACE = DATA / "decoder4_kineto.json.gz"
TRUTH = json.loads((DATA / "decoder4_truth.json").read_text())
SHARED = DATA / "graph_replay_torch2.11_h200.json"


def truth_kernels(layer: str) -> list[str]:
    return [n for n in TRUTH["layers"][layer]["kernel_names"] if not n.startswith("{")]


def test_fixture_is_real_h200_capture() -> None:
    assert TRUTH["device"] == "NVIDIA H200" and TRUTH["torch"].startswith("2.11")
    assert TRACE.stat().st_size < 2_000_000


def test_per_layer_counts_match_what_the_model_launches() -> None:
    s = summarize(attribute(load_profile(TRACE)), level="layer")
    rows = {r["name"]: r for r in s.layers.iter_rows(named=True)}
    for i in range(4):
        name = f"model.layers.{i}"
        want = truth_kernels(name)
        assert rows[name]["instances"] == TRUTH["steps"]
        assert rows[name]["kernels"] == TRUTH["steps"] * len(want), name
    # the per-instance kernel sequence is the one the layer launches alone
    seq = s.sequences.filter(pl.col("type") == "model.layers.*")
    assert seq.height == 1
    got = seq["kernels"][0].to_list()
    assert got in [[short_kernel_name(n) for n in truth_kernels(f"model.layers.{i}")]
                   for i in range(4)]


def test_innermost_submodules_and_side_stream() -> None:
    s = summarize(attribute(load_profile(TRACE)))
    rows = {r["name"]: r for r in s.layers.iter_rows(named=True)}
    for i in range(4):
        attn, mlp = rows[f"model.layers.{i}.self_attn"], rows[f"model.layers.{i}.mlp"]
        assert attn["kernels"] + mlp["kernels"] + rows.get(
            f"model.layers.{i}", {"kernels": 0})["kernels"] == 3 * len(
            truth_kernels(f"model.layers.{i}"))
    # layer 2's side-stream op (and the add that joins it) are owned by the layer itself
    assert rows["model.layers.2"]["kernels"] == 3 * 2
    streams = attribute(load_profile(TRACE)).ops["stream"].n_unique()
    assert streams >= 2


def test_graph_replays_are_opaque_to_kineto_and_said_so() -> None:
    att = attribute(load_profile(TRACE))
    replayed = att.ops.filter(pl.col("via") == "graph-launch")
    per_replay = sum(len(truth_kernels(f"model.layers.{i}")) for i in range(4))
    assert replayed.height == TRUTH["graph_replays"] * per_replay
    assert any("without graph node ids" in n for n in att.notes)
    steps = summarize(att).steps
    graph_steps = steps.filter(pl.col("step").str.contains("graph replay"))
    assert graph_steps.height == TRUTH["graph_replays"]
    assert set(graph_steps["kernels"].to_list()) == {per_replay}


def test_shared_graph_replay_fixture() -> None:
    att = attribute(load_profile(SHARED))
    s = summarize(att)
    rows = {r["name"]: r for r in s.layers.iter_rows(named=True)}
    assert rows["eager_layer"]["kernels"] == 3
    assert rows["replay_step"]["kernels"] == 6  # 2 replays x 3 kernels, correlation 73 / 82
    assert rows["replay_step"]["instances"] == 1
    assert s.steps.height == 3
    kernel = att.ops.filter(pl.col("correlation") == 27).row(0, named=True)
    assert kernel["end"] - kernel["start"] == 2_848  # dur 2.848 us -> exact ns

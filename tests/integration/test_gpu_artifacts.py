"""What real vLLM on a GPU produced, read back by agentload on a CPU machine.

``tests/data/gpu/`` holds artifacts of vLLM 0.26.0 serving the dummy-weight ``dsv3-mini``
MoE (arms/gpu-1x.toml) on an NVIDIA H100 80GB HBM3, driven by ``tests/gpu/proving_ground.sh``
(provenance and trimming in ``tests/data/gpu/README.md``):

- ``run_moe_ngram_eager/``: the run directory of a 35 s replay of the WEKA fixture sessions
  (16 users, ``--recycle``) against the ``moe-ngram-eager`` arm (n-gram speculative
  decoding, eager mode): journal, run.json, summary.json, gpu_metrics.parquet and the
  server's whole ``/metrics`` text at the end;
- ``dsv3mini_eager_ngram_h100.json.gz``: three decode steps of that server's torch profile
  (module ranges from ``with_stack``);
- ``dsv3mini_graphs_h100.json.gz``: three decode steps of the ``moe-graphs`` arm (CUDA graphs
  + torch.compile), where no layer range exists;
- ``dsv3mini_eager_h100.json.gz`` and ``dsv3mini_fullgraph_h100.json.gz``: the ``moe-eager``
  and ``moe-fullgraph`` arms (no torch.compile; FULL CUDA graphs for decode, eager
  prefill) on the same traffic: three decode steps each, and one prefill step before the
  graph replays.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from agentload.profiler import attribute, load_profile, summarize
from agentload.replay.results.finalize import write_results
from agentload.replay.results.report import spec_decode
from agentload.replay.serve import prometheus

DATA = Path(__file__).parents[1] / "data" / "gpu"
RUN = DATA / "run_moe_ngram_eager"
EAGER = DATA / "dsv3mini_eager_ngram_h100.json.gz"
GRAPHS = DATA / "dsv3mini_graphs_h100.json.gz"
PLAIN_EAGER = DATA / "dsv3mini_eager_h100.json.gz"
FULL_GRAPH = DATA / "dsv3mini_fullgraph_h100.json.gz"
LAYERS = 12  # dsv3-mini: the first layer dense, 11 MoE layers


def test_every_series_agentload_reads_is_in_the_real_metrics_text() -> None:
    text = (RUN / "server_metrics_end.txt").read_text()
    values = prometheus.parse_metrics(text)
    assert set(prometheus.WANTED) <= set(values), set(prometheus.WANTED) - set(values)
    # Counters as the run's end saw them: prompt tokens and hits match the run's deltas,
    # because the server was started for this run (its counters began at 0).
    delta = json.loads((RUN / "run.json").read_text())["server"]["metrics_delta"]
    for name in ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
                 "vllm:spec_decode_num_draft_tokens_total"):
        assert values[name] >= delta[name] > 0
    # MLA's KV cache block is 16 tokens here (not the 64 of the trace's blocks).
    assert prometheus.kv_block_size(text) == 16
    assert prometheus.info_labels(text)["enable_prefix_caching"] == "True"


def test_speculative_acceptance_from_the_real_counters() -> None:
    run = json.loads((RUN / "run.json").read_text())
    spec = spec_decode(run)
    assert spec is not None
    # Random weights make greedy decoding cycle, so n-gram drafts are all accepted.
    assert spec["acceptance_rate"] == 1.0 and spec["draft_tokens"] == 3274
    assert 3.8 < spec["mean_acceptance_length"] <= 4.0  # 3 drafts + the verified token


def test_the_report_builds_from_the_real_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(RUN, run_dir)
    stored = json.loads((RUN / "summary.json").read_text())
    result = write_results(run_dir)
    s = result.summary
    for key in ("requests_completed", "osl_exact_fraction", "p90_interactivity_tok_s",
                "e2e_norm_p90_interactivity_tok_s", "ttft_p50_s", "ttft_p90_s",
                "server_prefix_cache_hit_rate", "theoretical_prefix_cache_hit_rate_all"):
        assert s[key] == pytest.approx(stored[key], rel=1e-9), key
    assert s["requests_completed"] == 60 and s["osl_exact_fraction"] == 1.0
    assert s["speculative_decoding"]["acceptance_rate"] == 1.0
    # The server counts warmup requests too: against the same traffic, within 2 points.
    assert abs(s["server_prefix_cache_hit_rate"]
               - s["theoretical_prefix_cache_hit_rate_all"]) < 0.02
    assert s["gpu_telemetry"]["available"] and s["gpu_telemetry"]["gpus"][0]["samples"] > 10
    html = (run_dir / "report.html").read_text()
    assert "Speculative decoding" in html or "speculative decoding" in html
    assert pl.read_parquet(run_dir / "requests.parquet").height == 92  # warmup included


def _layers(path: Path) -> dict[str, dict[str, object]]:
    s = summarize(attribute(load_profile(path)), level="layer")
    return {r["name"]: r for r in s.layers.iter_rows(named=True)}


def test_eager_trace_has_every_decoder_layer_with_equal_kernels_per_step() -> None:
    rows = _layers(EAGER)
    decoder = {name: r for name, r in rows.items() if "DecoderLayer_" in name}
    assert sorted(decoder) == sorted(f"nn.Module: DeepseekV2DecoderLayer_{i}"
                                     for i in range(LAYERS))
    per_step = {name: r["kernels"] / r["instances"] for name, r in decoder.items()}
    assert all(r["instances"] == 3 for r in decoder.values())
    assert per_step["nn.Module: DeepseekV2DecoderLayer_0"] == 17  # the dense layer
    assert {per_step[f"nn.Module: DeepseekV2DecoderLayer_{i}"]
            for i in range(1, LAYERS)} == {25}  # MoE layers, every step alike
    total = sum(int(r["kernel_ns"]) for r in rows.values())
    in_layers = sum(int(r["kernel_ns"]) for r in decoder.values())
    named = sum(int(r["kernel_ns"]) for name, r in rows.items()
                if name.startswith("nn.Module: "))
    assert in_layers / total > 0.95  # decode time attributed to a decoder layer
    assert named / total > 0.97  # ... or to a named module around them (embedding, LM head)


def test_graph_trace_layers_are_inferred_from_the_replayed_kernels() -> None:
    s = summarize(attribute(load_profile(GRAPHS)), level="layer")
    rows = {r["name"]: r for r in s.layers.iter_rows(named=True)}
    layers = [rows[f"inferred.layers.{i}"] for i in range(LAYERS - 1)]
    assert f"inferred.layers.{LAYERS - 1}" not in rows
    # 11 MoE layers of 24 kernels in each of the 3 replays; the dense first layer and the
    # embedding are the prelude (torch.compile fused them into 18 kernels).
    assert {(r["instances"], r["kernels"]) for r in layers} == {(3, 72)}
    assert (rows["inferred.prelude"]["instances"], rows["inferred.prelude"]["kernels"]) == (3, 54)
    assert any("layers inferred" in n for n in s.notes)
    # One row per decode step: the 282 replayed kernels and the 16 eager ones (input
    # preparation, logits, sampler) launched inside the same step range.
    replays = s.steps.filter(pl.col("kernels") == 282 + 16)
    assert replays.height == 3 and set(replays["layers"]) == {11}


def test_the_dashboard_shows_acceptance_from_the_real_scrapes() -> None:
    """The run's last scrape, fed to the live board the dashboard reads."""
    from agentload.replay.live import Header, LiveBoard
    from agentload.tui.widgets import spec_text

    board = LiveBoard(Header("arm", "weka", 1, 16, 0, 35.0, recycle=True))
    end = prometheus.parse_metrics((RUN / "server_metrics_end.txt").read_text())
    board.server_sample(1_000_000_000, {k: 0.0 for k in end})  # the server's counters at 0
    assert spec_text(board.publish(1_000_000_000).server) == ""  # nothing drafted yet
    board.server_sample(2_000_000_000, end)
    shown = spec_text(board.publish(2_000_000_000).server)
    assert shown == "spec. acceptance 100.0%, mean length 3.87"


def test_diff_sets_eager_module_layers_against_inferred_graph_layers() -> None:
    from agentload.profiler.diff import diff_table, render_diff

    eager = summarize(attribute(load_profile(EAGER)), level="layer")
    graphs = summarize(attribute(load_profile(GRAPHS)), level="layer")
    row = diff_table(eager, graphs).filter(pl.col("key") == "layers.*").row(0, named=True)
    # Eager: 12 layers per step (the dense one has 17 kernels, the MoE ones 25); graphs:
    # the 11 inferred MoE layers of 24 (the dense layer is in the prelude).
    assert row["a_kernels"] == pytest.approx((17 + 11 * 25) / 12)
    assert row["b_kernels"] == 24
    text = render_diff(eager, graphs, ("eager", "graphs"))
    # torch.compile fused eager's separate norm kernels into Triton ones.
    assert "- vllm::fused_add_rms_norm_kernel" in text and "std::enable_if" not in text
    assert "= vllm::concat_and_cache_mla_kernel" in text and "= fused_moe_kernel" in text


def _per_instance(rows: dict[str, dict[str, object]], name: str) -> tuple[float, float]:
    r = rows[name]
    n = int(r["instances"])  # type: ignore[call-overload]
    return int(r["kernels"]) / n, int(r["memops"]) / n  # type: ignore[call-overload]


def test_full_graph_decode_layers_hold_the_same_gpu_ops_as_eager_ones() -> None:
    """FULL CUDA graphs without torch.compile replay eager's kernels: the replays have no
    layer ranges (inferred), the eager prefill step beside them keeps its module ranges."""
    eager = _layers(PLAIN_EAGER)
    graph = summarize(attribute(load_profile(FULL_GRAPH)), level="layer")
    rows = {r["name"]: r for r in graph.layers.iter_rows(named=True)}
    moe = [f"nn.Module: DeepseekV2DecoderLayer_{i}" for i in range(1, LAYERS)]
    inferred = [f"inferred.layers.{i}" for i in range(LAYERS - 1)]
    # Eager: each MoE layer launches 25 kernels and one device-to-device copy per step;
    # captured in a graph, that copy replays as a kernel (memcpy32_post): 26 and none.
    assert {_per_instance(eager, n) for n in moe} == {(25, 1)}
    assert {_per_instance(rows, n) for n in inferred} == {(26, 0)}
    assert {int(rows[n]["instances"]) for n in inferred} == {3}  # type: ignore[call-overload]
    assert "inferred.layers.11" not in rows
    # The dense first layer does not repeat: it is in the prelude with the embedding.
    embedding, dense = (_per_instance(eager, "nn.Module: VocabParallelEmbedding_0"),
                        _per_instance(eager, "nn.Module: DeepseekV2DecoderLayer_0"))
    assert _per_instance(rows, "inferred.prelude") == (embedding[0] + dense[0], 0)
    # The prefill step ran eagerly: its 12 module ranges are kept, not inferred.
    assert {int(rows[f"nn.Module: DeepseekV2DecoderLayer_{i}"]["instances"])  # type: ignore[call-overload]
            for i in range(LAYERS)} == {1}
    assert any("graph replays only" in n for n in graph.notes)
    # One step row per decode step: the replay (306 kernels) and the 16 eager kernels
    # launched in the same step range; >= 95 % of their kernel time in a decoder layer,
    # and nearly all in the layers, the prelude/postlude or a named module.
    decode = graph.steps.filter(pl.col("kernels") == 306 + 16)
    assert decode.height == 3 and set(decode["layers"]) == {LAYERS - 1}
    steps = set(decode["step_key"])
    inst = graph.instances.filter(pl.col("step_key").is_in(steps))
    total = int(inst["kernel_ns"].sum())
    assert total == int(decode["kernel_ns"].sum())
    in_layers = int(inst.filter(pl.col("name").str.starts_with("inferred.layers."))
                    ["kernel_ns"].sum())
    split = int(inst.filter(pl.col("name").str.starts_with("inferred."))["kernel_ns"].sum())
    named = split + int(inst.filter(pl.col("name").str.starts_with("nn.Module: "))
                        ["kernel_ns"].sum())
    assert in_layers / total > 0.90  # 11 MoE layers: 91 %
    assert split / total > 0.98  # + the prelude (embedding, dense layer) and postlude
    assert named / total > 0.99  # + the LM head and sampler; the rest: input preparation


def test_agreement_on_the_gpu_server_sets_both_clients_against_its_clock() -> None:
    """``bench agree`` against ``vllm bench serve`` on the H100 (moe-fullgraph, 3 runs)."""
    from agentload.replay.bench.agree import agree_lines

    r = json.loads((DATA / "agree_moe_fullgraph_h100.json").read_text())
    view = r["server_view"]
    for tool in ("agentload", "vllm_bench"):
        runs = view[tool]["runs"]
        assert len(runs) == 3
        # Each client's mean ITL is the server's own to within 0.5 % in every run ...
        assert all(abs(x["itl_over_server"] - 1) < 0.005 for x in runs)
    # ... and agentload's kernel-stamped TTFT sits closer to the server's than vllm bench's.
    ours = [x["ttft_minus_server_ms"] for x in view["agentload"]["runs"]]
    theirs = [x["ttft_minus_server_ms"] for x in view["vllm_bench"]["runs"]]
    assert 0 < max(ours) < min(theirs)
    # The server itself moved more between runs than the 3 % the tools are held to.
    itl = [x["server_itl_mean_ms"] for t in ("agentload", "vllm_bench")
           for x in view[t]["runs"]]
    assert max(itl) / min(itl) > 1.1
    lines = agree_lines(r)
    assert any(line.startswith("  and its mean ITL") for line in lines)

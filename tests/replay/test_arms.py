"""Arm files: validation with precise errors, inheritance, the exact argv, the GPU guards.

The shipped Kimi K3 arms' argv is parsed by the installed vLLM's own ``vllm serve``
argument parser (0.32 here; the flags used exist in 0.33 too), so a typo in a flag or a
JSON config that vLLM cannot read fails this test rather than a cluster job.
"""

from __future__ import annotations

import itertools
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentload.cli import app
from agentload.replay.results.compare import dry_run_lines, select_arms
from agentload.replay.serve.arms import (
    Arm,
    ArmError,
    check_gpu_count,
    check_same_gpus,
    load_arm,
    load_arms,
    parse_arm_ref,
    serve_argv,
    visible_gpus,
)
from tests.support import run_cli

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "arms" / "kimi-k3-gb300.toml"
CPU = ROOT / "arms" / "embedded-cpu.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "arms.toml"
    path.write_text(text)
    return path


def test_shipped_files_load_and_inherit() -> None:
    kimi = load_arms(KIMI)
    assert {"tp8-auto", "tp8-specialized", "tp16-auto", "tp16-specialized",
            "tp16-specialized-dspark", "tp8-specialized-dspark-synthetic"} <= set(kimi)
    assert kimi["tp8-auto"].gpus == 8 and kimi["tp16-specialized"].gpus == 16
    spec = kimi["tp8-specialized-dspark-synthetic"].get("speculative_config")
    # Tables merge key by key through two levels of extends.
    assert spec == {"method": "dspark", "num_speculative_tokens": 7,
                    "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 6}
    assert kimi["tp8-specialized"].get("additional_config") == {
        "decode_backend": "latency_specialized"}
    assert kimi["tp8-specialized-dspark-synthetic"].synthetic_acceptance is not None
    assert kimi["tp8-specialized-dspark"].synthetic_acceptance is None
    cpu = load_arms(CPU)
    assert cpu["no-prefix-cache"].get("enable_prefix_caching") is False
    assert all(arm.embedded and arm.gpus == 1 for arm in cpu.values())


@pytest.mark.parametrize(("text", "message"), [
    ("[arm.a]\nmodel = 'm'\ntensor_parallel_size = '8'\n",
     "[arm.a] tensor_parallel_size must be an integer >= 1, got '8'"),
    ("[arm.a]\nmodel = 'm'\ntensor_parallel_size = 0\n",
     "tensor_parallel_size must be an integer >= 1, got 0"),
    ("[arm.a]\nmodel = 'm'\ntensor_paralel_size = 8\n", "unknown key 'tensor_paralel_size'"),
    ("[arm.a]\nextends = 'b'\n", "extends 'b', which is not an arm in this file"),
    ("[arm.a]\nextends = 'b'\n[arm.b]\nextends = 'a'\n", "extends forms a cycle"),
    ("[arm.a]\ntensor_parallel_size = 2\n",
     "[arm.a] needs exactly one of model and dummy_model (or embedded = true)"),
    ("[arm.a]\nembedded = true\nmodel = 'x'\n", "embedded arms serve the tiny local model"),
    ("[arm.a]\nmodel = 'm'\nextra_args = ['--port', '9']\n", "extra_args may not set --port"),
    ("[arm.a]\nmodel = 'm'\nenable_prefix_caching = 1\n",
     "enable_prefix_caching must be true or false, got 1"),
    ("[arm.a]\nmodel = 'm'\ngpu_memory_utilization = 1.5\n", "gpu_memory_utilization must be"),
    ("[arm.a]\nmodel = 'm'\nenv = { A = 1 }\n", "env must be a table of strings"),
    ("[arms.a]\nmodel = 'm'\n", "unknown top-level key(s) arms"),
    ("[arm.a\nmodel = 'm'\n", "not valid TOML"),
    ("", "no arms"),
])
def test_bad_arm_files_say_where_and_what(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ArmError) as err:
        load_arms(write(tmp_path, text))
    assert message in str(err.value)
    assert str(tmp_path) in str(err.value)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "[arm.a]\nmodel = 1\n[arm.b]\nmodel = 'm'\nmax_num_seqs = -1\n")
    with pytest.raises(ArmError) as err:
        load_arms(path)
    assert "[arm.a] model must be" in str(err.value)
    assert "[arm.b] max_num_seqs must be" in str(err.value)


def test_arm_refs() -> None:
    assert parse_arm_ref("a/b.toml:x") == (Path("a/b.toml"), "x")
    with pytest.raises(ArmError, match="FILE:NAME"):
        parse_arm_ref("a/b.toml")
    with pytest.raises(ArmError, match=r"has no arm 'nope'.*tp8-auto"):
        load_arm(f"{KIMI}:nope")


def test_argv_is_exact() -> None:
    arm = load_arm(f"{KIMI}:tp8-specialized")
    argv = serve_argv(arm, "127.0.0.1", 8123)
    assert argv[:3] == ["vllm", "serve", "moonshotai/Kimi-K3"]
    pairs = dict(itertools.pairwise(argv[3:]))
    assert pairs["--port"] == "8123" and pairs["--tensor-parallel-size"] == "8"
    assert json.loads(pairs["--additional-config"]) == {"decode_backend": "latency_specialized"}
    assert "--headless" not in argv
    worker = serve_argv(arm, "127.0.0.1", 8123, node_rank=1)
    assert "--headless" in worker and worker[worker.index("--node-rank") + 1] == "1"
    off = serve_argv(load_arm(f"{CPU}:no-prefix-cache"), "127.0.0.1", 9, "/m")
    assert off[:6] == [sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server",
                       "--model", "/m"]
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off


def test_gpu_count_guards() -> None:
    tp8 = load_arm(f"{KIMI}:tp8-auto")
    tp16 = load_arm(f"{KIMI}:tp16-auto")
    with pytest.raises(ArmError, match=r"different GPU counts.*tp8-auto: 8 GPU.*tp16-auto: 16"):
        check_same_gpus([tp8, tp16], allow_change=False)
    check_same_gpus([tp8, tp16], allow_change=True)
    check_same_gpus([tp8, load_arm(f"{KIMI}:tp8-specialized")], allow_change=False)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3"})[0] == 4
    # tp8-auto spans 2 nodes: 4 GPUs visible on this node is enough, 3 is not.
    check_gpu_count(tp8, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    with pytest.raises(ArmError, match=r"needs 4 GPUs on each of its 2 nodes.*3 are visible"):
        check_gpu_count(tp8, {"CUDA_VISIBLE_DEVICES": "0,1,2"})
    single = Arm("one", "x", {"model": "m", "tensor_parallel_size": 2})
    with pytest.raises(ArmError, match=r"needs 2 GPUs.*0 are visible"):
        check_gpu_count(single, {"CUDA_VISIBLE_DEVICES": ""})
    check_gpu_count(load_arm(f"{CPU}:prefix-cache"), {"CUDA_VISIBLE_DEVICES": ""})


def test_compare_refuses_gpu_count_change_before_starting_anything(tmp_path: Path) -> None:
    proc = run_cli("compare", "--arms", str(KIMI), "--only", "tp8-auto,tp16-auto",
                   "-o", str(tmp_path / "c"))
    assert proc.returncode == 2
    assert "different GPU counts" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "c").exists()


def test_compare_dry_run_prints_every_arm_and_launches_nothing(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["compare", "--arms", str(KIMI), "--dry-run",
                                      "-o", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    commands = [ln for ln in result.output.splitlines() if ln.startswith("vllm serve")]
    assert len(commands) == len(load_arms(KIMI))
    assert "synthetic speculative acceptance" in result.output  # flagged before launch
    assert not (tmp_path / "c").exists()
    assert select_arms(KIMI, ["tp8-specialized", "tp8-auto"])[0].name == "tp8-specialized"


_PARSE = """
import json, shlex, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
out = []
for line in sys.stdin.read().splitlines():
    argv = shlex.split(line)
    args = parser.parse_args(argv[1:])  # exits 2 on any flag vLLM does not know
    out.append({"model": args.model_tag, "tp": args.tensor_parallel_size,
                "additional": args.additional_config, "spec": args.speculative_config,
                "kv": args.kv_cache_dtype, "nnodes": args.nnodes, "headless": args.headless})
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_dry_run_argv_is_accepted_by_vllms_own_parser() -> None:
    pytest.importorskip("vllm")
    lines = [ln.replace("'<free-port>'", "8000")
             for ln in dry_run_lines(list(load_arms(KIMI).values())) if not ln.startswith("#")]
    lines.append(shlex.join(serve_argv(load_arm(f"{KIMI}:tp16-auto"), "127.0.0.1", 1,
                                     node_rank=3)))
    proc = subprocess.run([sys.executable, "-c", _PARSE], input="\n".join(lines),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(parsed) == len(lines)
    by_tp = {p["tp"] for p in parsed}
    assert by_tp == {8, 16}
    assert all(p["model"] == "moonshotai/Kimi-K3" and p["kv"] == "fp8" for p in parsed)
    assert {p["additional"]["decode_backend"] for p in parsed} == {"auto",
                                                                   "latency_specialized"}
    assert any(p["spec"] and p["spec"]["num_speculative_tokens"] == 7 for p in parsed)
    assert parsed[-1]["headless"] and parsed[-1]["nnodes"] == 4

"""GPU staging without a GPU: dummy-weight presets, GPU arms, fatbin pruning, the stage script.

The bundle itself (``agentload gpu bundle``) downloads ~400 MB of wheels and is exercised
on the lent GPU box (docs/gpu.md); here every piece it is built
from is checked on what it does to known inputs.
"""

from __future__ import annotations

import json
import lzma
import os
import re
import shlex
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from agentload.replay.bench.agree import tokenizer_for
from agentload.replay.errors import ServerError
from agentload.replay.results.compare import dry_run_lines
from agentload.replay.serve.arms import ArmError, arm_server_spec, load_arms
from agentload.replay.serve.dummy_models import PRESETS, dummy_model, ensure_dummy_model
from agentload.replay.serve.gpu_bundle import (
    BundleError,
    build_bundle,
    elf_section,
    prune_fatbin,
    requirements,
    source_root,
)

ROOT = Path(__file__).resolve().parents[2]
GPU_ARMS = ROOT / "arms" / "gpu-1x.toml"
STAGE = ROOT / "replay" / "serve" / "gpu_stage.sh"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AGENTLOAD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_dummy_moe_preset_is_a_deepseek_v3_shape_with_its_own_tokenizer(cache: Path) -> None:
    from tokenizers import Tokenizer

    model = ensure_dummy_model(dummy_model("dsv3-mini"))
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)  # MLA
    assert (config["n_routed_experts"], config["num_experts_per_tok"],
            config["n_shared_experts"]) == (64, 6, 1)
    # Sampled ids must detokenize: the config's vocabulary is exactly the tokenizer's.
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert config["vocab_size"] == tokenizer.get_vocab_size() > 20_000
    assert not list(model.glob("*.safetensors"))  # --load-format dummy: no weights
    assert ensure_dummy_model(dummy_model("dsv3-mini")) == model  # built once, reused


def test_unknown_dummy_preset_names_the_known_ones() -> None:
    with pytest.raises(ServerError, match="dsv3-mini"):
        dummy_model("gpt-7")


def test_gpu_arms_serve_dummy_weights_on_one_gpu(cache: Path) -> None:
    arms = load_arms(GPU_ARMS)
    assert {a.gpus for a in arms.values()} == {1}
    spec = arm_server_spec(arms["moe-ngram"])
    argv = list(spec.argv)
    assert argv[:6] == ["python3", "-P", "-m", "vllm.entrypoints.cli.main", "serve",
                        str(ensure_dummy_model(PRESETS["dsv3-mini"]))]
    assert argv[argv.index("--load-format") + 1] == "dummy"
    assert json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "ngram"
    assert spec.served_model == "agentload-dsv3-mini"
    config = json.loads((Path(argv[5]) / "config.json").read_text())
    assert spec.vocab_size == config["vocab_size"]  # prompts stay inside the tokenizer
    eager = list(arm_server_spec(arms["moe-eager"]).argv)
    assert "--enforce-eager" in eager and "--enforce-eager" not in argv
    full = list(arm_server_spec(arms["moe-fullgraph"]).argv)  # graphs with eager's kernels
    assert json.loads(full[full.index("--compilation-config") + 1]) == {
        "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    for arm in arms.values():  # every arm's profiler writes where its name says
        args = list(arm_server_spec(arm).argv)
        profiler = json.loads(args[args.index("--profiler-config") + 1])
        assert profiler["torch_profiler_dir"].endswith("/" + arm.name)


def test_dry_run_of_gpu_arms_builds_nothing(cache: Path) -> None:
    lines = dry_run_lines(list(load_arms(GPU_ARMS).values()))
    assert "'<dsv3-mini-dir>' --load-format dummy" in lines[1]
    assert not cache.exists()


@pytest.mark.parametrize("body, message", [
    ('dummy_model = "dsv3-mini"\nmodel = "x"', "exactly one of model and dummy_model"),
    ('dummy_model = "nope"', "not a preset"),
    ("embedded = true\ndummy_model = \"dsv3-mini\"", "remove dummy_model"),
])
def test_dummy_model_arm_errors(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "a.toml"
    path.write_text(f"[arm.a]\n{body}\n")
    with pytest.raises(ArmError, match=message):
        load_arms(path)


def test_agree_finds_the_dummy_presets_tokenizer(cache: Path) -> None:
    assert tokenizer_for("agentload-dsv3-mini") == ensure_dummy_model(PRESETS["dsv3-mini"])
    assert tokenizer_for("some-other-model").name.startswith("tiny-llama-")


def test_requirements_are_exact_pins_in_three_sections() -> None:
    reqs = requirements()
    pins = reqs.vllm + reqs.agentload + reqs.ray
    assert all("==" in pin for pin in pins)
    names = [pin.split("==")[0] for pin in pins]
    assert len(names) == len(set(names))  # two versions of one package stop pip
    assert "apache_tvm_ffi==0.1.11" in reqs.vllm  # the xgrammar trap, kept on purpose
    assert {"polars", "textual", "httpx-aiohttp"} <= set(names)
    assert [pin.split("==")[0] for pin in reqs.ray] == ["ray", "msgpack"]


def _elf_with_fatbin(entries: list[tuple[int, int, bytes]]) -> tuple[bytearray, int]:
    """A minimal ELF64 whose .nv_fatbin holds one container of (kind, arch, payload)."""
    body = b""
    for kind, arch, payload in entries:
        header = bytearray(64)
        struct.pack_into("<HHIQ", header, 0, kind, 0, 64, len(payload))
        struct.pack_into("<I", header, 28, arch)
        body += bytes(header) + payload
    fatbin = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body
    names = b"\0.nv_fatbin\0.shstrtab\0"
    data_off = 64
    names_off = data_off + len(fatbin)
    shoff = (names_off + len(names) + 7) // 8 * 8
    elf = bytearray(shoff + 3 * 64)
    elf[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", elf, 0x28, shoff)
    struct.pack_into("<HHH", elf, 0x3A, 64, 3, 2)
    elf[data_off:names_off] = fatbin
    elf[names_off:names_off + len(names)] = names
    struct.pack_into("<IIQQQQ", elf, shoff + 64, 1, 1, 0, 0, data_off, len(fatbin))
    struct.pack_into("<IIQQQQ", elf, shoff + 128, 11, 3, 0, 0, names_off, len(names))
    return elf, data_off


def test_prune_fatbin_zeroes_only_other_archs_cubins() -> None:
    sm90, sm100, ptx = b"\x90" * 40, b"\xa0" * 56, b"\x11" * 24
    elf, at = _elf_with_fatbin([(2, 90, sm90), (2, 100, sm100), (1, 100, ptx)])
    original = bytes(elf)
    assert elf_section(elf, ".nv_fatbin") == (at, 16 + 3 * 64 + 40 + 56 + 24)
    zeroed, kept = prune_fatbin(elf, keep_arch=90)
    assert (zeroed, kept) == (56, 40 + 24)
    assert len(elf) == len(original)
    assert sm90 in elf and ptx in elf and sm100 not in elf
    changed = [i for i in range(len(elf)) if elf[i] != original[i]]
    assert len(changed) == 56 and all(elf[i] == 0 for i in changed)


def test_prune_fatbin_refuses_what_is_not_an_elf() -> None:
    with pytest.raises(BundleError, match="ELF64"):
        prune_fatbin(bytearray(b"MZ" + bytes(100)), 90)


def _xz(path: Path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:xz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            import io
            tar.addfile(info, io.BytesIO(data))


def test_stage_script_unpacks_each_load_once_and_checks_imports(tmp_path: Path) -> None:
    bundle, prefix = tmp_path / "bundle", tmp_path / "prefix"
    bundle.mkdir()
    stub_torch = "__version__ = 'stub'\nclass cuda:\n  is_available = staticmethod(lambda: False)\n"
    _xz(bundle / "vllm.tar.xz", {"vllm/__init__.py": "__version__ = '0.26.0'\n"})
    env = {**os.environ, "PYTHON": sys.executable}
    first = subprocess.run(["bash", str(STAGE), str(bundle), str(prefix)], env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert first.returncode == 0, first.stderr
    assert "unpacked vllm.tar.xz" in first.stdout and "site.tar.xz not here" in first.stdout
    assert "import vllm" not in first.stdout  # only once both loads are there
    _xz(bundle / "site.tar.xz", {"site/agentload/__init__.py": "__version__ = 'x'\n",
                                 "site/torch/__init__.py": stub_torch,
                                 "cache/models/m/config.json": "{}"})
    second = subprocess.run(["bash", str(STAGE), str(bundle), str(prefix)], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert second.returncode == 0, second.stderr
    assert "vllm already unpacked" in second.stdout
    assert re.search(r"import vllm 0\.26\.0 \+ agentload \S+ ok", second.stdout)
    assert (prefix / "cache" / "models" / "m" / "config.json").is_file()
    sourced = subprocess.run(
        ["bash", "-c", f". {shlex.quote(str(prefix / 'env.sh'))}; echo $AGENTLOAD_CACHE"],
        capture_output=True, text=True, check=True)
    assert sourced.stdout.strip() == str(prefix / "cache")


def test_stage_script_puts_the_optional_ray_load_after_the_site(tmp_path: Path) -> None:
    bundle, prefix = tmp_path / "bundle", tmp_path / "prefix"
    bundle.mkdir()
    _xz(bundle / "ray.tar.xz", {"ray-site/ray/__init__.py": "__version__ = '2.60.0'\n",
                                "ray-site/msgpack/__init__.py": ""})
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(STAGE), str(bundle), str(prefix)], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "unpacked ray.tar.xz" in proc.stdout and "import ray 2.60.0 ok" in proc.stdout
    assert "ray.tar.xz not here" not in proc.stdout
    sourced = subprocess.run(
        ["bash", "-c", f". {shlex.quote(str(prefix / 'env.sh'))}; echo $PYTHONPATH"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": ""})
    parts = sourced.stdout.strip().split(":")
    assert parts.index(str(prefix / "site")) < parts.index(str(prefix / "ray-site"))


def test_stage_script_fails_loudly_when_an_import_breaks(tmp_path: Path) -> None:
    bundle = tmp_path / "b"
    bundle.mkdir()
    _xz(bundle / "vllm.tar.xz", {"vllm/__init__.py": "raise ImportError('xgrammar')\n"})
    _xz(bundle / "site.tar.xz", {"site/agentload/__init__.py": "__version__ = 'x'\n"})
    proc = subprocess.run(["bash", str(STAGE), str(bundle), str(tmp_path / "p")],
                          env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "xgrammar" in proc.stderr
    assert lzma  # the loads are xz, as the bundle writes them


def test_console_summary_leads_with_the_verdict_and_shows_acceptance() -> None:
    from agentload.replay.results.finalize import summary_lines

    lines = summary_lines({
        "requests_completed": 10, "requests_failed": 0,
        "validity": {"verdict": "invalid", "reasons": ["error rate 12.0% > 5%"]},
        "speculative_decoding": {"acceptance_rate": 0.25, "draft_tokens": 1200.0,
                                 "accepted_tokens": 300.0, "drafts": 400.0,
                                 "mean_acceptance_length": 1.75}})
    assert lines[0] == "  INVALID RUN: error rate 12.0% > 5%"
    assert lines[-1].split() == ["Speculative", "acceptance", "25.0%", "of", "1,200",
                                 "drafted", "tokens,", "mean", "acceptance", "length", "1.75"]
    assert not any("INVALID" in ln for ln in summary_lines(
        {"requests_completed": 1, "requests_failed": 0, "validity": {"verdict": "valid"}}))


def test_archives_are_byte_identical_from_the_same_inputs(tmp_path: Path) -> None:
    import time

    from agentload.replay.serve.gpu_bundle import _xz_tar

    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "pkg" / "__pycache__").mkdir()
    for rel in ("pkg/b.py", "pkg/a.py", "pkg/sub/c.so", "pkg/__pycache__/a.pyc"):
        (src / rel).write_text(rel)
    _xz_tar(src, tmp_path / "one.tar.xz", ["pkg"])
    time.sleep(1.1)
    for rel in ("pkg/b.py", "pkg/a.py"):
        (src / rel).touch()  # a later build: new time stamps, same content
    _xz_tar(src, tmp_path / "two.tar.xz", ["pkg"])
    assert (tmp_path / "one.tar.xz").read_bytes() == (tmp_path / "two.tar.xz").read_bytes()
    with tarfile.open(tmp_path / "one.tar.xz") as tar:
        names = tar.getnames()
    assert names == ["pkg", "pkg/a.py", "pkg/b.py", "pkg/sub", "pkg/sub/c.so"]


def test_source_root_is_the_checkout_that_holds_pyproject() -> None:
    # The bundle module sits two rooms deep (replay/serve/); its wheel is built from the root.
    root = source_root()
    assert (root / "pyproject.toml").is_file()
    assert (root / "replay" / "serve" / "gpu_bundle.py").is_file()


def test_only_ray_needs_a_built_bundle_and_downloads_nothing_first(tmp_path: Path) -> None:
    said: list[str] = []
    with pytest.raises(BundleError, match=r"no bundle\.json"):
        build_bundle(tmp_path / "empty", only_ray=True, say=said.append)
    assert said == []  # refused before any download

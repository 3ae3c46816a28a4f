"""Serving arms: named vLLM configurations in a TOML file, and the exact argv of each.

An arm file holds one ``[arm.<name>]`` table per arm::

    [arm.tp8-auto]
    model = "moonshotai/Kimi-K3"
    tensor_parallel_size = 8
    additional_config = { decode_backend = "auto" }

    [arm.tp8-specialized]
    extends = "tp8-auto"
    additional_config = { decode_backend = "latency_specialized" }

``extends`` merges the parent's settings under the child's: tables (``additional_config``,
``speculative_config``, ``compilation_config``, ``env``) merge key by key, everything else
(``extra_args`` included) is replaced. Every problem is reported with the file, the arm and
the key, and all of them at once, so a file is fixed in one pass.

The GPU count of an arm is tensor x pipeline x data parallel size: it is what a comparison
holds fixed. ``embedded = true`` arms serve the locally built tiny Llama on vLLM's CPU
build, with the same defaults as ``--embedded``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentload.replay.errors import ReplayError
from agentload.replay.serve.dummy_models import PRESETS as DUMMY_PRESETS
from agentload.replay.serve.dummy_models import ensure_dummy_model, served_name
from agentload.replay.serve.server import (
    DEFAULT_HOST,
    EMBEDDED_BLOCK_SIZE,
    EMBEDDED_MAX_MODEL_LEN,
    ServerSpec,
    embedded_env,
    free_port,
)
from agentload.replay.serve.tiny_model import (
    DEFAULT_TINY_MODEL,
    SERVED_MODEL_NAME,
    ensure_tiny_model,
)


class ArmError(ReplayError):
    """An arm file or an arm in it is malformed, or an arm cannot run here."""


# key -> (python types accepted, what the error message calls it)
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "description": ((str,), "a string"),
    "extends": ((str,), "the name of another arm"),
    "embedded": ((bool,), "true or false"),
    "model": ((str,), "a model name or path"),
    "dummy_model": ((str,), "the name of a dummy-weight preset "
                             "(agentload.replay.serve.dummy_models)"),
    "served_model_name": ((str,), "a string"),
    "tensor_parallel_size": ((int,), "an integer >= 1"),
    "pipeline_parallel_size": ((int,), "an integer >= 1"),
    "data_parallel_size": ((int,), "an integer >= 1"),
    "nodes": ((int,), "an integer >= 1 (hosts the GPUs span)"),
    "master_addr": ((str,), "the address of node 0"),
    "master_port": ((int,), "a port number"),
    "additional_config": ((dict,), "a table"),
    "speculative_config": ((dict,), "a table"),
    "compilation_config": ((dict,), "a table"),
    "kv_cache_dtype": ((str,), "a string such as \"fp8\""),
    "max_model_len": ((int,), "an integer >= 1"),
    "max_num_seqs": ((int,), "an integer >= 1"),
    "max_num_batched_tokens": ((int,), "an integer >= 1"),
    "block_size": ((int,), "an integer >= 1"),
    "enable_prefix_caching": ((bool,), "true or false"),
    "gpu_memory_utilization": ((float, int), "a number in (0, 1]"),
    "dtype": ((str,), "a string such as \"bfloat16\""),
    "trust_remote_code": ((bool,), "true or false"),
    "kv_cache_gib": ((float, int), "a number of GiB > 0"),
    "env": ((dict,), "a table of strings"),
    "extra_args": ((list,), "a list of strings"),
    "command": ((list,), "a list of strings, e.g. [\"vllm\", \"serve\"]"),
}
_POSITIVE_INTS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                  "nodes", "master_port",
                  "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size")
_MERGED_TABLES = ("additional_config", "speculative_config", "compilation_config", "env")
# Flags agentload sets itself; an arm setting them through extra_args would fight the launcher.
_RESERVED_FLAGS = ("--host", "--port", "--model", "--served-model-name")
DEFAULT_COMMAND = ("vllm", "serve")
_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True, slots=True)
class Arm:
    """One resolved arm (``extends`` already applied)."""

    name: str
    source: str
    settings: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.settings.get(key, default)

    @property
    def embedded(self) -> bool:
        return bool(self.get("embedded", False))

    @property
    def gpus(self) -> int:
        """GPUs the arm occupies: TP x PP x DP (1 for the embedded CPU arm)."""
        return (int(self.get("tensor_parallel_size", 1))
                * int(self.get("pipeline_parallel_size", 1))
                * int(self.get("data_parallel_size", 1)))

    @property
    def nodes(self) -> int:
        return int(self.get("nodes", 1))

    @property
    def synthetic_acceptance(self) -> str | None:
        """Why this arm's speculative acceptance is forced, or None if it is real."""
        spec = self.get("speculative_config") or {}
        if spec.get("rejection_sample_method") != "synthetic":
            return None
        length = spec.get("synthetic_acceptance_length")
        return (f"synthetic speculative acceptance (rejection_sample_method = \"synthetic\", "
                f"acceptance length {length}): decode speed here is not what real drafts give")

    def describe(self) -> dict[str, Any]:
        """What a run records about its arm."""
        return {"name": self.name, "file": self.source, "gpus": self.gpus,
                "embedded": self.embedded, "settings": dict(self.settings),
                "synthetic_acceptance": self.synthetic_acceptance}


def parse_arm_ref(ref: str) -> tuple[Path, str]:
    """``FILE:NAME`` -> (file, name), with an error that shows the expected form."""
    path, sep, name = ref.rpartition(":")
    if not sep or not path or not name:
        raise ArmError(f"--arm must be FILE:NAME, e.g. arms/embedded-cpu.toml:prefix-cache; "
                       f"got {ref!r}")
    return Path(path), name


def load_arms(path: Path) -> dict[str, Arm]:
    """All arms of ``path``, resolved and validated; raises ``ArmError`` listing every problem."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ArmError(f"arm file {path} does not exist") from None
    except OSError as exc:
        raise ArmError(f"cannot read arm file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ArmError(f"{path}: not valid TOML: {exc}") from None
    problems: list[str] = []
    extra_top = sorted(set(raw) - {"arm"})
    if extra_top:
        problems.append(f"unknown top-level key(s) {', '.join(extra_top)} (arms go in "
                        "[arm.<name>] tables)")
    tables = raw.get("arm", {})
    if not isinstance(tables, dict) or not tables:
        raise ArmError(f"{path}: " + "; ".join(
            [*problems, "no arms; define at least one [arm.<name>] table"]))
    for name, table in tables.items():
        if not isinstance(table, dict):
            problems.append(f"[arm.{name}] must be a table")
            continue
        problems += [f"[arm.{name}] {p}" for p in _check_table(table)]
    resolved: dict[str, dict[str, Any]] = {}
    for name in tables:
        if isinstance(tables[name], dict):
            settings = _resolve(name, tables, [], problems)
            if settings is not None:
                resolved[name] = settings
    for name, settings in resolved.items():
        problems += [f"[arm.{name}] {p}" for p in _check_resolved(settings)]
    if problems:
        raise ArmError(f"{path}: " + "; ".join(dict.fromkeys(problems)))
    return {name: Arm(name, str(path), settings) for name, settings in resolved.items()}


def load_arm(ref: str) -> Arm:
    """The arm named by ``FILE:NAME``."""
    path, name = parse_arm_ref(ref)
    arms = load_arms(path)
    if name not in arms:
        raise ArmError(f"{path} has no arm {name!r} (it has: {', '.join(arms)})")
    return arms[name]


def _as_any(value: object) -> Any:
    return value


def _value_ok(key: str, value: Any) -> bool:
    types = _FIELDS[key][0]
    if isinstance(value, bool) and bool not in types:
        return False  # bool is an int in Python, not in an arm file
    if not isinstance(value, types):
        return False
    value = _as_any(value)  # isinstance against a tuple variable narrows to object
    if key in _POSITIVE_INTS:
        return bool(value >= 1)
    if key == "gpu_memory_utilization":
        return bool(0 < value <= 1)
    if key == "kv_cache_gib":
        return bool(value > 0 and math.isfinite(value))
    if key in ("extra_args", "command"):
        return all(isinstance(a, str) for a in value) and (key != "command" or bool(value))
    if key == "env":
        return all(isinstance(v, str) for v in value.values())
    return True


def _check_table(table: Mapping[str, Any]) -> list[str]:
    problems = []
    for key, value in table.items():
        if key not in _FIELDS:
            problems.append(f"unknown key {key!r} (known: {', '.join(sorted(_FIELDS))})")
        elif not _value_ok(key, value):
            problems.append(f"{key} must be {_FIELDS[key][1]}, got {value!r}")
    extra_args = table.get("extra_args")
    for flag in extra_args if isinstance(extra_args, list) else []:
        if isinstance(flag, str) and flag.split("=", 1)[0] in _RESERVED_FLAGS:
            problems.append(f"extra_args may not set {flag.split('=', 1)[0]} (agentload sets "
                            "host, port and model names itself)")
    return problems


def _resolve(name: str, tables: Mapping[str, Any], chain: list[str],
             problems: list[str]) -> dict[str, Any] | None:
    if name in chain:
        problems.append(f"[arm.{chain[0]}] extends forms a cycle: "
                        f"{' -> '.join([*chain, name])}")
        return None
    table = tables[name]
    parent_name = table.get("extends")
    if parent_name is None:
        return dict(table)
    if parent_name not in tables or not isinstance(tables[parent_name], dict):
        problems.append(f"[arm.{name}] extends {parent_name!r}, which is not an arm in this "
                        f"file (arms: {', '.join(tables)})")
        return None
    parent = _resolve(parent_name, tables, [*chain, name], problems)
    if parent is None:
        return None
    merged = {k: v for k, v in parent.items() if k not in ("extends", "description")}
    for key, value in table.items():
        if key in _MERGED_TABLES and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        elif key != "extends":
            merged[key] = value
    return merged


def _check_resolved(settings: Mapping[str, Any]) -> list[str]:
    if settings.get("embedded"):
        wrong = [k for k in ("model", "dummy_model", "tensor_parallel_size",
                             "pipeline_parallel_size", "data_parallel_size", "nodes", "command")
                 if k in settings]
        return [f"embedded arms serve the tiny local model on one CPU; remove "
                f"{', '.join(wrong)}"] if wrong else []
    problems = []
    if ("model" in settings) == ("dummy_model" in settings):
        problems.append("needs exactly one of model and dummy_model (or embedded = true)")
    if "dummy_model" in settings and settings["dummy_model"] not in DUMMY_PRESETS:
        problems.append(f"dummy_model {settings['dummy_model']!r} is not a preset (known: "
                        f"{', '.join(DUMMY_PRESETS)})")
    if "kv_cache_gib" in settings:
        problems.append("kv_cache_gib applies to embedded arms only (use "
                        "gpu_memory_utilization on GPUs)")
    return problems


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def serve_argv(arm: Arm, host: str, port: int, model_path: str | None = None,
               node_rank: int = 0) -> list[str]:
    """The exact argv that starts ``arm``'s server on ``host:port``.

    Non-embedded arms run ``vllm serve MODEL ...`` (or the arm's ``command``); the embedded
    arm runs vLLM's API server module with this Python, since the CPU build's ``vllm``
    script looks up the wrong distribution name. An arm spanning ``nodes`` hosts serves
    from node 0; ``node_rank`` > 0 gives the headless worker argv for the other hosts.
    """
    settings = arm.settings
    if arm.embedded:
        argv = [sys.executable, "-P", "-m", _API_SERVER_MODULE, "--model", str(model_path)]
        defaults: dict[str, Any] = {
            "served_model_name": SERVED_MODEL_NAME, "dtype": "bfloat16",
            "max_model_len": EMBEDDED_MAX_MODEL_LEN, "block_size": EMBEDDED_BLOCK_SIZE,
            "max_num_seqs": 64, "enable_prefix_caching": True,
        }
        settings = {**defaults, **settings}
    else:
        command = list(settings.get("command", DEFAULT_COMMAND))
        model = str(model_path or settings.get("model") or f"<{settings['dummy_model']}-dir>")
        argv = ([*command, model] if command[-1] == "serve" else [*command, "--model", model])
        if "dummy_model" in settings:
            # Random weights from the preset's config: no checkpoint, nothing downloaded.
            preset = DUMMY_PRESETS[settings["dummy_model"]]
            settings = {"served_model_name": served_name(preset), **settings}
            argv += ["--load-format", "dummy"]
    argv += ["--host", host, "--port", str(port)]
    if arm.nodes > 1:
        argv += ["--nnodes", str(arm.nodes), "--node-rank", str(node_rank)]
        if "master_addr" in settings:
            argv += ["--master-addr", settings["master_addr"]]
        if "master_port" in settings:
            argv += ["--master-port", str(settings["master_port"])]
        if node_rank > 0:
            argv.append("--headless")
    for key in ("served_model_name", "tensor_parallel_size", "pipeline_parallel_size",
                "data_parallel_size", "dtype", "kv_cache_dtype", "max_model_len",
                "max_num_seqs", "max_num_batched_tokens", "block_size",
                "gpu_memory_utilization"):
        if key in settings:
            argv += [_flag(key), str(settings[key])]
    for key in ("enable_prefix_caching", "trust_remote_code"):
        if key in settings:
            argv.append(_flag(key) if settings[key] else "--no-" + _flag(key)[2:])
    for key in ("additional_config", "speculative_config", "compilation_config"):
        if settings.get(key):
            argv += [_flag(key), json.dumps(settings[key], separators=(",", ":"),
                                            sort_keys=True)]
    # Cached-token counts in usage are how agentload checks prefix reuse per request.
    argv.append("--enable-prompt-tokens-details")
    if arm.embedded:
        argv += ["--uvicorn-log-level", "warning"]
    argv += list(settings.get("extra_args", []))
    return argv


def arm_server_spec(arm: Arm, host: str = DEFAULT_HOST, port: int | None = None,
                    label: str | None = None) -> ServerSpec:
    """A ``ServerSpec`` for ``arm`` (building the tiny model first for an embedded arm)."""
    port = port if port is not None else free_port(host)
    env = dict(arm.get("env", {}))
    if arm.embedded:
        model_dir = ensure_tiny_model()
        env = {**embedded_env(float(arm.get("kv_cache_gib", 1.0))), **env}
        return ServerSpec(
            argv=tuple(serve_argv(arm, host, port, str(model_dir))), host=host, port=port,
            served_model=arm.get("served_model_name", SERVED_MODEL_NAME),
            label=label or f"arm {arm.name} (embedded tiny Llama on vLLM CPU)", env=env, gpus=1,
            device="cpu", vocab_size=DEFAULT_TINY_MODEL.vocab_size)
    model_path, vocab = None, None
    if "dummy_model" in arm.settings:
        preset = DUMMY_PRESETS[arm.get("dummy_model")]
        model_dir = ensure_dummy_model(preset)
        model_path = str(model_dir)
        # Prompts must stay inside this tokenizer: an id past its end is refused.
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        served = arm.get("served_model_name", served_name(preset))
        what = f"{preset.name}, dummy weights"
    else:
        served, what = arm.get("served_model_name", arm.get("model")), arm.get("model")
    return ServerSpec(
        argv=tuple(serve_argv(arm, host, port, model_path)), host=host, port=port,
        served_model=served, label=label or f"arm {arm.name} ({what}, {arm.gpus} GPU)",
        env=env, gpus=arm.gpus, device="gpu", vocab_size=vocab)


def visible_gpus(env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """How many GPUs a server started from here would see, and how that was found."""
    env = os.environ if env is None else env
    cuda_visible = env.get("CUDA_VISIBLE_DEVICES")
    if cuda_visible is not None:
        ids = [d for d in cuda_visible.split(",") if d.strip() and d.strip() != "-1"]
        return len(ids), f"CUDA_VISIBLE_DEVICES={cuda_visible!r}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, "no nvidia-smi on PATH and CUDA_VISIBLE_DEVICES unset"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20,
                             check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"nvidia-smi -L failed: {exc}"
    gpus = [ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")]
    return len(gpus), "nvidia-smi -L"


def check_gpu_count(arm: Arm, env: Mapping[str, str] | None = None) -> None:
    """Refuse to start an arm that needs more GPUs than this machine lets it see."""
    if arm.embedded:
        return
    env = {**(os.environ if env is None else env), **arm.get("env", {})}
    seen, how = visible_gpus(env)
    per_node = math.ceil(arm.gpus / arm.nodes)
    if seen < per_node:
        where = (f"{per_node} GPUs on each of its {arm.nodes} nodes" if arm.nodes > 1
                 else f"{arm.gpus} GPUs")
        raise ArmError(f"arm {arm.name} needs {where} (tensor x pipeline x data parallel) "
                       f"but {seen} are visible here ({how}); run it where they are, or "
                       "change tensor_parallel_size")


def check_same_gpus(arms: Sequence[Arm], allow_change: bool) -> None:
    """A comparison must hold the GPU count fixed unless the user says otherwise."""
    counts = {arm.name: arm.gpus for arm in arms}
    if len(set(counts.values())) > 1 and not allow_change:
        listing = ", ".join(f"{name}: {n} GPU" for name, n in counts.items())
        raise ArmError(f"arms use different GPU counts ({listing}); a comparison that changes "
                       "the GPU count and the implementation together isolates neither. "
                       "Compare arms of one count, or pass --allow-gpu-count-change to label "
                       "every row with both counts")

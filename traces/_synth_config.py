"""The synthesizer's configs: ``SynthConfig`` and ``FixedConfig`` with their checks, the
presets (``demo``, ``agentx-coding`` read from its TOML, ``fixed``), and ``make_config``,
which layers a preset, a TOML file and command-line values, in that order of precedence,
with messages that name the file and key."""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Literal

from agentload.traces._synth_dists import (
    Constant,
    Dist,
    LogNormal,
    Uniform,
    _is_number,
    _number,
    _scaled_count,
    _show,
    parse_dist,
)
from agentload.traces.errors import TraceError

PRESETS = ("demo", "agentx-coding", "fixed")
# Presets are written for 64-token blocks (the WEKA traces' block size); another block
# size re-expresses their block counts so the token lengths stay what was measured.
PRESET_BLOCK_SIZE = 64
AGENTX_TOML = "agentx_coding.toml"
"""The agentx-coding preset's settings, in ``agentload.traces.data``."""


# ---------------------------------------------------------------------------------------
# Configurations


class SynthConfigError(TraceError):
    """One setting of a synthesizer config is out of range; ``key`` names it."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"key {key!r}: {problem}")
        self.key = key
        self.problem = problem


FieldKind = Literal["str", "count", "seed", "probability", "bool", "scale", "window",
                    "count_dist", "seconds_dist"]

# The prompt-length settings (in blocks): what --scale-context and a change of block size
# rescale. Output lengths stay, since they are what the decode benchmark measures.
PROMPT_FIELDS = ("system_blocks", "first_message_blocks", "tool_result_blocks",
                 "subagent_system_blocks", "subagent_first_message_blocks",
                 "subagent_first_tool_result_blocks", "subagent_tool_result_blocks",
                 "aux_system_blocks", "aux_prompt_blocks")


@dataclass(frozen=True, slots=True)
class SynthConfig:
    """Shape of an agent-traffic trace. The defaults are the ``demo`` preset.

    Prompt lengths (``*_blocks``) are in blocks of ``block_size`` tokens; outputs are in
    tokens; pauses in seconds. Distributions are sampled per use (per session, turn or
    request); ``system_blocks`` and ``subagent_system_blocks`` are fixed because every
    session shares those prefixes.

    - ``turns``: main-agent requests per session (fewer if ``max_context`` ends it).
    - ``first_message_blocks``: the first user message, after the shared prefix.
    - ``tool_result_blocks``: what each later main turn adds beyond the previous answer.
    - ``output_tokens``, ``pause_s``: main-agent OSL, and think/tool time before a turn.
    - ``subagent_probability``: chance that a session fans out after one main turn (not
      its last), into ``subagent_fanout`` parallel subagents of ``subagent_turns``
      requests each; the parent's next turn waits for all of them.
    - ``subagent_first_tool_result_blocks``: the jump after a subagent's first request
      (its first reads); ``subagent_tool_result_blocks`` the growth after later ones.
    - ``subagent_final_output_tokens``: the report a subagent ends with;
      ``subagent_result_in_parent`` puts the reports into the parent's next prompt.
    - ``aux_probability``: chance of an aux side call after each main turn (its own
      ``aux_system_blocks`` prefix plus ``aux_prompt_blocks``); nothing waits for it.
    - ``scale_context`` (0 < F <= 1): multiply every prompt length by F (at least one
      block each) so long sessions fit a small model.
    - ``max_context``: a context window in tokens. A request whose input plus output
      would not fit is not sent: a main chain ends there (the way an agent compacts), a
      subagent chain stops early, a subagent whose first request does not fit is not
      spawned, and a first message too long is cut to fit.
    """

    name: str = "demo-agentx"
    sessions: int = 8
    turns: Dist = Uniform(4, 7)
    block_size: int = 64
    system_blocks: int = 8
    first_message_blocks: Dist = Uniform(3, 8)
    tool_result_blocks: Dist = Uniform(1, 6)
    output_tokens: Dist = Uniform(24, 120)
    pause_s: Dist = Uniform(1.0, 4.0)
    subagent_probability: float = 0.35
    subagent_turns: Dist = Uniform(2, 3)
    subagent_system_blocks: int = 4
    seed: int = 7
    subagent_fanout: Dist = Constant(1)
    subagent_first_message_blocks: Dist = Uniform(3, 8)
    subagent_first_tool_result_blocks: Dist = Uniform(1, 6)
    subagent_tool_result_blocks: Dist = Uniform(1, 6)
    subagent_output_tokens: Dist = Uniform(24, 120)
    subagent_final_output_tokens: Dist = Uniform(24, 120)
    # Uniform(1, 4) / 2, as the demo has always drawn it (bit for bit the same floats).
    subagent_pause_s: Dist = Uniform(0.5, 2.0)
    subagent_result_in_parent: bool = False
    aux_probability: float = 0.0
    aux_system_blocks: int = 4
    aux_prompt_blocks: Dist = Uniform(1, 4)
    aux_output_tokens: Dist = Uniform(8, 64)
    scale_context: float = 1.0
    max_context: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(f.name, _SYNTH_KINDS[f.name], getattr(self, f.name))


@dataclass(frozen=True, slots=True)
class FixedConfig:
    """The ``fixed`` preset: ``requests`` one-request sessions of exactly ``isl`` input
    and ``osl`` output tokens, every block unique (no prefix-cache hits). The name is
    ``fixed-isl{isl}-osl{osl}`` unless given."""

    isl: int = 1
    osl: int = 1000
    requests: int = 10
    block_size: int = 64
    name: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(f.name, _FIXED_KINDS[f.name], getattr(self, f.name))


# How each setting is typed and checked, at the TOML boundary and in __post_init__ alike.
_SYNTH_KINDS: dict[str, FieldKind] = {
    "name": "str", "sessions": "count", "turns": "count_dist", "block_size": "count",
    "system_blocks": "count", "first_message_blocks": "count_dist",
    "tool_result_blocks": "count_dist", "output_tokens": "count_dist",
    "pause_s": "seconds_dist", "subagent_probability": "probability",
    "subagent_turns": "count_dist", "subagent_system_blocks": "count", "seed": "seed",
    "subagent_fanout": "count_dist", "subagent_first_message_blocks": "count_dist",
    "subagent_first_tool_result_blocks": "count_dist",
    "subagent_tool_result_blocks": "count_dist", "subagent_output_tokens": "count_dist",
    "subagent_final_output_tokens": "count_dist", "subagent_pause_s": "seconds_dist",
    "subagent_result_in_parent": "bool", "aux_probability": "probability",
    "aux_system_blocks": "count", "aux_prompt_blocks": "count_dist",
    "aux_output_tokens": "count_dist", "scale_context": "scale", "max_context": "window",
}
_FIXED_KINDS: dict[str, FieldKind] = {
    "isl": "count", "osl": "count", "requests": "count", "block_size": "count",
    "name": "str",
}


def _check(key: str, kind: FieldKind, value: object) -> None:
    """Raise ``SynthConfigError`` if ``value`` is not a valid setting of this kind."""
    if kind == "count_dist" or kind == "seconds_dist":
        if not isinstance(value, Constant | Uniform | LogNormal):
            raise SynthConfigError(key, f"must be a distribution, got {_show(value)}")
        if kind == "count_dist":
            if not all(float(b).is_integer() for b in value.bounds()):
                raise SynthConfigError(key, f"counts need whole numbers, got {value.describe()}")
            if value.lowest < 1:
                raise SynthConfigError(key, f"must be >= 1, got {value.describe()}")
        elif value.lowest < 0:
            raise SynthConfigError(key, f"seconds must be >= 0, got {value.describe()}")
        return
    if kind == "str":
        if not isinstance(value, str):
            raise SynthConfigError(key, f"must be a string, got {_show(value)}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise SynthConfigError(key, f"must be true or false, got {_show(value)}")
    elif kind in ("count", "seed") or (kind == "window" and value is not None):
        if not isinstance(value, int) or isinstance(value, bool):
            raise SynthConfigError(key, f"must be a whole number, got {_show(value)}")
        if kind != "seed" and value < 1:
            raise SynthConfigError(key, f"must be >= 1, got {value}")
    elif kind in ("probability", "scale"):
        if not _is_number(value):
            raise SynthConfigError(key, f"must be a number, got {_show(value)}")
        number = _number(value)
        if kind == "probability" and not 0 <= number <= 1:
            raise SynthConfigError(key, f"must be in [0, 1], got {number:g}")
        if kind == "scale" and not 0 < number <= 1:
            raise SynthConfigError(key, f"must be in (0, 1], got {number:g}")


def rescale_prompts(config: SynthConfig, factor: float) -> SynthConfig:
    """``config`` with every prompt length times ``factor`` (rounded, at least 1 block)."""
    changes: dict[str, object] = {}
    for key in PROMPT_FIELDS:
        value = getattr(config, key)
        changes[key] = (_scaled_count(value, factor) if isinstance(value, int)
                        else value.scaled(factor))
    return replace(config, **changes)  # type: ignore[arg-type]


def _with_block_size(config: SynthConfig, block_size: int) -> SynthConfig:
    if block_size == config.block_size:
        return config
    return replace(rescale_prompts(config, config.block_size / block_size),
                   block_size=block_size)


# ---------------------------------------------------------------------------------------
# Presets


def demo(block_size: int = PRESET_BLOCK_SIZE) -> SynthConfig:
    """The bundled demo trace: 8 short sessions that fit the embedded tiny model.

    A 512-token shared prefix, 4-7 turns, prompts growing by 1-6 blocks plus the answer,
    24-120 output tokens, 1-4 s pauses, and a 2-3 request subagent in about a third of
    the sessions. The largest prompt is about 3k tokens.
    """
    return _with_block_size(SynthConfig(), block_size)


def agentx_coding(block_size: int = PRESET_BLOCK_SIZE) -> SynthConfig:
    """Coding-agent traffic fitted to the WEKA / SemiAnalysis Claude Code traces.

    Its settings, each with the figures it was fitted to (the four sessions in
    ``tests/data/weka``), live in one place: ``traces/data/agentx_coding.toml``, which is
    also the example a user copies for ``agentload traces synth --config``.
    """
    text = (resources.files("agentload.traces") / "data" / AGENTX_TOML).read_text()
    data = tomllib.loads(text)
    data.pop("preset", None)
    settings = {k: parse_dist(v) if _SYNTH_KINDS[k].endswith("_dist") else v
                for k, v in data.items()}
    return _with_block_size(replace(SynthConfig(), **settings), block_size)  # type: ignore[arg-type]


def fixed(block_size: int = PRESET_BLOCK_SIZE) -> FixedConfig:
    """Fixed-length decode benchmark: ISL 1, OSL 1000, 10 requests, nothing cached.

    The headline numbers vendors publish (batch 1, often with speculative decoding) are
    this shape; replay it with one user to reproduce them with the same tool.
    """
    return FixedConfig(block_size=block_size)


_PRESETS: dict[str, Callable[[int], SynthConfig | FixedConfig]] = {
    "demo": demo, "agentx-coding": agentx_coding, "fixed": fixed,
}


def preset(name: str, block_size: int = PRESET_BLOCK_SIZE) -> SynthConfig | FixedConfig:
    """The named preset's config, its prompt lengths expressed in ``block_size`` blocks."""
    if name not in _PRESETS:
        raise TraceError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    return _PRESETS[name](block_size)


# ---------------------------------------------------------------------------------------
# Layering: preset < TOML file < command line


def make_config(preset_name: str | None = None, config_file: str | Path | None = None, *,
                sessions: int | None = None, seed: int | None = None,
                scale_context: float | None = None, max_context: int | None = None,
                isl: int | None = None, osl: int | None = None,
                requests: int | None = None,
                block_size: int | None = None) -> SynthConfig | FixedConfig:
    """The config ``agentload traces synth`` builds: a preset, then the TOML file's keys
    (field names of ``SynthConfig`` or ``FixedConfig``, plus ``preset`` to pick the base
    when none is given), then the values given here. None means "not given"."""
    path = None if config_file is None else Path(config_file)
    data = _read_toml(path) if path is not None else {}
    where = str(path)
    toml_preset = data.pop("preset", None)
    if toml_preset is not None and not (isinstance(toml_preset, str)
                                        and toml_preset in PRESETS):
        raise TraceError(f"{where}: key 'preset': must be one of "
                         f"{', '.join(PRESETS)}, got {_show(toml_preset)}")
    name = preset_name or toml_preset or "demo"
    if block_size is not None and block_size < 1:
        raise TraceError(f"--block-size must be >= 1, got {block_size}")
    toml_bs = data.get("block_size")
    bs = block_size if block_size is not None else (
        toml_bs if isinstance(toml_bs, int) and not isinstance(toml_bs, bool) and toml_bs >= 1
        else PRESET_BLOCK_SIZE)  # a bad TOML value is reported below, with its key
    base = preset(name, bs)

    kinds = _FIXED_KINDS if isinstance(base, FixedConfig) else _SYNTH_KINDS
    overrides: dict[str, object] = {}
    for key, value in data.items():
        if key not in kinds:
            raise TraceError(f"{where}: key {key!r}: {_unknown_key(key, name, kinds)}")
        try:
            overrides[key] = parse_dist(value) if kinds[key].endswith("_dist") else value
        except TraceError as exc:
            raise TraceError(f"{where}: key {key!r}: {exc}") from None
    config = _layer(base, overrides, lambda key: f"{where}: key {key!r}")

    given = {"sessions": sessions, "seed": seed, "scale_context": scale_context,
             "max_context": max_context, "isl": isl, "osl": osl, "requests": requests}
    flags = {k: v for k, v in given.items() if v is not None}
    wrong = sorted(set(flags) - set(kinds))
    if wrong:
        hint = ("--isl, --osl and --requests are for --preset fixed"
                if isinstance(config, SynthConfig) else
                "the fixed preset takes --isl, --osl, --requests and --block-size")
        raise TraceError(f"--{wrong[0].replace('_', '-')} does not apply to preset "
                         f"{name!r} ({hint})")
    config = _layer(config, flags, lambda key: f"--{key.replace('_', '-')}")
    if isinstance(config, SynthConfig) and isinstance(base, SynthConfig) and "name" not in data:
        config = replace(config, name=_suffixed(config.name, config, base))
    return config


def _read_toml(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise TraceError(f"{path}: config file not found") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read config file ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise TraceError(f"{path}: not valid TOML: {exc}") from None


def _unknown_key(key: str, preset_name: str, kinds: Mapping[str, FieldKind]) -> str:
    other = _SYNTH_KINDS if kinds is _FIXED_KINDS else _FIXED_KINDS
    if key in other:
        return f"not a setting of preset {preset_name!r}"
    close = difflib.get_close_matches(key, list(kinds), n=1)
    return "unknown setting" + (f" (did you mean {close[0]!r}?)" if close else "")


def _layer(config: SynthConfig | FixedConfig, changes: Mapping[str, object],
           where: Callable[[str], str]) -> SynthConfig | FixedConfig:
    try:
        return replace(config, **changes)  # type: ignore[arg-type]
    except SynthConfigError as exc:
        raise TraceError(f"{where(exc.key)}: {exc.problem}") from None


def _suffixed(name: str, config: SynthConfig, base: SynthConfig) -> str:
    # The file name is often all that travels with a trace, so a trace scaled or cut for
    # a small model says so in its name.
    if config.scale_context != base.scale_context:
        name += f"-scale{config.scale_context:g}"
    if config.max_context != base.max_context and config.max_context is not None:
        name += f"-max{config.max_context}"
    return name


